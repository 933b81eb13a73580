"""Page-locking the experts' file mapping for the GPU's copies (cudaHostRegister), in the background.

A copy from pageable memory (the memory-mapped weight file) goes through the driver's bounce buffer, or the CPU
first gathers or packs the expert into the pinned staging ring: the CPU that computes the cold experts spends its
memory bandwidth on it (anchors.md: 9.6 against 32.4 GB/s published; 8 against 54 GB/s measured by llama.cpp on the
H200 machine). Registered in place, the mapping is page-locked and the GPU reads experts straight from it, a DMA
at PCIe speed: a prefill wave's rows and a copied miss's raw rows go over without the CPU touching them.

It locks the experts' pages in RAM, so only where they fit and the OS already decides what stays in memory
(host_expert_bytes auto, file backing on; the caller checks), and only up to a share of the memory available. A
large model takes seconds to register (every page is read in and locked), so a thread does it after load;
copies go through the staging ring until it is done. Registration is undone when its owner (the loaded model)
goes away, before the mapping can be unmapped: this object keeps the mapping alive until then; or earlier, for
good, when host_expert_bytes is bounded on the loaded model (undo): madvise cannot release locked pages, so the
bounded host cache could not keep its bound.
"""

from __future__ import annotations

import mmap
import threading
import weakref

import numpy as np
import psutil

AVAILABLE_SHARE = 0.8  # of the memory available at load, at most, is locked
PORTABLE, READ_ONLY = 1, 8  # cudaHostRegister flags: every context may use it; the mapping is read-only


class HostRegistration:
    """The regions of a model's data files that hold its experts, registered with CUDA by a thread.

    `ready` is set when the thread has finished (`registered` says whether it succeeded, `reason` why not).
    `covers(array)` says whether an array's memory lies in a registered region."""

    def __init__(self, cp, device_index: int, regions: list[tuple[object, int, int]], owner,
                 available: int | None = None):
        """`regions`: (buffer keeping the memory alive, address, bytes), page-aligned; `owner`: the object whose
        end undoes the registration."""
        self.cp, self.device_index = cp, device_index
        self.total = sum(size for _, _, size in regions)
        limit = AVAILABLE_SHARE * (psutil.virtual_memory().available if available is None else available)
        self.registered = False
        self.reason = ""
        self.ready = threading.Event()
        self._regions = regions
        self._done: list[int] = []  # addresses registered so far
        self._bounds = np.zeros((0, 2), np.int64)
        if self.total > limit:
            self.reason = (f"the experts' {self.total / 1e9:.1f} GB exceed {AVAILABLE_SHARE:.0%} of the memory "
                           f"available ({limit / AVAILABLE_SHARE / 1e9:.1f} GB)")
            self.ready.set()
            return
        self._finalizer = weakref.finalize(owner, HostRegistration._undo, cp, device_index, self._done, regions)
        threading.Thread(target=self._run, name="expert-host-register", daemon=True).start()

    def _run(self) -> None:
        try:
            with self.cp.cuda.Device(self.device_index):
                for _, address, size in self._regions:
                    if not self._finalizer.alive:
                        return  # the model went away meanwhile: its finalizer has undone what was done
                    self.cp.cuda.runtime.hostRegister(address, size, PORTABLE | READ_ONLY)
                    self._done.append(address)
                    if not self._finalizer.alive:  # ... while this one was being registered
                        HostRegistration._undo(self.cp, self.device_index, self._done, self._regions)
                        return
            self._bounds = np.array([(a, a + s) for _, a, s in self._regions], np.int64)
            self.registered = True
        except Exception as exc:  # noqa: BLE001 - the driver refused (no read-only registration, limits): reported
            self.reason = f"cudaHostRegister refused the experts' mapping ({str(exc).splitlines()[0]})"
            HostRegistration._undo(self.cp, self.device_index, self._done, self._regions)
        finally:
            self.ready.set()

    def undo(self, why: str) -> None:
        """Unregister now, for good (`why`: the setting that asks it, for describe). A thread still at work stops at
        its next check (the finalizer is no longer alive); the region whose cudaHostRegister it is inside, it
        unregisters itself once the call returns, and this waits for that: once this returns, no page of the mapping
        is locked."""
        if self.ready.is_set() and not self.registered:
            return  # refused, or undone already: nothing is registered
        self._finalizer()  # undoes what is registered so far
        self.ready.wait()
        self.registered = False
        self.reason = f"{why}, so the experts' file mapping is no longer page-locked"

    def covers(self, array: np.ndarray) -> bool:
        """The array's bytes lie in a registered region (False until registration has finished)."""
        if not self.registered or not isinstance(array, np.ndarray):
            return False
        start = array.ctypes.data
        end = start + array.nbytes
        return bool(np.any((self._bounds[:, 0] <= start) & (end <= self._bounds[:, 1])))

    def describe(self) -> str:
        if not self.ready.is_set():
            return f"page-locking the experts' file mapping for the GPU's copies ({self.total / 1e9:.1f} GB) ..."
        if self.registered:
            return f"the experts' file mapping is page-locked: the GPU copies experts from it directly ({self.total / 1e9:.1f} GB)"
        return f"expert copies go through the pinned staging ring: {self.reason}"

    @staticmethod
    def _undo(cp, device_index: int, done: list[int], regions) -> None:
        """Unregister what was registered; `regions` (held until here) keeps the mappings alive until then."""
        with cp.cuda.Device(device_index):
            while done:
                try:
                    cp.cuda.runtime.hostUnregister(done.pop())
                except Exception:  # noqa: BLE001 - process teardown: the driver may be gone already
                    pass


def mapping_regions(source, infos) -> list[tuple[object, int, int]]:
    """(mapping, page-aligned address, bytes) of each data file of `source` (an OnnxFile) that holds expert
    weights of `infos`; the whole file, rounded up to whole pages."""
    regions, seen = [], set()
    for info in infos:
        for name in info.weight_inputs.values():
            location = source.external_location(name)
            if location is None or location in seen:
                continue
            seen.add(location)
            mapping = source.mapping(location)
            address = np.frombuffer(mapping, np.uint8).ctypes.data
            size = -(-len(mapping) // mmap.PAGESIZE) * mmap.PAGESIZE
            regions.append((mapping, address, size))
    return regions
