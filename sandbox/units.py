"""Parse sizes ("512MiB") and durations ("30s") from profiles and flags."""

from __future__ import annotations

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4,
}
_TIME_UNITS = {"": 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
_DIGITS = frozenset("0123456789")
_LETTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")

UNLIMITED = ("unlimited", "none", "off")
MAX_SIZE = 2**62  # beyond what any kernel limit file or rlimit takes
MAX_DURATION = 30 * 86400.0  # a month: longer is a typo, and float seconds must stay finite


def _number_and_unit(value: str) -> tuple[str, str] | None:
    """("1.5", "GiB") from " 1.5 GiB ", as `\\s*([0-9]+(?:\\.[0-9]+)?)\\s*([a-zA-Z]*)\\s*` matches
    the whole text (without `re`: it and its enum cost a CLI call ~3 ms to import)."""
    text = value.strip()
    end = len(text)
    i = 0
    while i < end and text[i] in _DIGITS:
        i += 1
    if i == 0:
        return None
    if i < end and text[i] == ".":
        j = i + 1
        while j < end and text[j] in _DIGITS:
            j += 1
        if j == i + 1:
            return None
        i = j
    unit = text[i:].lstrip()
    if not _LETTERS.issuperset(unit):
        return None
    return text[:i], unit


def parse_size(value: object) -> int | None:
    """Bytes from 123, "64MiB", "1.5GiB"; None for "unlimited". Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 512MiB, not a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("a size cannot be negative")
        if value > MAX_SIZE:
            raise ValueError("is too large")
        return value
    if isinstance(value, float):
        raise ValueError("write sizes as integers or with a unit, e.g. 512MiB")
    if not isinstance(value, str):
        raise ValueError(f"expected a size such as 512MiB, got {type(value).__name__}")
    if value.strip().lower() in UNLIMITED:
        return None
    if value.strip().startswith("-"):
        raise ValueError("a size cannot be negative")
    found = _number_and_unit(value)
    if found is None:
        raise ValueError("expected a size such as 512MiB or 1GiB (a bare number is bytes)")
    number, written_unit = found
    unit = written_unit.lower()
    if unit not in _SIZE_UNITS:
        raise ValueError(f"unknown size unit {written_unit!r} (use B, KiB, MiB, GiB, TiB or KB, MB, GB)")
    try:
        n = int(float(number) * _SIZE_UNITS[unit])
    except OverflowError:
        raise ValueError("is too large") from None
    if n > MAX_SIZE:
        raise ValueError("is too large")
    return n


def parse_duration(value: object) -> float | None:
    """Seconds from 30, 2.5, "30s", "500ms", "2m"; None for "unlimited". Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 30s, not a boolean")
    if isinstance(value, (int, float)):
        try:
            seconds = float(value)
        except OverflowError:
            raise ValueError("is too large") from None
        if seconds != seconds or seconds in (float("inf"), float("-inf")):
            raise ValueError("a duration must be a finite number")
        if seconds < 0:
            raise ValueError("a duration cannot be negative")
        if seconds > MAX_DURATION:
            raise ValueError(f"is too large (at most {MAX_DURATION:g}s)")
        return seconds
    if not isinstance(value, str):
        raise ValueError(f"expected a duration such as 30s, got {type(value).__name__}")
    if value.strip().lower() in UNLIMITED:
        return None
    if value.strip().startswith("-"):
        raise ValueError("a duration cannot be negative")
    found = _number_and_unit(value)
    if found is None:
        raise ValueError("expected a duration such as 30s, 500ms or 2m")
    number, written_unit = found
    unit = written_unit.lower()
    if unit not in _TIME_UNITS:
        raise ValueError(f"unknown time unit {written_unit!r} (use ms, s, m or h)")
    seconds = float(number) * _TIME_UNITS[unit]
    if seconds == float("inf"):  # 400 digits: a number, only too large for a float
        raise ValueError(f"is too large (at most {MAX_DURATION:g}s)")
    return parse_duration(seconds)


def format_size(n: int | None) -> str:
    if n is None:
        return "unlimited"
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"  # ("output limit of 10" read as a count of something)
