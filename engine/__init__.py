"""MoE Workbench engine: model loading, graph partition, expert execution, generation (no Qt)."""

import os

# Every decode step calls Numba's OpenMP expert kernels once per layer, a few hundred µs of other work (the dense
# part, Python) apart. OpenMP threads that sleep between calls (OMP_WAIT_POLICY=PASSIVE, this engine's setting until
# the sixth session) must be woken at every call: on the H200 machine's 16-core Xeon that cost 0.3-0.4 ms per call,
# shape A 1.26 ms against 0.89 ms with threads spinning 3M times before they sleep, with 1 ms pauses
# between calls (benchmarks/bench_cpu_gap.py, RESULTS.md). 3M spins cover a step's pauses, yet threads sleep once
# decoding stops (3M spins: ~80 ms of a worker's CPU time after a call on the 2-core dev VM's Zen 5, measured as the
# process's CPU time over an idle second; longer where the pause instruction takes more cycles), so an idle app holds
# no cores. onnxruntime's pools block (engine/ort_env.py); with its dense part on
# the CPU of the 2-core dev VM the spinning threads cost it ~0.2 ms per layer and saved the kernels ~0.4 ms.
# Set before Numba's OpenMP runtime starts; a user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "3000000"
