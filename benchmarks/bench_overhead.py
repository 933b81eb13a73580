"""Where a decode step's time goes per layer, outside the expert kernels and onnxruntime's compute (issue #4).

A writer-made model with few layers but the real dimensions of the Qwen3-30B-A3B-like shape (hidden 2048,
intermediate 768, 128 experts, top-8), decoded on device "cpu" (no offload) and on the simulated device at
0%, 50% and 100% of the experts resident (100% = every expert in a device slot, planner.all_resident_bytes).

Every boundary is timed with perf_counter by wrappers put on the loaded model (no engine code changes):

    step           PartitionedDecoder.forward, whole
    dense_call     DenseSegment.run (run_bound: bindings, the run, outputs to NumPy)
    dense_ort      InferenceSession.run_with_iobinding alone (onnxruntime's own run of the segment)
    expert_call    the expert node's run (CpuExpertNode or HybridExpertNode)
    kernel_cpu     CpuQMoE.run_experts called for the CPU's experts
    kernel_device  CpuQMoE.run_experts called by the simulated device's slots ("device" compute on the CPU here)
    launch/collect the device slots' launch / collect (CUDA: the host side of the launch, the wait + copy back);
                   a fully resident layer's launch_routed and a decode step's merge_on_device count as launches
                   (their statistics follow in end_step)
    to_host        a layer with cold experts bringing its inputs from GPU memory (the dense part on the GPU): the
                   wait for the dense part's stream, then the copy; a wait, not overhead
    load/stage     copies into slots / prefill waves
    end_step       on_step_end (placement's safe point)

and per layer (L expert nodes, L+1 dense segments, all divided by L):

    dense_setup    = dense_call - dense_ort                  bindings, OrtValues, outputs to NumPy
    hybrid_python  = expert_call - kernels - device calls - to_host   routing, stats, miss policy, bookkeeping
    device_python  = launch - kernel_device                   the device interface's own host work
    decoder_loop   = step - dense_call - expert_call - end_step   step inputs, the loop, state advance
    overhead       = the four above + end_step + collect on the simulated device (collect waits on CUDA)

The per-step numbers are medians over all measured steps (the machine may be shared: medians resist
bursts); each point is run `--rounds` times, interleaved, and the spread of the rounds' medians is
reported. `--profile` adds cProfile's attribution (top functions by own time, per layer per step).

    python benchmarks/bench_overhead.py [--layers 4] [--steps 40] [--rounds 3] [--profile] [--label before]
                                        [--stub-kernels]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS, RUN_DATE, machine, machine_tag, model_folder  # noqa: E402

QWEN3_LIKE = dict(hidden_size=2048, inter_size=768, num_experts=128, top_k=8, num_heads=32, num_kv_heads=4,
                  head_size=128, vocab_size=4096, swiglu_limit=None, alpha=1.0, beta=0.0)

BUCKETS = ("step", "dense_call", "dense_ort", "expert_call", "kernel_cpu", "kernel_device", "launch", "collect",
           "to_host", "load", "stage", "end_step",
           # finer attribution (nested inside the buckets above): see DETAIL
           "route", "miss_policy", "spare_slots", "host_cache", "stats", "observe", "numba")
# Nested timings reported apart (µs per layer), not part of the components' sums:
#   route        kernels.cpu.routing.route as the expert nodes call it
#   miss_policy  HybridExpertNode._copy_misses (costs, spare slots, decision, the copies' loads)
#   spare_slots  placement's spare_slots (inside miss_policy)
#   host_cache   HostExpertCache.touch;  stats  OffloadStats.count + split and the hybrid node's classify_pairs
#                (residency, per-expert counts, misses: step_pairs.py);  observe  placement's observe
#   numba        the compiled kernels' calls (moe_gemv, group_pairs): kernel_wrapper = kernels - numba, the
#                Python of CpuQMoE.run_experts / forward around them (counted in kernel_cpu / kernel_device)
DETAIL = ("route", "miss_policy", "spare_slots", "host_cache", "stats", "observe", "kernel_wrapper")


class Meter:
    """Seconds accumulated per bucket; `snapshot()` per step gives per-step deltas."""

    def __init__(self):
        self.total = dict.fromkeys(BUCKETS, 0.0)
        self.calls = dict.fromkeys(BUCKETS, 0)

    def timed(self, bucket: str, fn):
        total, calls, clock = self.total, self.calls, time.perf_counter

        def wrapper(*args, **kwargs):
            started = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                total[bucket] += clock() - started
                calls[bucket] += 1

        wrapper.__wrapped_by_meter__ = fn
        return wrapper

    def reset(self) -> None:
        for name in BUCKETS:
            self.total[name] = 0.0
            self.calls[name] = 0

    def snapshot(self) -> dict:
        return dict(self.total)


class _DeviceKernel:
    """Stands in for the kernel the simulated device's slots compute with: same object, timed apart."""

    def __init__(self, kernel, run_experts):
        self.spec = kernel.spec
        self.run_experts = run_experts
        self._kernel = kernel

    def __getattr__(self, name):
        return getattr(self._kernel, name)


