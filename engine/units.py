"""Byte counts and counted things as people read them, and sizes as people write them."""

import math
import re
from decimal import Decimal

UINT64_MAX = 2**64 - 1  # the most bytes a setting takes (onnxruntime reads byte counts as 64-bit unsigned)
INT64_MAX = 2**63 - 1  # the largest integer SQLite keeps: a run's seed, length limit and top-k go into the history
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def human_bytes(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """'1 layer', '3 layers' (`plural` where adding an s is wrong)."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


def layer_words(layers: list[int]) -> str:
    """'layer 3', 'layers 0-23' or 'layers 0-3, 5, 8-9': layer numbers in runs."""
    runs: list[list[int]] = []
    for layer in layers:
        if runs and runs[-1][1] == layer - 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    words = ", ".join(str(first) if first == last else f"{first}-{last}" for first, last in runs)
    return f"layer {words}" if len(layers) == 1 else f"layers {words}"


def byte_rate(bytes_per_s: float, decimals: int) -> str:
    """'64.2 GB/s', or in MB/s or kB/s below 1 GB/s (a small model's or a busy CPU's rate read '0.0 GB/s')."""
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6)):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.{decimals}f} {unit}"
    return f"{bytes_per_s / 1e3:.{decimals}f} kB/s"


def decode_rate(tokens_per_s: float | None, unit: str = " tok/s", none: str = "n/a (one token)") -> str:
    """A decode rate as the user reads it ("40.0 tok/s"; a table whose heading says the unit: unit=""), and `none`
    where the answers were one token each: no decode step after the first token, which the prefill gives (a table's
    "n/a", or "" where a line leaves the rate out)."""
    return none if not tokens_per_s else f"{tokens_per_s:.1f}{unit}"


def duration_text(seconds: float) -> str:
    """A time as the workbench gives every one (the window's views, the command line's lines and tables, a sweep's
    recommendation, the contention report): three significant figures in µs under a millisecond and in ms under a
    second (a small model's layer and answer: "32.0 µs", "2.20 ms", "171 ms"), two decimals from a second on
    ("12.35 s"); 0 as "0 ms"."""
    if seconds <= 0:
        return "0 ms"
    if float(f"{seconds:.3g}") >= 1:  # 0.9996 s reads "1.00 s", not "1000 ms"
        return f"{seconds:.2f} s"
    scale, unit = (1e3, "ms") if float(f"{seconds * 1e3:.3g}") >= 1 else (1e6, "µs")
    value = float(f"{seconds * scale:.3g}")
    return f"{value:.{max(0, 2 - math.floor(math.log10(value)))}f} {unit}"


def parse_bytes(text: str) -> int | None:
    """'1.5 GiB', '512M', '1000000' -> bytes; 'auto' / '' -> None. Raises ValueError otherwise."""
    given = text.strip()  # (the errors name it as typed)
    text = given.lower()
    if text in ("", "auto", "none"):
        return None
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-z]*)", text)
    if not match or match.group(2) not in _UNITS:
        raise ValueError(f"'{given}' is not a size (e.g. 512 MiB, 1.5 GiB)")
    count = int(Decimal(match.group(1)) * _UNITS[match.group(2)])  # exact: a double loses bytes past 2**53
    if count > UINT64_MAX:
        raise ValueError(f"'{given}' is more than {UINT64_MAX} bytes, the most a setting takes")
    return count
