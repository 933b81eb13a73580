"""The offload configuration, in onnxruntime 1.32's vocabulary: `session.moe.offload.*` keys and
value formats (shared/reference/offload-keys.md), so a configuration tuned here means the same
thing to onnxruntime's own offload. Short names (without the prefix) are accepted too.
"""

from __future__ import annotations

import difflib
import math
import re
import struct
from dataclasses import dataclass, field, fields, replace

from engine.errors import WorkbenchError
from engine.units import UINT64_MAX, parse_bytes

PREFIX = "session.moe.offload."
PROTOTYPE_PREFIX = "session.moe.cpu_offload."  # the offload prototype's keys, which onnxruntime 1.32 discards
ALIASES = {"gpu_budget_bytes": "device_expert_bytes"}
# keys that only mean something where a device holds experts: without one (every expert on the CPU) they do nothing
# (cpu_execution and async_max_tokens say where cold experts run beside the device, tail substitution replaces a cold
# expert by a resident one)
DEVICE_KEYS = frozenset({"device_expert_bytes", "reserve_device_bytes", "gpu_device_mem_limit", "pinned_bytes",
                         "device_working_bytes", "placement", "prefill_wave_experts", "node_overrides",
                         "popularity_file", "tail_substitution_threshold", "tail_substitution_min_rank",
                         "cpu_execution", "async_max_tokens"})
# approximate routing's keys: it drops or substitutes cold experts in hybrid offload, so under mode=disabled (no offload,
# every expert where the dense part runs) they do nothing and routing is exact
ROUTING_KEYS = frozenset({"min_expert_weight", "skip_tail_cold_only", "tail_substitution_threshold",
                          "tail_substitution_min_rank"})
# approximate routing's settings that narrow another (which does nothing while off): narrowing -> narrowed
NARROWING = {"skip_tail_cold_only": "min_expert_weight", "tail_substitution_min_rank": "tail_substitution_threshold"}
# keys onnxruntime takes that this engine has no use for: host scratch it sizes itself, budgets shared across sessions
# (one model runs here), weights and derived layouts read and made in place, and a CPU doorbell it does not have;
# they are kept in the configuration, so that it goes to onnxruntime whole
UNUSED_KEYS = frozenset({"host_working_bytes", "budget_group", "source_root", "derived_cache_dir",
                         "skip_zero_cold_doorbell"})
PATH_KEYS = ("popularity_file", "source_root", "derived_cache_dir")  # the keys whose value is a file or folder


def short_key(key: str) -> str:
    """`session.moe.offload.mode` or `mode` (or an alias) as the short name."""
    key = key[len(PREFIX):] if key.startswith(PREFIX) else key
    return ALIASES.get(key, key)


def keys_among(entries, group: frozenset) -> list[str]:
    """The short names of `entries`' keys (any naming) that are in `group` (DEVICE_KEYS, UNUSED_KEYS), sorted."""
    return sorted({short_key(key) for key in entries} & group)
AUTO = None  # how 'auto' is held for byte budgets


class OffloadConfigError(WorkbenchError):
    """An offload key or value onnxruntime would refuse."""


@dataclass(frozen=True)
class NodeOverride:
    max_resident_slots: int | None = None
    device_expert_bytes: int | None = None


