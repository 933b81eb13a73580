"""An expert node run with hybrid offload: resident experts on the device; in decode, cold ones computed on the CPU or
copied into spare device slots (the miss policy), read by the GPU from the host tier, or shared between the tier and
the CPU (decode path "both"); in prefill, on the CPU or, where copying pays, streamed to the device in waves; results
merged. Drop-in for CpuExpertNode in the decoder."""

from __future__ import annotations

import time
import weakref

import numpy as np

from engine.expert_node import CpuExpertNode
from engine.offload.approximate import approximate_routing
from engine.offload.miss_policy import choose, copying_pays, decode_costs
from engine.offload.projection import layer_critical_s
from engine.offload.stats import LayerStats
from engine.offload.step_pairs import NO_COUNTS, classify_pairs, count_routed, split_pairs, take_copied
from kernels.cold_split import cpu_spans, fc1_share, gpu_rows_of_split
from kernels.cpu.routing import route
from kernels.gpu.qmoe import GpuQMoE, routes_on_device

_NONE = np.empty(0, np.int64)  # no expert copied (read only)
_NONE.flags.writeable = False
DECODE_MAX_TOKENS = GpuQMoE.decode_max_tokens  # a step merged on the device: the GPU's decode launch


class HybridExpertNode:
    """The per-layer host work is kept to a few NumPy calls on decode-sized steps (issue #4: at high
    residency it is what remains of a token's time): one compiled pass sorts the step's pairs by residency
    and counts them (step_pairs.py), no miss policy where the layer has no slot, no set operations where a
    mask does."""

    def __init__(self, runner: CpuExpertNode, layer: int, engine):
        self.info = runner.info
        self.runner = runner
        self.layer = layer
        self.engine = engine
        self.last_split: SplitStep | None = None  # the "both" step the latest run() finished, else None (the decoder)
        self._flops_per_token = self.info.flops_per_token
        self._out: np.ndarray | None = None       # the decode-sized accumulator, reused at every step (_output)
        self._out_view: np.ndarray | None = None  # ... and the view of it returned (fp16 models: a kept fp16 copy)
        self._every_pair: np.ndarray | None = None  # account_resident's mask: every routed pair resident
        self._none_on_cpu: np.ndarray | None = None  # ... and split_pairs' on_cpu there: no pair computed on the CPU
        # route_split (the decode path "both") routes on the device: nodes it cannot route take the tier's step there
        self._splittable = routes_on_device(self.info.spec)

    @property
    def kernel(self):
        return self.runner.kernel  # rebuilt when allow_file_backing changes

    @property
    def takes_device_arrays(self) -> bool:
        """Whether the dense part may hand this node its inputs in GPU memory (a device store that takes them:
        run() brings them to the host where the layer needs them there)."""
        store = self.engine.stores[self.layer]
        return store is not None and getattr(store, "device_inputs", False)

    def run(self, values: dict[str, np.ndarray]) -> np.ndarray:
        inputs = self.info.activation_inputs
        x = values[inputs["input"]]
        router_weights = values[inputs["router_weights"]] if "router_weights" in inputs else None
        logits = values[inputs["router_probs"]]
        self.runner.check_activations(x, logits)
        spec = self.info.spec
        engine, layer = self.engine, self.layer
        store = engine.stores[layer]
        approximating = engine.approximating
        self.last_split = None
        held = store is not None and store.holds(x)  # the inputs lie in the device's memory
        if held:
            if not approximating and engine.slots[layer].all_resident:
                return self._run_resident(store, x, logits, router_weights)  # every expert on the device
            table = self._split_table(store, x)
            if table is not None:
                self.last_split = self._run_split(store, x, logits, router_weights, table)
                return self.last_split.finish_alone()
            if (not approximating and engine.reads_tier and store.reads_cold
                    and x.size <= spec.hidden_size * engine.config.async_max_tokens):
                # a decode step whose cold experts the GPU reads from the host tier alone
                return self._run_resident(store, x, logits, router_weights)
            like = x  # the result goes back where the inputs came from, in their dtype and shape
            x, logits, router_weights = store.to_host(x, logits, router_weights)
        x2d = np.ascontiguousarray(x.reshape(-1, spec.hidden_size))
        logits = logits.reshape(-1, spec.num_experts)
        ids, weights = route(logits, spec, router_weights)
        slot_of = engine.slots[layer].slot_of
        # placement counts what the router chose, not what approximate routing computes in its place: a substitute is
        # always a resident, and counting it would keep whatever is resident (static placement's opening chose copied
        # misses so)
        routed = ids
        if approximating:  # it drops pairs (-1); route() gives every pair an expert
            ids = approximate_routing(ids, weights, logits, slot_of, engine.config, engine.approximation)
        shadow = engine.shadow
        stats = engine.stats.layers[layer] if not shadow else LayerStats()
        counts = None if shadow else engine.stats.pair_counts(layer)
        # cold: the ids of the pairs not resident (-1 elsewhere; never written in place)
        resident, cold, hits, missed, residents, miss_experts, miss_tokens = classify_pairs(
            ids, slot_of, NO_COUNTS if counts is None else counts, counts is not None)
        stats.hits += hits
        stats.misses += missed
        if not shadow:
            if counts is None:
                engine.stats.count(layer, ids, resident, ids >= 0)
            if hits:
                engine.copy_reuse.hit(layer, ids, resident)

        out = self._output(x2d.shape[0])
        standin_before = getattr(store, "standin_s", 0.0) if store is not None else 0.0
        decode = self._decode(x2d.shape[0])
        copied_pairs = copies = 0
        pending = None
        waves = []      # (copy s, device s) per prefill wave: the projection's critical path (projection.py)
        miss_copy_s = 0.0
        if store is not None and missed and not shadow and engine.slots[layer].num_slots and decode:
            # Decode: the miss policy copies the misses that pay into spare slots first; one launch then computes
            # them with the residents (after the copies), while the CPU computes the rest. A second launch for the
            # copied ones cost the host an upload, a launch and a collect more (~80 µs a layer on the H200).
            copy_before = stats.copy_s
            copied = self._copy_misses(ids, residents, miss_experts, miss_tokens, stats)
            miss_copy_s = stats.copy_s - copy_before
            if copied.size:
                device_ids, cold, copied_pairs = take_copied(ids, cold, copied)
                copies = int(copied.size)
                pending = store.launch(x2d, device_ids, weights)
            elif hits:
                pending = store.launch(x2d, np.where(resident, ids, -1), weights)
        elif store is not None and missed and not shadow and engine.streaming.by_layer[layer] is not None and decode:
            # Decode at a layer without slots: the misses that pay are copied into the shared streaming slots and
            # computed there in one launch, while the CPU computes the rest (streaming.py).
            copy_before = stats.copy_s
            copied = self._stream_misses(miss_experts, miss_tokens, stats, engine.streaming.by_layer[layer])
            miss_copy_s = stats.copy_s - copy_before
            if copied.size:  # no pair is resident here: the device's ids are the copied pairs alone
                device_ids, cold, copied_pairs = take_copied(ids, cold, copied)
                copies = int(copied.size)
                pending = store.launch(x2d, device_ids, weights, streamed=engine.streaming.by_layer[layer])
        elif store is not None:
            # The device starts on the resident experts; prefill waves of cold ones follow; the CPU computes the
            # rest meanwhile.
            pending = store.launch(x2d, np.where(resident, ids, -1), weights) if hits else None
            for wave in self._waves(cold) if missed and not decode else ():
                wave_copy = store.stage(wave)
                stats.copy_s += wave_copy
                stats.copy_bytes += len(wave) * store.wave_bytes
                in_wave = np.isin(cold, wave)
                copied_pairs += int(np.count_nonzero(in_wave))
                wave_device = store.collect(store.launch(x2d, np.where(in_wave, cold, -1), weights), out)
                stats.device_s += wave_device
                waves.append((wave_copy, wave_device))
                cold = np.where(in_wave, -1, cold)
        cpu_s = 0.0
        if copied_pairs < missed:
            started = time.perf_counter()
            self.kernel.run_experts(x2d, cold, weights, out=out)
            cpu_s = time.perf_counter() - started
            stats.cpu_s += cpu_s
            # the miss policy's CPU rate, measured in layers without slots too: a budget raised later uses it at once
            if not shadow and engine.device is not None and decode:
                # the CPU's experts: the misses less the copied ones (a decode step has no prefill waves)
                engine.cpu_rate.observe((miss_experts.size - copies) * self.info.bytes_per_expert, cpu_s, layer)
            if not shadow and engine.host_cache.budget is not None:
                engine.host_cache.touch(layer, sorted(set(cold[cold >= 0].tolist())))
        standin = getattr(store, "standin_s", 0.0) - standin_before if pending is not None or waves else 0.0
        tokens = x2d.shape[0]
        result = None
        if held and not shadow and not waves and tokens <= min(engine.config.async_max_tokens, DECODE_MAX_TOKENS):
            # Decode with the inputs in device memory: the CPU's part goes over and is added to the device's there,
            # and the result stays for the next dense segment; the host does not wait for the device. Its time is
            # read once the launch is done (OffloadEngine.settle), at the latest at the end of the step.
            result, timing = store.merge_on_device(pending, out if copied_pairs < missed else None, like)
            engine.defer(lambda: self._account_time(stats, tokens, cpu_s, store.merged_done(timing),
                                                    pending is not None, copies, miss_copy_s, waves, standin),
                         lambda: store.merged_ready(timing))
        else:
            device_s = 0.0
            if pending is not None:
                waited = time.perf_counter()
                device_s = store.collect(pending, out)
                stats.wait_s += time.perf_counter() - waited
            if store is not None and (pending is not None or waves):
                store.flush(out)
            self._account_time(stats, tokens, cpu_s, device_s, pending is not None or bool(waves), copies,
                               miss_copy_s, waves, standin)
        if not shadow:
            engine.stats.split(layer, missed - copied_pairs, copied_pairs, copies)
            engine.policy.observe(layer, routed.reshape(-1))
            engine.settle()
        if result is not None:
            return result
        if out is self._out:
            # a decode step: the same array at every step (fp16 models: a kept fp16 copy), which the next dense
            # segment finds bound already
            if self._out_view is None or self._out_view.shape != x.shape or self._out_view.dtype != x.dtype:
                self._out_view = out.reshape(x.shape) if x.dtype == np.float32 else np.empty(x.shape, x.dtype)
            if x.dtype != np.float32:
                np.copyto(self._out_view, out.reshape(x.shape), casting="same_kind")
            return self._out_view
        return out.astype(x.dtype, copy=False).reshape(x.shape)

    def _account_time(self, stats: LayerStats, tokens: int, cpu_s: float, device_s: float, on_device: bool,
                      copies: int, miss_copy_s: float, waves, standin: float) -> None:
        """A step's device time (that of its launch; prefill waves count theirs as they run) and the projection for
        the simulated card (projection.py): the step's critical path on a real card, and the wall time the
        simulated device spent computing its experts on the CPU."""
        stats.device_s += device_s
        if not on_device:
            critical = cpu_s  # no device work: the CPU's time, as measured
        elif copies:  # one launch after the copies: residents and copied misses together
            critical = layer_critical_s(cpu_s, miss_copy_s=miss_copy_s, miss_device_s=device_s)
        else:
            critical = layer_critical_s(cpu_s, device_s, waves)
        stats.critical_s += critical
        stats.standin_s += standin
        if self.engine.shadow:
            return  # the agreement meter's exact-routing pass, which no timing the phases are taken from counts
        phase = self.engine.stats.phase(tokens)
        phase.cpu_s += cpu_s
        phase.critical_s += critical
        phase.standin_s += standin

    def _run_resident(self, store, x, logits, router_weights):
        """Every expert of the layer resident (or read from the host tier): routing and experts on the device, the
        result left there (in GPU memory when the dense part runs on the GPU: no host round trip, no wait). The
        step's statistics follow (account_resident) once the launch is done and its routed ids' copy to the host is
        in: in a later layer (OffloadEngine.settle) or at the step's end."""
        out, pending = store.launch_routed(x, logits, router_weights)
        engine = self.engine
        if not engine.shadow:
            engine.defer(lambda: self.account_resident(pending), lambda: store.routed_ready(pending))
            engine.settle()
        return out

    def launch_ahead(self, values: dict[str, np.ndarray]) -> "SplitStep | None":
        """This step launched where run() would take it to _run_split, its host part left to the caller
        (SplitStep.finish(queued=True), which takes earlier layers' accounts while it waits for the routing); None,
        with nothing done, where run() would take another way."""
        inputs = self.info.activation_inputs
        x = values[inputs["input"]]
        self.runner.check_activations(x, values[inputs["router_probs"]])
        store = self.engine.stores[self.layer]
        if store is None or not store.holds(x):
            return None
        table = self._split_table(store, x)
        if table is None:
            return None
        router_weights = values[inputs["router_weights"]] if "router_weights" in inputs else None
        return self._run_split(store, x, values[inputs["router_probs"]], router_weights, table)

    def _split_table(self, store, x) -> np.ndarray | None:
        """The split's table (OffloadEngine.cold_split_table) where a step with its inputs in the device's memory is a
        "both" step: a partly resident layer whose cold experts the GPU reads from the host tier while the CPU takes a
        share, no approximate routing, a decode launch's tokens at most (route_split's limit); None otherwise, and
        where the tables give the CPU nothing, neither a whole pair nor a split one's rows (cold_split_rows) (the
        tier's step then, whose host does not wait for the routing)."""
        engine, spec = self.engine, self.info.spec
        if (engine.approximating or not engine.splits_cold or not self._splittable or not engine.reads_tier
                or not store.reads_cold or engine.slots[self.layer].all_resident
                or x.size > spec.hidden_size * min(engine.config.async_max_tokens, DECODE_MAX_TOKENS)):
            return None
        table = engine.cold_split_table(self.layer)
        if table.any():
            return table
        rows = engine.cold_split_rows(self.layer)  # (asked only here: the common step reads one table)
        return table if rows is not None and rows.any() else None

    def _run_split(self, store, x, logits, router_weights, cpu_take: np.ndarray) -> "SplitStep":
        """A decode step whose cold experts the GPU (from the host tier) and the CPU share (decode path "both"),
        launched: routing and the GPU's part on the device; the CPU's share of the cold pairs (`cpu_take`:
        OffloadEngine.cold_split_table; with a pair split by rows where cold_split_rows gives them) is the host's part,
        SplitStep.finish."""
        launched_at = time.perf_counter()
        standin_before = getattr(store, "standin_s", 0.0)
        pending = store.launch_split(x, logits, router_weights, cpu_take, self.engine.cold_split_rows(self.layer))
        return SplitStep(self, store, pending, x, launched_at, standin_before)

    def _finish_split(self, step: "SplitStep", arrived: float, settling: bool, ahead: bool):
        """SplitStep.finish: the CPU computes its share as soon as the routing reaches the host (published by the
        routing kernel: a few µs, no stream synchronisation), then raises the gate; the sum stays on the device for
        the next dense segment.

        Between the CPU's part and the next layer's routing the GPU waits for the host, so the host's bookkeeping is
        kept out of that stretch: the earlier layers' accounts are taken while the GPU works towards this layer's
        routing (the host would only wait there: run() before this part, `settling` within the wait for the routing),
        and this step's statistics join them (account_split). What the host does from the CPU's part to the next
        layer's wait (`arrived`) is measured (HostGap) for the split's table; in a queued part (launch ahead) a host
        that then waited for the routing counts none. `ahead`: work is queued behind the merge (merge_split's)."""
        engine, layer, store, pending = self.engine, self.layer, step.store, step.pending
        idle = (lambda: engine.settle(1) > 0) if settling and not engine.shadow else None
        x2d, ids, on_cpu, weights = store.split_routing(pending, idle)
        if not engine.shadow:  # (a host that waited for the routing in a queued part left the CPU no gap)
            engine.host_gap.arrived(layer, arrived, settling and store.routing_waited(pending))
        cpu_s, out = 0.0, None
        try:
            if on_cpu.any():
                out = store.split_part(pending)  # the gated merge's buffer, else the node's own
                out = self._output(ids.shape[0]) if out is None else out
                spec = self.info.spec
                spans = cpu_spans(ids, on_cpu, spec.num_experts, spec.inter_size)
                started = time.perf_counter()
                self.kernel.run_experts(x2d, np.where(on_cpu != 0, ids, -1), weights, out=out, spans=spans)
                cpu_s = time.perf_counter() - started
        finally:  # a gated merge waits for merge_split: the GPU is let go even when the CPU's part failed
            if not engine.shadow:
                engine.host_gap.left(layer, time.perf_counter())
            result, timing = store.merge_split(pending, out, step.x, ahead=ahead)
        if not engine.shadow:
            standin = getattr(store, "standin_s", 0.0) - step.standin_before
            engine.defer(lambda: self.account_split(ids, on_cpu, cpu_s, store.merged_done(timing), standin),
                         lambda: store.merged_ready(timing))
        return result

    def host_part_done(self, job) -> None:
        """A SplitStep whose host part the host-part worker did (engine/offload/host_part_worker.py JobDone): the
        routing copied off the published block before the layer's next launch overwrites it, the host's gap (the
        worker's, from the previous layer's gate to this job: none where it waited for the GPU's routing) and the
        step's statistics deferred, as _finish_split's."""
        engine, layer, step = self.engine, self.layer, job.step
        if engine.shadow:
            return
        published, store = step.pending.published, step.store
        ids, on_cpu = published.ids.copy(), published.on_cpu.copy()
        engine.host_gap.arrived(layer, job.reached, job.waited)
        engine.host_gap.left(layer, job.gated)
        standin = getattr(store, "standin_s", 0.0) - step.standin_before
        timing = (step.pending.start, step.pending.stop)
        engine.defer(lambda: self.account_split(ids, on_cpu, job.cpu_s, store.merged_done(timing), standin),
                     lambda: store.merged_ready(timing))

    def account_split(self, ids: np.ndarray, on_cpu: np.ndarray, cpu_s: float, device_s: float,
                      standin: float) -> None:
        """The statistics of one _run_split step, once its launch is done (OffloadEngine.settle / end_step): the pairs
        in a slot hits, the others misses the CPU computed (`on_cpu`, coded as kernels/cold_split.py's
        split_cold_rows: a pair split by rows counts as the CPU's) or the device read from the tier, the CPU's and the
        tier's measured rates for the split's table (the tier's: the launch's time less its residents' HBM reads;
        each side's bytes with its part of a split pair), the step's device time on the critical path beside the
        CPU's."""
        engine, layer = self.engine, self.layer
        store, bandwidths = engine.stores[layer], engine.device.bandwidths
        stats = engine.stats.layers[layer]
        resident, hits, cpu_pairs, cpu_experts, on_gpu, held = self._counted_pairs(ids, on_cpu != 0)
        split = gpu_rows_of_split(on_cpu, self.info.spec.inter_size)  # the GPU's share of split pairs, in experts
        stats.hits += hits
        stats.misses += ids.size - hits
        stats.cpu_s += cpu_s
        stats.routed_on_device += 1
        engine.copy_reuse.hit(layer, ids, resident)
        engine.stats.split(layer, cpu_pairs, 0, 0, read=ids.size - hits - cpu_pairs)
        engine.policy.observe(layer, ids.reshape(-1))
        if cpu_pairs:
            gpu_share = 1.0 if getattr(self.kernel, "reads_rows_in_part", False) else fc1_share(self.info.spec.gated)
            cpu_experts_read = cpu_experts.size - split * gpu_share
            engine.observe_split_part(int(cpu_experts_read * self.info.bytes_per_expert), cpu_s)
            if engine.host_cache.budget is not None:
                engine.host_cache.touch(layer, cpu_experts.tolist())
        if on_gpu + split > held:
            engine.tier_read.observe(int((on_gpu + split - held) * store.read_bytes),
                                     device_s - held * store.read_bytes / bandwidths.hbm)
        self._account_time(stats, ids.shape[0], cpu_s, device_s, True, 0, 0.0, (), standin)

    def _counted_pairs(self, ids: np.ndarray, on_cpu: np.ndarray) -> tuple:
        """step_pairs.split_pairs on this layer's step, its pairs added to the layer's per-expert statistics: the
        sorting and counting in one compiled pass (NumPy's calls cost µs each; this runs per layer)."""
        engine, layer = self.engine, self.layer
        counts = engine.stats.pair_counts(layer)
        pairs = split_pairs(ids, on_cpu, engine.slots[layer].slot_of, NO_COUNTS if counts is None else counts,
                            counts is not None)
        if counts is None:
            engine.stats.count(layer, ids, pairs[0])
        return pairs

    def account_resident(self, pending) -> None:
        """The statistics of one _run_resident step, once its launch is done (OffloadEngine.settle / end_step): the
        routing the launch wrote back (no routing again on the host), every pair in a slot a hit, the others misses
        the device read from the host tier, the launch's device time on the critical path."""
        engine, layer = self.engine, self.layer
        ids, device_s, standin = engine.stores[layer].routed_done(pending)
        stats = engine.stats.layers[layer]
        slots = engine.slots[layer]
        if slots.all_resident:
            stats.hits += count_routed(ids, engine.stats.expert_hits[layer])
            if self._every_pair is None or self._every_pair.shape != ids.shape:
                self._every_pair = np.ones(ids.shape, bool)
            resident, read = self._every_pair, 0
        else:
            if self._none_on_cpu is None or self._none_on_cpu.shape != ids.shape:
                self._none_on_cpu = np.zeros(ids.shape, bool)
            resident, hits, _, _, _, _ = self._counted_pairs(ids, self._none_on_cpu)
            read = ids.size - hits
            stats.hits += hits
            stats.misses += read
        stats.routed_on_device += 1
        engine.copy_reuse.hit(layer, ids, resident)
        self._account_time(stats, ids.shape[0], 0.0, device_s, True, 0, 0.0, (), standin)
        engine.stats.split(layer, 0, 0, 0, read=read)
        engine.policy.observe(layer, ids.reshape(-1))

    def _output(self, tokens: int) -> np.ndarray:
        """A zeroed float32 [tokens, hidden] accumulator. A decode step's is one buffer per node, returned (as the
        same view) at every step: the next dense segment finds the very array it bound at the last step and does
        not bind it again. So a result lives until this node's next run: the decoder reads it within the step."""
        hidden = self.info.spec.hidden_size
        if tokens > self.engine.config.async_max_tokens:
            return np.zeros((tokens, hidden), np.float32)  # prefill: not kept
        if self._out is None or self._out.shape[0] != tokens:
            self._out, self._out_view = np.zeros((tokens, hidden), np.float32), None
        else:
            self._out.fill(0.0)
        return self._out

    def _decode(self, tokens: int) -> bool:
        """A decode-sized step (misses judged one by one) with CPU execution allowed."""
        config = self.engine.config
        return config.cpu_execution != "disabled" and tokens <= config.async_max_tokens

    def _miss_costs(self, tokens: list[int], residents: int, prepare_s: float, reuse: float | None,
                    launch_s: float = 0.0):
        """The miss policy's cost model for this layer's misses (miss_policy.decode_costs, as the slot weighing prices
        them: miss_slots). The CPU reads the stored expert; a copy moves it in the kernels' (converted) layout, which
        the device then reads: converted layouts (int2, fp4 ...) cost more on the device side than on the CPU side."""
        engine, store = self.engine, self.engine.stores[self.layer]
        cpu_rate, cpu_fixed_s = engine.cpu_rate.priced(engine.device.bandwidths.cpu)
        return decode_costs(engine.device.bandwidths, self.info.bytes_per_expert, tokens, residents, launch_s=launch_s,
                            flops_per_token=self._flops_per_token, prepare_s=prepare_s, copy_bytes=store.expert_bytes,
                            read_bytes=store.read_bytes, cpu_rate=cpu_rate, reuse=reuse, cpu_fixed_s=cpu_fixed_s)

    def _stream_misses(self, miss_experts: np.ndarray, miss_tokens: np.ndarray, stats: LayerStats,
                       streaming) -> np.ndarray:
        """Decide with the cost model which misses to copy into the streaming slots (no residents beside them, no
        later hits to credit: they are overwritten by the next layer; a launch and merge of their own, whose host time
        the copies must earn back); copy them; returns the copied experts."""
        experts = miss_experts.tolist()
        costs = self._miss_costs(miss_tokens.tolist(), 0, streaming.prepare_s, None, launch_s=streaming.launch_s)
        decision = choose(costs, streaming.num_slots)  # it scans every m: launch_s breaks copying_pays' shortcut
        chosen = [experts[i] for i in decision.copied.tolist()]
        if chosen:
            store = self.engine.stores[self.layer]
            stats.copy_s += store.stream(streaming, chosen)
            stats.copy_bytes += len(chosen) * store.expert_bytes
        return np.array(chosen, dtype=np.int64)

    def _copy_misses(self, ids: np.ndarray, residents: int, miss_experts: np.ndarray, miss_tokens: np.ndarray,
                     stats: LayerStats) -> np.ndarray:
        """Decide with the cost model (miss_policy.py) which misses (distinct experts ascending, the pairs routed to
        each) to copy into spare slots; copy them (the placement policy is told); returns the copied experts.
        residents: the distinct resident experts of the step. With none, copies would make the step's device part
        on their own: its launch and merge are charged to them (the store's launch_s)."""
        engine, store = self.engine, self.engine.stores[self.layer]
        experts = miss_experts.tolist()
        costs = self._miss_costs(miss_tokens.tolist(), residents, getattr(store, "prepare_s", 0.0),
                                 engine.copy_reuse.value, launch_s=getattr(store, "launch_s", 0.0))
        if not copying_pays(costs):
            return _NONE  # no copy can pay, whatever the spare slots: placement's spare_slots is not asked
        policy = engine.policy
        spare = policy.spare_slots(self.layer, ids)  # unrouted pairs (-1) are ignored there
        if spare.size == 0:
            return _NONE
        decision = choose(costs, spare.size)
        chosen = [experts[i] for i in decision.copied.tolist()]
        for slot, expert in zip(spare.tolist(), chosen):
            policy.admit(self.layer, slot, expert)
            stats.copy_s += store.load(slot, expert)
            stats.copy_bytes += store.expert_bytes
        if chosen:
            engine.copy_reuse.copied(self.layer, chosen)
        return np.array(chosen, dtype=np.int64)

    def _waves(self, cold: np.ndarray) -> list[np.ndarray]:
        """Cold experts of a step larger than decode (there the miss policy splits the misses between the CPU and spare
        slots) worth running on the device, in waves that fit the staging ring."""
        wave = self.engine.wave_experts
        config = self.engine.config
        if wave == 0:
            return []
        experts, tokens = np.unique(cold[cold >= 0], return_counts=True)
        if experts.size == 0:
            return []
        if config.cpu_execution != "disabled":
            # Prefill: stream an expert when copying it costs less than computing its tokens on the CPU.
            bw = self.engine.device.bandwidths
            wave_bytes = self.engine.stores[self.layer].wave_bytes  # what the wave copies of one expert
            worth = tokens * self._flops_per_token / bw.cpu_flops > wave_bytes / bw.pcie
            experts = experts[worth]
        return [experts[i:i + wave] for i in range(0, experts.size, wave)]


