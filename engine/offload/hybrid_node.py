"""An expert node run with hybrid offload: resident experts on the device, cold ones on the CPU
or streamed to the device in waves, results merged. Drop-in for CpuExpertNode in the decoder."""

from __future__ import annotations

import time

import numpy as np

from engine.expert_node import CpuExpertNode
from engine.offload.approximate import approximate_routing
from engine.offload.miss_policy import decide
from engine.offload.stats import LayerStats
from kernels.cpu.routing import route


class HybridExpertNode:
    def __init__(self, runner: CpuExpertNode, layer: int, engine):
        self.info = runner.info
        self.runner = runner
        self.layer = layer
        self.engine = engine
        self.last_decision = None  # the miss policy's latest MissDecision (tests, diagnostics)

    @property
    def kernel(self):
        return self.runner.kernel  # rebuilt when allow_file_backing changes

    def run(self, values: dict[str, np.ndarray]) -> np.ndarray:
        inputs = self.info.activation_inputs
        x = values[inputs["input"]]
        router_weights = values[inputs["router_weights"]] if "router_weights" in inputs else None
        spec = self.info.spec
        x2d = np.ascontiguousarray(x.reshape(-1, spec.hidden_size))
        logits = values[inputs["router_probs"]].reshape(-1, spec.num_experts)
        ids, weights = route(logits, spec, router_weights)
        slot_of = self.engine.slots[self.layer].slot_of
        if self.engine.approximating:
            ids = approximate_routing(ids, weights, logits, slot_of, self.engine.config, self.engine.approximation)
        resident = (ids >= 0) & (slot_of[ids] >= 0)
        shadow = self.engine.shadow
        stats = self.engine.stats.layers[self.layer] if not shadow else LayerStats()
        stats.hits += int(np.count_nonzero(resident))
        stats.misses += int(np.count_nonzero((ids >= 0) & ~resident))
        if not shadow:
            self.engine.stats.count(self.layer, ids, resident)

        out = np.zeros((x2d.shape[0], spec.hidden_size), np.float32)
        store = self.engine.stores[self.layer]
        # The device starts on the resident experts; the CPU computes the cold ones meanwhile.
        pending = store.launch(x2d, np.where(resident, ids, -1), weights) if store is not None and resident.any() else None
        cold = np.where(resident, -1, ids)
        missed = int(np.count_nonzero(cold >= 0))
        copied_pairs = copies = 0
        pending_copied = None
        if store is not None:
            for wave in self._waves(cold):
                stats.copy_s += store.stage(wave)
                stats.copy_bytes += len(wave) * store.wave_bytes
                in_wave = np.isin(cold, wave)
                copied_pairs += int(np.count_nonzero(in_wave))
                stats.device_s += store.collect(store.launch(x2d, np.where(in_wave, cold, -1), weights), out)
                cold = np.where(in_wave, -1, cold)
            if not shadow and (cold >= 0).any() and self._decode(cold):
                # Decode: the miss policy copies the misses that pay into spare slots, computed on
                # the device in this step; the rest run on the CPU.
                copied = self._copy_misses(ids, resident, cold, stats)
                if copied.size:
                    in_copied = np.isin(cold, copied)
                    copied_pairs += int(np.count_nonzero(in_copied))
                    copies = int(copied.size)
                    pending_copied = store.launch(x2d, np.where(in_copied, cold, -1), weights)
                    cold = np.where(in_copied, -1, cold)
        if (cold >= 0).any():
            started = time.perf_counter()
            self.kernel.run_experts(x2d, cold, weights, out=out)
            stats.cpu_s += time.perf_counter() - started
            if not shadow:
                self.engine.host_cache.touch(self.layer, np.unique(cold[cold >= 0]))
        if pending is not None or pending_copied is not None:
            waited = time.perf_counter()
            for work in (pending, pending_copied):
                if work is not None:
                    stats.device_s += store.collect(work, out)
            stats.wait_s += time.perf_counter() - waited
        if not shadow:
            self.engine.stats.split(self.layer, missed - copied_pairs, copied_pairs, copies)
            self.engine.policy.observe(self.layer, ids.reshape(-1))
        return out.astype(x.dtype, copy=False).reshape(x.shape)

    def _decode(self, cold: np.ndarray) -> bool:
        """A decode-sized step (misses judged one by one) with CPU execution allowed."""
        config = self.engine.config
        return config.cpu_execution != "disabled" and cold.shape[0] <= config.async_max_tokens

    def _copy_misses(self, ids: np.ndarray, resident: np.ndarray, cold: np.ndarray, stats: LayerStats) -> np.ndarray:
        """Decide with the cost model (miss_policy.py) which misses to copy into spare slots; copy
        them (the placement policy is told); returns the copied experts."""
        engine, store = self.engine, self.engine.stores[self.layer]
        policy = engine.policy
        spare = policy.spare_slots(self.layer, np.unique(ids[ids >= 0]))
        if spare.size == 0:
            return np.empty(0, np.int64)
        experts, tokens = np.unique(cold[cold >= 0], return_counts=True)
        bandwidths = engine.device.bandwidths
        # The CPU reads the stored expert; a copy moves it in the kernels' (converted) layout, which the device
        # then reads: converted layouts (int2, fp4 ...) cost more on the device side than on the CPU side.
        resident_s = np.unique(ids[resident]).size * store.read_bytes / bandwidths.hbm
        decision = decide(bandwidths, self.info.bytes_per_expert, tokens, spare.size, resident_s,
                          2 * self._weights_per_expert(), getattr(store, "prepare_s", 0.0),
                          copy_bytes=store.expert_bytes, read_bytes=store.read_bytes)
        self.last_decision = decision
        chosen = experts[decision.copied]
        for slot, expert in zip(spare, chosen):
            policy.admit(self.layer, int(slot), int(expert))
            stats.copy_s += store.load(int(slot), int(expert))
            stats.copy_bytes += store.expert_bytes
        return chosen

    def _waves(self, cold: np.ndarray) -> list[np.ndarray]:
        """Cold experts worth running on the device, in waves that fit the staging ring."""
        experts, tokens = np.unique(cold[cold >= 0], return_counts=True)
        wave = self.engine.wave_experts
        if experts.size == 0 or wave == 0:
            return []
        config = self.engine.config
        if config.cpu_execution != "disabled":
            if cold.shape[0] <= config.async_max_tokens:
                return []  # decode: the miss policy splits the misses between the CPU and spare slots
            # Prefill: stream an expert when copying it costs less than computing its tokens on the CPU.
            bw = self.engine.device.bandwidths
            wave_bytes = self.engine.stores[self.layer].wave_bytes  # what the wave copies of one expert
            flops_per_token = 2 * self._weights_per_expert()
            worth = tokens * flops_per_token / bw.cpu_flops > wave_bytes / bw.pcie
            experts = experts[worth]
        return [experts[i:i + wave] for i in range(0, experts.size, wave)]

    def _weights_per_expert(self) -> int:
        spec = self.info.spec
        return spec.fc1_rows * spec.hidden_size + spec.hidden_size * spec.inter_size + (
            spec.inter_size * spec.hidden_size if spec.has_fc3 else 0)
