"""The decoder's inputs and state fed the way onnxruntime-genai feeds them.

KV caches are fixed-capacity buffers that onnxruntime writes in place (past and present bound to
the same memory); sliding-window layers get a buffer of window_size slots; conv and recurrent
state use two buffers that swap after each step. Position ids are 1-D/2-D or MRoPE's [3, B, S].
The buffers live where the dense part runs (engine/array_backend.py: NumPy on the host, CuPy on a
CUDA device) and are bound to onnxruntime by pointer.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import onnx

from engine.array_backend import NUMPY, ArrayBackend
from engine.errors import ModelFileError, PromptError
from engine.genai_config import GenaiConfig
from engine.units import counted, human_bytes

CAPACITY_STEP = 256
KV_KINDS = {"key", "value"}  # genai_config's past_key_names / past_value_names


def grown_capacity(needed: int, capacity: int, longest: int) -> int:
    """The rows a full-attention KV buffer of `capacity` rows grows to when a step needs `needed` (> capacity): at
    least twice what it held, so that a long answer copies its KV a few times rather than at every step, in
    CAPACITY_STEP steps, never past the longest sequence (GenaiConfig.longest_sequence) unless a step needs more."""
    return max(needed, min(longest, -(-max(needed, 2 * capacity) // CAPACITY_STEP) * CAPACITY_STEP))


def kv_rows_at_most(tokens: int, longest: int) -> int:
    """The most rows a full-attention KV buffer can reach while a conversation holds at most `tokens` tokens
    (grown_capacity's doubling: nearly twice `tokens`, e.g. 7,680 rows for 4,096 tokens, reached by a 3,840-token
    prompt and one more token). What a memory estimate for `tokens` must count."""
    below = (tokens - 1) // CAPACITY_STEP * CAPACITY_STEP  # the largest capacity that still grows for `tokens`
    return grown_capacity(tokens, below, longest)


@dataclass(frozen=True)
class StateSnapshot:
    """A conversation's state at one point, in host memory: full-attention KV up to that point, sliding-window KV and
    conv/recurrent state whole (they cannot be cut back to an earlier point, only restored whole)."""
    past_length: int
    arrays: tuple


@dataclass
class StateSlot:
    past_name: str
    present_name: str
    layer: int
    shared: bool  # KV: past and present are one buffer written in place
    sliding: bool
    array: object  # what the next step reads as past (a NumPy or CuPy array)
    spare: object | None = None  # where a swapped state's present goes

    @property
    def present(self):
        """The buffer the step writes: the past buffer itself for KV (in place), the spare otherwise."""
        return self.array if self.shared else self.spare


def _np_dtype(value_info: onnx.ValueInfoProto) -> np.dtype:
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(value_info.type.tensor_type.elem_type))


def _pattern_regex(pattern: str) -> re.Pattern:
    return re.compile("^" + re.escape(pattern).replace("%d", r"(\d+)") + "$")


def check_kv_head_size(config: GenaiConfig, graph: onnx.GraphProto) -> None:
    """genai_config.json's head_size, which sizes a KV cache whose graph input leaves its last dimension symbolic (the
    builder's 'kv_cache_dim'), held against the GroupQueryAttention node that reads that cache: its output, as the graph
    declares it, is num_heads heads of that size. A missing or wrong one failed only at the first step, in
    onnxruntime's words, naming neither the file nor the field."""
    inputs = {value.name: value for value in graph.input}
    declared = {value.name: value.type.tensor_type.shape.dim for value in (*graph.value_info, *graph.output)}
    for node in graph.node:
        if node.op_type != "GroupQueryAttention" or len(node.input) < 4 or node.input[3] not in inputs:
            continue
        dims = inputs[node.input[3]].type.tensor_type.shape.dim
        if len(dims) != 4 or dims[3].HasField("dim_value"):
            continue
        if not config.head_size:
            raise ModelFileError(f"{config.path}: missing 'model.decoder.head_size', which sizes the KV cache "
                                 f"'{node.input[3]}' (its last dimension is '{dims[3].dim_param}' in the graph)")
        heads = next((attr.i for attr in node.attribute if attr.name == "num_heads"), 0)
        output = declared.get(node.output[0]) if node.output else None
        width = output[-1].dim_value if output and output[-1].HasField("dim_value") else 0
        if heads > 0 and width and width != heads * config.head_size:
            raise ModelFileError(f"{config.path}: 'model.decoder.head_size' is {config.head_size}, but node "
                                 f"'{node.name}' attends with heads of {width / heads:g} (its output has {width} "
                                 f"values over its {heads} heads)")


