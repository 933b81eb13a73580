"""Python's cyclic garbage collection held off while decoder steps run.

A collection runs inside whichever allocation crosses its threshold. Inside a decoder step that can be while a "both"
layer's gated merge spins on the GPU, waiting for the gate the engine's thread raises once the CPU's part is done: a
finalizer that synchronizes the device there (the teardown of an onnxruntime CUDA session, a host registration or a
CUDA graph, left in a reference cycle by an earlier model or plan) waits for the merge, and the merge waits for the
thread, until the merge gives up after its timeout (1 s; the GPU test's [ahead-0.0] failure, RESULTS.md "Forty-ninth
session"). Held off here, the same collection runs at the first allocation after the step, where nothing waits on
the host. Steps on several threads at once (a side-by-side chat) hold it together: it resumes after the last one, and
only where it was on before the first.
"""

from __future__ import annotations

import gc
import threading
from contextlib import contextmanager

_lock = threading.Lock()
_steps = 0  # steps holding the collection off now
_was_enabled = False  # whether it was on before the first of them


@contextmanager
def collection_held():
    global _steps, _was_enabled
    with _lock:
        if _steps == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _steps += 1
    try:
        yield
    finally:
        with _lock:
            _steps -= 1
            if _steps == 0 and _was_enabled:
                gc.enable()
