"""Diagnosis (GPU machine): what the decode path trials time for "both" against "both" in force (issue #4).

The trials' "both" window timed 26.4 ms a step at Qwen3-30B-A3B-like 0% (thirty-sixth session, host probe 16) where
"both" asked for ran 16.9 ms a step on the same kind of host (thirty-seventh session). Here one model decodes under
path auto through its first trial and beyond, and each step prints: its milliseconds, the path in force and the way the
trial times, the dense segments' graph replays and onnxruntime's own runs in the step, the captures, the CPU's
and the tier's misses, the split's tables (CPU share per cold count: each distinct one with its layers), the rates they
come from and the share trials' shift (split_share.py).

    python3 benchmarks/diag_path_trials.py --folder /tmp/bench-qwen3-30b-a3b-like [--fractions 0,0.5] [--steps 110]

With --then-both N and --slowdown STEP:MS, a burst of other work on every core (competing_load.py) starts at that
step of the "both" window, as a build or an indexer would: whether the split's table comes back after it
(spike_gate.py). --gate-ab runs that window twice, with the split's slow-step gate and with every step counted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_offload import SHAPES  # noqa: E402
from benchmarks.bench_offload_ab import open_model  # noqa: E402
from benchmarks.competing_load import CompetingLoad  # noqa: E402
from engine.dense_segment import DenseSegment  # noqa: E402
from engine.offload import OffloadConfig  # noqa: E402
from engine.offload.planner import all_resident_bytes  # noqa: E402
from engine.units import byte_rate, counted, layer_words  # noqa: E402


def count_runs(model) -> dict:
    """onnxruntime's own runs of every dense segment, counted (the sessions' run_with_iobinding wrapped)."""
    counts = {"runs": 0}
    for step in model.decoder.steps:
        if isinstance(step, DenseSegment) and step.session is not None:
            real = step.session.run_with_iobinding

            def counted(*args, real=real, **kwargs):
                counts["runs"] += 1
                return real(*args, **kwargs)
            step.session.run_with_iobinding = counted
    return counts


def graph_counts(model) -> tuple[int, int]:
    """(replays, graphs held) over every dense segment."""
    replays = held = 0
    for step in model.decoder.steps:
        if not isinstance(step, DenseSegment):
            continue
        for binding in list(step.bindings._by_state.values()):  # one per live conversation state
            graphs = binding._graphs
            if graphs is not None:
                replays += graphs.replays
                held += len(graphs._graphs)
    return replays, held


def tables_text(split: dict | None) -> str:
    """The split's tables as a step's line shows them: '0,0,1,1,2 in layers 0-23', or each distinct one with its
    layers ('0,0,1,1,2 in layers 0-11; 0,1,1,2,2 in layers 12-23'); '' where "both" is not in force."""
    if split is None:
        return ""
    return "; ".join(f"{','.join(str(int(take)) for take in table['cpu_takes'])} in {layer_words(table['layers'])}"
                     for table in split["tables"])


def run_steps(model, state, token: int, steps: int, runs: dict, at_step: dict | None = None) -> tuple[int, list]:
    """`steps` decode steps from `token`, one line each (the columns main's header names), `at_step[i]()` called
    before step i; returns the last token and the steps' milliseconds."""
    engine, decoder = model.offload, model.decoder
    step_ms = []
    before_replays, _ = graph_counts(model)
    before_runs = runs["runs"]
    stats = engine.stats
    for step in range(steps):
        beside, again, cpu_s = decoder.layers_beside, decoder.steps_run_again, stats.phases["decode"].cpu_s
        cpu_before = sum(layer.misses - layer.misses_read for layer in stats.layers)
        read_before = sum(layer.misses_read for layer in stats.layers)
        if at_step and step in at_step:
            at_step[step]()
        started = time.perf_counter()
        token = int(decoder.forward(state, [token])[-1].argmax())
        ms = (time.perf_counter() - started) * 1e3
        step_ms.append(ms)
        replays, held = graph_counts(model)
        trial = engine.path_trials.state()
        split = engine.copy_state()["decode_path"]["cold_split"]  # None unless "both" is in force
        cpu_misses = sum(layer.misses - layer.misses_read for layer in stats.layers) - cpu_before
        read = sum(layer.misses_read for layer in stats.layers) - read_before
        # the one the table comes from, in force; the measured line (its rate, its own fixed cost) beside it where the
        # stream clamped it
        cpu_rate = engine.cpu_rate_state(engine.split_cpu_rate if engine.splits_cold else engine.cpu_rate)
        # none measured yet: "no rate" ("0.0 kB/s" read as a CPU that costs nothing), as diag_worker_parts says it
        rate, measured = cpu_rate["cpu_bytes_per_s"], cpu_rate["cpu_measured_bytes_per_s"]
        cpu = f"{'no rate':>10}"
        if rate is not None:
            measured_call = cpu_rate["cpu_measured_call_s"] * 1e6
            clamped = f" (measured {byte_rate(measured, 1)} + {measured_call:.0f})" if measured > rate else ""
            cpu = f"{byte_rate(rate, 1):>10}+{cpu_rate['cpu_call_s'] * 1e6:4.0f}{clamped}"
        tier = "no rate" if engine.tier_read.value is None else byte_rate(engine.tier_read.value, 1)
        print(f"{step:4d} {ms:7.2f} {engine.decode_path_in_force:>4}/{trial['measuring'] or '-':>4}  "
              f"replays {replays - before_replays:3d} runs {runs['runs'] - before_runs:3d} held {held:3d}  "
              f"cpu {cpu_misses:4d} read {read:4d}  "
              f"table {tables_text(split):>17}  "
              f"{cpu}  {tier:>10}  "
              f"{engine.host_gap.value * 1e6:5.0f}  share {engine.share_trials.shift:+d}"
              f"/{engine.share_trials.state()['measuring'] or '-'}  beside {decoder.layers_beside - beside:2d} "
              f"again {decoder.steps_run_again - again}  cpu ms {(stats.phases['decode'].cpu_s - cpu_s) * 1e3:5.2f}",
              flush=True)
        before_replays, before_runs = replays, runs["runs"]
    return token, step_ms


def both_window(model, state, token: int, steps: int, runs: dict, slowdown: tuple[int, float] | None,
                gate: bool) -> int:
    """`steps` steps with the decode path asked for as "both", a burst of other work on every core at the slowdown's
    step for its ms, the split's slow-step gate on or off (spike_gate.py); ends with the median step before the
    burst against the last third's, and every layer's table at the end."""
    engine = model.offload
    ratio, left_before = engine.split_gate.ratio, engine.split_gate.left_out
    engine.split_gate.ratio = ratio if gate else float("inf")
    engine.set_decode_path("both")
    load = CompetingLoad(os.cpu_count() or 2, slowdown[1]) if slowdown else None
    try:
        token, step_ms = run_steps(model, state, token, steps, runs, {slowdown[0]: load.start} if load else None)
    finally:
        if load is not None:
            load.close()
        engine.split_gate.ratio = ratio
    split = engine.copy_state()["decode_path"]["cold_split"]
    before = step_ms[3:slowdown[0]] if slowdown else step_ms[3:]
    print(f"-- gate {'on' if gate else 'off'}: median ms before the burst {statistics.median(before):.2f}, last "
          f"third {statistics.median(step_ms[-(steps // 3):]):.2f}; table {tables_text(split)}, "
          f"{counted(split['slow_steps_left_out'] - left_before, 'slow step')} left out in the window", flush=True)
    engine.set_decode_path("auto")
    return token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b-like")
    parser.add_argument("--fractions", default="0")
    parser.add_argument("--steps", type=int, default=110)
    parser.add_argument("--folder")
    parser.add_argument("--layers", type=int, help="fewer layers than the shape has (quick runs)")
    parser.add_argument("--device", choices=["cuda", "simulated"], default="cuda")
    parser.add_argument("--then-both", type=int, default=0,
                        help="after the steps, this many more with the decode path asked for as \"both\" (no trials)")
    parser.add_argument("--slowdown", help="STEP:MS, a burst of other work on every core at that step of the \"both\" "
                                           "window, for MS milliseconds")
    parser.add_argument("--gate-ab", action="store_true",
                        help="the \"both\" window twice: the split's slow-step gate on, then off")
    args = parser.parse_args()
    slowdown = None
    if args.slowdown:
        step, ms = args.slowdown.split(":")
        slowdown = (int(step), float(ms))
    model, prompt = open_model(args.shape, args.layers, args.folder, device=args.device, prefix="diag-path-trials-")
    engine = model.offload
    for fraction in [float(f) for f in args.fractions.split(",")]:
        engine.reconfigure(OffloadConfig(device_expert_bytes=int(fraction * all_resident_bytes(model.folder.experts))))
        runs = count_runs(model)
        state = model.new_state()
        token = int(model.decoder.forward(state, prompt)[-1].argmax())
        print(f"== {fraction:.0%} resident; step ms, path in force / trial timing, dense replays / onnxruntime runs "
              f"/ graphs held, misses cpu / read, table, CPU rate + fixed µs (measured where the host's "
              f"streaming read clamped it), tier read rate, host gap µs, the CPU's share shift in force / trial "
              f"timing, layers the worker took, steps run again, the CPU's ms", flush=True)
        token, _ = run_steps(model, state, token, args.steps, runs)
        print(f"trials: {engine.path_trials.state()}, share: {engine.share_trials.state()}", flush=True)
        for gate in ((True, False) if args.gate_ab else (True,)) if args.then_both else ():
            print(f"== {fraction:.0%} resident, decode path \"both\" asked for"
                  + (f", other work on every core at step {slowdown[0]} for {slowdown[1]:.0f} ms" if slowdown else ""),
                  flush=True)
            token = both_window(model, state, token, args.then_both, runs, slowdown, gate)


if __name__ == "__main__":
    main()
