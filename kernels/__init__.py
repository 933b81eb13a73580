"""MoE Workbench kernels: QMoE spec, layouts, NumPy reference, CPU (Numba) and GPU (CuPy) kernels. No Qt, no engine
imports."""
