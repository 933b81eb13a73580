"""CPU (Numba) kernels for com.microsoft QMoE / MoE nodes."""
from .qmoe import CpuQMoE

__all__ = ["CpuQMoE"]