class SplitStep:
    """A "both" step launched (HybridExpertNode._run_split) whose host part is still to do: finish() computes the
    CPU's share of the cold pairs and raises the gate, and returns the step's result in GPU memory.

    Where the launch queued its merge behind the gate (`result_ahead`: the result's buffer, known at the launch), the
    GPU orders everything after it, so a caller may launch the next layer's work first (PartitionedDecoder: the GPU
    then goes on from this gate without waiting for the host's launches). It then calls finish(ahead=True): the gate
    is not checked there (that would wait for the work queued behind it), `late` says whether the merge may have
    given up waiting, and abandon() raises the gate of a step that will not be finished (an error elsewhere)."""

    __slots__ = ("node", "store", "pending", "x", "launched_at", "standin_before", "done")

    def __init__(self, node: HybridExpertNode, store, pending, x, launched_at: float, standin_before: float):
        # the node held weakly: it keeps its latest step (last_split), and a step holding it made a cycle that kept
        # the engine and the device (its cap on CuPy's pool, its slots) past the model's end until a garbage
        # collection. A step is used only within the decoder step that launched it, while the decoder holds the node
        self.node = weakref.proxy(node)
        self.store, self.pending, self.x = store, pending, x
        self.launched_at, self.standin_before = launched_at, standin_before
        self.done = False

    @property
    def result_ahead(self):
        """The step's result (GPU memory, filled in stream order once the gate is raised) where its merge is queued
        behind the gate; None where the merge is queued by finish()."""
        return self.store.split_result(self.pending, self.x)

    def finish_alone(self):
        """The host's part right after the launch, as run() does it: earlier layers' accounts first, while the GPU
        works towards this layer's routing, then finish()."""
        if not self.node.engine.shadow:
            self.node.engine.settle()
        return self.finish()

    def finish(self, ahead: bool = False, queued: bool = False):
        """The host's part; the result. `ahead`: the caller launched later work behind this step's merge. `queued`:
        the caller did other work since the launch (the host's gap then runs to now, not to the launch), and earlier
        layers' accounts are taken while the host waits for this step's routing."""
        result = self.node._finish_split(self, time.perf_counter() if queued else self.launched_at, queued, ahead)
        self.done = True
        return result

    @property
    def late(self) -> bool:
        """Whether finish(ahead=True) raised the gate after the merge may have stopped waiting for it."""
        return self.store.split_gate_late(self.pending)

    @property
    def gave_up(self) -> bool:
        """Whether the step's gated merge gave up waiting for the gate and left its sum without the CPU's part: the
        device's word, read once the merge has run (the step's logits on the host)."""
        return self.store.split_gate_gave_up(self.pending)

    def abandon(self) -> None:
        """The gate raised without the CPU's part (the sum is wrong and must not be used), unless finished: after an
        error in this step's host part or elsewhere, so that the GPU is not held until the gate's timeout."""
        if not self.done:
            self.done = True
            self.store.abandon_split(self.pending)
