"""A/B of two versions of kernels/cpu/kernels.py in one process: the CPU decode kernel (moe_gemv) of each.

Between processes the same kernel's time spreads 1.3-1.5x on the dev VM, with address space randomisation off too
(RESULTS.md, "Forty-sixth session"), so an A/B of trees in separate processes reads that spread. Here both sources
are compiled in this process as modules of their own (Numba's cache off), each `--instances` times, and called on
the same arguments (those run_experts gives the node of Qwen3-30B-A3B's shape: one token, warm experts), interleaved
in rounds of --calls calls. Printed per thread count and expert count: each instance's median of its rounds'
medians, and new / old per instance pair. Only kernels.py is swapped: the rest of kernels/cpu (simd.py, ...) is this
tree's, so the A/B is for changes confined to kernels.py. Each instance compiles moe_gemv afresh (~30 s on the dev
VM).

    python benchmarks/ab_kernel_source.py --old REV_OR_FILE [--new FILE] [--threads 1,16] [--experts 1,8]
        [--instances 2] [--rounds 8] [--calls 40] [--scales float32|float16]

REV_OR_FILE: a kernels.py file (e.g. .ab_old/kernels/cpu/kernels.py, from `git archive`), or a git revision of this
repository; --new defaults to this tree's kernels.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.diag_cached_kernel import interleaved_medians, kernel_arguments  # noqa: E402
from benchmarks.diag_cpu_fixed import node_of_shape_b  # noqa: E402
from kernels.cpu.threads import use_threads  # noqa: E402

KERNELS = Path("kernels/cpu/kernels.py")


def kernels_source(given: str) -> str:
    """kernels.py's text from a file, else from git revision `given` of this repository."""
    path = Path(given)
    if path.is_file():
        return path.read_text()
    shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{given}:{KERNELS.as_posix()}"], capture_output=True,
                           text=True)
    if shown.returncode != 0:
        raise SystemExit(f"ab_kernel_source: {given!r} is neither a file nor a revision with {KERNELS}")
    return shown.stdout


def load_kernels(source: str, name: str):
    """`source` run as module kernels.cpu.<name> (its relative imports are this tree's kernels/cpu), cache off."""
    spec = importlib.util.spec_from_loader(f"kernels.cpu.{name}", loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "kernels.cpu"
    sys.modules[spec.name] = module
    exec(compile(source.replace("cache=True", "cache=False"), f"<kernels.py: {name}>", "exec"), module.__dict__)
    return module


def largest_difference(kernels: dict, arguments: tuple) -> float:
    """The largest difference between the outputs (moe_gemv's `out`, which a call adds to) of the first old and the
    first new instance called once on `arguments` from zero: the A/B times the same results."""
    at = list(inspect.signature(next(iter(kernels.values())).py_func).parameters).index("out")
    outputs = {}
    for name in ("old 1", "new 1"):
        called = list(arguments)
        called[at] = np.zeros_like(arguments[at])
        kernels[name](*called)
        outputs[name] = called[at]
    return float(np.abs(outputs["new 1"] - outputs["old 1"]).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True)
    parser.add_argument("--new", default=str(ROOT / KERNELS))
    parser.add_argument("--threads", default="1,16")
    parser.add_argument("--experts", default="1,8")
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--scales", choices=("float32", "float16"), default="float32",
                        help="the node's scales and biases (float16: as float16 models carry them)")
    args = parser.parse_args()
    sources = {"old": kernels_source(args.old), "new": kernels_source(args.new)}
    kernels = {f"{side} {i + 1}": load_kernels(text, f"ab_{side}_{i + 1}").moe_gemv
               for i in range(args.instances) for side, text in sources.items()}
    node = node_of_shape_b(np.dtype(args.scales))
    x = np.random.default_rng(0).standard_normal((1, node.spec.hidden_size)).astype(args.scales)
    print(f"moe_gemv of kernels.py, old {args.old} against new {args.new}; one token at shape B, {args.scales} "
          f"scales, warm; µs, median "
          f"of {args.rounds} rounds' medians of {args.calls} calls", flush=True)
    for threads in [int(t) for t in args.threads.split(",")]:
        node.num_threads = threads
        use_threads(threads)
        for experts in [int(e) for e in args.experts.split(",")]:
            arguments = kernel_arguments(node, x, experts)
            print(f"{threads:3d} threads, {experts} experts: largest |new - old| of the outputs "
                  f"{largest_difference(kernels, arguments):.3g}", flush=True)
            medians = interleaved_medians(kernels, arguments, args.rounds, args.calls)
            ratios = [medians[f"new {i + 1}"] / medians[f"old {i + 1}"] for i in range(args.instances)]
            print(f"{threads:3d} threads, {experts} experts: " + "  ".join(f"{name} {m:7.1f}" for name, m in
                                                                         medians.items())
                  + "  |  new / old " + " ".join(f"{r:.3f}" for r in ratios), flush=True)


if __name__ == "__main__":
    main()
