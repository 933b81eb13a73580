"""Per-step offload statistics for the window and the records."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class LayerStats:
    hits: int = 0            # routed (token, expert) pairs found resident
    misses: int = 0          # routed pairs whose expert was cold
    cpu_s: float = 0.0       # wall time of CPU expert compute
    device_s: float = 0.0    # device compute time (measured on CUDA, modelled on the simulated device)
    wait_s: float = 0.0      # time the CPU waited for the device after finishing its own experts
    copy_bytes: int = 0      # host -> device expert copies (fills, swaps, misses copied in, prefill waves)
    copy_s: float = 0.0
    swaps: int = 0           # residents placement replaced at a safe point (routing moved), not its fills
    fills: int = 0           # experts placement copied into empty slots (at load, at a re-plan, or a safe point's)
    misses_cpu: int = 0      # missed pairs computed on the CPU
    misses_copied: int = 0   # missed pairs whose expert was copied to the device (spare slot or prefill wave)
    miss_copies: int = 0     # experts the decode miss policy copied into spare slots
    routed_on_device: int = 0  # steps routed and computed on the device (every expert resident or read from the host
    #                            tier: no host round trip)
    misses_read: int = 0     # missed pairs the device read from the host tier in such steps (GpuQMoE's host_tier)
    # The simulated device's projection (engine/offload/projection.py). standin_s: wall time the simulated
    # device spent computing "device" experts with the CPU kernels (0 on CUDA). critical_s: per step, the
    # modelled critical path of the layer on a real card (CPU and device overlapped), summed over steps.
    standin_s: float = 0.0
    critical_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


@dataclass
class OffloadStats:
    layers: list[LayerStats] = field(default_factory=list)
    steps: int = 0
    expert_hits: list[np.ndarray] = field(default_factory=list)    # per layer, routed pairs per expert found resident
    expert_misses: list[np.ndarray] = field(default_factory=list)  # per layer, routed pairs per expert found cold
    # per decoder step (the most recent STEP_HISTORY): missed pairs [on the CPU, copied to the device, read by the
    # device from the host tier]
    step_splits: list[tuple[int, int, int]] = field(default_factory=list)
    pinned: dict = field(default_factory=dict)  # the pinned staging ring: bytes, high_water, ... (engine fills)
    # the projection's inputs by phase, all layers together: "prefill" steps (more than one token), "decode" steps
    # (one token); see projection.py. The agreement meter's exact-routing passes are left out, as the layers and the
    # timings the projection takes these from leave them out (generation.py's agreement_s)
    phases: dict = field(default_factory=lambda: {"prefill": LayerStats(), "decode": LayerStats()})
    _pairs: list[np.ndarray] = field(default_factory=list)  # per layer [hits | misses], viewed by the two above
    _step_cpu: int = 0
    _step_copied: int = 0
    _step_read: int = 0

    STEP_HISTORY = 4096

    def reset(self, num_layers: int, num_experts: list[int] | None = None) -> None:
        self.layers = [LayerStats() for _ in range(num_layers)]
        self.steps = 0
        self.step_splits = []
        self.phases = {"prefill": LayerStats(), "decode": LayerStats()}
        self._step_cpu = self._step_copied = self._step_read = 0
        if num_experts is not None:
            # per layer one array [hits per expert | misses per expert]: a step's pairs counted in one call
            self._pairs = [np.zeros(2 * e, np.int64) for e in num_experts]
            self.expert_hits = [pairs[:e] for pairs, e in zip(self._pairs, num_experts)]
            self.expert_misses = [pairs[e:] for pairs, e in zip(self._pairs, num_experts)]
        else:
            for counts in self.expert_hits + self.expert_misses:
                counts[:] = 0

    def add_earlier(self, earlier: "OffloadStats") -> None:
        """Put back the counts of `earlier`, a copy taken before these were reset (a measured run's own statistics:
        records/scenarios.run_turns), so that the totals run on as if never reset. The phases are new objects, as
        reset() makes them: the engine's layer-split trials take a phase it marked that is gone as 'reset since'."""
        for layer, before in zip(self.layers, earlier.layers):
            for name, value in asdict(before).items():
                setattr(layer, name, getattr(layer, name) + value)
        for counts, before in zip(self.expert_hits + self.expert_misses, earlier.expert_hits + earlier.expert_misses):
            counts += before
        self.steps += earlier.steps
        self.step_splits[:0] = earlier.step_splits
        del self.step_splits[:-self.STEP_HISTORY]
        self.phases = {name: LayerStats(**{key: value + getattr(earlier.phases[name], key)
                                          for key, value in asdict(phase).items()})
                       for name, phase in self.phases.items()}

    def count(self, layer: int, expert_ids: np.ndarray, resident: np.ndarray, routed: np.ndarray | None = None) -> None:
        """Count routed (token, expert) pairs of one step, by expert and residency. `routed` masks the pairs
        routed to an expert; None: every pair is (route() gives each one; approximate routing drops some, -1)."""
        hits = self.expert_hits[layer]
        pairs = self._pairs[layer] if layer < len(self._pairs) else None
        if pairs is None or hits.base is not pairs:  # counts not made by reset(): two calls
            routed = expert_ids >= 0 if routed is None else routed
            np.add.at(hits, expert_ids[routed & resident], 1)
            np.add.at(self.expert_misses[layer], expert_ids[routed & ~resident], 1)
            return
        index = np.where(resident, expert_ids, expert_ids + hits.size)  # a miss counts in the second half
        np.add.at(pairs, index if routed is None else index[routed], 1)

    def pair_counts(self, layer: int) -> np.ndarray | None:
        """The layer's [hits per expert | misses per expert] array, for a caller that counts a step's pairs itself
        (step_pairs.classify_pairs); None where the counts are not one such array (count() then)."""
        pairs = self._pairs[layer] if layer < len(self._pairs) else None
        return pairs if pairs is not None and self.expert_hits[layer].base is pairs else None

    def split(self, layer: int, on_cpu: int, copied: int, copies: int = 0, read: int = 0) -> None:
        """Missed pairs of one layer's step: how many ran on the CPU, how many were copied, how many the device read
        from the host tier."""
        stats = self.layers[layer]
        stats.misses_cpu += on_cpu
        stats.misses_copied += copied
        stats.miss_copies += copies
        stats.misses_read += read
        self._step_cpu += on_cpu
        self._step_copied += copied
        self._step_read += read

    def phase(self, tokens: int) -> LayerStats:
        """The projection's accumulator for a step of `tokens` tokens."""
        return self.phases["decode" if tokens <= 1 else "prefill"]

    def end_step(self) -> None:
        self.steps += 1
        self.step_splits.append((self._step_cpu, self._step_copied, self._step_read))
        del self.step_splits[:-self.STEP_HISTORY]
        self._step_cpu = self._step_copied = self._step_read = 0

    def totals(self) -> LayerStats:
        total = LayerStats()
        for layer in self.layers:
            for name, value in asdict(layer).items():
                setattr(total, name, getattr(total, name) + value)
        return total

    def as_dict(self) -> dict:
        total = self.totals()
        return {"steps": self.steps, "hit_rate": total.hit_rate, "copy_bytes": total.copy_bytes,
                "cpu_s": total.cpu_s, "device_s": total.device_s, "wait_s": total.wait_s, "swaps": total.swaps,
                "fills": total.fills,
                "standin_s": total.standin_s, "critical_s": total.critical_s,
                "phases": {name: {"cpu_s": phase.cpu_s, "standin_s": phase.standin_s, "critical_s": phase.critical_s}
                           for name, phase in self.phases.items()},
                "misses_cpu": total.misses_cpu, "misses_copied": total.misses_copied, "miss_copies": total.miss_copies,
                "misses_read": total.misses_read,
                "step_splits": [list(split) for split in self.step_splits], "pinned": dict(self.pinned),
                "layers": [dict(asdict(layer), hit_rate=layer.hit_rate,
                                **({"expert_hits": self.expert_hits[i].tolist(),
                                    "expert_misses": self.expert_misses[i].tolist()} if i < len(self.expert_hits) else {}))
                           for i, layer in enumerate(self.layers)]}
