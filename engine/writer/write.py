"""write_model: a random-weight MoE model folder in onnxruntime-genai builder format, streamed."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from engine.writer.external_data import WRITE_DEPTH, TensorPlan, external_tensor, placed, total_bytes, write_tensors
from engine.writer.folder_files import genai_config, readme, spec_json
from engine.writer.graph import build_graph, make_model
from engine.writer.spec import WriterSpec
from engine.writer.tokenizer_files import tokenizer_files

DATA_NAME = "model.onnx.data"
# the files write_model writes, each under its name and PARTIAL until every one is written
FILE_NAMES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", DATA_NAME, "model.onnx",
              "genai_config.json", "README.txt")
PARTIAL = ".partial"
# model.onnx is one protobuf message, which protobuf does not serialize past 2 GiB
PROTOBUF_LIMIT = (2 << 30) - 1
# write_model holds the graph whole (its node and tensor plans, the ModelProto made of them, its serialized bytes):
# measured, about 24 times model.onnx's size (146 KiB a layer for its 6.0 KiB), with some room over that
GRAPH_MEMORY_FACTOR = 28


@dataclass(frozen=True)
class WriteSizes:
    data_bytes: int  # model.onnx.data
    graph_bytes: int  # model.onnx, about (a layer's names grow with its number's digits)
    # the weights streamed: the most memory making a chunk takes beside the largest chunks queued for the disk (a
    # chunk is an expert or a band of rows: --hidden 10000000 made an expert of 1.2 GiB, and ran out of memory after
    # writing for minutes), and the tensor of the largest chunk
    stream_bytes: int = 0
    largest: TensorPlan | None = None

    @property
    def memory_bytes(self) -> int:
        """About the most memory write_model holds: the graph whole, and the weights a chunk at a time."""
        return self.graph_bytes * GRAPH_MEMORY_FACTOR + self.stream_bytes

    @property
    def graph_memory_bytes(self) -> int:
        return self.graph_bytes * GRAPH_MEMORY_FACTOR


def write_sizes(spec: WriterSpec) -> WriteSizes:
    """What writing this spec takes, without writing anything: counted on graphs of at most four layers, each layer
    after the first adding as much as the one before (a sliding window's layers alternate: counted in pairs). A
    graph of every layer holds about 146 KiB a layer: a mistyped --layers filled the memory before the disk's free
    space was checked."""
    spec.validate()
    if spec.layers <= 4:
        return _sizes(spec)
    two, four = _sizes(replace(spec, layers=2)), _sizes(replace(spec, layers=4))
    pairs = (spec.layers - 2) / 2
    return WriteSizes(two.data_bytes + (spec.layers - 2) * (four.data_bytes - two.data_bytes) // 2,
                      two.graph_bytes + round(pairs * (four.graph_bytes - two.graph_bytes)), four.stream_bytes,
                      four.largest)  # (every layer's tensors are a layer's of four)


def _sizes(spec: WriterSpec) -> WriteSizes:
    plan = build_graph(spec)  # (plans of tensors, none made: nothing held in proportion to a size)
    initializers = [external_tensor(tensor, DATA_NAME, offset) for tensor, offset in placed(plan.tensors)]
    largest = max(plan.tensors, key=lambda tensor: tensor.chunk_bytes)
    stream = max(tensor.work_bytes for tensor in plan.tensors) + WRITE_DEPTH * largest.chunk_bytes
    return WriteSizes(total_bytes(plan.tensors), make_model(plan, initializers, "", {}).ByteSize(), stream, largest)


def model_data_bytes(spec: WriterSpec) -> int:
    """The size model.onnx.data will have for this spec, without writing anything."""
    return write_sizes(spec).data_bytes


def write_model(folder: str | Path, spec: WriterSpec,
                progress: Callable[[float], None] | None = None) -> Path:
    """Write model.onnx, model.onnx.data, genai_config.json, tokenizer files and README.txt.

    The weights are streamed to model.onnx.data one expert (or band of rows) at a time; only the
    graph proto, which holds no weights, is built in memory. progress, when given, is called with
    the fraction written so far (0.0 .. 1.0). Returns the folder.
    """
    spec.validate()
    folder = Path(folder)

    texts, tokenizer_size = tokenizer_files(spec.vocab_size, spec.context_length)
    plan = build_graph(spec)
    data_bytes = total_bytes(plan.tensors)

    done = 0
    last_reported = -1.0

    def on_bytes(n: int) -> None:
        nonlocal done, last_reported
        done += n
        frac = done / data_bytes if data_bytes else 1.0
        if progress is not None and (frac - last_reported >= 0.005 or frac >= 1.0):
            last_reported = frac
            progress(min(frac, 1.0))

    made = [path for path in (folder, *folder.parents) if not path.exists()]  # (innermost first)
    folder.mkdir(parents=True, exist_ok=True)
    partials = []

    def partial(name: str) -> Path:
        partials.append(folder / (name + PARTIAL))
        return partials[-1]

    # a write that fails partway (a full disk, Ctrl-C) leaves the folder as it was: the model files there are
    # replaced only once every new one is written, and what this write made is removed
    try:
        for name, text in texts.items():
            partial(name).write_text(text, encoding="utf-8")
        if progress is not None:
            progress(0.0)
        with open(partial(DATA_NAME), "wb") as f:
            initializers = write_tensors(f, plan.tensors, DATA_NAME, on_bytes)

        doc = "Random-weight MoE model written by MoE Workbench's writer. " + (spec.description or "")
        model = make_model(plan, initializers, doc.strip(),
                           {"moe_workbench.writer_spec": spec_json(spec),
                            "moe_workbench.tokenizer_size": str(tokenizer_size)})
        partial("model.onnx").write_bytes(model.SerializeToString())
        partial("genai_config.json").write_text(json.dumps(genai_config(spec), indent=4) + "\n", encoding="utf-8")
        partial("README.txt").write_text(readme(spec, data_bytes), encoding="utf-8")
        for path in partials:
            os.replace(path, path.with_name(path.name.removesuffix(PARTIAL)))
    except BaseException:
        for path in partials:
            path.unlink(missing_ok=True)
        for made_folder in made:
            with contextlib.suppress(OSError):  # (one that holds files written there meanwhile stays)
                made_folder.rmdir()
        raise
    if progress is not None and last_reported < 1.0:
        progress(1.0)
    return folder


def unfinished_files(folder: str | Path) -> list[str]:
    """The partial files in `folder` that a write killed before it could remove them left there."""
    return [name + PARTIAL for name in FILE_NAMES if (Path(folder) / (name + PARTIAL)).exists()]