def _wrap(obj, name: str, meter: Meter, bucket: str) -> None:
    current = getattr(obj, name)
    original = getattr(current, "__wrapped_by_meter__", current)
    setattr(obj, name, meter.timed(bucket, original))


def instrument(model, meter: Meter | None = None) -> Meter:
    """Put the timing wrappers on a LoadedModel (again after a reconfigure: idempotent)."""
    from engine.dense_segment import DenseSegment

    meter = meter or Meter()
    decoder = model.decoder
    for runner in decoder.steps:
        if isinstance(runner, DenseSegment):
            _wrap(runner, "run", meter, "dense_call")
            _wrap(runner.session, "run_with_iobinding", meter, "dense_ort")
        else:
            _wrap(runner, "run", meter, "expert_call")
    engine = model.offload
    if engine is not None:
        for store in engine.stores:
            if store is None:
                continue
            kernel = getattr(store, "kernel", None)
            if kernel is not None:  # the simulated device: its "device" compute is the CPU kernel
                base = kernel._kernel if isinstance(kernel, _DeviceKernel) else kernel
                original = type(base).run_experts.__get__(base)
                store.kernel = _DeviceKernel(base, meter.timed("kernel_device", original))
            for name in ("launch", "collect", "load", "stage"):
                _wrap(store, name, meter, name)
            _wrap(store, "stream", meter, "load")  # decode misses into the streaming slots: copies, as loads
            _wrap(store, "launch_routed", meter, "launch")  # a fully resident layer's launch, routing included
            _wrap(store, "merge_on_device", meter, "launch")  # a decode result merged on the device: host work
            _wrap(store, "to_host", meter, "to_host")  # inputs from GPU memory: waits for the dense part's stream
            # decode path "both": its launch and merge as host work, its wait for the published routing as to_host
            for name, bucket in (("launch_split", "launch"), ("merge_split", "launch"), ("split_routing", "to_host")):
                if hasattr(store, name):  # (trees before the twenty-ninth session have none)
                    _wrap(store, name, meter, bucket)
        if decoder.on_step_end is not None:
            _wrap(decoder, "on_step_end", meter, "end_step")
    for runner in decoder.steps:
        kernel = getattr(runner, "kernel", None)
        if kernel is not None:
            _wrap(kernel, "run_experts", meter, "kernel_cpu")
    _instrument_detail(model, meter)
    return meter


def wrapped_module_functions() -> list[tuple]:
    """(module, function name, bucket) of the module functions instrument() wraps: the engine looks them up at call
    time. They stay wrapped in the process (a test that instruments a model puts them back)."""
    import engine.offload.hybrid_node as hybrid_node
    import kernels.cpu.kernels as compiled
    import kernels.cpu.qmoe as qmoe

    found = [(hybrid_node, "route", "route"), (qmoe, "route", "route")]
    if hasattr(hybrid_node, "classify_pairs"):  # the trees before the fourth pass count in OffloadStats.count
        found.append((hybrid_node, "classify_pairs", "stats"))
    return found + [(compiled, "moe_gemv", "numba"), (compiled, "group_pairs", "numba")]


