"""Reproducer for the Numba bug in docs/numba-cached-caller-issue.md: a cached function that is not parallel but calls a
parallel one is written without its threading-layer hook when the writing process loaded the callee from the cache,
and a later process whose first call is that function dies (SIGSEGV).

Standalone (numba and numpy only), not part of the test suite: `python docs/numba_cached_caller_repro.py`. Each step
runs in a fresh process over one cache folder; the script prints each step's exit status and the reload_init that
each step leaves in `outer`'s cache entry, then says whether the bug showed. Exit status 1 where it did.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

MODULE = '''
import numpy as np
from numba import njit, prange


@njit(parallel=True, cache=True)
def inner(x):
    total = 0.0
    for i in prange(x.shape[0]):
        total += x[i]
    return total


@njit(cache=True)
def outer(x):
    return inner(x)
'''

CALL = "import numpy as np, repro_module; print(repro_module.{}(np.ones(100000)))"
# outer's cache entries' reload_init (the 8th field Numba pickles for a compile result: numba/core/compiler.py)
RELOAD_INIT = """
import repro_module
cache = repro_module.outer._cache._cache_file
print([[hook.__qualname__ for hook in cache._load_data(name)[7]] for name in cache._load_index().values()])
"""


def run(folder: Path, code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(folder / "cache"), PYTHONPATH=str(folder))
    return subprocess.run([sys.executable, "-c", code], cwd=folder, env=env, capture_output=True, text=True)


def steps(folder: Path, first: str) -> bool:
    """Run `first` then outer twice, each in a fresh process; whether every process exited cleanly."""
    (folder / "repro_module.py").write_text(MODULE)
    clean = True
    for what, function in ((f"{first} compiled and cached", first), ("outer called first", "outer"),
                           ("outer called first again", "outer")):
        result = run(folder, CALL.format(function))
        entry = run(folder, RELOAD_INIT).stdout.strip()
        status = f"killed by {signal.Signals(-result.returncode).name}" if result.returncode < 0 else \
            f"exit status {result.returncode}"
        print(f"  {what}: {status}; reload_init of outer's cache entries: {entry}")
        clean = clean and result.returncode == 0
    return clean


def main() -> int:
    import numba

    print(f"numba {numba.__version__}, Python {sys.version.split()[0]}")
    with tempfile.TemporaryDirectory() as expected, tempfile.TemporaryDirectory() as buggy:
        print("outer compiled in the process that compiles inner (expected):")
        fine = steps(Path(expected), "outer")
        print("inner cached by an earlier process, then outer compiled (loads inner from the cache):")
        bug = not steps(Path(buggy), "inner")
    print("bug reproduced" if bug and fine else "bug not reproduced" if fine else "the expected case failed too")
    return 1 if bug else 0


if __name__ == "__main__":
    sys.exit(main())
