"""Streaming model.onnx.data: tensors written one chunk at a time, TensorProtos that point at them.

A tensor is planned as a name, an ONNX element type, dims and a function that yields its bytes in
order as NumPy arrays (one expert, or a band of rows, at a time). Nothing holds more than one
chunk, so a 20 GB model is written with a few MB of memory.
"""

from __future__ import annotations

import math
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterable, Iterator

import numpy as np
import onnx
from onnx import helper

# Tensors of at least one page start on a page boundary, so a reader can mmap them (and their
# experts, whose strides are usually whole pages) directly; smaller tensors are aligned to 64 bytes.
PAGE_ALIGN = 4096
SMALL_ALIGN = 64
# the chunks write_tensors keeps queued for the disk while it makes the next one
WRITE_DEPTH = 3


@dataclass
class TensorPlan:
    name: str
    elem_type: int                                # onnx.TensorProto.FLOAT, FLOAT16, UINT8, ...
    dims: tuple[int, ...]
    chunks: Callable[[], Iterable[np.ndarray]]    # yields the tensor's bytes in order
    chunk_rows: int = 0                           # rows (of dims[0]) in its largest chunk; 0: one chunk of it all
    work: float = 1.0                             # the most memory making a chunk holds, in multiples of its bytes

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.dims:
            n *= int(d)
        return n * np.dtype(helper.tensor_dtype_to_np_dtype(self.elem_type)).itemsize

    @property
    def chunk_bytes(self) -> int:
        return self.nbytes * self.chunk_rows // self.dims[0] if self.chunk_rows else self.nbytes

    @property
    def work_bytes(self) -> int:
        """About the most memory making one of its chunks takes (the chunk and the arrays it is made from)."""
        return math.ceil(self.chunk_bytes * self.work)


def aligned(offset: int, nbytes: int) -> int:
    align = PAGE_ALIGN if nbytes >= PAGE_ALIGN else SMALL_ALIGN
    return -(-offset // align) * align


def external_tensor(plan: TensorPlan, location: str, offset: int) -> onnx.TensorProto:
    t = onnx.TensorProto()
    t.name = plan.name
    t.data_type = plan.elem_type
    t.dims.extend(int(d) for d in plan.dims)
    t.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(plan.nbytes))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    return t


def placed(plans: Iterable[TensorPlan]) -> Iterator[tuple[TensorPlan, int]]:
    """Each plan with its offset in model.onnx.data, as write_tensors places it."""
    end = 0
    for plan in plans:
        offset = aligned(end, plan.nbytes)
        yield plan, offset
        end = offset + plan.nbytes


def total_bytes(plans: Iterable[TensorPlan]) -> int:
    """The size model.onnx.data will have, alignment gaps included."""
    end = 0
    for plan, offset in placed(plans):
        end = offset + plan.nbytes
    return end


class _BackgroundWriter:
    """Writes chunks to f on one thread while the caller generates the next ones.

    At most `depth` chunks wait in the queue, so memory stays at a few chunks."""

    def __init__(self, f: BinaryIO, depth: int = WRITE_DEPTH):
        self._f = f
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-writer")
        self._pending: deque[Future] = deque()
        self._depth = depth

    def write(self, data) -> None:
        while len(self._pending) >= self._depth:
            self._pending.popleft().result()
        self._pending.append(self._pool.submit(self._f.write, data))

    def close(self) -> None:
        try:
            while self._pending:
                self._pending.popleft().result()
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)


def write_tensors(f: BinaryIO, plans: Iterable[TensorPlan], location: str,
                  on_bytes: Callable[[int], None] | None = None) -> list[onnx.TensorProto]:
    """Write each plan's bytes to f (opened at offset 0); returns their external TensorProtos."""
    end = 0
    np_types: dict[int, np.dtype] = {}
    tensors = []
    writer = _BackgroundWriter(f)
    try:
        for plan in plans:
            offset = aligned(end, plan.nbytes)
            if offset > end:
                writer.write(b"\0" * (offset - end))
            want = np_types.setdefault(plan.elem_type, np.dtype(helper.tensor_dtype_to_np_dtype(plan.elem_type)))
            written = 0
            for chunk in plan.chunks():
                chunk = np.ascontiguousarray(chunk)
                if chunk.dtype != want:
                    raise TypeError(f"{plan.name}: chunk dtype {chunk.dtype} != {want}")
                # as bytes (ml_dtypes float8 arrays have no buffer format); the view keeps the chunk alive
                writer.write(memoryview(chunk.reshape(-1).view(np.uint8)))
                written += chunk.nbytes
                if on_bytes is not None:
                    on_bytes(chunk.nbytes)
            if written != plan.nbytes:
                raise ValueError(f"{plan.name}: wrote {written} bytes, its shape {plan.dims} needs {plan.nbytes}")
            end = offset + written
            tensors.append(external_tensor(plan, location, offset))
    finally:
        writer.close()
    return tensors