@dataclass(frozen=True)
class OffloadConfig:
    mode: str = "auto"                      # disabled | auto | required
    placement: str = "adaptive"             # static | adaptive
    cpu_execution: str = "auto"             # auto | enabled | disabled
    device_expert_bytes: int | None = AUTO
    reserve_device_bytes: int | None = AUTO
    gpu_device_mem_limit: int = 0           # 0 = no limit
    host_expert_bytes: int | None = AUTO
    pinned_bytes: int | None = AUTO
    device_working_bytes: int | None = None
    host_working_bytes: int | None = None
    allow_file_backing: bool = True
    cpu_threads: int = 0                    # 0 = automatic (engine/kernel_threads.py)
    async_max_tokens: int = 8
    prefill_wave_experts: int = 8
    node_overrides: dict[str, NodeOverride] = field(default_factory=dict)
    popularity_file: str | None = None
    budget_group: str | None = None
    source_root: str | None = None
    derived_cache_dir: str | None = None
    min_expert_weight: float = 0.0
    skip_tail_cold_only: bool = False
    skip_zero_cold_doorbell: bool = False
    tail_substitution_threshold: float = 0.0
    tail_substitution_min_rank: int = 1

    @property
    def approximate_routing(self) -> bool:
        """Routing drops or substitutes experts: asked for, and offload on (mode=disabled routes exactly)."""
        asked = self.min_expert_weight > 0 or self.tail_substitution_threshold > 0
        return asked and self.mode != "disabled"

    def idle_routing_settings(self) -> list[str]:
        """Approximate routing's settings (as key=value) that mode=disabled leaves without effect; none otherwise."""
        if self.mode != "disabled":
            return []
        return [f"{short_key(key)}={value}" for key, value in self.to_entries().items() if short_key(key) in ROUTING_KEYS]

    def unpaired_routing_settings(self) -> list[tuple[str, str]]:
        """Approximate routing's settings (as key=value) that only narrow another which is off, so do nothing, each
        with the one it narrows: skip_tail_cold_only without min_expert_weight, tail_substitution_min_rank without
        tail_substitution_threshold. None under mode=disabled, where none of them applies (idle_routing_settings)."""
        if self.mode == "disabled":
            return []
        given = {short_key(key): value for key, value in self.to_entries().items()}
        return [(f"{key}={given[key]}", narrowed) for key, narrowed in NARROWING.items()
                if key in given and narrowed not in given]

    @classmethod
    def from_entries(cls, entries: dict[str, str], also_known: tuple[str, ...] = ()) -> "OffloadConfig":
        """From key=value entries, full (`session.moe.offload.mode`) or short (`mode`) names. `also_known`: the names
        the caller takes beside these entries (a side-by-side B's layer_split), which an unknown key's hint offers."""
        values, given_as = {}, {}
        for raw_key, raw_value in entries.items():
            key = short_key(raw_key)
            parser = _PARSERS.get(key)
            if parser is None and raw_key.startswith(PROTOTYPE_PREFIX):
                rest = raw_key[len(PROTOTYPE_PREFIX):]
                raise OffloadConfigError(f"unknown offload key '{raw_key}': the offload prototype's prefix, which "
                                         "onnxruntime 1.32 discards; " + (
                                             f"its name now is '{PREFIX}{rest}'" if short_key(rest) in _PARSERS
                                             else f"{PREFIX}* has no '{rest}'"))
            if parser is None:
                names = [*_PARSERS, *ALIASES, *also_known]
                near = difflib.get_close_matches(key, names, n=1)
                raise OffloadConfigError(f"unknown offload key '{raw_key}'" + (
                    f": did you mean '{near[0]}'?" if near else f" (known: {', '.join(sorted(names))})"))
            try:
                value = parser(str(raw_value))
            except ValueError as exc:
                raise OffloadConfigError(f"{PREFIX}{key}={raw_value!r}: {exc}{_spaces_hint(parser, str(raw_value))}") \
                    from None
            if key in values and values[key] != value:  # as onnxruntime refuses device_expert_bytes != gpu_budget_bytes
                earlier, earlier_value = given_as[key]
                raise OffloadConfigError(f"conflicting values for one setting: {earlier}={earlier_value!r} and "
                                         f"{raw_key}={raw_value!r}")
            values[key], given_as[key] = value, (raw_key, raw_value)
        config = cls(**values)
        config.validate()
        return config

    def updated(self, **changes) -> "OffloadConfig":
        config = replace(self, **changes)
        config.validate()
        return config

    def validate(self) -> None:
        if self.tail_substitution_min_rank < 0:
            raise OffloadConfigError(f"{PREFIX}tail_substitution_min_rank must be >= 0")

    def session_entries(self) -> dict[str, str]:
        """Every setting as onnxruntime session config entries, defaults written out, so that they mean the same
        there whatever its own defaults are (what a user copies out); a setting left unset that onnxruntime has no
        value for (a path or group, working bytes, node overrides) is left out."""
        entries = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if (value is None and f.name not in AUTO_KEYS) or value == {}:
                continue
            entries[PREFIX + f.name] = _format(f.name, value)
        return entries

    def to_entries(self) -> dict[str, str]:
        """Every non-default setting as onnxruntime session config entries."""
        default = OffloadConfig()
        entries = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value != getattr(default, f.name):
                entries[PREFIX + f.name] = _format(f.name, value)
        return entries


