"""Byte counts and counted things as people read them."""


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


def decode_rate(tokens_per_s: float | None, unit: str = " tok/s", none: str = "n/a (one token)") -> str:
    """A decode rate as the user reads it ("40.0 tok/s"; a table whose heading says the unit: unit=""), and `none`
    where the answers were one token each: no decode step after the first token, which the prefill gives (a table's
    "n/a", or "" where a line leaves the rate out)."""
    return none if not tokens_per_s else f"{tokens_per_s:.1f}{unit}"
