"""model.onnx read without its weights, and its external data mapped, never copied.

The graph proto is small; the weights stay in model.onnx.data. Expert weights are handed out as
read-only memory-mapped views, so a model larger than RAM opens.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import onnx
from onnx import numpy_helper

from engine.errors import ModelFileError, lfs_pointer, no_link_loop, not_a_file


class DataFileChanged(ModelFileError):
    """A mapped data file cut short or written to in place since the model was loaded (OnnxFile.check_mapped_files);
    `change` says which, in those words."""

    def __init__(self, message: str, change: str):
        super().__init__(message)
        self.change = change


@dataclass(frozen=True)
class ExternalRef:
    location: str
    offset: int
    length: int


def _external_ref(tensor: onnx.TensorProto) -> ExternalRef | None:
    """Where an initializer's values are (None: inline). Its offset and length were checked when the file was
    opened (OnnxFile._check_external_data)."""
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return None
    fields = {entry.key: entry.value for entry in tensor.external_data}
    return ExternalRef(fields.get("location", ""), int(fields.get("offset", 0)), int(fields.get("length", -1)))


def inside_folder(folder: Path, relative: str) -> bool:
    """Whether `relative` names a file within `folder`, symbolic links followed: a model folder is read whole and
    nothing outside it (an absolute path, '..', or a link out of it)."""
    if not relative or Path(relative).is_absolute() or ".." in Path(relative).parts:
        return False
    root = no_link_loop(Path(folder)).resolve()
    return no_link_loop(root / relative).resolve().is_relative_to(root)


def _constant_to_initializer(node: onnx.NodeProto) -> onnx.TensorProto | None:
    """A Constant node holding a tensor, as an initializer of the same name (None for other forms)."""
    for attr in node.attribute:
        if attr.name == "value":
            tensor = onnx.TensorProto()
            tensor.CopyFrom(attr.t)
        elif attr.name in ("value_float", "value_floats", "value_int", "value_ints"):
            value = onnx.helper.get_attribute_value(attr)
            dtype = np.float32 if attr.name.startswith("value_float") else np.int64
            tensor = numpy_helper.from_array(np.array(value, dtype=dtype))
        else:
            continue
        tensor.name = node.output[0]
        return tensor
    return None


# Linux's value (5.14+); Python < 3.13 does not name it. Other systems have no such advice.
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22) if sys.platform == "linux" else None


def _libc_madvise():
    """libc's madvise through ctypes, which lets go of the interpreter during the call: mmap.madvise holds it, and a
    populate reads tens of MB (from disk where the page cache lacks them), all that time stopping every other
    Python thread (the engine's decode, the GUI) at its next bytecode. None where there is no libc to ask."""
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_MADVISE = _libc_madvise() if MADV_POPULATE_READ is not None else None


def populate(mapping: mmap.mmap, offset: int, length: int) -> bool:
    """MADV_POPULATE_READ on bytes [offset, offset + length) of a mapping (offset page-aligned), the interpreter
    free meanwhile. False where the system cannot (older kernels, other systems)."""
    if _MADVISE is None:
        return False
    view = np.frombuffer(mapping, np.uint8)  # for the mapping's address only
    base = view.ctypes.data
    del view  # no buffer export kept on the mapping
    return _MADVISE(base + offset, length, MADV_POPULATE_READ) == 0


class OnnxFile:
    """The graph of model.onnx, its initializers by name, and mapped views of its external data."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.folder = self.path.parent
        if not self.path.is_file():
            raise ModelFileError(f"{self.path}: {not_a_file(self.path)}")
        try:
            self.proto = onnx.load(str(self.path), load_external_data=False)
        except OSError as exc:
            raise ModelFileError(f"{self.path}: not readable ({exc.strerror or exc})") from None
        except Exception as exc:  # protobuf's DecodeError and friends
            reason = lfs_pointer(self.path) or f"not a valid ONNX model ({type(exc).__name__}: {exc})"
            raise ModelFileError(f"{self.path}: {reason}") from None
        if not self.proto.graph.node:
            raise ModelFileError(f"{self.path}: the ONNX graph has no nodes (corrupt or empty model)")
        self._check_text()
        self._fold_constants()
        self.initializers: dict[str, onnx.TensorProto] = {t.name: t for t in self.proto.graph.initializer}
        self._maps: dict[str, mmap.mmap] = {}
        # each data file's modification time when the folder was opened, which its mapping (made at the load, later)
        # and every check of the mapped files after it (check_mapped_files) are held against
        self._opened_mtimes: dict[str, int] = {}
        self._mapped_files: dict[str, BinaryIO] = {}  # each mapped data file, kept open (check_mapped_files)
        # each initializer's external data (None: inline), parsed once: release_pages runs at every copy of an expert
        # to the device under a bounded host cache (HostExpertCache), and parsing took 2.5 of its 4 µs
        self._refs: dict[str, ExternalRef | None] = {}
        self._data_needs: dict[str, int] = {}  # each external data file's bytes its initializers take, to the last
        self._declared_shapes: dict[str, tuple] | None = None  # declared_shape's, read at first use
        self._check_initializers()
        self._check_external_data()

    def _check_text(self) -> None:
        """Every name and location the graph holds is UTF-8 text. protobuf hands one that is not (a damaged byte) as
        bytes, which failed later as a name no node produces, an operator "b'Si\\x9bmoid'" onnxruntime lacks, or an
        internal error (a data file's location)."""
        def shown(value) -> str:
            return value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else value

        graph = self.proto.graph
        fields = [(f"a graph {kind}'s name", value.name)
                  for kind, values in (("input", graph.input), ("output", graph.output),
                                       ("value_info", graph.value_info)) for value in values]
        for node in graph.node:
            where = f"node '{shown(node.name)}'"
            fields += [("a node's name", node.name), (f"{where} operator", node.op_type),
                       (f"{where} domain", node.domain)]
            fields += [(f"{where} input {i}", name) for i, name in enumerate(node.input)]
            fields += [(f"{where} output {i}", name) for i, name in enumerate(node.output)]
        for tensor in graph.initializer:
            fields.append(("an initializer's name", tensor.name))
            fields += [(f"initializer '{shown(tensor.name)}' external data {shown(entry.key)}", entry.value)
                       for entry in tensor.external_data]
        for what, value in fields:
            if isinstance(value, bytes):
                raise ModelFileError(f"{self.path}: {what} '{shown(value)}' is not UTF-8 text")

    def _check_initializers(self) -> None:
        """Each initializer of a data type ONNX defines, its inline values filling its shape, and its external data's
        offset and length whole numbers of bytes, so that nothing later fails on them without naming them."""
        for tensor in self.initializers.values():
            try:
                self.tensor_dtype(tensor)
            except (KeyError, TypeError, ValueError):
                raise ModelFileError(f"{self.path}: initializer '{tensor.name}' has data type {tensor.data_type}, "
                                     "which is no tensor type ONNX defines") from None
            if any(dim < 0 for dim in tensor.dims):
                raise ModelFileError(f"{self.path}: initializer '{tensor.name}' has shape {list(tensor.dims)}, a "
                                     "negative dimension")
            if tensor.data_location != onnx.TensorProto.EXTERNAL:
                try:  # its values fill its shape (onnxruntime refuses them at load, our kernels misread them)
                    numpy_helper.to_array(tensor)
                except (ValueError, TypeError) as exc:
                    raise ModelFileError(f"{self.path}: initializer '{tensor.name}' holds values that do not fill its "
                                         f"shape {list(tensor.dims)} ({exc})") from None
                continue
            for entry in tensor.external_data:
                if entry.key in ("offset", "length") and not (entry.value.isdigit() and entry.value.isascii()):
                    raise ModelFileError(f"{self.path}: initializer '{tensor.name}' has external data {entry.key} "
                                         f"{entry.value!r}, not a number of bytes")

    def _fold_constants(self) -> None:
        """Turn Constant nodes into initializers so every partition can read them without a cut."""
        graph = self.proto.graph
        kept = []
        for node in graph.node:
            tensor = _constant_to_initializer(node) if node.op_type == "Constant" and node.domain in ("", "ai.onnx") else None
            if tensor is None:
                kept.append(node)
            else:
                graph.initializer.append(tensor)
        del graph.node[:]
        graph.node.extend(kept)

    def _check_external_data(self) -> None:
        sizes: dict[str, int] = {}
        for tensor in self.initializers.values():
            ref = self._refs[tensor.name] = _external_ref(tensor)
            if ref is None:
                continue
            data_path = self.folder / ref.location
            if ref.location not in sizes:  # each data file checked once (a model has thousands of initializers)
                if not inside_folder(self.folder, ref.location):
                    raise ModelFileError(
                        f"{self.path}: initializer '{tensor.name}' points outside the model folder ('{ref.location}')")
                if not data_path.is_file():
                    raise ModelFileError(f"{data_path}: {not_a_file(data_path)} (external data of initializer '{tensor.name}')")
                try:
                    with open(data_path, "rb") as data:  # read when mapped: said now, not at the load
                        stat = os.fstat(data.fileno())
                except OSError as exc:
                    raise ModelFileError(f"{data_path}: not readable ({exc.strerror or exc})") from None
                sizes[ref.location], self._opened_mtimes[ref.location] = stat.st_size, stat.st_mtime_ns
            expected = self.tensor_nbytes(tensor)
            length = expected if ref.length < 0 else ref.length
            if length != expected:
                raise ModelFileError(
                    f"{data_path}: initializer '{tensor.name}' has length {length} but its shape needs {expected} bytes")
            if ref.offset + length > sizes[ref.location]:
                if pointer := lfs_pointer(data_path):
                    raise ModelFileError(f"{data_path}: {pointer}")
                raise ModelFileError(
                    f"{data_path}: truncated: initializer '{tensor.name}' needs bytes {ref.offset}..{ref.offset + length} "
                    f"but the file has {sizes[ref.location]}")
            self._data_needs[ref.location] = max(self._data_needs.get(ref.location, 0), ref.offset + length)

    @staticmethod
    def tensor_dtype(tensor: onnx.TensorProto) -> np.dtype:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))

    @classmethod
    def tensor_nbytes(cls, tensor: onnx.TensorProto) -> int:
        count = math.prod(tensor.dims)  # Python's integers: a shape past int64 is not wrapped round
        return count * cls.tensor_dtype(tensor).itemsize

    def declared_shape(self, name: str) -> tuple | None:
        """The shape the graph declares for tensor `name` (its inputs, outputs and value_info: the builder writes them),
        each dimension a number or a symbolic name; None where it declares none."""
        if self._declared_shapes is None:
            graph = self.proto.graph
            self._declared_shapes = {
                info.name: tuple(d.dim_value if d.HasField("dim_value") else d.dim_param or None
                                 for d in info.type.tensor_type.shape.dim)
                for info in (*graph.input, *graph.value_info, *graph.output)
                if info.type.tensor_type.HasField("shape") and info.type.tensor_type.shape.dim}
        return self._declared_shapes.get(name)

    def external_location(self, name: str) -> str | None:
        """The data file (relative to the model folder) holding an initializer's values; None when inline."""
        ref = self._refs[name]
        return None if ref is None else ref.location

    def is_external(self, name: str) -> bool:
        return self._refs[name] is not None

    def nbytes(self, name: str) -> int:
        return self.tensor_nbytes(self.initializers[name])

    def mapping(self, location: str) -> mmap.mmap:
        """The read-only memory mapping of an external data file (made at first use, kept)."""
        mapping = self._maps.get(location)
        if mapping is None:
            path = self.folder / location
            try:
                data = open(path, "rb")
            except OSError as exc:  # removed or made unreadable since it was checked
                raise ModelFileError(f"{path}: not readable ({exc.strerror or exc})") from None
            try:
                stat = os.fstat(data.fileno())
                size, needs = stat.st_size, self._data_needs[location]
                if size < needs:  # rewritten since it was checked
                    raise ModelFileError(f"{path}: truncated since the model folder was opened: it has {size} bytes "
                                         f"of the {needs} its initializers take")
                if stat.st_mtime_ns != self._opened_mtimes[location]:  # other bytes than the folder was opened with
                    raise ModelFileError(f"{path}: changed since the model folder was opened (written to or replaced): "
                                         "open the model again to load what it holds now")
                mapping = mmap.mmap(data.fileno(), 0, access=mmap.ACCESS_READ)
            except BaseException:
                data.close()
                raise
            # kept open for check_mapped_files: its fstat is the mapped file's, wherever its path leads now (closed
            # with this object: an open file collected unclosed warns)
            weakref.finalize(self, data.close)
            self._maps[location] = mapping
            self._mapped_files[location] = data
        return mapping

    def check_mapped_files(self) -> None:
        """Refuse, naming the file, where a mapped data file was truncated since it was mapped (the folder rewritten in
        place): a read past its new end kills the process (SIGBUS); or written to in place at any size (its
        modification time other than when the folder was opened): the mapping shows the new bytes, so the weights
        would change under the loaded model unsaid. A file deleted or replaced by another keeps its mapping whole, the
        loaded file's bytes: the file kept open is the mapped one, not the path's. One fstat a mapped file, about 4 µs
        on the dev VM (the size alone, mmap.size, took 2): the decoder checks before every step."""
        for location, data in self._mapped_files.items():
            stat = os.fstat(data.fileno())
            if stat.st_size < self._data_needs[location]:
                raise self._cut_short(location, stat.st_size)
            if stat.st_mtime_ns != self._opened_mtimes[location]:
                raise DataFileChanged(f"{self.folder / location}: changed since the model was loaded (written to in "
                                      "place); load the model again", "written to in place")

    def _cut_short(self, location: str, size: int) -> DataFileChanged:
        return DataFileChanged(f"{self.folder / location}: truncated since the model was loaded: it has {size} bytes "
                               f"of the {self._data_needs[location]} its initializers take; load the model again",
                               "cut short")

    def array(self, name: str) -> np.ndarray:
        """The initializer's values: a read-only memory-mapped view for external data (no copy)."""
        tensor = self.initializers[name]
        ref = self._refs[name]
        if ref is None:
            return numpy_helper.to_array(tensor)
        dtype = self.tensor_dtype(tensor)
        count = self.tensor_nbytes(tensor) // dtype.itemsize
        view = np.frombuffer(self.mapping(ref.location), dtype=dtype, count=count, offset=ref.offset)
        return view.reshape(tuple(tensor.dims))

    def populate_pages(self, name: str, start: int, length: int) -> bool:
        """Map the pages of bytes [start, start + length) of an external initializer into this process now
        (MADV_POPULATE_READ, Linux 5.14+: read from the file where not in the page cache) instead of one fault
        per page at first use, without holding the interpreter meanwhile. False where the system cannot (older
        kernels, other systems)."""
        ref = self._refs[name]
        if ref is None:
            return False
        begin = ref.offset + start
        first = begin // mmap.PAGESIZE * mmap.PAGESIZE  # every page the range touches
        return populate(self.mapping(ref.location), first, begin + length - first)

    def release_pages(self, name: str, start: int, length: int) -> None:
        """Let the OS drop the mapped pages of bytes [start, start + length) of an external
        initializer from this process (they are read back from the file when next touched)."""
        ref = self._refs[name]
        if ref is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        begin = ref.offset + start
        first = -(-begin // mmap.PAGESIZE) * mmap.PAGESIZE          # whole pages inside the range only
        last = (begin + length) // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first:
            self.mapping(ref.location).madvise(mmap.MADV_DONTNEED, first, last - first)
