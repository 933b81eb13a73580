"""genai_config.json, the description onnxruntime-genai's builder writes beside model.onnx."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import ModelFileError, no_link_loop, not_a_file, read_model_json
from engine.units import INT64_MAX


@dataclass(frozen=True)
class SearchDefaults:
    max_length: int = 2048  # the longest sequence, prompt and answer: load_genai_config reads 0 or none as the context
    min_length: int = 0  # no end of text while the sequence, prompt and answer, is shorter
    random_seed: int = -1  # the sampler's seed where the user gives none; -1: a fresh one each time
    num_beams: int = 1  # above 1: beam search, which the engine does not do (beam_search_note)
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    past_present_share_buffer: bool = True


@dataclass(frozen=True)
class GenaiConfig:
    path: Path
    model_type: str
    filename: str
    context_length: int
    vocab_size: int
    num_layers: int
    hidden_size: int
    head_size: int
    num_heads: int
    num_kv_heads: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    inputs: dict[str, str]
    outputs: dict[str, str]
    sliding_window_size: int | None = None
    sliding_window_layers: tuple[int, ...] | None = ()  # None: every layer (a sliding_window that lists none)
    sliding_cache_slack: int = 0
    search: SearchDefaults = field(default_factory=SearchDefaults)

    @property
    def longest_sequence(self) -> int:
        """The most tokens a conversation reaches, prompt and answer: search.max_length, within the context. What the
        KV cache is sized for, as onnxruntime-genai allocates it for max_length (never past the context)."""
        return min(self.search.max_length, self.context_length)

    @property
    def longest_sequence_words(self) -> str:
        """Which bound longest_sequence is, for a memory estimate's text."""
        if self.search.max_length < self.context_length:
            return (f"search.max_length's {self.search.max_length} tokens "
                    f"(below the {self.context_length}-token context)")
        return f"the full {self.context_length}-token context"

    def is_sliding(self, layer: int) -> bool:
        """Whether layer `layer`'s KV cache is a window of sliding_window_size (+ slack) slots. A sliding_window that
        lists no layers applies to every layer, as onnxruntime-genai reads it (its uniform window, from before the
        builder wrote the list)."""
        return bool(self.sliding_window_size) and (self.sliding_window_layers is None
                                                   or layer in self.sliding_window_layers)

    def state_pairs(self) -> list[tuple[str, str, str]]:
        """(kind, input pattern, output pattern) for every past/present kind the config names, e.g.
        ("key", "past_key_values.%d.key", "present.%d.key")."""
        pairs = []
        for key, pattern in self.inputs.items():
            if key.startswith("past_") and key.endswith("_names"):
                kind = key[len("past_"):-len("_names")]
                out = self.outputs.get(f"present_{kind}_names")
                if out is None:
                    raise ModelFileError(
                        f"{self.path}: decoder.inputs.{key} has no matching decoder.outputs.present_{kind}_names")
                pairs.append((kind, pattern, out))
        return pairs


def _require(obj: dict, key: str, path: Path, where: str):
    if key not in obj:
        raise ModelFileError(f"{path}: missing '{where}{key}'")
    return obj[key]


def _object(obj: dict, key: str, path: Path, where: str, required: bool = True) -> dict:
    """obj[key] as a JSON object (missing or null where not required: empty); an error names the field."""
    value = _require(obj, key, path, where) if required else obj.get(key)
    if value is None and not required:
        return {}
    if not isinstance(value, dict):
        raise ModelFileError(f"{path}: '{where}{key}' is {json.dumps(value)[:40]}, not a JSON object")
    return value


def _integer(obj: dict, key: str, path: Path, where: str, default: int | None = None, minimum: int = 0,
             maximum: int | None = None) -> int:
    """obj[key] as an integer of at least `minimum` and at most `maximum` (missing or null: `default`, or required when
    None); an error names the field and its value."""
    value = _require(obj, key, path, where) if default is None else obj.get(key)
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float)
                                                                          and not value.is_integer()):
        raise ModelFileError(f"{path}: '{where}{key}' is {value!r}, not an integer")
    if value < minimum:
        raise ModelFileError(f"{path}: '{where}{key}' is {value}, less than {minimum}")
    if maximum is not None and value > maximum:
        raise ModelFileError(f"{path}: '{where}{key}' is {value}, more than {maximum}")
    return int(value)


def _field(obj: dict, key: str, path: Path, where: str, default, accepts, what: str):
    """obj[key] where `accepts` it (missing or null: `default`: builders run with transformers 5 write null for a
    setting the model leaves unset); an error names the field, its value and `what` it should be."""
    value = obj.get(key)
    if value is None:
        return default
    if not accepts(value):
        raise ModelFileError(f"{path}: '{where}{key}' is {json.dumps(value)[:40]}, not {what}")
    return value


def _text(obj: dict, key: str, path: Path, where: str, default: str) -> str:
    return _field(obj, key, path, where, default, lambda value: isinstance(value, str), "a string")


def _names(obj: dict, key: str, path: Path, where: str) -> dict[str, str]:
    """decoder.inputs or .outputs: {role: graph name or %d pattern}, each name a string."""
    section = _object(obj, key, path, where)
    return {str(role): _text(section, role, path, f"{where}{key}.", "")
            for role in section if section[role] is not None}


def _token_id(obj: dict, key: str, path: Path, where: str) -> int | None:
    return _field(obj, key, path, where, None,
                  lambda value: isinstance(value, int) and not isinstance(value, bool) and value >= 0, "a token id")


