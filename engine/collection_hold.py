"""When Python's cyclic garbage collection may run: never inside a decoder step, and (in the window) only on the
thread a timer runs on.

A collection runs inside whichever allocation crosses its threshold. Inside a decoder step that can be while a "both"
layer's gated merge spins on the GPU, waiting for the gate the engine's thread raises once the CPU's part is done: a
finalizer that synchronizes the device there (the teardown of an onnxruntime CUDA session, a host registration or a
CUDA graph, left in a reference cycle by an earlier model or plan) waits for the merge, and the merge waits for the
thread, until the merge gives up after its timeout (1 s; the GPU test's [ahead-0.0] failure, RESULTS.md "Forty-ninth
session"). Held off here, the same collection runs at the first allocation after the step, where nothing waits on
the host. Steps on several threads at once (a side-by-side chat) hold it together.

The window takes automatic collection over (`collect_on_timer`): Qt objects must be destroyed on the thread that owns
them, and a collection on the engine's thread that frees a widget left in a cycle destroys it there (it deadlocked
the test suite once: app/gui/collector.py). It then collects on its own thread with `collect_unless_held`.

Automatic collection comes back on once no step holds it off and no window has taken it over, and only where it was on
before.
"""

from __future__ import annotations

import gc
import threading
from contextlib import contextmanager

_lock = threading.Lock()
_steps = 0  # steps holding the collection off now
_takers = 0  # windows collecting on their timers instead of automatic collection
_was_enabled = False  # whether automatic collection was on before the first of them


def _off() -> None:
    """(under _lock, before a step or a taker is counted) Automatic collection off, its state kept."""
    global _was_enabled
    if _steps == 0 and _takers == 0:
        _was_enabled = gc.isenabled()
        gc.disable()


def _back() -> None:
    """(under _lock, after a step or a taker left) Automatic collection as it was, where nothing holds it off."""
    if _steps == 0 and _takers == 0 and _was_enabled:
        gc.enable()


@contextmanager
def collection_held():
    global _steps
    with _lock:
        _off()
        _steps += 1
    try:
        yield
    finally:
        with _lock:
            _steps -= 1
            _back()


def collect_on_timer():
    """Automatic collection off until the returned function is called: the caller collects (collect_unless_held)."""
    global _takers
    with _lock:
        _off()
        _takers += 1
    released = []

    def release() -> None:
        global _takers
        with _lock:
            if not released:
                released.append(True)
                _takers -= 1
                _back()
    return release


def collect_unless_held(generation: int = 2) -> bool:
    """gc.collect(generation) now, unless a step holds the collection off (then none); True where it ran."""
    with _lock:  # (a step starting meanwhile waits for the collection's end)
        if _steps:
            return False
        gc.collect(generation)
        return True
