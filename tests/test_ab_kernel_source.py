"""benchmarks/ab_kernel_source.py: where it reads kernels.py from, and the modules it makes of a source (cache off,
this tree's kernels/cpu around them)."""
import shutil
import subprocess

import numpy as np
import pytest
from numba.core.caching import NullCache

from benchmarks import ab_kernel_source as ab

HEAD_READABLE = shutil.which("git") is not None and subprocess.run(
    ["git", "-C", str(ab.ROOT), "rev-parse", "HEAD"], capture_output=True).returncode == 0


def test_a_file_is_read_as_it_is(tmp_path):
    path = tmp_path / "kernels.py"
    path.write_text("X = 1\n")
    assert ab.kernels_source(str(path)) == "X = 1\n"


@pytest.mark.skipif(not HEAD_READABLE, reason="not a git checkout")
def test_a_revision_is_read_from_git_and_a_wrong_one_named():
    assert "def moe_gemv(" in ab.kernels_source("HEAD")
    with pytest.raises(SystemExit, match="'no-such-rev' is neither a file nor a revision with kernels/cpu/kernels.py"):
        ab.kernels_source("no-such-rev")


def test_a_loaded_source_is_a_module_of_its_own_with_numbas_cache_off():
    source = (ab.ROOT / ab.KERNELS).read_text()
    one, two = ab.load_kernels(source, "ab_test_1"), ab.load_kernels(source, "ab_test_2")
    assert one.__name__ == "kernels.cpu.ab_test_1" and one.moe_gemv is not two.moe_gemv
    assert isinstance(one.moe_gemv._cache, NullCache) and isinstance(one._claim._cache, NullCache)
    from kernels.cpu import kernels as cached
    assert not isinstance(cached.moe_gemv._cache, NullCache)  # the engine's own module untouched
    counters = np.full(24, -1, np.int64)
    one._claim_init(counters, 10, 3, 1)  # the loaded module's functions run: own spans of 10 chunks over 3 threads
    assert counters[[0, 8, 16]].tolist() == [0, 3, 6]


def test_the_outputs_compared_are_each_instance_s_own_call_from_zero():
    class Kernel:  # moe_gemv's calling convention where it matters here: a call adds into `out`
        def __init__(self, adds):
            self.adds = adds

        def py_func(self, x, out, nth):
            pass

        def __call__(self, x, out, nth):
            out += self.adds * x

    given = np.full(4, 7.0, np.float32)
    arguments = (np.arange(4, dtype=np.float32), given, 2)
    kernels = {"old 1": Kernel(1.0), "new 1": Kernel(1.5), "old 2": Kernel(9.0)}
    assert ab.largest_difference(kernels, arguments) == pytest.approx(1.5)  # 0.5 x the largest x (3)
    assert given.tolist() == [7.0] * 4  # the caller's accumulator left alone
