"""A prefill wave's gather into the staging buffer: NumPy's take against host_copy.take_rows (every core).

8 experts of a 32-expert tensor of 15.6 MB rows (gpt-oss-20b's experts at int4 block 32), read from a
memory-mapped file as the engine reads model weights; best of 5 after a warm-up, GB/s of rows gathered.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_result  # noqa: E402
from engine.offload.host_copy import take_rows  # noqa: E402

EXPERTS, ROW_BYTES, WAVE = 32, 15_586_560, np.array([1, 5, 9, 13, 17, 21, 25, 29])


def best_seconds(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "experts.npy"
        src = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(EXPERTS, ROW_BYTES))
        src[:] = np.random.default_rng(0).integers(0, 255, ROW_BYTES, dtype=np.uint8)
        src.flush()
        del src
        src = np.load(path, mmap_mode="r")
        out = np.empty((WAVE.size, ROW_BYTES), np.uint8)
        numpy_s = best_seconds(lambda: np.take(src, WAVE, axis=0, out=out, mode="clip"))
        ours_s = best_seconds(lambda: take_rows(src, WAVE, out))
        assert np.array_equal(out, src[WAVE])
    gbs = out.nbytes / 1e9
    print(f"numpy take {numpy_s * 1e3:.1f} ms ({gbs / numpy_s:.1f} GB/s), take_rows {ours_s * 1e3:.1f} ms "
          f"({gbs / ours_s:.1f} GB/s): {numpy_s / ours_s:.1f}x")
    path = write_result("host-copy", [{"name": "wave gather, 8 experts x 15.6 MB", "value": ours_s * 1e3, "unit": "ms",
                                       "reference": "numpy take", "reference_value": numpy_s * 1e3,
                                       "ratio": numpy_s / ours_s}])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