# --- value parsers, one per onnxruntime value format ------------------------------------------

def _choice(*options: str, aliases: dict[str, str] | None = None):
    """One of `options`, in any case, as onnxruntime takes them; `aliases` are its other spellings (mode=1 is
    required there), held as the option they mean."""
    spellings = {option: option for option in options} | (aliases or {})

    def parse(text: str) -> str:
        if text.lower() not in spellings:
            raise ValueError(f"expected one of {', '.join(options)}")
        return spellings[text.lower()]
    return parse


# onnxruntime reads integers as ASCII digits alone (no sign, spaces, '_' or other scripts' digits), byte counts as
# 64-bit unsigned (UINT64_MAX) and counts of threads, tokens, experts and slots as 32-bit signed
DIGITS = re.compile(r"[0-9]+")
INT32_MAX = 2**31 - 1
FLOAT32_MAX = float.fromhex("0x1.fffffep+127")


def _int(minimum: int, maximum: int = INT32_MAX):
    def parse(text: str) -> int:
        if not DIGITS.fullmatch(text):
            raise ValueError(f"expected an integer >= {minimum}, in digits only")
        value = int(text)
        if value < minimum:
            raise ValueError(f"expected an integer >= {minimum}")
        if value > maximum:
            raise ValueError(f"expected an integer from {minimum} to {maximum}")
        return value
    return parse


def _bytes(minimum: int):
    count = _int(minimum, UINT64_MAX)

    def parse(text: str) -> int:
        try:
            return count(text)
        except ValueError as exc:
            size = _size_with_unit(text)
            if size is None:
                raise
            raise ValueError(f"{exc} (onnxruntime takes a byte count without a unit: {text.strip()} is {size})") \
                from None
    return parse


def _size_with_unit(text: str) -> int | None:
    """The bytes a size written with a unit ('2GiB', '1.5 MiB', as the window takes it) means, else None."""
    if not re.search("[a-zA-Z]", text):
        return None
    try:
        return parse_bytes(text)
    except ValueError:
        return None


def _bytes_or_auto(text: str) -> int | None:
    return AUTO if text.lower() == "auto" else _bytes(0)(text)


