"""The bounded host cache of cold experts (host_expert_bytes).

Experts live in the memory-mapped weight file (allow_file_backing=1): the pages of an expert the
CPU computes come into this process's memory and stay there. This cache keeps the most recently
computed experts and tells the OS to drop the pages of the least recent ones once their bytes
pass host_expert_bytes, so the model's share of host memory stays bounded while the file backs
everything. An expert read from the file to be copied to the device leaves as soon as it is read,
unless the cache holds it (release_after_read). With allow_file_backing=0 every expert is copied
into RAM at load instead.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from engine.expert_node import ExpertNodeInfo
from engine.offload.config import OffloadConfig
from engine.onnx_file import OnnxFile


def file_backing_refusal(config: OffloadConfig, expert_bytes: int, available: int) -> str:
    """Why allow_file_backing=0 cannot keep `expert_bytes` of experts in host RAM ('' where it can): they must fit
    host_expert_bytes and the host memory `available` to copy them into (more and the copy ends in the OOM killer)."""
    if config.allow_file_backing:
        return ""
    said = f"allow_file_backing=0 keeps all {expert_bytes} bytes of experts in host memory, more than "
    if config.host_expert_bytes is not None and expert_bytes > config.host_expert_bytes:
        return said + f"host_expert_bytes={config.host_expert_bytes}"
    if expert_bytes > available:
        return said + f"the {available} bytes of host memory available"
    return ""


# How far beyond the bytes it reads a read of the mapped file may map pages: the kernel's fault-around and its mapping of
# a whole large folio of the page cache stay within the 2 MiB-aligned region (x86-64's PMD) of the page faulted on
# (64 KiB measured on the 2-core dev VM; 128 pages, a large folio, seen before: _release_uncached).
SPILL = 2 << 20


class HostExpertCache:
    def __init__(self, source: OnnxFile, infos: list[ExpertNodeInfo], budget_bytes: int | None):
        self.source, self.infos = source, infos
        self.budget = budget_bytes  # None: unbounded (the OS decides)
        self._lru: OrderedDict[tuple[int, int], int] = OrderedDict()
        self._held = self._none_held()  # the experts in _lru, by layer
        self._rows = [self._expert_rows(info) for info in infos]
        self.cached_bytes = 0
        self.evictions = 0

    def _none_held(self) -> list[np.ndarray]:
        return [np.zeros(info.spec.num_experts, bool) for info in self.infos]

    def _expert_rows(self, info: ExpertNodeInfo) -> list[tuple[str, int, int]]:
        """The node's tensors laid out [E, ...]: (name, bytes per expert, experts within SPILL of one's rows)."""
        rows = []
        for name in info.weight_inputs.values():
            nbytes = self.source.nbytes(name)
            per_expert = nbytes // info.spec.num_experts
            if per_expert and per_expert * info.spec.num_experts == nbytes:
                rows.append((name, per_expert, -(-SPILL // per_expert)))
        return rows

    def set_budget(self, budget_bytes: int | None) -> None:
        """A new host_expert_bytes. Bounding an unbounded cache drops every expert's pages first: while
        unbounded it kept no account of what the CPU read (nor did the load's prefault). A lower bound drops the least
        recent experts beyond it at once: the CPU may compute none for a long while (an idle model, all resident)."""
        if self.budget is None and budget_bytes is not None:
            for layer, info in enumerate(self.infos):
                for expert in range(info.spec.num_experts):
                    self._release(layer, expert, expert + 1)
            self._lru.clear()
            self._held = self._none_held()
            self.cached_bytes = 0
        self.budget = budget_bytes
        self._evict_beyond_budget()

    def touch(self, layer: int, experts) -> None:
        """The CPU just computed these experts of this layer (nothing to account while unbounded)."""
        if self.budget is None:
            return
        added = False
        for expert in experts:
            key = (layer, int(expert))
            if key in self._lru:
                self._lru.move_to_end(key)
                continue
            size = self.infos[layer].bytes_per_expert
            self._lru[key] = size
            self._held[layer][key[1]] = True
            self.cached_bytes += size
            added = True
        self._evict_beyond_budget()
        if added:
            self._release_uncached(layer)

    def _evict_beyond_budget(self) -> None:
        """The least recent experts' pages dropped until the rest fit the budget (the latest one kept whatever)."""
        while self.budget is not None and self.cached_bytes > self.budget and len(self._lru) > 1:
            (old_layer, old_expert), size = self._lru.popitem(last=False)
            self._held[old_layer][old_expert] = False
            self._release(old_layer, old_expert, old_expert + 1)
            self.cached_bytes -= size
            self.evictions += 1

    def release_after_read(self, layer: int, experts) -> None:
        """A copy to the device has read these experts of this layer from the mapped file (a packed copy or the pinned
        ring holds their rows now, then the device): their pages leave this process, and those the reads mapped around
        them (up to SPILL away), less what the cache holds for the CPU. An expert it holds is skipped: it was mapped
        already, so its read faulted nothing in around it. Nothing to do while unbounded (the OS decides)."""
        if self.budget is None:
            return
        held = self._held[layer]
        read = sorted({int(expert) for expert in experts if not held[expert]})
        for name, per_expert, reach in self._rows[layer]:
            first = end = 0
            for expert in read:  # the reaches of experts near each other merged: a range released once
                if expert - reach > end:
                    self._release_gaps(layer, name, per_expert, first, end)
                    first = expert - reach
                end = min(held.size, expert + 1 + reach)
            self._release_gaps(layer, name, per_expert, first, end)

    def _release_uncached(self, layer: int) -> None:
        """Drop the pages of this layer's experts the cache does not hold. Reading an expert maps the pages around
        those it faults on (the kernel's fault-around: 16 pages, or a whole large folio of the page cache, 128 on
        Linux 6.18), which spill into its neighbours uncounted: 38 MB of experts mapped under host_expert_bytes=16 MiB."""
        for name, per_expert, _reach in self._rows[layer]:
            self._release_gaps(layer, name, per_expert, 0, self._held[layer].size)

    def _release_gaps(self, layer: int, name: str, per_expert: int, first: int, end: int) -> None:
        """Drop the pages of one tensor's rows of the experts in [first, end) the cache does not hold."""
        for held in (np.flatnonzero(self._held[layer][first:end]) + first).tolist() + [end]:
            if held > first:
                self.source.release_pages(name, first * per_expert, (held - first) * per_expert)
            first = held + 1

    def _release(self, layer: int, first: int, end: int) -> None:
        """Drop the pages of experts [first, end) of this layer."""
        for name, per_expert, _reach in self._rows[layer]:
            self.source.release_pages(name, first * per_expert, (end - first) * per_expert)
