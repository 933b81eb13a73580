"""MoE Workbench engine: model loading, graph partition, expert execution, generation (no Qt)."""

import os

# Every decode step alternates between onnxruntime's thread pool (dense segments) and Numba's
# OpenMP threads (expert kernels), dozens of times per token. OpenMP threads that spin after a
# parallel region steal the cores onnxruntime's threads need next, and the reverse: measured on
# the 2-core dev VM, an 8-layer model decoded in 15.0 ms/token spinning and 3.2 ms passive. Set
# before Numba's OpenMP runtime starts; a user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
