"""Hybrid offload on a writer-made model with real dimensions, on the CUDA device (or simulated).

At 0/25/50/100% of experts resident: decode tokens/s next to its bound (anchors.md:
t_token >= dense + (1-h)·W_act/(B_dram + B_pcie) + h·W_act/B_hbm, with B_pcie and B_hbm measured in this run,
B_dram the highest of its reads, at the start and after each fraction's timed decode (DramReads), h the measured hit
rate and dense the dense part's time a token measured first with every expert resident: dense_reference),
prefill tokens/s for a 2,048-token prompt against the all-CPU prefill, and the per-layer overhead (Python,
synchronisation, launches) left when kernel and dense times are taken out: as (experts_s - wait_s) / (steps x layers)
where no expert ran on the CPU in the timed steps (layer_overhead), and by
component from bench_overhead's timing wrappers (dense set-up, hybrid-node Python, launches, waiting
for the device split into its kernels and the synchronisation / copy back, placement, decoder loop). Random weights route almost uniformly, so each point
also reports the hit rate the adaptive policy reaches on a realistic routing trace at the same
slot count, and measures decode with every step's routing replaced by such a trace (benchmarks/trace_routing.py;
--trace-tokens). (A decode rate projected from the random run's costs at the trace's hit rate was dropped: it added
CPU and device seconds that the decode paths overlap, and projected slower decode at higher hit rates.) Each
decode point also reports how the miss policy split the misses (CPU / copied into spare slots) and
the pinned staging ring's size and high-water mark. The CPU decode kernels alone are measured once at the start
(cpu_calibration: the model's first expert node, cold, at the engine's thread count; next to B_dram), and each point
whose CPU kernels ran under the decode path cpu or both gives their rate against it (cpu_kernels): the CPU kernels'
own rate moves from one host to the next, and the goal points with it.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_overhead import instrument, profile_steps, summarise  # noqa: E402
from benchmarks.common import (  # noqa: E402
    median_seconds, model_folder, stream_read_bandwidth, write_result, written_model)
from benchmarks.trace_routing import TraceRouting  # noqa: E402
from engine.errors import WorkbenchError  # noqa: E402
from engine.generation import LoadedModel  # noqa: E402
from engine.host_load import HostLoadMeter  # noqa: E402
from engine.offload import OffloadConfig  # noqa: E402
from engine.offload.decode_path import MODES as PATH_MODES, measured_words  # noqa: E402
from engine.offload.miss_policy import cpu_rate_words  # noqa: E402
from engine.offload.planner import all_resident_bytes  # noqa: E402
from engine.offload.traces import SWITCH_EVERY, hit_rate, realistic_trace  # noqa: E402
from engine.records.schema import ALL_RESIDENT  # noqa: E402
from engine.units import byte_rate, counted, layer_words  # noqa: E402
from engine.writer import WriterSpec  # noqa: E402

# decode steps a benchmark's warm-up goes on for at most while the engine's trials are under way (trials_under_way):
# a first trial of the CPU's share under "both" takes 16 steps to start and 60 to run
TRIALS_WARMUP_MAX = 160
# layer_overhead's None, in the printed line and the result file
NO_OVERHEAD = "not given (experts computed on the CPU in the timed steps)"
EVERY_EXPERT = "every expert resident"  # the trace-routed point without a placement to choose (bench at 100%)
SHAPES = {
    "gpt-oss-20b-like": dict(layers=24, hidden_size=2880, inter_size=2880, num_experts=32, top_k=4, num_heads=64,
                             num_kv_heads=8, head_size=64, vocab_size=4096, sliding_window=128),
    "qwen3-30b-a3b-like": dict(layers=48, hidden_size=2048, inter_size=768, num_experts=128, top_k=8, num_heads=32,
                               num_kv_heads=4, head_size=128, vocab_size=4096, swiglu_limit=None, alpha=1.0, beta=0.0),
}


def shape_spec(shape: str, layers: int | None = None, dtype: str = "float32") -> WriterSpec:
    """The writer's spec of a SHAPES model (int4 block 32), with `layers` layers where given (quick runs)."""
    return WriterSpec(**dict(SHAPES[shape], **({"layers": layers} if layers else {})), bits=4, block_size=32,
                      context_length=4096, seed=7, dtype=dtype)


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _wait_for_population(model: LoadedModel, what: str) -> None:
    """Time only once the model's background work after load is done (LoadedModel.wait_until_settled): the experts'
    population reads the whole file beside whatever runs meanwhile."""
    waited = model.wait_until_settled()
    if model.prefault is not None:
        print(f"{what}: {model.prefault.populated_bytes / 1e9:.1f} GB of experts mapped (waited {waited:.1f} s)",
              flush=True)


def _gather_seconds(model: LoadedModel) -> float:
    """Seconds the CUDA slots spent gathering prefill waves' rows into the pinned ring so far (0 when simulated)."""
    return sum(getattr(store, "wave_gather_s", 0.0) for store in model.offload.stores if store is not None)


def decode(model: LoadedModel, prompt: list[int], tokens: int, warmup: int = 4) -> tuple[float, list[dict]]:
    """Decode tokens/s, and per step the seconds at each boundary bench_overhead times (its Meter:
    dense set-up vs onnxruntime's run, expert node, launch / collect, placement, the decoder loop). Starts once the
    background work a re-plan started is done (back from every expert resident, as after the dense reference: the
    experts' pages mapped in, their mapping page-locked), which the warm-up, the trials and the timed steps ran
    beside."""
    model.wait_until_settled()
    meter = instrument(model)
    state = model.new_state()
    logits = model.decoder.forward(state, prompt)
    token = int(logits[-1].argmax())
    for _ in range(warmup):  # warm-up: placement fills, kernels compiled
        token = int(model.decoder.forward(state, [token])[-1].argmax())
    for _ in range(TRIALS_WARMUP_MAX):  # ... and the engine's trials over (timed steps would time the ways they try)
        if not trials_under_way(model):
            break
        token = int(model.decoder.forward(state, [token])[-1].argmax())
    model.offload.stats.reset(len(model.offload.slots)) if model.offload else None
    profile = model.decoder.profile
    profile.update(steps=0, dense_s=0.0, experts_s=0.0, total_s=0.0)
    meter.reset()
    rows, before, clock = [], meter.snapshot(), time.perf_counter
    collector = GcClock()
    gc.callbacks.append(collector)
    try:
        started = clock()
        for _ in range(tokens):
            step_started, gc_before = clock(), collector.seconds
            logits = model.decoder.forward(state, [token])
            meter.total["step"] += clock() - step_started
            token = int(logits[-1].argmax())
            now = meter.snapshot()
            rows.append({**{k: now[k] - before[k] for k in now}, "gc": collector.seconds - gc_before})
            before = now
        rate = tokens / (clock() - started)
    finally:
        gc.callbacks.remove(collector)
    return rate, rows