def _instrument_detail(model, meter: Meter) -> None:
    """The nested buckets (DETAIL): module functions the engine looks up at call time, and engine objects."""
    from engine.offload.hybrid_node import HybridExpertNode

    for module, name, bucket in wrapped_module_functions():
        _wrap(module, name, meter, bucket)
    for runner in model.decoder.steps:
        if "_route" in vars(runner):  # CpuExpertNode routes itself (no CpuQMoE.forward) since pass 3
            _wrap(runner, "_route", meter, "route")
    engine = model.offload
    if engine is None:
        return
    for runner in model.decoder.steps:
        if isinstance(runner, HybridExpertNode):
            _wrap(runner, "_copy_misses", meter, "miss_policy")
            _wrap(runner, "_stream_misses", meter, "miss_policy")
    _wrap(engine.policy, "spare_slots", meter, "spare_slots")
    _wrap(engine.policy, "observe", meter, "observe")
    _wrap(engine.host_cache, "touch", meter, "host_cache")
    _wrap(engine.stats, "count", meter, "stats")
    _wrap(engine.stats, "split", meter, "stats")


def per_layer(deltas: dict, layers: int, simulated: bool) -> dict:
    """One step's bucket seconds -> µs per layer by component (see the module docstring)."""
    d = {k: v * 1e6 / layers for k, v in deltas.items()}
    device_calls = d["launch"] + d["collect"] + d["load"] + d["stage"]
    out = {
        "step": d["step"],
        "dense_ort": d["dense_ort"],
        "dense_setup": d["dense_call"] - d["dense_ort"],
        "kernel_cpu": d["kernel_cpu"],
        "kernel_device": d["kernel_device"],
        "hybrid_python": d["expert_call"] - d["kernel_cpu"] - device_calls - d["to_host"],
        "device_python": d["launch"] - d["kernel_device"],
        "collect": d["collect"],
        "to_host": d["to_host"],
        "copies": d["load"] + d["stage"],
        "end_step": d["end_step"],
        "decoder_loop": d["step"] - d["dense_call"] - d["expert_call"] - d["end_step"],
        **{name: d[name] for name in DETAIL[:-1]},
        "kernel_wrapper": d["kernel_cpu"] + d["kernel_device"] - d["numba"],
    }
    # What remains of a token once kernels, onnxruntime's run and copies are taken out; on the simulated
    # device collect is `out += partial` (host work), on CUDA it is the wait for the device (not overhead).
    out["overhead"] = (out["dense_setup"] + out["hybrid_python"] + out["device_python"] + out["end_step"]
                       + out["decoder_loop"] + (out["collect"] if simulated else 0.0))
    return out


def decode_steps(model, meter: Meter, steps: int, prompt: list[int], warmup: int = 5) -> list[dict]:
    """Per-step bucket deltas (seconds) of `steps` decode steps after a prompt and a warm-up."""
    decoder = model.decoder
    state = model.new_state()
    token = int(decoder.forward(state, prompt)[-1].argmax())
    for _ in range(warmup):
        token = int(decoder.forward(state, [token])[-1].argmax())
    if model.offload is not None:
        model.offload.stats.reset(len(model.offload.slots))
    decoder.profile.update(steps=0, dense_s=0.0, experts_s=0.0, total_s=0.0)
    meter.reset()
    rows, before = [], meter.snapshot()
    clock = time.perf_counter
    for _ in range(steps):
        started = clock()
        logits = decoder.forward(state, [token])
        meter.total["step"] += clock() - started
        token = int(logits[-1].argmax())
        now = meter.snapshot()
        rows.append({k: now[k] - before[k] for k in BUCKETS})
        before = now
    return rows


