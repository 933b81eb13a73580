"""A decode-like loop beside the experts' background population (issue 4): does populating stop the loop?

After load, a thread maps the experts' pages (engine/expert_prefault.py: MADV_POPULATE_READ, 64 MiB a call). Python's
`mmap.madvise` holds the interpreter for the whole call, so every other Python thread (the engine's decode, the GUI)
stops at its next bytecode until the call returns; from a cold page cache a call reads 64 MiB from disk. The engine
calls libc's madvise through ctypes instead (`engine.onnx_file.populate`), which lets go of the interpreter.

Here: a data file of --mib MiB, dropped from the page cache before each variant (POSIX_FADV_DONTNEED, so the
population reads the disk as after a reboot); a thread populates it in CHUNK pieces while this thread runs a
decode-like loop, each iteration ~20 µs of Python work and a call that lets go of the interpreter (time.sleep(0), as
onnxruntime's run and the Numba kernels do). Per variant: the loop's iterations per second while the population runs,
its longest iteration, and the population's time; variants alternate over --rounds rounds:
    alone      no population (the reference)
    mmap       the population by mmap.madvise (the engine before the twenty-fifth session)
    engine     the population by engine.onnx_file.populate

    python benchmarks/bench_prefault_gil.py [--mib 1024] [--rounds 3] [--dir /tmp] [--no-write]
"""
from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_result  # noqa: E402
from engine.expert_prefault import CHUNK  # noqa: E402
from engine.onnx_file import MADV_POPULATE_READ, populate  # noqa: E402


def python_work(n: int = 60) -> int:
    total = 0
    for i in range(n):  # ~20 µs of bytecode on a 2-core VM
        total += i * i
    return total


def run_variant(path: Path, variant: str, seconds_cap: float = 30.0) -> dict:
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # cold: the population reads the disk
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    size = len(mapping)
    done = threading.Event()
    spent = []

    def fill():
        started = time.perf_counter()
        for offset in range(0, size, CHUNK):
            length = min(CHUNK, size - offset)
            if variant == "mmap":
                mapping.madvise(MADV_POPULATE_READ, offset, length)
            else:
                populate(mapping, offset, length)
        spent.append(time.perf_counter() - started)
        done.set()

    thread = threading.Thread(target=fill) if variant != "alone" else None
    iterations, longest = 0, 0.0
    started = last = time.perf_counter()
    if thread is not None:
        thread.start()
    while True:
        python_work()
        time.sleep(0)
        now = time.perf_counter()
        longest = max(longest, now - last)
        last = now
        iterations += 1
        if (thread is None and now - started >= 1.0) or done.is_set() or now - started > seconds_cap:
            break
    elapsed = time.perf_counter() - started
    if thread is not None:
        thread.join()
    mapping.close()
    return {"variant": variant, "iterations_per_s": iterations / elapsed, "longest_iteration_s": longest,
            "population_s": spent[0] if spent else None}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the data file is written (default: the temp folder)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    if MADV_POPULATE_READ is None or not hasattr(os, "posix_fadvise"):
        sys.exit("this benchmark needs Linux (MADV_POPULATE_READ, posix_fadvise)")
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        path = Path(folder) / "experts.bin"
        block = os.urandom(1 << 20)
        with open(path, "wb") as f:
            for _ in range(args.mib):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())  # clean pages: the drop from the page cache takes them all
        runs: dict[str, list[dict]] = {"alone": [], "mmap": [], "engine": []}
        for round_ in range(args.rounds):
            for variant in runs:
                result = run_variant(path, variant)
                runs[variant].append(result)
                population = result["population_s"]
                print(f"round {round_ + 1} {variant:7s}: {result['iterations_per_s']:9.0f} iterations/s, longest "
                      f"{result['longest_iteration_s'] * 1e3:6.2f} ms"
                      + (f", population {population:.2f} s" if population else ""), flush=True)
    median = {v: {k: statistics.median(r[k] for r in rs) for k in ("iterations_per_s", "longest_iteration_s")}
              for v, rs in runs.items()}
    figures = []
    for variant in ("mmap", "engine"):
        ratio = median[variant]["iterations_per_s"] / median["alone"]["iterations_per_s"]
        print(f"{variant}: the loop ran at {ratio:.3f}x its speed alone; longest iteration "
              f"{median[variant]['longest_iteration_s'] * 1e3:.2f} ms (alone "
              f"{median['alone']['longest_iteration_s'] * 1e3:.2f} ms)")
        figures.append({"name": f"decode-like loop beside the experts' population ({variant})", "unit": "iterations/s",
                        "value": median[variant]["iterations_per_s"], "reference": "the loop alone",
                        "reference_value": median["alone"]["iterations_per_s"], "ratio": ratio,
                        "longest_iteration_s": median[variant]["longest_iteration_s"]})
    if not args.no_write:
        path = write_result("prefault-gil", figures, mib=args.mib, chunk=CHUNK,
                            runs={v: rs for v, rs in runs.items()})
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
