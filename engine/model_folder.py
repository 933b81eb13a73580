"""A model folder opened for inspection: config, tokenizer, graph and expert nodes; no sessions yet."""

from __future__ import annotations

import errno
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import psutil

from engine.decoder_state import DecoderState, check_kv_head_size, check_window_attention
from engine.errors import ModelFileError, UnsupportedModelError, no_link_loop
from engine.expert_node import ExpertNodeInfo, describe_expert_node
from engine.genai_config import GenaiConfig, load_genai_config
from engine.onnx_file import OnnxFile, inside_folder
from engine.ort_env import unknown_operator, unloadable_versions
from engine.partition import Plan, plan_partition
from engine.tokenizer import ModelTokenizer


def folder_path(folder: str | Path) -> Path:
    """`folder` resolved, checked to be a folder (a model's: its files are checked as they are read)."""
    path = no_link_loop(Path(folder).expanduser()).resolve()
    if not path.is_dir():
        raise ModelFileError(f"{path}: {'not a folder' if path.exists() else 'no such folder'} (point at the folder "
                             "holding genai_config.json and model.onnx)")
    if not os.access(path, os.R_OK | os.X_OK):
        raise ModelFileError(f"{path}: not readable ({os.strerror(errno.EACCES)})")
    return path


@dataclass
class ModelFolder:
    folder: Path
    config: GenaiConfig
    tokenizer: ModelTokenizer
    onnx: OnnxFile
    plan: Plan
    experts: list[ExpertNodeInfo]

    @classmethod
    def open(cls, folder: str | Path) -> "ModelFolder":
        folder = folder_path(folder)
        config = load_genai_config(folder)
        tokenizer = ModelTokenizer(folder)
        if not inside_folder(folder, config.filename):
            raise ModelFileError(f"{folder / 'genai_config.json'}: model.decoder.filename '{config.filename}' is not a "
                                 "file inside the model folder")
        source = OnnxFile(folder / config.filename)
        versions = unloadable_versions(source.proto)
        if versions:
            raise UnsupportedModelError(f"{source.path}: {versions}")
        initializers = set(source.initializers)
        try:
            plan = plan_partition(source.proto.graph, initializers, config.inputs.get("attention_mask"))
        except ValueError as exc:
            raise ModelFileError(f"{source.path}: {exc}") from None
        unknown = unknown_operator(node for segment in plan.segments for node in segment.nodes)
        if unknown:
            raise UnsupportedModelError(f"{source.path}: {unknown}")
        experts = [describe_expert_node(step.node, step.layer, source) for step in plan.expert_steps]
        for name, count in Counter(info.name for info in experts).items():
            if count > 1:  # the engine keys a node's slots, placement and settings by its name
                raise ModelFileError(f"{source.path}: {count} expert nodes are named '{name}'; each needs a name "
                                     "of its own")
        if config.outputs.get("logits", "logits") not in {o.name for o in source.proto.graph.output}:
            raise ModelFileError(f"{source.path}: the graph has no output named '{config.outputs.get('logits')}'")
        state = DecoderState(config, source.proto.graph)  # genai_config's past and present names match the graph's
        state.check_window(psutil.virtual_memory().total)
        check_kv_head_size(config, source.proto.graph)
        check_window_attention(config, source.proto.graph)
        return cls(folder, config, tokenizer, source, plan, experts)

    @property
    def logits_name(self) -> str:
        return self.config.outputs.get("logits", "logits")

    @property
    def vocabulary(self) -> int | None:
        """How many token ids the model takes: the rows of the embedding its graph gathers input_ids from, else the
        vocabulary its logits declare; None where the graph says neither."""
        graph, ids = self.onnx.proto.graph, self.config.inputs.get("input_ids", "input_ids")
        for node in graph.node:
            if node.op_type in ("Gather", "GatherBlockQuantized") and list(node.input[1:2]) == [ids]:
                axis = next((a.i for a in node.attribute if a.name in ("axis", "gather_axis")), 0)
                table = self.onnx.initializers.get(node.input[0])
                if table is not None and axis == 0 and table.dims:
                    return int(table.dims[0])
        shape = self.onnx.declared_shape(self.logits_name)
        return shape[-1] if shape and isinstance(shape[-1], int) and shape[-1] > 0 else None

    @property
    def eos_warnings(self) -> list[str]:
        """The end-of-text tokens genai_config.json and tokenizer_config.json name that no answer can end on: an id
        past the model's vocabulary, a text that is no token of tokenizer.json. onnxruntime-genai loads such a model
        (its answers then run to their length), so the engine does too, and says so rather than nothing."""
        vocabulary = self.vocabulary or self.tokenizer.vocab_size
        said = [f"{self.folder / 'genai_config.json'}: model.eos_token_id {token} is past the model's vocabulary of "
                f"{vocabulary} tokens: no answer ends on it" for token in self.config.eos_token_ids
                if token >= vocabulary]
        text = self.tokenizer.eos_token
        if text is not None and self.tokenizer.token_id(text) is None:
            said.append(f"{self.folder / 'tokenizer_config.json'}: eos_token {json.dumps(text)} is no token of "
                        "tokenizer.json: no answer ends on it")
        return said

    @property
    def expert_bytes(self) -> int:
        return sum(info.weight_bytes for info in self.experts)

    @property
    def dense_bytes(self) -> int:
        """Bytes of every initializer that onnxruntime loads (all but the expert weights)."""
        expert_tensors = {t for info in self.experts for t in info.weight_inputs.values()}
        return sum(self.onnx.nbytes(name) for name in self.onnx.initializers if name not in expert_tensors)

    def unsupported(self) -> list[str]:
        return [info.unsupported for info in self.experts if info.unsupported]
