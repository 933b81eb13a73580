"""Python's cyclic garbage collection on the GUI thread only, on a timer.

Qt objects must be destroyed on the thread that owns them. Automatic collection runs in whichever thread's allocation
crosses its threshold, and the engine's thread allocates the most. A collection there that frees widgets left in a
reference cycle (a closed window's pyqtgraph view boxes and their menus) destroys them on the engine's thread: in the
test suite that thread then held Qt's object mutex while it waited for the GIL, and the GUI thread held the GIL while
it waited for that mutex (RESULTS.md, "Forty-ninth session").

So while a window lives, automatic collection is off (engine/collection_hold.py) and this timer collects on the GUI
thread, the oldest generation whose count passed its threshold, as automatic collection would pick; never while a
decoder step holds collection off. pyqtgraph's GarbageCollector does the same, except for that last condition, which
is why it is not used.
"""

from __future__ import annotations

import gc

from PySide6.QtCore import QObject, QTimer

from engine.collection_hold import collect_on_timer, collect_unless_held

INTERVAL_MS = 500


def due_generation(counts: tuple, thresholds: tuple) -> int | None:
    """The generation automatic collection would collect at these counts (gc.get_count, gc.get_threshold)."""
    due = None
    for generation, (count, threshold) in enumerate(zip(counts, thresholds)):
        if count <= threshold:
            break
        due = generation
    return due


class GuiCollector(QObject):
    def __init__(self, parent: QObject, interval_ms: int = INTERVAL_MS):
        super().__init__(parent)
        self._release = collect_on_timer()
        self.timer = QTimer(self)
        self.timer.timeout.connect(self.collect_due)
        self.timer.start(interval_ms)

    def collect_due(self) -> None:
        generation = due_generation(gc.get_count(), gc.get_threshold())
        if generation is not None:
            collect_unless_held(generation)

    def stop(self) -> None:
        """Automatic collection back (where nothing else holds it off)."""
        self.timer.stop()
        self._release()
