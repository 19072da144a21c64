"""Operators' patterns (`[filter] block` and `scan`) matched in time linear in the text.

Python's `re` backtracks, so a pattern's cost on a hostile command has no bound:
`(a|aa)*c` took 15 s on 38 characters, `a.*b.*c.*d` 110 s on 3 KB, and a filter runs
on every untrusted command (up to 1 MiB) and every script. No check of a pattern's shape
catches them all (a review found a dozen shapes past one). RE2 (google-re2) matches in
time linear in the text whatever the pattern; it has no lookarounds, backreferences,
possessive or atomic groups, so a pattern that needs them is refused when the profile is
read. The built-in rules stay on `re`: they are ours, written possessive, and tested on
near misses (tests/test_properties.py).

Imported only when a profile has such patterns (~8 ms, once).
"""

from __future__ import annotations

import functools

TYPE_CHECKING = False  # typing costs ~5 ms to import; annotations here are strings anyway
if TYPE_CHECKING:
    from typing import Any

UNSUPPORTED = ("not something a linear-time matcher can run (RE2 has no lookarounds, backreferences, "
               "possessive or atomic groups, \\Z: use \\z)")


@functools.lru_cache(maxsize=256)
def compile_pattern(pattern: str, multiline: bool = False) -> Any:
    """The RE2 regex for `pattern` (`multiline`: ^ and $ at line ends, as re.MULTILINE);
    ValueError saying why it cannot be one."""
    import re

    if not isinstance(pattern, str):
        raise ValueError(f"expected a string, got {type(pattern).__name__}")
    try:
        re.compile(pattern)  # Python's own message for what is no regex at all
    except (re.error, TypeError, ValueError, OverflowError, RecursionError) as e:
        raise ValueError(f"invalid regular expression: {e}") from None
    try:
        import re2
    except ImportError:  # a dependency of the package: only a broken install lacks it
        raise ValueError("filter patterns need the google-re2 package (pip install google-re2)") from None
    options = re2.Options()
    options.log_errors = False  # it would print to our stderr; the error is ours to report
    try:
        return re2.compile(("(?m)" if multiline else "") + pattern, options)
    except re2.error as e:
        reason = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise ValueError(f"{UNSUPPORTED}: {reason}") from None


def problem(pattern: str) -> str | None:
    """Why `pattern` cannot be an operator's pattern, or None."""
    try:
        compile_pattern(pattern)
    except ValueError as e:
        return str(e)
    return None