def trials_under_way(model: LoadedModel) -> bool:
    """Whether a trial of the engine's is timing its ways now, or a first one is still to come (trials_pending)."""
    return model.offload is not None and model.offload.trials_pending


class GcClock:
    """A gc.callbacks entry: the seconds Python's cyclic garbage collector has run since it was made (a collection
    inside a decode step is one of the suspects for a slow step)."""

    def __init__(self):
        self.seconds = 0.0
        self._started = 0.0

    def __call__(self, phase: str, _info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started


def traced_decode(model: LoadedModel, prompt: list[int], tokens: int, warmup: int, seed: int,
                  switch_every: int = SWITCH_EVERY) -> float:
    """Decode tokens/s with every step routed by a realistic trace (`seed`, a topic switch every `switch_every`
    tokens), after `warmup` routed steps."""
    infos = model.folder.experts
    spec = infos[0].spec
    trace = realistic_trace(warmup + TRIALS_WARMUP_MAX + tokens, len(infos), spec.num_experts, spec.k, seed=seed,
                            switch_every=switch_every)
    with TraceRouting(trace, len(infos)):
        rate, _rows = decode(model, prompt, tokens, warmup=warmup)
    return rate


class DramReads:
    """The run's reads of B_dram, each with when it was taken (seconds into the run) and after what. Every bound takes
    the highest (a read that comes out low flatters every ratio): on one H100 host the benchmark's 2 GB read came out
    120.8 GB/s where the engine's at start-up read 145.1 in the same process (sixty-fifth session), and on the GPU host
    the CPU's streaming read moved 108-144 GB/s within minutes, so one read before the points bounded none measured
    later. The benchmark reads again after each fraction's timed decode (Bounds.rebase re-bases the earlier points)."""

    def __init__(self, started: float):
        self.started = started  # time.perf_counter() at the run's start
        self.reads: list[dict] = []

    def add(self, what: str, bytes_per_s: float) -> float:
        self.reads.append({"what": what, "at_s": round(time.perf_counter() - self.started, 1),
                           "bytes_per_s": bytes_per_s})
        return bytes_per_s

    def read(self, what: str) -> float:
        """The benchmark's streaming read (2 GB, all threads) now."""
        return self.add(what, stream_read_bandwidth() * 1e9)

    @property
    def highest(self) -> float:
        return max(read["bytes_per_s"] for read in self.reads)

    def words(self, reads: list[dict] | None = None) -> str:
        """'120.8 GB/s at 41 s (the benchmark's, at the start), 145.1 at 38 s (...)' for `reads` (default: all)."""
        return ", ".join(f"{read['bytes_per_s'] / 1e9:.1f}{' GB/s' if not index else ''} at {read['at_s']:.0f} s "
                         f"({read['what']})" for index, read in enumerate(self.reads if reads is None else reads))


def bound_seconds(dense_s: float, h: float, w_act: float, b_cold: float, b_hbm: float) -> float:
    """anchors.md's bound on a decode token: the dense part, the misses' share of W_act at `b_cold` (B_dram + B_pcie;
    B_dram alone where misses can only run on the CPU, B_pcie alone where the GPU reads them all from the host tier)
    and the hits' at B_hbm."""
    return dense_s + (1 - h) * w_act / b_cold + h * w_act / b_hbm


def dense_reference(model: LoadedModel, infos, prompt: list[int], tokens: int, warmup: int) -> float | None:
    """The dense part's seconds a decode token with every expert resident: the bound's dense term. A point's own
    dense time holds whatever the dense calls wait for on the device: with the host tier a layer's experts run on the
    dense part's stream and its next dense call waits for their PCIe reads (Qwen3-30B-A3B-like at 0%: 21.5 ms a token
    of "dense" against 2.5 ms at 100%, RESULTS.md twenty-eighth session), which made the bound looser than the decode
    it bounds. None where every expert does not fit the device."""
    try:
        model.offload.reconfigure(model.offload.config.updated(device_expert_bytes=all_resident_bytes(infos)))
    except WorkbenchError as exc:
        print(f"no dense reference (every expert resident does not fit: {exc}); each point's own dense time is used",
              flush=True)
        return None
    decode(model, prompt, tokens, warmup=warmup)
    profile = model.decoder.profile
    return profile["dense_s"] / profile["steps"]


def trace_decode(model: LoadedModel, prompt: list[int], tokens: int, warmup: int, switch_every: int,
                 bounds: "Bounds", calibration: float) -> dict:
    """Decode with every step routed by a realistic trace (TraceRouting): tokens/s after `warmup` trace-routed
    tokens (placement adapts to the trace meanwhile), next to the bound at the hit rate reached (Bounds.trace), with
    its CPU kernels' rate against `calibration` (cpu_kernels)."""
    rate = traced_decode(model, prompt, tokens, warmup, seed=5, switch_every=switch_every)
    stats, profile, state = model.offload.stats.totals(), model.decoder.profile, model.offload.copy_state()
    figure = {"value": rate, "hit_rate": stats.hit_rate, "dense_s_per_token": profile["dense_s"] / profile["steps"]}
    path = path_run(model, state["decode_path"])
    return {**figure, "unit": "tokens/s", "reference": "bound at the hit rate reached (as for random routing)",
            **bounds.trace(figure), "misses_cpu": stats.misses_cpu,
            "misses_copied": stats.misses_copied, "misses_read": stats.misses_read, "swaps": stats.swaps,
            "placement": state.get("placement"), "decode_path": path,
            **cpu_kernels(cpu_rate_in_force(model.offload), path, stats.misses_cpu, calibration),
            "copy_reuse": model.offload.copy_reuse.value,
            "trace": f"engine.offload.traces.realistic_trace seed 5, {counted(warmup, 'warm-up token')}, {tokens} "
                     f"timed, a topic switch every {switch_every}"}


class Bounds:
    """A run's bounds on its decode points (anchors.md, bound_seconds): W_act, B_pcie and B_hbm, the dense term
    measured with every expert resident (dense_reference; None: each point's own dense time) and B_dram, the highest
    of the run's reads (DramReads) when asked."""

    def __init__(self, dram: DramReads, w_act: float, b_pcie: float, b_hbm: float, dense_ref: float | None = None):
        self.dram, self.w_act, self.b_pcie, self.b_hbm, self.dense_ref = dram, w_act, b_pcie, b_hbm, dense_ref

    def _seconds(self, dense_s: float, h: float, b_cold: float) -> float:
        return bound_seconds(dense_s, h, self.w_act, b_cold, self.b_hbm)

    def decode(self, measured: dict) -> dict:
        """A random-routing decode's bounds and its ratios to them, from its rate (`value`), `hit_rate` and own dense
        time a token (`dense_s_per_token`)."""
        rate, h, own = measured["value"], measured["hit_rate"], measured["dense_s_per_token"]
        dense, b_dram = own if self.dense_ref is None else self.dense_ref, self.dram.highest
        bound_s = self._seconds(dense, h, b_dram + self.b_pcie)
        # the misses on the CPU alone (no slot and no streaming slot to copy one into): their share bound by B_dram
        cpu_only_bound_s = self._seconds(dense, h, b_dram)
        # the misses all read by the GPU from the host tier (decode path "tier"): their share bound by B_pcie; a
        # tier point cannot pass this, however the host runs (RESULTS.md, thirty-sixth session)
        tier_only_bound_s = self._seconds(dense, h, self.b_pcie)
        # as earlier sessions reported it: the point's own dense time (with what its dense calls waited for)
        point_bound_s = self._seconds(own, h, b_dram + self.b_pcie)
        return {"reference_value": 1 / bound_s, "ratio": rate * bound_s,
                "ratio_with_the_points_dense_time": rate * point_bound_s,
                "bound_misses_on_cpu_only": 1 / cpu_only_bound_s, "ratio_to_cpu_only_bound": rate * cpu_only_bound_s,
                "bound_misses_on_tier_only": 1 / tier_only_bound_s,
                "ratio_to_tier_only_bound": rate * tier_only_bound_s}

    def trace(self, measured: dict) -> dict:
        """A trace-routed decode's bound at the hit rate it reached and its ratio to it (as decode's first)."""
        dense = measured["dense_s_per_token"] if self.dense_ref is None else self.dense_ref
        bound_s = self._seconds(dense, measured["hit_rate"], self.dram.highest + self.b_pcie)
        return {"reference_value": 1 / bound_s, "ratio": measured["value"] * bound_s}

    def rebase(self, figures: list[dict]) -> None:
        """Every decode figure's bounds and ratios on the run's highest read so far: a point measured before a higher
        read gets the bound that read gives, as the points measured after it do (its repeats each, then their
        medians; a dense-capped ratio with them)."""
        for figure in figures:
            if "repeats" in figure:
                for repeat in figure["repeats"]:
                    repeat.update(self.decode(repeat))
                figure.update(decode_repeats(figure["repeats"]))
            elif "trace" in figure:
                figure.update(self.trace(figure))
            if "dense_capped_s" in figure:
                figure["ratio_dense_capped"] = capped_ratio(figure, self.dense_ref)


def cap_dense_term(figures: list[dict], dense_s: float, step_s: float) -> list[tuple[str, float]]:
    """Where the dense term measured before the points (dense_reference, `dense_s` a token) came out longer than a
    whole all-resident decode step measured later (`step_s`, which includes the dense part), the host was slower when
    the term was measured, and every bound built on it is too loose (the thirty-fifth session: 4.08 against 3.69 ms).
    Each decode figure (random and trace routing) gets its ratio with the dense term replaced by `step_s`
    (`ratio_dense_capped`: an upper limit on the true ratio, as the dense part alone is shorter than the step), the
    primary ratio left as measured. Returns (figure name, capped ratio) for each."""
    capped = []
    for figure in figures:
        if not figure["name"].startswith("decode tokens/s") or not figure.get("reference_value"):
            continue
        figure["dense_capped_s"] = step_s
        figure["ratio_dense_capped"] = capped_ratio(figure, dense_s)
        capped.append((figure["name"], figure["ratio_dense_capped"]))
    return capped


def capped_ratio(figure: dict, dense_s: float) -> float:
    """A decode figure's ratio with its bound's dense term `dense_s` replaced by its `dense_capped_s`."""
    return figure["value"] * (1 / figure["reference_value"] - dense_s + figure["dense_capped_s"])


def decode_repeats(repeats: list[dict]) -> dict:
    """The decode figure of a fraction measured `--repeats` times: the median tokens/s, the median bound and the
    median of the per-repeat ratios (each repeat's rate against its own bound: the dense time and the hit rate it
    measured), the same for the bounds with the misses on the CPU alone and on the host tier alone, with every repeat
    kept. The other figures of the point (overhead, statistics, projection) are the last repeat's: by then placement
    and the miss policy have run longest on this fraction."""

    def median(key: str) -> float:
        return statistics.median(r[key] for r in repeats)

    return {"value": median("value"), "reference_value": median("reference_value"), "ratio": median("ratio"),
            "bound_misses_on_cpu_only": median("bound_misses_on_cpu_only"),
            "ratio_to_cpu_only_bound": median("ratio_to_cpu_only_bound"),
            "bound_misses_on_tier_only": median("bound_misses_on_tier_only"),
            "ratio_to_tier_only_bound": median("ratio_to_tier_only_bound"), "repeats": repeats}


def split_text(split: dict) -> str:
    """', whole layers (trial: 20.1 / 30.2 ms a step whole / spread)' where the budget holds whole layers or a trial
    measured both; '' otherwise."""
    measured = split.get("measured_ms") or {}
    if not split.get("whole_layers") and not measured:
        return ""
    text = ", whole layers" if split.get("whole_layers") else ", spread"
    if {"whole", "spread"} <= measured.keys():
        text += f" (trial: {measured['whole']:.1f} / {measured['spread']:.1f} ms a step whole / spread)"
    return text


def all_resident(model: LoadedModel) -> bool:
    """Every expert is resident on the device under the plan in force: no decode path runs (records: 'all resident')."""
    return model.offload.plan.placement_mode == "all_resident"


def path_run(model: LoadedModel, path: dict) -> dict:
    """The engine's decode path state (copy_state's), its path in force "all resident" where no expert is cold, as
    the engine's run records say: none runs (the one in force, cpu by default, would read as decoding on the CPU)."""
    return dict(path, in_force=ALL_RESIDENT) if all_resident(model) else path


def path_text(path: dict) -> str:
    """', decode path tier (trial a step: 20.1 ms read by the GPU, 30.2 ms on the CPU, 25.0 ms both)': the path in
    force, with what its trial measured where one finished; ', every expert resident: no decode path ran' where none
    ran (path_run)."""
    if path.get("in_force") == ALL_RESIDENT:
        return ", every expert resident: no decode path ran"
    measured = path.get("measured_ms") or {}
    text = f", decode path {path.get('in_force')}" + ("" if path.get("host_tier") else " (no host tier)")
    if len(measured) > 1:
        text += f" (trial a step: {measured_words(measured)})"
    return text


def judge_words(placement: dict | None) -> str:
    """' (paused: 0.05 hits a swap)' or ' (2.31 hits a swap)' where adaptive placement's judge has a figure; else ''."""
    earned = (placement or {}).get("net_hits_per_swap")
    if earned is None:
        return ""
    return f" ({'paused: ' if placement['swaps_paused'] else ''}{earned:.2f} hits a swap)"


def split_words(cold_split: dict | None, fixed: str | None = None) -> str:
    """Under "both": ', CPU takes [0, 0, 1, ...] of c cold in layers 0-23 (share trials' shift -1; 2 slow steps left
    out of its rate), a pair split at rows [0, 0, 2688, ...] in layers 0-23, host 120 µs between layers, the GPU reads
    the tier at 39 GB/s' (every layer's table: each distinct one with its layers, joined by 'and'; the shift where
    not 0, the slow steps where any, the split's rows where a count of cold pairs has them, the tier's rate where
    measured); under tables fixed (the engine's fix_split_tables: no share trials), '(fixed tables "split"; ...' with
    `fixed`, the name of the tables (bench_offload_ab's); else ''."""
    if cold_split is None:
        return ""
    tables = cold_split["tables"]
    shift = (cold_split.get("share") or {}).get("shift", 0)
    left_out = cold_split.get("slow_steps_left_out") or 0
    named = "fixed tables" + (f" \"{fixed}\"" if fixed else "")
    notes = ([named] if cold_split.get("fixed") else []) + ([f"share trials' shift {shift:+d}"] if shift else []) + (
        [f"{counted(left_out, 'slow step')} left out of its rate"] if left_out else [])
    tier = cold_split.get("tier_read_bytes_per_s")
    takes = " and ".join(f"{table['cpu_takes']}{' of c cold' if not index else ''} in {layer_words(table['layers'])}"
                         for index, table in enumerate(tables))
    rows = " and ".join(f"{table['split_rows']} in {layer_words(table['layers'])}" for table in tables
                        if table["split_rows"] and any(table["split_rows"]))
    return (f", CPU takes {takes}"
            + (f" ({'; '.join(notes)})" if notes else "")
            + (f", a pair split at rows {rows}" if rows else "")
            + f", host {cold_split['host_gap_s'] * 1e6:.0f} µs between layers"
            + (f", the GPU reads the tier at {tier / 1e9:.0f} GB/s" if tier else ""))


def decoded_spread(decoded: dict) -> str:
    """', ratios 23% / 26% / 20%' where a point was measured more than once."""
    if len(decoded["repeats"]) < 2:
        return ""
    return ", ratios " + " / ".join(f"{r['ratio']:.0%}" for r in decoded["repeats"])


def host_probe_us(spec, rounds: int = 300) -> float:
    """Median µs of a fixed piece of a decode layer's host work (route() on fixed router logits, the miss policy's
    choice among four misses, one NumPy reduction), timed right before a fraction's decode: how fast this machine
    runs host work at that moment. On the H200 machine the same engine's host components moved 1.5-2x between runs
    (RESULTS.md, nineteenth session); runs compare by their decode rates only where their probes agree."""
    from engine.offload.devices import Bandwidths
    from engine.offload.miss_policy import choose, miss_costs
    from kernels.cpu.routing import route

    logits = np.random.default_rng(11).standard_normal((1, spec.num_experts)).astype(np.float32)
    bandwidths = Bandwidths(pcie=55e9, hbm=4e12, cpu=90e9)
    scratch = np.ones(4096, np.float32)

    def work() -> None:
        route(logits, spec)
        choose(miss_costs(bandwidths, 2_661_376, [1, 1, 1, 1], 0.0, prepare_s=30e-6, cpu_fixed_s=100e-6), 3)
        scratch.sum()

    return median_seconds(work, rounds, warmup=20) * 1e6  # the warm-up: compiled and warm


def cpu_calibration(path: Path, cpu_threads: int, calls: int = 60) -> dict:
    """The CPU decode kernels alone on the model's first expert node, cold (bench_cpu_scaling's cold figure: every
    expert comes back only after all the others), at the engine's thread count (KernelThreads: `cpu_threads`, 0 the
    cores other processes leave, every core on an idle host): what this host's kernels do by themselves, measured in
    the run whose points' CPU rates are read against it (cpu_kernels). A goal point moved from one GPU host to the next
    with the kernels' own rate (NOTES-overhead.md, seventieth session). Bytes as the engine's rates count them: the
    experts as stored. `seconds`: what it took, the model's graph read, the count's settling and the kernels' first
    call included."""
    from benchmarks.bench_cpu_scaling import cold_call_s
    from benchmarks.bench_qmoe_cpu import cold_decode_inputs
    from engine.expert_node import CpuExpertNode
    from engine.kernel_threads import KernelThreads
    from engine.model_folder import ModelFolder

    started, meter = time.perf_counter(), HostLoadMeter()
    folder = ModelFolder.open(path)
    info = folder.experts[0]
    count = KernelThreads([], cpu_threads)
    count.settle()  # the automatic count: the cores other processes leave (all, on an idle host), as the engine's
    spec, threads = info.spec, count.in_force
    logits, xs = cold_decode_inputs(spec.num_experts, spec.hidden_size, spec.k)
    call_s = cold_call_s(CpuExpertNode(info, folder.onnx, threads).kernel, xs, logits, calls)
    load = meter.read()
    return {"bytes_per_s": spec.k * info.bytes_per_expert / call_s, "call_s": call_s, "node": info.name,
            "threads": threads, "calls": calls, "seconds": time.perf_counter() - started, "host": load.describe(),
            **load.as_dict()}


def calibration_words(calibration: dict, b_dram: float) -> str:
    """'CPU kernels alone: 101.6 GB/s = 80% of B_dram (127.4 GB/s; node ..., cold routing, 16 threads, 0.614 ms a
    call, median of 60; took 1.2 s; steal 0.0%, other processes 0.3% of the CPUs' time)' against `b_dram`. Rates under
    1 GB/s in MB/s or kB/s (units.byte_rate): a small model's kernels on a busy host read '0.0 GB/s', as if free."""
    alone = calibration["bytes_per_s"]
    return (f"CPU kernels alone: {byte_rate(alone, 1)} = {alone / b_dram:.0%} of B_dram ({byte_rate(b_dram, 1)}; "
            f"node {calibration['node']}, cold routing, {counted(calibration['threads'], 'thread')}, "
            f"{calibration['call_s'] * 1e3:.3f} ms a call, median of {calibration['calls']}; "
            f"took {calibration['seconds']:.1f} s; {calibration['host']})")


def cpu_rate_in_force(offload) -> dict:
    """The CPU kernels' rate the engine holds for the decode path in force: the split's under "both" (from its
    parts), else the CPU path's calls'; in force (at most the host's streaming read) and as measured
    (OffloadEngine.cpu_rate_state)."""
    rate = offload.split_cpu_rate if offload.splits_cold else offload.cpu_rate
    state = offload.cpu_rate_state(rate)
    return {"bytes_per_s": state["cpu_bytes_per_s"], "measured_bytes_per_s": state["cpu_measured_bytes_per_s"],
            "fixed_s": state["cpu_call_s"], "measured_fixed_s": state["cpu_measured_call_s"],
            "average_bytes_per_s": rate.average}


def cpu_kernels(rate: dict, path: dict, misses_cpu: int, calibration: float) -> dict:
    """{"cpu_kernels": `rate` (cpu_rate_in_force after a point's timed steps) with its average's ratio to the
    run's `calibration` (cpu_calibration's bytes a second)} under the decode path cpu or both where the timed steps
    computed experts on the CPU (`misses_cpu`); {} elsewhere, where the rate is an earlier point's. The average, not
    the fit's rate of one more miss: bytes over seconds of whole calls, as the calibration's."""
    if path.get("in_force") not in ("cpu", "both") or not misses_cpu or rate["average_bytes_per_s"] is None:
        return {}
    return {"cpu_kernels": {**rate, "average_to_calibration": rate["average_bytes_per_s"] / calibration}}


def cpu_kernels_words(figure: dict) -> str:
    """' (CPU kernels 47 GB/s + 90 µs a call, average 40 GB/s = 39% of them alone)' where a decode figure has its
    CPU kernels (cpu_kernels), with the measured line where the stream clamped its rate (cpu_rate_words); else ''."""
    if "cpu_kernels" not in figure:
        return ""
    rate = figure["cpu_kernels"]
    said = cpu_rate_words(rate["bytes_per_s"], rate["measured_bytes_per_s"], rate["fixed_s"], rate["measured_fixed_s"])
    return (f" (CPU kernels {said}, average {byte_rate(rate['average_bytes_per_s'], 0)} = "
            f"{rate['average_to_calibration']:.0%} of them alone)")


def engine_after_decode(model: LoadedModel) -> tuple[dict, dict]:
    """What the engine holds once a point's timed decode is over, for the point's figure (the first dict) and line:
    read before the point's prefill, profiled steps and trace decodes, which go on measuring and re-plan (the traces'
    placements). Read after them, the CPU kernels' rates, the miss slots, the copies' reuse and the streaming slots
    were the last trace's, and at every expert resident an earlier fraction's. The second dict: the CPU's rate in
    force (the split's under "both", from its parts; else the CPU path's calls')."""
    offload = model.offload
    groups = offload.streaming.groups
    held = offload.cpu_rate_state(offload.cpu_rate)
    return ({"cpu_rate": held["cpu_bytes_per_s"], "cpu_measured_rate": held["cpu_measured_bytes_per_s"],
             "cpu_fixed_s": held["cpu_call_s"], "cpu_measured_fixed_s": held["cpu_measured_call_s"],
             "cpu_average_rate": offload.cpu_rate.average, "miss_slots_per_layer": list(offload.policy.miss_slots),
             "copy_prepare_s": getattr(offload.stores[0], "prepare_s", None), "copy_reuse": offload.copy_reuse.value,
             "pinned": offload.pinned_info(), "streaming_slots": [group.num_slots for group in groups],
             "streaming_prepare_s": [group.prepare_s for group in groups],
             "streaming_launch_s": [group.launch_s for group in groups]}, cpu_rate_in_force(offload))


def layer_overhead(profile: dict, stats, layers: int) -> float | None:
    """Seconds a layer and step the expert nodes took beyond waiting for the device ((experts_s - wait_s - standin_s)
    / (steps x layers)): the host's Python, synchronisation and launches, where no expert ran on the CPU in the timed
    steps (every expert resident, or every miss read by the GPU from the host tier). None where one did: taking the
    CPU's seconds out as well meant nothing, as under "both" they overlap the GPU's (the host-part worker's or between
    launches) and never held the wall clock, and the difference came out negative. standin_s: the simulated device's
    "device" experts, computed by the CPU kernels as it launches them (0 on CUDA); left in, they were most of the
    simulated figure (16186 µs a layer at 0% on the dev VM, 15190 of it the stand-in's kernels)."""
    if stats.misses_cpu:
        return None
    return (profile["experts_s"] - stats.wait_s - stats.standin_s) / (profile["steps"] * layers)


def overhead_words(overhead: float | None) -> str:
    """'overhead     53 µs/layer', or why it is not given (layer_overhead)."""
    return f"overhead {overhead * 1e6:6.0f} µs/layer" if overhead is not None else f"overhead {NO_OVERHEAD}"


def overhead_breakdown(rows: list[dict], layers: int, simulated: bool, device_s_per_layer: float) -> dict:
    """µs per layer (medians over the steps) by component; on CUDA `collect` is split into the device's
    kernel time (CUDA events, stats.device_s) and the rest: synchronisation and the copy back."""
    parts = summarise(rows, layers, simulated)
    if not simulated:
        parts["device_kernels"] = device_s_per_layer * 1e6
        parts["sync_and_copy_back"] = parts["collect"] - parts["device_kernels"]
    return parts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gpt-oss-20b-like")
    parser.add_argument("--device", choices=["cuda", "simulated"], default="cuda")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--fractions", default="0,0.25,0.5,1", help="resident fractions, comma-separated")
    parser.add_argument("--decode-warmup", type=int, default=96,
                        help="decode steps before the timed ones: by 96 the engine's trials are done (the decode "
                             "path's, three ways: ~76 steps, engine/offload/trials.py), so the figure is what they keep")
    parser.add_argument("--repeats", type=int, default=1,
                        help="decode measurements per fraction (the figure: their median; see decode_repeats)")
    parser.add_argument("--folder", help="write the model here (default: a temporary folder)")
    parser.add_argument("--dtype", choices=["float32", "float16"], default="float32",
                        help="activations and KV cache; float16 lets the dense part run on onnxruntime-gpu's CUDA EP")
    parser.add_argument("--layers", type=int, help="fewer layers than the shape has (quick runs)")
    # A session's routing changes topic (a new question, a new document), and a placement's worth shows over such
    # a change: 32 tokens straight after the warm-up, whose popularity static placement is made from, were static's
    # best case (RESULTS.md, fifty-fourth session). 256 timed tokens with a switch every 200 hold at least one.
    parser.add_argument("--trace-tokens", type=int, default=256,
                        help="decode tokens measured with routing replaced by a realistic trace (0: none)")
    parser.add_argument("--trace-switch-every", type=int, default=200,
                        help="the trace's topic switches: a third of each layer's live experts move every this many "
                             "tokens (no more than --trace-tokens, so that the timed tokens hold one)")
    parser.add_argument("--trace-warmup", type=int, default=96,
                        help="trace-routed decode tokens before those (96: the engine's trials are done by then)")
    parser.add_argument("--trace-placements", default="adaptive,static",
                        help="placements measured under the trace, comma-separated (each from the same budget)")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="after each point's timings, cProfile's own-time attribution over this many decode steps "
                             "(top functions, µs per layer per step: where the host's time per layer goes)")
    parser.add_argument("--no-host-register", action="store_true",
                        help="copy experts through the pinned staging ring only (no page-locked mapping: A/B)")
    parser.add_argument("--dense-pool", action="store_true",
                        help="the dense part on the GPU with onnxruntime's pool of CPU threads, not the caller's "
                             "thread alone (A/B)")
    parser.add_argument("--cpu-average-rate", action="store_true",
                        help="the miss policy prices CPU misses at the kernels' average rate, without the fitted cost "
                             "per call (CpuRate.fit off: A/B)")
    parser.add_argument("--cpu-threads", type=int, default=0,
                        help="session.moe.offload.cpu_threads: threads of the CPU expert kernels (0: all cores)")
    parser.add_argument("--host-part-worker", action="store_true",
                        help="each \"both\" layer's host part on the host-part worker's thread "
                             "(engine/decoder.py host_part_worker)")
    parser.add_argument("--decode-path", choices=PATH_MODES, default="auto",
                        help="where decode computes cold experts (engine/offload/decode_path.py): auto (the engine's "
                             "default: from cpu_execution, trials under its auto), cpu, tier (the GPU reads them "
                             "from page-locked host memory; a GPU, CUDA or simulated) or both (tier, and the CPU "
                             "computes a share of them at once)")
    args = parser.parse_args()
    if args.trace_tokens and not 0 < args.trace_switch_every <= args.trace_tokens:
        parser.error(f"--trace-switch-every {args.trace_switch_every}: between 1 and --trace-tokens "
                     f"({args.trace_tokens}), so that the timed trace tokens hold a topic switch")
    if args.host_part_worker:
        from engine import decoder
        decoder.host_part_worker = True
    if args.dense_pool:
        from engine.ort_env import DenseDevice
        DenseDevice.dense_pool_on_gpu = True
    if args.no_host_register:
        from engine.offload.cuda_device import CudaDevice
        CudaDevice.register_experts = lambda self, source, infos, owner: None

    spec = shape_spec(args.shape, args.layers, args.dtype)
    started = time.perf_counter()
    path = written_model(model_folder(args.folder, "bench-offload-"), spec)
    print(f"model written in {time.perf_counter() - started:.0f} s", flush=True)

    if args.device == "cuda":
        from engine.offload.cuda_device import open_cuda_device
        device = open_cuda_device()
    else:
        from engine.offload import SimulatedDevice
        device = SimulatedDevice(200 << 30)
    dram = DramReads(started)
    if args.device == "cuda":  # the simulated device's rates are assumed, not read: they never raise the bound
        dram.add("the engine's, at device open", device.bandwidths.cpu)
    dram.read("the benchmark's, at the start")
    b_pcie, b_hbm = device.bandwidths.pcie, device.bandwidths.hbm
    print(f"B_dram reads: {dram.words()}; every bound takes the run's highest (read again after each fraction's timed "
          f"decode), B_pcie {b_pcie / 1e9:.1f} GB/s, B_hbm {b_hbm / 1e9:.0f} GB/s"
          + (" (assumed, not measured: the GPU is simulated)" if args.device == "simulated" else ""), flush=True)
    calibration = cpu_calibration(path, args.cpu_threads)  # before the models load: nothing of the run's beside it
    print(calibration_words(calibration, dram.highest), flush=True)

    model = LoadedModel.open(path, offload=OffloadConfig(device_expert_bytes=0, cpu_threads=args.cpu_threads), device=device)
    model.offload.cpu_rate.fit = not args.cpu_average_rate
    model.offload.set_decode_path(args.decode_path)
    print(f"dense part on the {model.dense_device}: {model.dense_reason}", flush=True)
    registration = model.host_registration
    if registration is not None:  # measured once the experts' mapping is page-locked (or refused)
        waited = _timed(lambda: registration.ready.wait(300))
        print(f"{registration.describe()} (waited {waited:.1f} s after load)", flush=True)
    _wait_for_population(model, "the hybrid model")
    print(f"host-part worker's loop ready in {model.decoder.warm_host_part_loop():.2f} s", flush=True)
    infos = model.folder.experts
    per_expert = infos[0].bytes_per_expert
    w_act = sum(info.spec.k * info.bytes_per_expert for info in infos)
    rng = np.random.default_rng(0)
    short_prompt = [int(t) for t in rng.integers(3, 400, 16)]
    long_prompt = [int(t) for t in rng.integers(3, 400, args.prefill_tokens)]
    trace = realistic_trace(600, 4, infos[0].spec.num_experts, infos[0].spec.k, seed=3)

    cpu_model = LoadedModel.open(path)
    _wait_for_population(cpu_model, "the all-CPU model")
    cpu_model.decoder.forward(cpu_model.new_state(), long_prompt[:64])  # untimed: the CPU kernels compiled first
    cpu_prefill = args.prefill_tokens / _timed(lambda: cpu_model.decoder.forward(cpu_model.new_state(), long_prompt))
    dense_ref = dense_reference(model, infos, short_prompt, args.decode_tokens, args.decode_warmup)
    bounds = Bounds(dram, w_act, b_pcie, b_hbm, dense_ref)
    printed_on = None  # the highest B_dram read when the first point's bounds were printed
    if dense_ref is not None:
        print(f"dense part alone (every expert resident): {dense_ref * 1e3:.2f} ms a token, the bounds' dense term",
              flush=True)
    figures = []
    for fraction in [float(f) for f in args.fractions.split(",")]:
        # 100% = every expert in a device slot (slots are in the GPU kernels' layout, larger than the stored experts)
        model.offload.reconfigure(model.offload.config.updated(device_expert_bytes=int(fraction * all_resident_bytes(infos))))
        probe = host_probe_us(infos[0].spec)
        others = sorted(t.name for t in threading.enumerate() if t is not threading.current_thread())
        if others:  # a Python thread beside the timed decode competes for the interpreter (NOTES-overhead.md)
            print(f"{fraction:4.0%}: other Python threads alive: {', '.join(others)}", flush=True)
        repeats, loads, reads = [], [], len(dram.reads)
        for repeat in range(args.repeats):
            meter = HostLoadMeter()
            rate, step_rows = decode(model, short_prompt, args.decode_tokens, warmup=args.decode_warmup)
            load = meter.read()
            loads.append(load)
            dram.read(f"after {fraction:.0%}'s timed decode" + (f", repeat {repeat + 1}" if args.repeats > 1 else ""))
            stats, profile = model.offload.stats.totals(), model.decoder.profile
            h = stats.hit_rate
            dense_per_token = profile["dense_s"] / profile["steps"]
            measured = {"value": rate, "hit_rate": h, "dense_s_per_token": dense_per_token}
            repeats.append({**measured, **bounds.decode(measured), "misses_cpu": stats.misses_cpu,
                            "misses_copied": stats.misses_copied,
                            "miss_slots": max(model.offload.policy.miss_slots, default=0), **load.as_dict(),
                            "cpu_threads_in_force": model.decoder.kernel_threads.in_force})
        decoded = decode_repeats(repeats)
        state = model.offload.copy_state()  # the trials' outcomes (the traces below re-plan)
        held, cpu_in_force = engine_after_decode(model)
        split, path = state["layer_split"], path_run(model, state["decode_path"])
        kernels = cpu_kernels(cpu_in_force, path, stats.misses_cpu, calibration["bytes_per_s"])
        parts = overhead_breakdown(step_rows, len(infos), args.device == "simulated",
                                   stats.device_s / max(1, profile["steps"] * len(infos)))
        overhead = layer_overhead(profile, stats, len(infos))
        before = model.offload.stats.totals()
        gathered = _gather_seconds(model)
        prefill_s = _timed(lambda: model.decoder.forward(model.new_state(), long_prompt))
        prefill = args.prefill_tokens / prefill_s
        after = model.offload.stats.totals()
        # Where the prefill's time went (the experts' share; the rest is the dense part and the loop): waves'
        # staging (host gather, upload and conversion: copy_s; of it the gather into the pinned ring: gather_s),
        # device compute, CPU compute.
        prefill_split = {"wall_s": prefill_s, "stage_s": after.copy_s - before.copy_s,
                         "gather_s": _gather_seconds(model) - gathered,
                         "device_s": after.device_s - before.device_s, "cpu_s": after.cpu_s - before.cpu_s,
                         "copied_gb": (after.copy_bytes - before.copy_bytes) / 1e9}
        # after the timed runs (the profiler slows what it watches: attribution only)
        attribution = profile_steps(model, args.profile_steps, short_prompt, len(infos), top=30) \
            if args.profile_steps else []
        # slots a layer holds on average (with the budget on whole layers, some layers hold all and the others none)
        slots = round(sum(model.offload.plan.slots.values()) / len(infos))
        trace_h = hit_rate("adaptive", trace, infos[0].spec.num_experts, slots) if 0 < slots < infos[0].spec.num_experts \
            else float(slots > 0)
        label = f"{args.shape}, {fraction:.0%} resident"
        traced = {}  # placement -> the trace-routed figure
        if args.trace_tokens and slots > 0:
            config = model.offload.config
            # Every expert resident, placement has nothing to choose: one run, the trace-routed points' ceiling
            # (what routing by the trace costs a step beside the model's own routing: a steering launch a layer).
            every = slots == infos[0].spec.num_experts
            for placement in [EVERY_EXPERT] if every else args.trace_placements.split(","):
                if not every:
                    model.offload.reconfigure(config.updated(placement=placement))
                traced[placement] = trace_decode(model, short_prompt, args.trace_tokens, args.trace_warmup,
                                                 args.trace_switch_every, bounds, calibration["bytes_per_s"])
                figures.append({"name": f"decode tokens/s on a realistic routing trace (measured), {label}"
                                        + ("" if every else f", {placement} placement"), **traced[placement]})
            model.offload.reconfigure(config)
        figures += [
            {"name": f"decode tokens/s, {label}", "unit": "tokens/s",
             "reference": "bound: dense + (1-h)·W_act/(B_dram+B_pcie) + h·W_act/B_hbm", **decoded,
             "hit_rate": h, "dense_s_per_token": dense_per_token, "dense_reference_s_per_token": dense_ref,
             "step_ms": [row["step"] * 1e3 for row in step_rows],  # the last repeat's timed steps, in order
             "step_gc_ms": [row["gc"] * 1e3 for row in step_rows],  # of which Python's garbage collector
             "host_probe_us": probe,
             "misses_cpu": stats.misses_cpu, "misses_copied": stats.misses_copied, "miss_copies": stats.miss_copies,
             "misses_read": stats.misses_read, "decode_path": path,
             **held, "layer_split": split, **kernels},
            {"name": f"prefill tokens/s ({args.prefill_tokens}-token prompt), {label}", "value": prefill,
             "unit": "tokens/s", "reference": "all-CPU prefill", "reference_value": cpu_prefill,
             "ratio": prefill / cpu_prefill, "split": prefill_split},
            {"name": f"per-layer overhead, {label}", "unit": "µs", "reference": "goal", "reference_value": 100.0,
             **({"value": overhead * 1e6, "ratio": overhead * 1e6 / 100.0} if overhead is not None else
                {"value": None, "ratio": None, "not_given": NO_OVERHEAD})},
            {"name": f"per-layer overhead by component (bench_overhead's), {label}", "value": parts["overhead"],
             "unit": "µs", "reference": "goal", "reference_value": 100.0, "ratio": parts["overhead"] / 100.0,
             "components_us_per_layer": parts, "cprofile_top_own_us_per_layer_step": attribution,
             "reading": "overhead = dense_setup (bindings, outputs to NumPy: dense call minus onnxruntime's run) + "
                        "hybrid_python (routing, stats, miss policy, bookkeeping) + device_python (launch: host side) "
                        "+ end_step (placement) + decoder_loop (step inputs, loop); medians over the steps; "
                        "to_host = a layer with cold experts waiting for the dense part's stream and copying its "
                        "inputs to the host (a wait, not overhead); "
                        "collect = waiting for the device and the copy back (CUDA: device_kernels by events, "
                        "sync_and_copy_back the rest)"},
            {"name": f"hit rate on a realistic routing trace (adaptive placement replayed), {label}",
             "value": trace_h, "unit": "fraction", "reference": "hit rate on random routing", "reference_value": h,
             "ratio": trace_h / h if h else None},
        ]
        bounds.rebase(figures)  # the earlier points' on this point's reads where one came out higher
        other_bounds = (f"; misses on the CPU only {decoded['bound_misses_on_cpu_only']:.1f}: "
                        f"{decoded['ratio_to_cpu_only_bound']:.0%}" if slots == 0 else "")
        if h < 1:
            other_bounds += (f"; on the tier only {decoded['bound_misses_on_tier_only']:.1f}: "
                             f"{decoded['ratio_to_tier_only_bound']:.0%}")
        print(f"{fraction:5.0%}  decode {decoded['value']:7.1f} tok/s "
              f"(bound {decoded['reference_value']:7.1f}: {decoded['ratio']:.0%}{other_bounds}, hit {h:.2f}"
              f"{decoded_spread(decoded)}, host probe {probe:.1f} µs)  "
              f"prefill {prefill:7.0f} tok/s (CPU {cpu_prefill:.0f})  {overhead_words(overhead)}  "
              f"trace hit {trace_h:.2f}  misses cpu/copied/read {stats.misses_cpu}/{stats.misses_copied}/"
              f"{stats.misses_read}" + path_text(path)
              + cpu_kernels_words(kernels)
              + f", miss slots {max(held['miss_slots_per_layer'], default=0)} of {slots} per layer"
              + split_text(split)
              + "".join(f", {counted(n, 'streaming slot')} ({prepare * 1e6:.0f} µs to issue a copy, "
                        f"{launch * 1e6:.0f} to launch and merge)" for n, prepare, launch in
                        zip(held["streaming_slots"], held["streaming_prepare_s"], held["streaming_launch_s"]))
              # (at every expert resident nothing is copied: the reuse an earlier fraction's copies earned)
              + (f", later hits per copy {held['copy_reuse']:.2f}"
                 if held["copy_reuse"] is not None and not all_resident(model) else ""),
              flush=True)
        busiest = max(loads, key=lambda load: load.steal + load.others)
        threads = model.decoder.kernel_threads.state()  # the automatic count follows other processes' load
        print(f"       host during the decode timings (the busiest repeat): {busiest.describe()}; CPU kernels on "
              f"{threads['cpu_threads_in_force']} of {threads['cores']} threads at the end"
              f" ({counted(threads['cpu_threads_changes'], 'change')})", flush=True)
        print(f"       B_dram {dram.words(dram.reads[reads:])}; the bounds take the run's highest so far, "
              f"{dram.highest / 1e9:.1f} GB/s", flush=True)
        printed_on = printed_on or dram.highest
        for placement, fig in traced.items():
            named = placement if placement == EVERY_EXPERT else f"{placement} placement"
            print(f"       realistic routing trace (measured), {named}: decode {fig['value']:.1f} tok/s "
                  f"(bound {fig['reference_value']:.1f}: {fig['ratio']:.0%}), hit {fig['hit_rate']:.2f}, misses "
                  f"cpu/copied/read {fig['misses_cpu']}/{fig['misses_copied']}/{fig['misses_read']}, swaps "
                  f"{fig['swaps']}{judge_words(fig['placement'])}" + path_text(fig["decode_path"])
                  + split_words(fig["decode_path"].get("cold_split")) + cpu_kernels_words(fig), flush=True)
        print("       prefill s: " + ", ".join(f"{k} {v:.2f}" for k, v in prefill_split.items()), flush=True)
        print("       per layer µs: " + ", ".join(f"{k} {v:.0f}" for k, v in parts.items() if k != "step")
              + f" (step {parts['step'] * len(infos) / 1e3:.2f} ms)", flush=True)
        steps_ms = sorted(row["step"] * 1e3 for row in step_rows)  # a mean above the median: a few slow steps
        slowest = [f"{row['step'] * 1e3:.1f} (gc {row['gc'] * 1e3:.1f})"
                   for row in sorted(step_rows, key=lambda row: row["step"])[-3:]]
        print(f"       timed steps ms: median {statistics.median(steps_ms):.2f}, mean {statistics.mean(steps_ms):.2f}, "
              f"slowest {', '.join(slowest)}", flush=True)
        for row in attribution:
            print(f"       cProfile own {row['own_us']:7.1f} µs/layer ({row['calls_per_layer_step']:5.2f} calls) "
                  f"{row['function']}", flush=True)
        step_s = 1 / decoded["value"]
        if fraction == 1.0 and dense_ref is not None and step_s < dense_ref:
            capped = cap_dense_term(figures, dense_ref, step_s)
            print(f"       the dense term ({dense_ref * 1e3:.2f} ms) exceeds this whole step ({step_s * 1e3:.2f} ms): the "
                  f"bounds are loose; with the dense term at most this step, the ratios are at most", flush=True)
            for name, ratio in capped:
                print(f"         {ratio:4.0%}  {name}", flush=True)
        # Written after every point: a run stopped by its time limit keeps the points it finished.
        path = write_result(f"offload-{args.shape}-{args.dtype}", figures, shape=args.shape, device=device.name,
                            expert_bytes=model.folder.expert_bytes, bytes_per_expert=per_expert,
                            bandwidths={"dram": dram.highest, "dram_reads": dram.reads, "pcie": b_pcie, "hbm": b_hbm,
                                        "cpu_engine": device.bandwidths.cpu},
                            calibration={**calibration, "ratio_to_b_dram": calibration["bytes_per_s"] / dram.highest},
                            pinned=model.offload.pinned_info(), dtype=args.dtype,
                            dense_device=model.dense_device, dense_reason=model.dense_reason,
                            host_registration=registration.describe() if registration is not None else
                            "off (--no-host-register)" if args.no_host_register else None)
    if printed_on is not None and dram.highest > printed_on:
        alone = calibration["bytes_per_s"]
        print(f"B_dram reads: {dram.words()}; the highest came after earlier points were printed (the CPU kernels "
              f"alone, {alone / 1e9:.1f} GB/s, are {alone / dram.highest:.0%} of it): the decode figures on it (as "
              f"written):", flush=True)
        for figure in figures:
            if figure["name"].startswith("decode tokens/s") and figure.get("reference_value"):
                capped = f", dense-capped at most {figure['ratio_dense_capped']:.0%}" \
                    if "ratio_dense_capped" in figure else ""
                print(f"  {figure['ratio']:4.0%} of {figure['reference_value']:.1f} tok/s{capped}  {figure['name']}",
                      flush=True)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