def _flag(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError("expected 0 or 1")
    return text == "1"


def _flag_or_word(text: str) -> bool:
    """0 or 1, or true or false in any case (onnxruntime's reading of allow_file_backing, not of the skip_ flags)."""
    flag = {"true": "1", "false": "0"}.get(text.lower(), text)
    if flag not in ("0", "1"):
        raise ValueError("expected 0, 1, true or false")
    return flag == "1"


# onnxruntime reads the two floats with two parsers, both into a 32-bit float: min_expert_weight as C's strtof
# (spaces around it, a '+' and hex floats allowed, an underflow read as 0), tail_substitution_threshold as
# std::from_chars (decimal alone, no '+' or spaces, an overflow or underflow refused)
DECIMAL = r"(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
HEX = r"0[xX](?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)(?:[pP][+-]?[0-9]+)?"
STRTOF = re.compile(rf"[+-]?(?:{DECIMAL}|{HEX}|inf(?:inity)?|nan)", re.IGNORECASE)
FROM_CHARS = re.compile(rf"-?{DECIMAL}")
C_SPACES = " \t\n\v\f\r"


def _float32(value: float) -> float:
    """`value` rounded to the nearest 32-bit float (inf past its range)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _held(value: float, high: float) -> float:
    """`value` as held, where its 32-bit float (onnxruntime's) is not itself: 0.0 where that is zero (1e-50 is 0
    there, approximate routing off; -0 too), `high` past it ('1.00000001' is 1.0 there)."""
    return 0.0 if _float32(value) == 0 else min(value, high)


def _float_in(low: float, high: float):
    """strtof's reading, within [low, high]."""
    def parse(text: str) -> float:
        text = text.strip(C_SPACES)
        if not STRTOF.fullmatch(text):
            raise ValueError(f"expected a number in [{low}, {high}]")
        value = float.fromhex(text) if "x" in text.lower() else float(text)
        if not low <= _float32(value) <= high:  # NaN fails both
            raise ValueError(f"expected a number in [{low}, {high}]")
        return _held(value, high)
    return parse


def _finite_float(low: float):
    """std::from_chars's reading, finite and at least `low`."""
    def parse(text: str) -> float:
        if not FROM_CHARS.fullmatch(text):
            raise ValueError(f"expected a number >= {low} in decimal digits (no '+' or spaces)")
        single = _float32(float(text))
        if math.isinf(single) or (single == 0 and re.search("[1-9]", re.split("[eE]", text)[0])):
            raise ValueError("beyond a 32-bit float's range (1.4e-45 to 3.4e38)")
        if single < low:
            raise ValueError(f"expected a number >= {low}")
        return _held(float(text), FLOAT32_MAX)
    return parse


def _text(text: str) -> str | None:
    """A name or path as given; empty (which onnxruntime accepts) is unset."""
    return text or None


def _node_overrides(text: str) -> dict[str, NodeOverride]:
    """`node:max_resident_slots=N,device_expert_bytes=B;node2:...`, split as onnxruntime splits it: at a node's first
    ':' (a name holding one is refused there), spaces around each part dropped, one ',' allowed at the end. A node or
    a limit given twice is refused: onnxruntime takes it without saying which one wins."""
    overrides, items = {}, {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        node, sep, settings = item.partition(":")
        node = node.strip()
        if not sep or not node:
            raise ValueError(f"'{item}' is not node:key=value[,key=value]")
        if node in items:
            raise ValueError(f"node '{node}' is named twice: '{items[node]}' and '{item}'")
        items[node] = item
        parts = settings.split(",")
        if len(parts) > 1 and parts[-1] == "":
            parts.pop()
        values = {}
        for setting in parts:
            key, eq, value = setting.partition("=")
            key = key.strip()
            if not eq or key not in ("max_resident_slots", "device_expert_bytes"):
                raise ValueError(f"'{setting}' in '{item}': expected max_resident_slots=N or device_expert_bytes=B")
            if key in values:
                raise ValueError(f"{key} is given twice in '{item}'")
            try:
                values[key] = (_bytes(0) if key == "device_expert_bytes" else _int(0))(value.strip())
            except ValueError as exc:  # which of the list's numbers it is
                raise ValueError(f"'{setting.strip()}' in '{item}': {exc}") from None
        overrides[node] = NodeOverride(**values)
    return overrides


_PARSERS = {
    "mode": _choice("disabled", "auto", "required", aliases={"0": "disabled", "off": "disabled", "1": "required",
                                                             "on": "required"}),
    "placement": _choice("static", "adaptive"),
    "cpu_execution": _choice("auto", "enabled", "disabled", aliases={"1": "enabled", "0": "disabled"}),
    "device_expert_bytes": _bytes_or_auto,
    "reserve_device_bytes": _bytes_or_auto,
    "gpu_device_mem_limit": _bytes(0),
    "host_expert_bytes": _bytes_or_auto,
    "pinned_bytes": _bytes_or_auto,
    "device_working_bytes": _bytes(1),
    "host_working_bytes": _bytes(1),
    "allow_file_backing": _flag_or_word,
    "cpu_threads": _int(0),
    "async_max_tokens": _int(0),
    "prefill_wave_experts": _int(1),
    "node_overrides": _node_overrides,
    "popularity_file": _text,
    "budget_group": _text,
    "source_root": _text,
    "derived_cache_dir": _text,
    "min_expert_weight": _float_in(0.0, 1.0),
    "skip_tail_cold_only": _flag,
    "skip_zero_cold_doorbell": _flag,
    "tail_substitution_threshold": _finite_float(0.0),
    "tail_substitution_min_rank": _int(0),
}

# the byte budgets whose unset value is onnxruntime's 'auto'
AUTO_KEYS = frozenset(key for key, parser in _PARSERS.items() if parser is _bytes_or_auto)


def _spaces_hint(parser, text: str) -> str:
    """Why a value with spaces around it is refused, where the value without them would do."""
    if text == text.strip():
        return ""
    try:
        parser(text.strip())
    except ValueError:
        return ""
    return " (onnxruntime refuses spaces around the value)"


def _format(key: str, value) -> str:
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return "1" if value else "0"
    if key == "node_overrides":
        return ";".join(
            f"{node}:" + ",".join(f"{k}={v}" for k, v in vars(o).items() if v is not None)
            for node, o in value.items())
    return str(value)
