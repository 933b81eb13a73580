"""The CPU expert kernels compiled before a timed run, so that a measurement does not carry their compilation.

Numba compiles a CPU kernel at its first call for each argument type and keeps the machine code in its cache
(kernels/cpu/numba_cache.py). On a machine's first run, or after an upgrade of the kernels, the first answer would
wait for that: on the 2-core dev VM a first generation on the demo model took 47 s to its first token against 0.4 s
once compiled, and a resource record made then would say so. warm_cpu_kernels runs each distinct kernel of a model
once on a decode-sized and a prefill-sized input (zeros, routed to the first k experts) before the timed part starts;
with the cache warm it costs milliseconds. It touches no model state: the kernels are called directly, not the
decoder or the offload engine.
"""

from __future__ import annotations

import time

import numpy as np


def _warm(kernel) -> None:
    spec = kernel.spec
    # the prefill path computes an expert with more than gemv_max_rows tokens by its GEMM kernels: every token goes to
    # the same k experts, so that one call reaches them
    for tokens in (1, max(kernel.gemv_max_rows, kernel.decode_max_tokens) + 1):
        logits = np.zeros((tokens, spec.num_experts), np.float32)
        logits[:, :spec.k] = np.arange(spec.k, 0, -1, dtype=np.float32)
        kernel.forward(np.zeros((tokens, spec.hidden_size), np.float32), logits)


def warm_cpu_kernels(runners) -> float:
    """Each distinct CPU expert kernel among `runners` (the decoder's steps: anything with a `kernel`) run once for a
    decode step and once for a prefill; returns the seconds it took (its compilation's, on a cold cache)."""
    started = time.perf_counter()
    seen = set()
    for runner in runners:
        kernel = getattr(runner, "kernel", None)
        if kernel is None or not hasattr(kernel, "compiled_for"):
            continue
        key = kernel.compiled_for
        if key not in seen:
            seen.add(key)
            _warm(kernel)
    return time.perf_counter() - started
