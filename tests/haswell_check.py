"""The CPU kernels as Numba compiles them for a CPU without AVX-512 (Haswell), checked against the reference: the
table-lookup int4 kernels fall back to the convert-based ones, the fp4 / int2 / int3 table kernels look up lane by
lane, int3 with plain 24-byte loads and generic byte shuffles. Run in a subprocess of its own with Numba targeting
Haswell (Check); it prints "all cases agree" when every one does (test_qmoe_cpu.test_cpu_kernels_without_avx512).

It compiles every kernel it runs again for that target: minutes with a cold Numba cache, on one core. conftest.py
starts it as soon as collection shows the test will run, so that it compiles beside the other tests; for a run of the
whole suite, after tests/warm_kernels.py has compiled the native kernels of the later tests in the same process
(Check(warm=...)), the Haswell check being needed only near the end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

FEATURES = ("+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+f16c,+fma,+fxsr,+lzcnt,+mmx,+movbe,+popcnt,+sse,+sse2,"
            "+sse3,+sse4.1,+sse4.2,+ssse3,+xsave,-avx512f,-avx512bw,-avx512dq,-avx512vl,-avx512cd,-avx512vbmi")
ROOT = Path(__file__).resolve().parents[1]
PARENT = "HASWELL_CHECK_PARENT"  # the process that started this one, which it ends with (end_with_parent)


def _haswell_env() -> dict:
    env = dict(os.environ, NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES=FEATURES)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env[PARENT] = str(os.getpid())
    return env


class Check:
    """This module's checks running in a subprocess with Numba targeting Haswell; with `warm` (tests/warm_kernels.py's
    parts), a process compiling those native kernels first, then starting the check. Its output goes to a file, not a
    pipe: a pipe nobody reads until the test runs could fill and stop it halfway."""

    def __init__(self, warm: tuple[str, ...] = ()):
        if warm:  # native: the check's process gets the Haswell target from this one
            env = dict(os.environ, **{PARENT: str(os.getpid())})
            env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
            command = [sys.executable, "-m", "tests.haswell_check", "--warm-first", *warm]
        else:
            env, command = _haswell_env(), [sys.executable, "-m", "tests.haswell_check"]
        self._output = tempfile.TemporaryFile(mode="w+")
        # a session of its own: stop() ends the check started by the warming process too
        self._process = subprocess.Popen(command, env=env, cwd=ROOT, stdout=self._output, stderr=subprocess.STDOUT,
                                         text=True, start_new_session=True)

    def result(self, timeout: float) -> tuple[int, str]:
        """(its exit status, what it printed), once it has ended."""
        status = self._process.wait(timeout)
        self._output.seek(0)
        printed = self._output.read()
        self._output.close()
        return status, printed

    def stop(self) -> None:
        try:
            os.killpg(self._process.pid, signal.SIGKILL)
        except ProcessLookupError:  # ended, and every process of its session with it
            pass
        self._process.wait()
        self._output.close()


running: Check | None = None  # the check conftest.py started, for the test to read (or to stop)


def _check(attrs, t, x, lg, tokens, tol, label, own_kernels=True):
    import numpy as np

    from kernels.cpu import CpuQMoE
    from kernels.qmoe_spec import QMoESpec
    from kernels.reference import qmoe_reference

    spec = QMoESpec.from_tensors("t", "QMoE", attrs, t, x.shape)
    m = CpuQMoE(spec, t)
    assert m._delegate is None or not own_kernels, label
    for T in tokens:
        ref = np.asarray(qmoe_reference(x[:T], lg[:T], spec, t), np.float64)
        err = np.abs(np.asarray(m.forward(x[:T], lg[:T]), np.float64) - ref).max() / np.abs(ref).max()
        assert err < tol, (label, T, err)
    return m


def main() -> None:
    import ml_dtypes
    import numpy as np

    from kernels.cpu.simd import HAS_AVX512F
    from tests.qmoe_oracle import make_case, make_layout_case

    assert not HAS_AVX512F
    # int4: the convert-based kernels; scales in the activations' type: fp16 / bf16 rows converted up front
    # (13 blocks a row)
    for dtype, tol, hidden in ((np.float32, 1e-5, 64), (np.float16, 4e-3, 416), (ml_dtypes.bfloat16, 2e-2, 416)):
        case = make_case(seed=11, E=6, H=hidden, I=96, k=2, bits=4, block_size=32, zero_points=True, T=37,
                         bias=True, activation="swiglu", swiglu_fusion=1, swiglu_limit=7.0, alpha=1.702, dtype=dtype)
        _check(*case, (1, 37), tol, dtype, own_kernels=False)
    # table kernels of fp4 / int2 / int3: lane-by-lane lookups
    for kw in (dict(quant_type="nvfp4", packing="k_packed", H=80, I=48), dict(quant_type="fp4", H=64, I=96),
               dict(bits=2, block_size=32, zero_points=True, H=96, I=32), dict(bits=2, H=68, I=36),
               dict(bits=3, block_size=32, zero_points=True, H=96, I=160), dict(bits=3, zero_points=True, H=100, I=71),
               dict(bits=3, block_size=64, H=128, I=64)):
        case = make_layout_case(seed=5, E=6, k=2, T=20, bias=True, activation="swiglu", swiglu_fusion=1,
                                swiglu_limit=7.0, alpha=1.702, **kw)
        _check(*case, (1, 20), 1e-5, kw)
    # int2 block 16: lane-by-lane lookups, generic shuffles of the four blocks' scales
    for kw in (dict(zero_points=True, H=112, I=80, swiglu_fusion=1, swiglu_limit=7.0),
               dict(H=80, I=48, swiglu_fusion=0, dtype=np.float16)):
        case = make_layout_case(seed=5, E=6, k=2, T=20, bias=True, bits=2, block_size=16, activation="swiglu",
                                alpha=1.702, **kw)
        m = _check(*case, (1, 20), 1e-5 if case[2].dtype == np.float32 else 4e-3, kw)
        assert m.fc1.bpc == 4
    print("all cases agree")


def warm_then_check(parts) -> int:
    """tests/warm_kernels.py's parts compiled here (native), then this module's checks in a process targeting Haswell;
    their exit status."""
    from tests import warm_kernels

    warm_kernels.main(parts)
    sys.stdout.flush()
    return subprocess.call([sys.executable, "-m", "tests.haswell_check"], env=_haswell_env(), cwd=ROOT)


def end_with_parent() -> None:
    """This process ends once the one that started it has gone. Check starts it in a session of its own, out of reach
    of what ends pytest without its session finishing (a CI time limit's SIGTERM to pytest's group, a closed terminal's
    SIGHUP, SIGKILL): it would go on compiling on a core for minutes, beside the next run. The check the warming
    process starts does the same, once that process has gone. The parent is named by its starter (PARENT), as it may
    have gone before this process got here."""
    parent = int(os.environ.get(PARENT) or os.getppid())

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="end-with-parent", daemon=True).start()


if __name__ == "__main__":
    end_with_parent()
    if sys.argv[1:2] == ["--warm-first"]:
        sys.exit(warm_then_check(sys.argv[2:]))
    main()
