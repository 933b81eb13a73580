"""CPU (Numba) kernels for com.microsoft QMoE / MoE nodes."""
from . import numba_cache

numba_cache.configure()  # before the kernel modules are imported: see numba_cache

from .qmoe import CpuQMoE  # noqa: E402

__all__ = ["CpuQMoE"]