def _number(obj: dict, key: str, path: Path, where: str, default: float) -> float:
    return float(_field(obj, key, path, where, default, lambda value: isinstance(value, (int, float))
                        and not isinstance(value, bool) and math.isfinite(value), "a number"))


def _flag(obj: dict, key: str, path: Path, where: str, default: bool) -> bool:
    return _field(obj, key, path, where, default, lambda value: isinstance(value, bool), "true or false")


def _layers(sliding: dict, path: Path, where: str) -> tuple[int, ...] | None:
    """sliding_window.layers: the layer indices with a window; None where it lists none (missing, null or [])."""
    layers = sliding.get("layers")
    if layers is None or layers == []:
        return None
    if not isinstance(layers, list) or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers):
        raise ModelFileError(f"{path}: '{where}layers' is {json.dumps(layers)[:40]}, not a list of layer indices")
    return tuple(layers)


def model_folders_inside(folder: Path, most: int = 4) -> str:
    """The folders one or two levels below `folder` that hold a genai_config.json, as paths relative to it ('' where
    none do): a downloaded repository keeps its models there (cpu_and_mobile/cpu-int4-.../)."""
    found = sorted({config.parent.relative_to(folder).as_posix()
                    for pattern in ("*/genai_config.json", "*/*/genai_config.json") for config in folder.glob(pattern)})
    return ", ".join(found[:most]) + (", …" if len(found) > most else "")


def load_genai_config(folder: Path) -> GenaiConfig:
    path = Path(folder) / "genai_config.json"
    if not no_link_loop(path).is_file():
        inside = model_folders_inside(Path(folder))
        raise ModelFileError(f"{path}: {not_a_file(path)} (a model folder from onnxruntime-genai's builder has one"
                             + (f"; model folders in this one: {inside}" if inside else "") + ")")
    raw = read_model_json(path)
    try:
        if not isinstance(raw, dict):
            raise ModelFileError(f"{path}: not a JSON object")
        model = _object(raw, "model", path, "")
        decoder = _object(model, "decoder", path, "model.")
        search = _object(raw, "search", path, "", required=False)
        eos = model.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        if any(isinstance(e, bool) or not isinstance(e, int) or e < 0 for e in eos_ids):
            raise ModelFileError(f"{path}: 'model.eos_token_id' is {json.dumps(eos)[:40]}, not token ids")
        sliding = _object(decoder, "sliding_window", path, "model.decoder.", required=False)
        defaults = SearchDefaults()
        context_length = _integer(model, "context_length", path, "model.", minimum=1)
        num_layers = _integer(decoder, "num_hidden_layers", path, "model.decoder.", default=0)
        sliding_layers = _layers(sliding, path, "model.decoder.sliding_window.")
        # a window for a layer the model lacks: a layer index typed wrong, whose own layer runs without its window
        beyond = [i for i in sliding_layers or () if num_layers and i >= num_layers]
        if beyond:
            raise ModelFileError(f"{path}: 'model.decoder.sliding_window.layers' names layer {beyond[0]}; "
                                 f"'model.decoder.num_hidden_layers' is {num_layers} (layers 0 to {num_layers - 1})")
        return GenaiConfig(
            path=path,
            model_type=_text(model, "type", path, "model.", "unknown"),
            filename=_text(decoder, "filename", path, "model.decoder.", "model.onnx"),
            context_length=context_length,
            vocab_size=_integer(model, "vocab_size", path, "model.", default=0),
            num_layers=num_layers,
            hidden_size=_integer(decoder, "hidden_size", path, "model.decoder.", default=0),
            head_size=_integer(decoder, "head_size", path, "model.decoder.", default=0),
            num_heads=_integer(decoder, "num_attention_heads", path, "model.decoder.", default=0),
            num_kv_heads=_integer(decoder, "num_key_value_heads", path, "model.decoder.", default=0),
            bos_token_id=_token_id(model, "bos_token_id", path, "model."),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            pad_token_id=_token_id(model, "pad_token_id", path, "model."),
            inputs=_names(decoder, "inputs", path, "model.decoder."),
            outputs=_names(decoder, "outputs", path, "model.decoder."),
            sliding_window_size=_integer(sliding, "window_size", path, "model.decoder.sliding_window.", default=0)
            or None,
            sliding_window_layers=sliding_layers,
            sliding_cache_slack=_integer(sliding, "cache_slack", path, "model.decoder.sliding_window.", default=0),
            search=SearchDefaults(
                max_length=_integer(search, "max_length", path, "search.", default=0) or context_length,
                min_length=_integer(search, "min_length", path, "search.", default=defaults.min_length),
                random_seed=_integer(search, "random_seed", path, "search.", default=defaults.random_seed, minimum=-1,
                                     maximum=INT64_MAX),  # (a sampled record keeps it)
                num_beams=_integer(search, "num_beams", path, "search.", default=defaults.num_beams, minimum=1),
                do_sample=_flag(search, "do_sample", path, "search.", defaults.do_sample),
                temperature=_number(search, "temperature", path, "search.", defaults.temperature),
                top_k=_integer(search, "top_k", path, "search.", default=defaults.top_k, maximum=INT64_MAX),
                top_p=_number(search, "top_p", path, "search.", defaults.top_p),
                repetition_penalty=_number(search, "repetition_penalty", path, "search.", defaults.repetition_penalty),
                past_present_share_buffer=_flag(search, "past_present_share_buffer", path, "search.",
                                                defaults.past_present_share_buffer),
            ),
        )
    except (TypeError, ValueError, AttributeError) as exc:
        raise ModelFileError(f"{path}: malformed ({exc})") from None