def check_window_attention(config: GenaiConfig, graph: onnx.GraphProto) -> None:
    """genai_config.json's sliding-window layers held against the GroupQueryAttention nodes that read their KV caches:
    a node that attends over more tokens than the window's cache holds (local_window_size, or the context where it is
    -1) outgrows that cache, which onnxruntime refused only at the step that filled it, naming neither the file nor
    the field (and inspect said the model runs)."""
    window = (config.sliding_window_size or 0) + config.sliding_cache_slack
    keys = [_pattern_regex(pattern) for kind, pattern, _ in config.state_pairs() if kind == "key"]
    for node in graph.node:
        if node.op_type != "GroupQueryAttention" or len(node.input) < 4:
            continue
        match = next((found for regex in keys if (found := regex.match(node.input[3]))), None)
        if match is None or not config.is_sliding(int(match.group(1))):
            continue
        local = next((attr.i for attr in node.attribute if attr.name == "local_window_size"), -1)
        if (config.context_length if local < 0 else local) > window:
            attends = (f"the whole context of {config.context_length:,} tokens" if local < 0
                       else f"the last {local:,} tokens")
            raise ModelFileError(f"{config.path}: 'model.decoder.sliding_window' makes layer {match.group(1)}'s KV "
                                 f"cache '{node.input[3]}' {window:,} slots, but node '{node.name}' attends over "
                                 f"{attends} (its local_window_size is {local})")


