"""GPU kernels (CuPy RawModule, CUDA C++) for com.microsoft QMoE nodes: ``GpuQMoE`` mirrors ``kernels.cpu.CpuQMoE``.

Importing this package needs neither CuPy nor a GPU (CuPy is imported when a ``GpuQMoE`` is built).
"""
from .qmoe import GpuQMoE, gpu_available

__all__ = ["GpuQMoE", "gpu_available"]
