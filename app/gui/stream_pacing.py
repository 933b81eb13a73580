"""Streamed text shown at a pace the window can keep: the batches that come while one waits to be shown are shown
together. Qt lays a paragraph out whole at each insertion into it, so an answer streamed as one long line (a
paragraph, code without line breaks) cost each batch the whole line: the window fell behind a fast stream, and the
batches queued up behind each other cost it the square of the line's length. A pacer bounds the insertions by time,
and by their cost: the longer the line, the rarer its insertions, and the window's share of the work stays bounded."""

from __future__ import annotations

import time
from collections.abc import Callable

from PySide6.QtCore import QObject, QTimer

INTERVAL_MS = 50  # at most one showing this often, while showing costs little (the workers send a batch each 33-50 ms)
LOAD = 10         # and LOAD times as long as the last showing took, or longer: a tenth of the window's time at most


class Pacer:
    """Calls `show` once for the batches that came since it last did: INTERVAL_MS after the first of them, or LOAD
    times as long as `show` took last, whichever is longer; at once on flush (the stream ended, or failed)."""

    def __init__(self, show: Callable[[], None], parent: QObject):
        self._show = show
        self.timer = QTimer(parent, singleShot=True, interval=INTERVAL_MS)
        self.timer.timeout.connect(self.flush)

    def schedule(self) -> None:
        """A batch came: shown at the next showing."""
        if not self.timer.isActive():
            self.timer.start()

    def cancel(self) -> None:
        """What came is shown otherwise (the whole text drawn again): no showing of it."""
        self.timer.stop()
        self.timer.setInterval(INTERVAL_MS)

    def flush(self) -> None:
        self.timer.stop()
        started = time.perf_counter()
        self._show()
        self.timer.setInterval(max(INTERVAL_MS, round(LOAD * 1000 * (time.perf_counter() - started))))
