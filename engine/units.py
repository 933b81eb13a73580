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
