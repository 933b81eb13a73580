"""The bounded host cache of cold experts (host_expert_bytes).

Experts live in the memory-mapped weight file (allow_file_backing=1): the pages of an expert the
CPU computes come into this process's memory and stay there. This cache keeps the most recently
computed experts and tells the OS to drop the pages of the least recent ones once their bytes
pass host_expert_bytes, so the model's share of host memory stays bounded while the file backs
everything. With allow_file_backing=0 every expert is copied into RAM at load instead.
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


class HostExpertCache:
    def __init__(self, source: OnnxFile, infos: list[ExpertNodeInfo], budget_bytes: int | None):
        self.source, self.infos = source, infos
        self.budget = budget_bytes  # None: unbounded (the OS decides)
        self._lru: OrderedDict[tuple[int, int], int] = OrderedDict()
        self._cached: list[set[int]] = [set() for _ in infos]  # the experts in _lru, by layer
        self.cached_bytes = 0
        self.evictions = 0

    def set_budget(self, budget_bytes: int | None) -> None:
        """A new host_expert_bytes. Bounding an unbounded cache drops every expert's pages first: while
        unbounded it kept no account of what the CPU read (nor did the load's prefault)."""
        if self.budget is None and budget_bytes is not None:
            for layer, info in enumerate(self.infos):
                for expert in range(info.spec.num_experts):
                    self._release(layer, expert, expert + 1)
            self._lru.clear()
            self._cached = [set() for _ in self.infos]
            self.cached_bytes = 0
        self.budget = budget_bytes

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
            self._cached[layer].add(key[1])
            self.cached_bytes += size
            added = True
        while self.budget is not None and self.cached_bytes > self.budget and len(self._lru) > 1:
            (old_layer, old_expert), size = self._lru.popitem(last=False)
            self._cached[old_layer].discard(old_expert)
            self._release(old_layer, old_expert, old_expert + 1)
            self.cached_bytes -= size
            self.evictions += 1
        if added:
            self._release_uncached(layer)

    def _release_uncached(self, layer: int) -> None:
        """Drop the pages of this layer's experts the cache does not hold. Reading an expert maps the pages around
        those it faults on (the kernel's fault-around: 16 pages, or a whole large folio of the page cache, 128 on
        Linux 6.18), which spill into its neighbours uncounted: 38 MB of experts mapped under host_expert_bytes=16 MiB."""
        cached, count, first = self._cached[layer], self.infos[layer].spec.num_experts, None
        for expert in range(count + 1):
            held = expert == count or expert in cached
            if not held and first is None:
                first = expert
            elif held and first is not None:
                self._release(layer, first, expert)
                first = None

    def _release(self, layer: int, first: int, end: int) -> None:
        """Drop the pages of experts [first, end) of this layer."""
        info = self.infos[layer]
        for tensor in info.weight_inputs.values():
            nbytes = self.source.nbytes(tensor)
            per_expert = nbytes // info.spec.num_experts
            if per_expert * info.spec.num_experts == nbytes:  # tensors laid out [E, ...]
                self.source.release_pages(tensor, first * per_expert, (end - first) * per_expert)
