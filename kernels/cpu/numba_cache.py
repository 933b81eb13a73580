"""Where Numba keeps the compiled CPU kernels, keyed by the kernels' own source.

Numba's on-disk cache checks only the time stamp of the file that defines a jitted function. The
kernels in kernels.py are built from intrinsics in simd.py: an upgrade that changes simd.py alone
would load machine code compiled from the old intrinsics. Caching into a folder named after a hash
of every source file in this package makes any change start a fresh cache.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numba
from numba.core.caching import FunctionCache
from numba.np.ufunc.parallel import _launch_threads

HERE = Path(__file__).resolve().parent


def source_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(HERE.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def cache_root() -> Path:
    """NUMBA_CACHE_DIR when the user set one, else the user's cache folder."""
    configured = os.environ.get("NUMBA_CACHE_DIR")
    if configured:
        return Path(configured)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("moe-workbench")) / "numba"


def configure() -> Path:
    """Point Numba's cache at this source's folder; must run before the kernel modules are imported
    (Numba picks the cache location when a function is decorated)."""
    folder = cache_root() / f"cpu-kernels-{source_digest()}"
    numba.config.CACHE_DIR = str(folder)
    return folder


class ThreadsFirstCache(FunctionCache):
    """Numba's cache of a function, launching Numba's threading layer before it loads an entry."""

    def load_overload(self, sig, target_context):
        _launch_threads()
        return super().load_overload(sig, target_context)


def calls_parallel(dispatcher):
    """Mark a cached function that is not parallel but calls a parallel kernel (directly or through another): its
    entries are loaded after the threading layer is launched, as Numba's own reloader launches it for a parallel one.

    Numba (0.68) records that a cached function needs the threading layer at load (reload_init) only where it is
    parallel itself or where the process that wrote the entry compiled its parallel callees too: a library rebuilt
    from the cache keeps no reload hooks, so a caller compiled after its callee was loaded from the cache is written
    without one (numba#8578). Loaded from such an entry as a process's first kernel call, it ran parallel regions with
    no threading layer and died (SIGSEGV). tests/test_numba_cache.py checks that every such function is marked."""
    dispatcher._cache = ThreadsFirstCache(dispatcher.py_func)
    return dispatcher