def wrapper_cost(samples: int = 20000) -> float:
    """Seconds one timing wrapper adds to a call (subtracted nowhere: reported)."""
    meter = Meter()

    def f():
        return None

    g = meter.timed("step", f)
    clock = time.perf_counter
    started = clock()
    for _ in range(samples):
        f()
    plain = clock() - started
    started = clock()
    for _ in range(samples):
        g()
    return max(0.0, (clock() - started - plain) / samples)


def profile_steps(model, steps: int, prompt: list[int], layers: int, top: int = 25) -> list[dict]:
    """cProfile's own-time attribution over `steps` decode steps, µs per layer per step (inflated by the profiler:
    for attribution only)."""
    decoder = model.decoder
    state = model.new_state()
    token = int(decoder.forward(state, prompt)[-1].argmax())
    for _ in range(3):
        token = int(decoder.forward(state, [token])[-1].argmax())
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        token = int(decoder.forward(state, [token])[-1].argmax())
    profiler.disable()
    stats = pstats.Stats(profiler, stream=io.StringIO())
    rows = []
    for (path, line, func), (cc, nc, tt, ct, _callers) in stats.stats.items():
        short = path.replace(str(ROOT) + "/", "")
        if "site-packages/" in short:
            short = short.split("site-packages/", 1)[1]
        rows.append({"function": f"{short}:{line}({func})", "calls_per_layer_step": nc / (steps * layers),
                     "own_us": tt * 1e6 / (steps * layers), "cum_us": ct * 1e6 / (steps * layers)})
    rows.sort(key=lambda r: -r["own_us"])
    return rows[:top]


def summarise(rows: list[dict], layers: int, simulated: bool) -> dict:
    table = [per_layer(row, layers, simulated) for row in rows]
    return {k: float(np.median([t[k] for t in table])) for k in table[0]}


def stub_expert_kernels() -> None:
    """CpuQMoE.run_experts (the CPU's and the simulated device's expert compute) made a no-op, in this process."""
    from kernels.cpu.qmoe import CpuQMoE

    def no_experts(self, x2d, expert_ids, weights, out=None):
        return out if out is not None else np.zeros((x2d.shape[0], self.spec.hidden_size), x2d.dtype)

    CpuQMoE.run_experts = no_experts


