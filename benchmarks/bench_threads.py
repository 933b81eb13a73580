"""Decode on the CPU with onnxruntime's pool threads spinning between runs, against blocking (the engine's default).

Each decode step alternates between onnxruntime (the dense segments) and Numba (the expert kernels) once per
layer. onnxruntime's pool threads spin after a run, waiting for more work; with as many pool threads as cores
they hold the cores the expert kernels need next. The engine gives every session its own pool with
`session.intra_op.allow_spinning = 0` (engine/ort_env.py). This benchmark decodes the same writer-made model
(gpt-oss-20b dimensions, fewer layers) both ways in one run and reports, per layer, the expert kernels' time
against the streaming-read bound (the experts' bytes a token reads / B_dram, measured in the same run) and
onnxruntime's dense time.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine.ort_env as ort_env  # noqa: E402
from benchmarks.bench_offload import SHAPES, decode, overhead_breakdown, shape_spec  # noqa: E402
from benchmarks.common import model_folder, stream_read_bandwidth, write_result  # noqa: E402
from engine.generation import LoadedModel  # noqa: E402
from engine.writer import write_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gpt-oss-20b-like")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--folder", help="write the model here (default: a temporary folder)")
    args = parser.parse_args()

    import numba

    spec = shape_spec(args.shape, args.layers)
    folder = model_folder(args.folder, "bench-threads-") / "model"
    started = time.perf_counter()
    if not (folder / "genai_config.json").is_file():
        write_model(folder, spec)
    print(f"model written in {time.perf_counter() - started:.0f} s; {numba.config.NUMBA_NUM_THREADS} Numba threads",
          flush=True)
    b_dram = stream_read_bandwidth() * 1e9
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 400, 16)]
    blocking = ort_env.session_options
    figures = []
    for spinning in (False, True, False):  # blocking twice: the first run also warms Numba's cache
        ort_env.session_options = functools.partial(blocking, spinning=spinning)
        try:
            model = LoadedModel.open(folder)
            rate, rows = decode(model, prompt, args.decode_tokens)
        finally:
            ort_env.session_options = blocking
        infos = model.folder.experts
        parts = overhead_breakdown(rows, len(infos), simulated=True, device_s_per_layer=0.0)
        bound_us = infos[0].spec.k * infos[0].bytes_per_expert / b_dram * 1e6
        label = f"{args.shape}, {args.layers} layers, onnxruntime {'spinning' if spinning else 'blocking'}"
        print(f"{label}: decode {rate:.1f} tok/s; per layer: expert kernels {parts['kernel_cpu']:.0f} µs "
              f"(streaming bound {bound_us:.0f} µs: {bound_us / parts['kernel_cpu']:.0%}), onnxruntime dense "
              f"{parts['dense_ort']:.0f} µs, overhead {parts['overhead']:.0f} µs", flush=True)
        figures.append({"name": f"decode tokens/s, {label}", "value": rate, "unit": "tokens/s",
                        "reference": "expert kernels' streaming-read bound per layer (µs)",
                        "reference_value": bound_us, "ratio": bound_us / parts["kernel_cpu"],
                        "components_us_per_layer": parts})
        del model
    layer = numba.threading_layer()
    print(f"Numba threading layer: {layer}")
    path = write_result("threads", figures, shape=args.shape, layers=args.layers, b_dram=b_dram,
                        threading_layer=layer)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
