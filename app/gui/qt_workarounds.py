"""Work-arounds for two PySide6 defects that crash the window on Python 3.11.

1. PySide6 6.12's `SignalInstance.emit()` drops a reference to `True` it does not own, once per call
   (measured: `sys.getrefcount(True)` falls by one per emit, with or without receivers), and queued
   slot calls drop references to `None` now and then. On Python >= 3.12 these objects are immortal
   and nothing happens; on 3.11 the count reaches zero after a few thousand emits and the process
   aborts ("Fatal Python error: bool_dealloc" / "none_dealloc"). pyqtgraph emits several signals
   per redraw, the engine worker one per token, so the window died within a minute. When the probe
   below sees the leak, True, False and None get 2**40 extra references: immortal in effect, as
   they are on 3.12.
2. PySide6 replaces `builtins.__import__` with a hook (`__feature_import__`) that runs Python code
   on every import for its optional `from __feature__ import ...` switches. This window never uses
   them; the hook is taken out of the import path so imports in the worker threads (the engine
   imports its kernels lazily, Numba parts of itself while compiling) go straight to the import
   PySide6 wrapped.
"""

from __future__ import annotations

import builtins
import ctypes
import sys

PINNED = 1 << 40
applied: list[str] = []


def emit_leaks_a_reference() -> bool:
    from PySide6.QtCore import QObject, Signal

    class Probe(QObject):
        ping = Signal()

    probe = Probe()
    before = sys.getrefcount(True)
    for _ in range(8):
        probe.ping.emit()
    return sys.getrefcount(True) <= before - 8


def pin_singletons() -> None:
    for obj in (True, False, None):
        ctypes.c_ssize_t.from_address(id(obj)).value += PINNED


def bypass_feature_import() -> bool:
    original = getattr(builtins, "__orig_import__", None)
    if original is not None and getattr(builtins.__import__, "__name__", "") == "__feature_import__":
        builtins.__import__ = original
        return True
    return False


def apply() -> None:
    if applied:
        return
    import PySide6.QtCore  # noqa: F401  (installs the import hook)

    if sys.version_info < (3, 12) and emit_leaks_a_reference():
        pin_singletons()
        applied.append("pinned True/False/None (PySide6 emit() reference leak)")
    if bypass_feature_import():
        applied.append("bypassed PySide6's __feature__ import hook")
    applied.append("checked")
