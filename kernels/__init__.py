"""MoE Workbench kernels: QMoE spec, NumPy reference and CPU (Numba) kernels. No Qt, no engine imports."""
