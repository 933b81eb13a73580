"""Diagnosis (GPU machine): what a "both" layer's CPU part costs on the host-part worker, and what else a decode step
holds (issue #4).

The split's table prices a worker's part at ~80 µs a call plus its bytes at ~105 GB/s (fifty-fifth session, Qwen
50%), where the kernel alone on 16 threads takes ~25 µs a call plus the same bytes (diag_gemv_timeline.py). Here one
model decodes under "both" with the worker, and for each job the worker stamps (engine/offload/host_part_worker.py
JobDone) the CPU part's seconds are kept by the number of pairs it computed, with the worker's waits for the GPU's
routing and for the engine thread's next job, and the engine's end_step (the GPU idles through it) with the accounts
left for it, over --steps decode steps after --warmup (figures in RESULTS.md from before the fifty-ninth session
compared two variants in alternating rounds). --path tier (or a fraction of 1: every expert resident) times the same
without the worker. The process's thread count is read after every step, and the engine thread's CPU time in each
marked call beside its wall time (a call that waited or was off its core reads short). --cpu-threads sets the offload
key cpu_threads. Where every layer is a worker's job, the time from each gate to the next layer's routing is split by
the GPU clock readings route_split and merge_gated leave in each layer's published block (chain_parts).

The kernel alone, outside the engine, for comparison: diag_gemv_timeline.py --threads 15 --experts 1,2,3,4.

    python3 benchmarks/diag_worker_parts.py --folder /tmp/bench-qwen3-30b-a3b-like --fractions 0.5,0 [--path tier]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_offload import SHAPES, TRIALS_WARMUP_MAX, trials_under_way  # noqa: E402
from benchmarks.bench_offload_ab import open_model  # noqa: E402
from engine.dense_segment import DenseSegment  # noqa: E402
from engine.offload import OffloadConfig  # noqa: E402
from engine.offload.host_part_worker import IDLE_S  # noqa: E402
from engine.offload.hybrid_node import HybridExpertNode  # noqa: E402
from engine.offload.miss_policy import cpu_rate_words  # noqa: E402
from engine.offload.placement import LayerSlots, make_policy  # noqa: E402
from engine.offload.planner import all_resident_bytes  # noqa: E402
from engine.offload.traces import uniform_trace  # noqa: E402
from engine.units import byte_rate, counted  # noqa: E402


def threads_now() -> int:
    return len(os.listdir("/proc/self/task"))


class RebalanceProbe:
    """A placement of the model's own size (half its experts in slots, uniform routing: the judge pauses its swaps,
    as the engine's does under random weights) apart from the engine's, whose rebalance is timed where the engine's
    runs (at the step's end, the worker's threads still spinning) and again after a sleep past the worker's IDLE_S
    (its loop asleep): if the first reads slower, the engine's host work at a step's end shares the CPUs with the
    worker's spinning threads (bench_rebalance.py times the same call alone)."""

    def __init__(self, layers: int, experts: int, k: int, steps: int = 600):
        self.trace = uniform_trace(steps, layers, experts, k, seed=2)
        self.policy = make_policy("adaptive", [LayerSlots(experts, experts // 2) for _ in range(layers)])
        for layer in range(layers):
            self.policy.observe(layer, self.trace[0, layer])
        self.policy.initial()
        self.step = 1
        for _ in range(steps // 2):  # its state settled (the judge paused), as in bench_rebalance's warm-up
            self()

    def __call__(self) -> float:
        routing = self.trace[self.step]
        self.step = self.step + 1 if self.step + 1 < len(self.trace) else 1
        for layer in range(routing.shape[0]):
            self.policy.observe(layer, routing[layer])
        started = time.perf_counter()
        self.policy.rebalance()
        return time.perf_counter() - started


def decode_steps(model, prompt, steps: int, warmup: int, probe: RebalanceProbe | None = None,
                 past_trials: bool = False) -> dict:
    """The worker's part seconds by pairs, step seconds and their parts (from the first job's arrival at the worker to
    the last gate; the engine's end_step, with the accounts left for it and placement's rebalance inside it), swaps
    per step, thread counts. `past_trials`: after the warm-up, more steps until no trial of the engine's is pending
    (at most TRIALS_WARMUP_MAX), so that the timed steps run the share the engine keeps, not the ones it tries; the
    steps added are in the row's "past_trials"."""
    jobs: list = []
    real = HybridExpertNode.host_part_done
    engine, decoder = model.offload, model.decoder
    real_end = decoder.on_step_end  # the engine's end_step (engine/offload/__init__.py)
    real_rebalance = engine.policy.rebalance
    ends: list = []
    left: list = []
    ready_left: list = []
    rebalances: list = []

    def recorded(node, job):
        jobs.append((job.pairs, job.cpu_s, job.routed - job.reached, job.reached, job.gated, job.routed))
        return real(node, job)

    real_settle = engine.settle
    settled: list = []
    marks: list = []  # this step's moments: (perf_counter, what) (boundary_parts)
    on_cpu: dict = defaultdict(list)  # a marked call's wall and engine-thread CPU seconds, by name

    def marked(name, call):
        def call_marked(*args, **kwargs):
            started, cpu_started = time.perf_counter(), time.thread_time()
            marks.append((started, name + " in"))
            try:
                return call(*args, **kwargs)
            finally:
                ended = time.perf_counter()
                marks.append((ended, name + " out"))
                on_cpu[name].append((ended - started, time.thread_time() - cpu_started))
        return call_marked

    def counted_settle(*args, **kwargs):
        taken = real_settle(*args, **kwargs)
        settled.append((taken, len(engine.deferred), bool(engine.deferred) and engine.deferred[0][0]()))
        return taken

    segments = [runner for runner in decoder.steps if isinstance(runner, DenseSegment)]
    on_device = [runner for runner in segments if not runner.segment.on_host]
    first_layer = next(runner for runner in decoder.steps if hasattr(runner, "launch_ahead"))
    wrapped = [(decoder, "before_last_segment", "settle_all_but"), (on_device[0], "run", "first segment"),
               (segments[-1], "run", "last segment"), (first_layer, "launch_ahead", "first layer's launch"),
               (decoder, "_run_steps_beside", "steps"), (decoder, "_give_pool_back", "pool given back")]
    wrapped += [(runner, "run", "mask's segment (host)") for runner in segments if runner.segment.on_host]

    def wrap_step_parts(state) -> None:
        """The calls whose moments boundary_parts reads, wrapped (the worker's once the warm-up has made it)."""
        if getattr(decoder, "_worker", None) is not None:
            wrapped.extend([(decoder._worker, "set_threads", "worker threads set"), (decoder._worker, "drain", "drain")])
        if hasattr(state.backend, "copy_out"):  # a decode step's logits left on the GPU, copied out last
            wrapped.append((state.backend, "copy_out", "logits copied"))
        wrapped.extend([(state, "step_inputs", "step inputs"), (state, "advance", "state advanced"),
                        (engine.split_gate, "end_step", "split gate's end_step"), (engine, "_apply", "swaps made"),
                        (engine.stats, "end_step", "statistics' end_step"), (engine.policy, "rebalance", "rebalance"),
                        (engine, "pinned_info", "pinned info")])
        for owner, attribute, name in wrapped:
            setattr(owner, attribute, marked(name, getattr(owner, attribute)))

    def timed_end(*args, **kwargs):
        left.append(len(engine.deferred))
        ready_left.append(sum(bool(ready()) for ready, _ in engine.deferred))
        started = time.perf_counter()
        marks.append((started, "end_step in"))
        try:
            return real_end(*args, **kwargs)
        finally:
            ends.append(time.perf_counter() - started)
            marks.append((time.perf_counter(), "end_step out"))

    def timed_rebalance(*args, **kwargs):
        if probe is not None:
            row["probe_in_step"].append(probe())
        started = time.perf_counter()
        try:
            return real_rebalance(*args, **kwargs)
        finally:
            rebalances.append(time.perf_counter() - started)

    HybridExpertNode.host_part_done = recorded
    decoder.on_step_end = timed_end
    engine.policy.rebalance = timed_rebalance
    engine.settle = counted_settle
    row = {"parts": defaultdict(list), "steps": [], "threads": [], "waits": [], "layers": [], "end_step": [],
           "left": [], "ready_left": [], "settled": [], "settle_calls": [], "head_ready": [], "rebalance": [],
           "swaps": [], "jobs": [], "idle": [], "probe_in_step": [], "probe_quiet": [], "boundary": defaultdict(list),
           "on_cpu": on_cpu, "chain": defaultdict(list), "split": [], "past_trials": 0}
    try:
        state = model.new_state()
        token = int(decoder.forward(state, prompt)[-1].argmax())
        for _ in range(warmup):
            token = int(decoder.forward(state, [token])[-1].argmax())
        while past_trials and trials_under_way(model) and row["past_trials"] < TRIALS_WARMUP_MAX:
            token = int(decoder.forward(state, [token])[-1].argmax())
            row["past_trials"] += 1
        wrap_step_parts(state)
        on_cpu.clear()
        for _ in range(steps):
            jobs.clear()
            ends.clear()
            left.clear()
            ready_left.clear()
            settled.clear()
            rebalances.clear()
            marks.clear()
            swaps_before = engine.stats.totals().swaps
            started = time.perf_counter()
            marks.append((started, "step in"))
            logits = decoder.forward(state, [token])
            marks.append((time.perf_counter(), "step out"))
            token = int(logits[-1].argmax())
            row["steps"].append(time.perf_counter() - started)
            for part, seconds in boundary_parts(marks).items():
                row["boundary"][part].append(seconds)
            row["threads"].append(threads_now())
            row["end_step"].append(sum(ends))
            row["left"].extend(left)
            row["ready_left"].extend(ready_left)
            row["settled"].append(sum(t for t, _, _ in settled))
            row["settle_calls"].append(len(settled))
            row["head_ready"].append(sum(h for _, _, h in settled))
            row["rebalance"].append(sum(rebalances))
            row["swaps"].append(engine.stats.totals().swaps - swaps_before)
            row["jobs"].append(len(jobs))
            row["split"].append(split_inputs(engine, first_layer.layer) if engine.decode_path_in_force == "both" else "")
            if jobs:
                row["layers"].append(jobs[-1][4] - jobs[0][3])
            # the worker's time between a gate and its next job (the engine thread had not queued it yet)
            row["idle"].extend(b[3] - a[4] for a, b in zip(jobs, jobs[1:]))
            for pairs, cpu_s, wait, _, _, _ in jobs:
                row["parts"][pairs].append(cpu_s)
                row["waits"].append(wait)
            if getattr(decoder, "_worker", None) is not None and len(jobs) == len(decoder._worker._index_of):
                for part, seconds in chain_parts(decoder._worker, jobs).items():
                    row["chain"][part].extend(seconds)
            if probe is not None:  # the worker's loop asleep (IDLE_S), then the same call as at the step's end
                time.sleep(IDLE_S + 0.01)
                row["probe_quiet"].append(probe())
    finally:
        HybridExpertNode.host_part_done = real
        decoder.on_step_end = real_end
        for owner, attribute, _ in wrapped:
            if attribute in owner.__dict__:
                delattr(owner, attribute)  # the class's method again
        decoder.before_last_segment = engine.settle_all_but  # (an instance attribute of its own)
        engine.policy.__dict__.pop("rebalance", None)
        engine.__dict__.pop("settle", None)
    return row


def chain_parts(worker, jobs: list) -> dict:
    """Where the time from one layer's gate to the next layer's routing went in the step just done (every layer a job,
    in order), per pair of consecutive layers: each side's part of the layer (the GPU's from its routing published
    to its merge's start, the CPU's on the host's clock); on the GPU's clock (PublishedRouting.gpu_times) the
    merge's wait for the gate once the GPU's part was done, the merge and the next dense segment up to the next
    route_split, that route_split; on the host's, from the gate to the worker finding that routing. What the host's
    span has beyond the GPU's (gate seen to routing published) is the GPU still on its part after the gate, and the
    two crossings of PCIe (the merge seeing the gate, the worker seeing the flag)."""
    times = [published.gpu_times() for _, (_, _, published) in sorted(worker._index_of.items())]
    parts = defaultdict(list)
    for (gate_layer, next_layer), ((cpu_pairs, _, _, _, gated, gate_routed), (_, _, _, _, _, routed)) in zip(
            zip(times, times[1:]), zip(jobs, jobs[1:])):
        _, published, merge_waited, gate_seen = gate_layer
        route_started, routing_published, _, _ = next_layer
        on_gpu = (routing_published - gate_seen) * 1e-9
        gpu_part = (merge_waited - published) * 1e-9
        parts["the GPU's part (published -> merge began)"].append(gpu_part)
        parts[f"  the GPU's part where the CPU took {counted(cpu_pairs, 'pair')}"].append(gpu_part)
        parts["the CPU's part (routing found -> gate)"].append(gated - gate_routed)
        parts["the GPU idle before the gate (merge waited)"].append((gate_seen - merge_waited) * 1e-9)
        parts["gate seen -> next route_split (merge, dense segment)"].append((route_started - gate_seen) * 1e-9)
        parts["route_split, start -> published"].append((routing_published - route_started) * 1e-9)
        parts["gate -> routing found by the worker (host)"].append(routed - gated)
        parts["  of it off the GPU's clock: the GPU's part past the gate, the crossings"].append(
            routed - gated - on_gpu)
    # the two clocks over the step: the first layer's routing found to the last's, host less GPU (the crossings
    # cancel; what is left is the clocks' disagreement, which the split above assumes is nil)
    parts["first to last routing found, host less GPU (the clocks agree: ~0)"].append(
        jobs[-1][5] - jobs[0][5] - (times[-1][1] - times[0][1]) * 1e-9)
    return parts


def split_inputs(engine, layer: int) -> str:
    """What the split's table of `layer` was made from at the step's end (engine.cold_split_table): the CPU's rate and
    fixed cost a call (in force, with the measured line where the stream clamped its rate: cpu_rate_words; "no rate"
    before any), the GPU's tier reads (in MB/s or kB/s under 1 GB/s: units.byte_rate), the host's gap, the share
    trials' choice; and the table in force, with the rows of a pair split by rows where any (engine.cold_split_rows)."""
    rate, tier = engine.cpu_rate_state(engine.split_cpu_rate), engine.tier_read.value
    rows = engine.cold_split_rows(layer)
    cpu = "no rate" if rate["cpu_bytes_per_s"] is None else cpu_rate_words(
        rate["cpu_bytes_per_s"], rate["cpu_measured_bytes_per_s"], rate["cpu_call_s"], rate["cpu_measured_call_s"], 1)
    return (f"the split's table from: CPU {cpu}, "
            f"tier reads {'not measured' if tier is None else byte_rate(tier, 1)}, host gap "
            f"{engine.host_gap.value * 1e6:.0f} µs, share {engine.share_trials.choice!r}: CPU takes "
            f"{engine.cold_split_table(layer).tolist()} of 0..k cold pairs"
            + (f", a pair split at rows {rows.tolist()}" if rows is not None and rows.any() else ""))


def boundary_parts(marks: list) -> dict:
    """A step's moments in time order (the marked calls' ins and outs, each call of the worker's drain apart from the
    step's last left out: it runs once per layer), as the seconds from each moment to the next, named "a -> b": where a
    step's time outside its layers goes, the host's work while the GPU idles included."""
    drains = [i for i, (_, what) in enumerate(marks) if what.startswith("drain")]
    kept = [mark for i, mark in enumerate(marks) if i not in drains[:-2]]
    kept.sort()
    return {f"{a} -> {b}": tb - ta for (ta, a), (tb, b) in zip(kept, kept[1:])}


def us(values) -> str:
    return f"{statistics.median(values) * 1e6:7.1f}" if values else "      -"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b-like")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--fractions", default="0.5,0")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--warmup", type=int, default=48)
    parser.add_argument("--past-trials", action="store_true",
                        help="after --warmup, step on until the engine's trials are over (its timed steps then run "
                             "the share it keeps; without it they may run a share trial's other ways)")
    parser.add_argument("--path", default="both", help="the decode path asked for (both, tier, auto, cpu)")
    parser.add_argument("--folder")
    parser.add_argument("--cpu-threads", type=int, default=0, help="the offload key cpu_threads (0: automatic)")
    parser.add_argument("--probe", action="store_true",
                        help="time a placement's rebalance of the model's size at each step's end and after a sleep "
                             "(RebalanceProbe; the steps then sleep in between)")
    args = parser.parse_args()
    model, prompt = open_model(args.shape, args.layers, args.folder, prefix="diag-worker-parts-")
    engine = model.offload
    print(f"threads after load: {threads_now()}", flush=True)
    for fraction in [float(f) for f in args.fractions.split(",")]:
        engine.reconfigure(OffloadConfig(device_expert_bytes=int(fraction * all_resident_bytes(model.folder.experts)),
                                         cpu_threads=args.cpu_threads))
        model.wait_until_settled()
        engine.set_decode_path(args.path)
        shape = SHAPES[args.shape]
        probe = RebalanceProbe(args.layers or shape["layers"], shape["num_experts"], shape["top_k"]) if args.probe else None
        row = decode_steps(model, prompt, args.steps, args.warmup, probe, args.past_trials)
        worker_threads = model.decoder._worker.threads if getattr(model.decoder, "_worker", None) else None
        path = engine.copy_state()["decode_path"]["in_force"]
        after = f", {counted(row['past_trials'], 'step')} more until no trial was pending" if args.past_trials else ""
        print(f"\n{fraction:.0%} resident, decode path {path}, worker threads {worker_threads}{after}: the worker's CPU "
              f"part, µs, median (n) by pairs", flush=True)
        parts = row["parts"]
        cells = "  ".join(f"{p}: {us(parts[p])} ({len(parts[p])})" for p in sorted(parts) if p)
        print(f"  step {statistics.median(row['steps']) * 1e3:6.2f} ms (first job to last gate "
              f"{us(row['layers'])}, end_step {us(row['end_step'])} µs with {statistics.median(row['left'])} "
              f"accounts left ({statistics.median(row['ready_left'])} ready) and rebalance "
              f"{us(row['rebalance'])} µs; settle took {statistics.median(row['settled'])} in "
              f"{statistics.median(row['settle_calls'])} calls, the head ready after "
              f"{statistics.median(row['head_ready'])}), jobs {statistics.median(row['jobs'])}, "
              f"swaps {statistics.mean(row['swaps']):.1f}, threads {min(row['threads'])}-{max(row['threads'])}, "
              f"wait for routing {us(row['waits'])}, gate to next job {us(row['idle'])}\n"
              f"     part µs by pairs | {cells}", flush=True)
        print("     the step's moments, µs from each to the next (median over the steps):\n" + "\n".join(
            f"       {us(values)}  {part} ({len(values)})" for part, values in row["boundary"].items()), flush=True)
        # a call whose engine-thread CPU time falls well short of its wall time waited (for the GPU, a lock) or was
        # off its core (the host's other threads on it)
        print("     the marked calls on the engine's thread, µs, median wall / thread CPU time (calls):\n" + "\n".join(
            f"       {us([w for w, _ in calls])} / {us([c for _, c in calls])}  {name} ({len(calls)})"
            for name, calls in row["on_cpu"].items()), flush=True)
        if any(row["split"]):
            print("     at the first and the last step's end, " + "; ".join(
                text for text in (row["split"][0], row["split"][-1]) if text), flush=True)
        if row["chain"]:
            print("     a layer's gate to the next layer's routing, µs, median over layers and steps:\n" + "\n".join(
                f"       {us(values)}  {part} ({len(values)})" for part, values in row["chain"].items()), flush=True)
        if probe is not None:
            print(f"     a placement of this size's rebalance: {us(row['probe_in_step'])} µs at the step's end, "
                  f"{us(row['probe_quiet'])} µs after {IDLE_S + 0.01:.2f} s asleep", flush=True)


if __name__ == "__main__":
    main()