class DecoderState:
    """Everything that carries over between steps for one conversation (batch size 1)."""

    def __init__(self, config: GenaiConfig, graph: onnx.GraphProto, backend: ArrayBackend | None = None):
        self.config = config
        self.backend = backend or NUMPY
        self.past_length = 0
        self.graph_inputs = {i.name: i for i in graph.input}
        self.input_ids_name = config.inputs.get("input_ids", "input_ids")
        self.mask_name = config.inputs.get("attention_mask")
        self.position_name = config.inputs.get("position_ids")
        self._slots: list[StateSlot] = []
        self._kv_capacity = 0
        # the step inputs' types, read from the graph once (onnx's type lookup cost ~15 µs per decode step, issue #4)
        mask, position = self.graph_inputs.get(self.mask_name), self.graph_inputs.get(self.position_name)
        self._mask_dtype = _np_dtype(mask) if mask is not None else None
        self._position_dtype = _np_dtype(position) if position is not None else None
        self._mrope = position is not None and len(position.type.tensor_type.shape.dim) == 3
        self._match_state_inputs(graph)

    # --- construction -------------------------------------------------------------------------
    def _match_state_inputs(self, graph: onnx.GraphProto) -> None:
        pairs = [(_pattern_regex(p), o, kind in KV_KINDS) for kind, p, o in self.config.state_pairs()]
        outputs = {o.name for o in graph.output}
        known = {self.input_ids_name, self.mask_name, self.position_name}
        for name, info in self.graph_inputs.items():
            if name in known:
                continue
            for regex, out_pattern, is_kv in pairs:
                match = regex.match(name)
                if match:
                    layer = int(match.group(1))
                    present = out_pattern.replace("%d", str(layer))
                    if present not in outputs:
                        raise ModelFileError(f"{self.config.path}: state input '{name}' has no output '{present}' in the graph")
                    sliding = is_kv and self.config.is_sliding(layer)
                    self._slots.append(StateSlot(name, present, layer, is_kv, sliding, None))
                    break
            else:
                raise ModelFileError(
                    f"{self.config.path}: graph input '{name}' is neither a genai_config input nor a past-state pattern")
        # a window for a layer the graph lacks (load_genai_config checks this against num_hidden_layers, where given):
        # a layer index typed wrong, whose own layer runs without its window
        layers = 1 + max((slot.layer for slot in self._slots), default=-1)
        beyond = [i for i in self.config.sliding_window_layers or () if not self.config.num_layers and i >= layers]
        if beyond:
            raise ModelFileError(f"{self.config.path}: 'model.decoder.sliding_window.layers' names layer {beyond[0]}; "
                                 f"the graph's past-state inputs are of layers 0 to {layers - 1} (genai_config.json "
                                 "gives no 'model.decoder.num_hidden_layers')")
        self._by_past = {slot.past_name: slot for slot in self._slots}
        self._by_present = {slot.present_name: slot for slot in self._slots}
        for slot in self._slots:
            if not slot.shared:
                shape, dtype = self._fixed_shape(slot.past_name), _np_dtype(self.graph_inputs[slot.past_name])
                slot.array = self.backend.zeros(shape, dtype)
                slot.spare = self.backend.zeros(shape, dtype)

    def _fixed_shape(self, name: str) -> tuple[int, ...]:
        dims = self.graph_inputs[name].type.tensor_type.shape.dim
        shape = []
        for position, dim in enumerate(dims):
            if dim.HasField("dim_value"):
                shape.append(dim.dim_value)
            elif position == 0:
                shape.append(1)  # batch
            else:
                raise ModelFileError(f"{self.config.path}: state input '{name}' has a symbolic dimension '{dim.dim_param}'")
        return tuple(shape)

    def _kv_shape(self, slot: StateSlot, capacity: int) -> tuple[int, ...]:
        dims = self.graph_inputs[slot.past_name].type.tensor_type.shape.dim
        heads = dims[1].dim_value or self.config.num_kv_heads
        head_size = dims[3].dim_value or self.config.head_size
        return (1, heads, capacity, head_size)

    def full_context_bytes(self) -> tuple[int, int]:
        """(bytes of every state buffer with full-attention KV at the longest sequence (the context, or
        search.max_length below it: GenaiConfig.longest_sequence), bytes of the
        largest single KV buffer): a conversation's state at its largest, and the extra a KV buffer
        needs for a moment while it grows (old and new both held, one layer at a time)."""
        window = (self.config.sliding_window_size or 0) + self.config.sliding_cache_slack
        total = largest = 0
        for slot in self._slots:
            itemsize = _np_dtype(self.graph_inputs[slot.past_name]).itemsize
            if slot.shared:
                nbytes = int(np.prod(self._kv_shape(slot, window if slot.sliding else self.config.longest_sequence))) * itemsize
                largest = max(largest, nbytes)
            else:
                nbytes = 2 * int(np.prod(self._fixed_shape(slot.past_name))) * itemsize
            total += nbytes
        return total, largest

    def check_window(self, memory: int) -> None:
        """genai_config.json's sliding window held against the machine's `memory`: it sizes its layers' KV caches
        whatever the context, and caches larger than the memory cannot be made (they failed at the first step). Checked
        at open (ModelFolder.open), so that inspect says what generate would."""
        window = (self.config.sliding_window_size or 0) + self.config.sliding_cache_slack
        caches = [slot for slot in self._slots if slot.shared and slot.sliding]
        needed = sum(math.prod(self._kv_shape(slot, window)) * _np_dtype(self.graph_inputs[slot.past_name]).itemsize
                     for slot in caches)
        if needed > memory:
            raise ModelFileError(
                f"{self.config.path}: 'model.decoder.sliding_window' makes {counted(len(caches), 'KV cache')} "
                f"('{caches[0].past_name}', …) of {window:,} slots each (window_size "
                f"{self.config.sliding_window_size:,} and cache_slack {self.config.sliding_cache_slack:,}), which "
                f"take more than this machine's {human_bytes(memory)} of memory")

    def kv_dtypes(self) -> set[np.dtype]:
        """The element types of the KV caches (what GroupQueryAttention reads and writes in place)."""
        return {_np_dtype(self.graph_inputs[slot.past_name]) for slot in self._slots if slot.shared}

    # --- per step ------------------------------------------------------------------------------
    @property
    def slots(self) -> list[StateSlot]:
        return self._slots

    def slot_for_past(self, name: str) -> StateSlot | None:
        return self._by_past.get(name)

    def slot_for_present(self, name: str) -> StateSlot | None:
        return self._by_present.get(name)

    def reserve(self, new_tokens: int) -> None:
        """Make the KV buffers hold past + new_tokens, growing full-attention buffers if needed."""
        needed = self.past_length + new_tokens
        if needed > self.config.context_length:
            raise PromptError(
                f"the conversation needs {needed} tokens but the model's context is {self.config.context_length}")
        if needed <= self._kv_capacity:
            return
        capacity = grown_capacity(needed, self._kv_capacity, self.config.longest_sequence)
        # the whole window even where the context is shorter: GroupQueryAttention refuses a sliding-window buffer
        # smaller than its local_window_size
        window = (self.config.sliding_window_size or 0) + self.config.sliding_cache_slack
        for slot in self._slots:
            if not slot.shared:
                continue
            slot_capacity = window if slot.sliding else capacity
            if slot.array is not None and slot.array.shape[2] == slot_capacity:
                continue
            grown = self.backend.zeros(self._kv_shape(slot, slot_capacity),
                                       _np_dtype(self.graph_inputs[slot.past_name]))
            if slot.array is not None:
                self.backend.copy_prefix(grown, slot.array, min(self.past_length, slot.array.shape[2]))
            slot.array = grown  # the old buffer goes now: one layer's old and new held at a time
        self._kv_capacity = capacity

    def step_inputs(self, token_ids: list[int] | np.ndarray) -> dict[str, np.ndarray]:
        """input_ids, attention_mask and position ids for the next step (not the state); new arrays at every step."""
        ids = np.asarray(token_ids, dtype=np.int64).reshape(1, -1)
        count = ids.shape[1]
        self.reserve(count)
        feeds = {self.input_ids_name: ids}
        total = self.past_length + count
        if self._mask_dtype is not None:
            feeds[self.mask_name] = np.ones((1, total), dtype=self._mask_dtype)
        if self._position_dtype is not None:
            positions = np.arange(self.past_length, total, dtype=self._position_dtype).reshape(1, count)
            if self._mrope:  # MRoPE: temporal, height, width all text positions
                positions = np.broadcast_to(positions, (3, 1, count)).copy()
            feeds[self.position_name] = positions
        return feeds

    def advance(self, count: int) -> None:
        for slot in self._slots:
            if not slot.shared:
                slot.array, slot.spare = self.backend.swap(slot.array, slot.spare)
        self.past_length += count

    def _kept(self, slot: StateSlot):
        """What a snapshot keeps of a slot (a view, no copy): full-attention KV to the past length, any other state
        whole; None for a KV buffer not made yet (no step reserved it)."""
        if slot.array is None:
            return None
        return slot.array[:, :, :self.past_length] if slot.shared and not slot.sliding else slot.array

    def snapshot_bytes(self) -> int:
        """The host memory snapshot() takes now."""
        return sum(view.nbytes for view in map(self._kept, self._slots) if view is not None)

    def snapshot(self) -> StateSnapshot:
        return StateSnapshot(self.past_length, tuple(None if view is None else self.backend.to_host(view)
                                                     for view in map(self._kept, self._slots)))

    def restore(self, snapshot: StateSnapshot) -> None:
        """The state as `snapshot` holds it, written into the buffers in place (their bindings stay), which are at
        least as large as then: a snapshot is restored to the state it was taken of, which only grows."""
        for slot, array in zip(self._slots, snapshot.arrays):
            if array is not None:
                self.backend.load(slot.array, array)
        self.past_length = snapshot.past_length

    def reset(self) -> None:
        self.past_length = 0
        for slot in self._slots:
            if not slot.shared:
                self.backend.fill_zero(slot.array)
                self.backend.fill_zero(slot.spare)
