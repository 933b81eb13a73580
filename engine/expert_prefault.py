"""Mapping the experts' pages into this process after load, in the background.

Expert weights are read from the memory-mapped weight file, and the first read of each 4 KiB page faults. Until
every expert has been computed once, decode steps wait on those faults: on the dev VM the first tokens of a
gpt-oss-20b-shaped layer took 8-12 ms against 5.5 ms once the experts had been read. One MADV_POPULATE_READ call
maps a whole range (~10 GB/s from the page cache), so a thread does that for the experts right after load, and
tokens run at their steady speed sooner.

Only where the experts' host memory is not bounded (host_expert_bytes auto: the OS decides), and only as many
bytes as the machine has available: the bounded host cache releases the pages of experts it evicts, and pages it
never saw computed would escape its count (a bound set on the loaded model stops it: OffloadEngine).
"""

from __future__ import annotations

import threading
import weakref

import psutil

from engine.errors import ModelFileError
from engine.expert_node import ExpertNodeInfo
from engine.onnx_file import OnnxFile

CHUNK = 64 << 20      # bytes per call (the call itself runs without the interpreter: OnnxFile.populate_pages)
AVAILABLE_SHARE = 0.8  # of the memory available at load, at most, is populated


def expert_ranges(source: OnnxFile, infos: list[ExpertNodeInfo]) -> list[tuple[str, int, int]]:
    """(initializer, start, length) pieces of at most CHUNK bytes covering every expert weight tensor, layer by
    layer (the order decode reads them)."""
    ranges = []
    for info in infos:
        for name in info.weight_inputs.values():
            if not source.is_external(name):
                continue
            size = source.nbytes(name)
            ranges += [(name, start, min(CHUNK, size - start)) for start in range(0, size, CHUNK)]
    return ranges


class ExpertPrefault:
    """The background thread. `done` is set when it has finished, stopped, found the system cannot populate
    (`supported` False) or found the data file truncated since the load (`error`: check_mapped_files' line)."""

    def __init__(self, source: OnnxFile, infos: list[ExpertNodeInfo], available: int | None = None):
        self._source = weakref.ref(source)  # an unloaded model's mapping is not kept alive by this thread
        limit = int(AVAILABLE_SHARE * (psutil.virtual_memory().available if available is None else available))
        self.ranges, total = [], 0
        for piece in expert_ranges(source, infos):
            if total + piece[2] > limit:
                break
            self.ranges.append(piece)
            total += piece[2]
        self.populated_bytes = 0
        self.supported = True
        self.error: str | None = None
        self.done = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="expert-prefault", daemon=True)

    def start(self) -> "ExpertPrefault":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Map no more pages: returns once the thread has finished (its call in progress: CHUNK bytes at most)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        try:
            for name, start, length in self.ranges:
                source = self._source()
                if source is None or self._stop.is_set():
                    return
                try:
                    populated = source.populate_pages(name, start, length)
                    if not populated:  # a range past a truncated file's end fails the call too (EFAULT): said as that
                        source.check_mapped_files()
                except ModelFileError as exc:
                    self.error = str(exc)
                    return
                if not populated:
                    self.supported = False
                    return
                self.populated_bytes += length
                del source
        finally:
            self.done.set()