def write_model_once(folder: Path, layers: int) -> Path:
    from engine.writer import WriterSpec, write_model

    path = folder / "model"
    if not (path / "genai_config.json").is_file():
        write_model(path, WriterSpec(layers=layers, **QWEN3_LIKE, bits=4, block_size=32, context_length=4096, seed=7))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--points", default="cpu,0,0.5,1", help="'cpu' and/or resident fractions on the simulated device")
    parser.add_argument("--profile", action="store_true", help="add cProfile's attribution per point")
    parser.add_argument("--folder", help="write the model here (default: a temporary folder); reused if present")
    parser.add_argument("--label", default="", help="a tag for the result file (e.g. before / after)")
    parser.add_argument("--out", help="result JSON path (default benchmarks/results/overhead-<the run's start "
                                      "date>-<machine>[-label].json)")
    parser.add_argument("--stub-kernels", action="store_true",
                        help="expert kernels that do nothing: the host's Python per layer without the kernels' time "
                             "and cache pollution (outputs are meaningless, routing follows them)")
    args = parser.parse_args()
    if args.stub_kernels:
        stub_expert_kernels()

    from engine.generation import LoadedModel
    from engine.offload import OffloadConfig, SimulatedDevice
    from engine.offload.planner import all_resident_bytes

    folder = model_folder(args.folder, "bench-overhead-")
    model_path = write_model_once(folder, args.layers)
    points = [p.strip() for p in args.points.split(",") if p.strip()]
    cpu_model = LoadedModel.open(model_path) if "cpu" in points else None
    sim_model = None
    if any(p != "cpu" for p in points):
        sim_model = LoadedModel.open(model_path, offload=OffloadConfig(device_expert_bytes=0),
                                     device=SimulatedDevice(200 << 30))
    layers = len((cpu_model or sim_model).folder.experts)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(3, 400, 16)]
    per_point: dict[str, list[list[dict]]] = {p: [] for p in points}
    meters: dict[str, Meter] = {}
    for round_index in range(args.rounds):
        for point in points:
            if point == "cpu":
                model = cpu_model
            else:
                model = sim_model
                everything = all_resident_bytes(model.offload.infos)
                model.offload.reconfigure(model.offload.config.updated(device_expert_bytes=int(float(point) * everything)))
            meter = instrument(model, meters.get(id(model)))
            meters[id(model)] = meter
            per_point[point].append(decode_steps(model, meter, args.steps, prompt))
            med = summarise(per_point[point][-1], layers, point != "cpu")
            print(f"round {round_index + 1} {point:>4}: step {med['step'] * layers / 1e3:6.2f} ms  "
                  f"overhead {med['overhead']:6.1f} µs/layer (dense setup {med['dense_setup']:5.1f}, hybrid "
                  f"{med['hybrid_python']:5.1f}, device {med['device_python']:5.1f}, loop {med['decoder_loop']:5.1f}, "
                  f"end_step {med['end_step']:5.1f})\n{'':12}detail: " + ", ".join(f"{k} {med[k]:5.1f}" for k in DETAIL),
                  flush=True)
    results = []
    for point in points:
        simulated = point != "cpu"
        everything = [row for rows in per_point[point] for row in rows]
        median = summarise(everything, layers, simulated)
        rounds = [summarise(rows, layers, simulated) for rows in per_point[point]]
        entry = {"point": "cpu (no offload)" if point == "cpu" else f"simulated, {float(point):.0%} resident",
                 "median_us_per_layer": median,
                 "round_medians_overhead_us": [r["overhead"] for r in rounds],
                 "round_medians_step_ms": [r["step"] * layers / 1e3 for r in rounds]}
        if args.profile:
            model = cpu_model if point == "cpu" else sim_model
            if simulated:
                everything_bytes = all_resident_bytes(model.offload.infos)
                model.offload.reconfigure(model.offload.config.updated(
                    device_expert_bytes=int(float(point) * everything_bytes)))
            entry["cprofile_top_own_us_per_layer_step"] = profile_steps(model, args.steps, prompt, layers)
        if simulated:
            stats = sim_model.offload.stats.totals()
            entry["hit_rate_last_round"] = stats.hit_rate
        results.append(entry)
    cost = wrapper_cost()
    print(f"\nmedian µs per layer over {args.rounds}×{args.steps} steps, {layers} layers (one timing wrapper adds "
          f"{cost * 1e6:.2f} µs per wrapped call)")
    keys = ["step", "dense_ort", "kernel_cpu", "kernel_device", "dense_setup", "hybrid_python", "device_python",
            "collect", "to_host", "end_step", "decoder_loop", "overhead", *DETAIL]
    print(f"{'point':<28}" + "".join(f"{k:>14}" for k in keys))
    for entry in results:
        m = entry["median_us_per_layer"]
        print(f"{entry['point']:<28}" + "".join(f"{m[k]:14.1f}" for k in keys)
              + f"   rounds: {', '.join(f'{v:.1f}' for v in entry['round_medians_overhead_us'])}")
    info = machine()
    label = f"-{args.label}" if args.label else ""
    path = Path(args.out) if args.out else RESULTS / f"overhead-{RUN_DATE}-{machine_tag(info)}{label}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "benchmark": "overhead", "date": RUN_DATE, "machine": info, "command": " ".join(["python", *sys.argv]),
        "label": args.label, "stub_kernels": args.stub_kernels, "layers": layers,
        "shape": dict(QWEN3_LIKE, layers=layers, bits=4, block_size=32),
        "steps": args.steps, "rounds": args.rounds, "wrapper_cost_us": cost * 1e6,
        "components": __doc__.split("and per layer")[1].split("The per-step")[0].strip(),
        "points": results}, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
