"""Does an operator's block pattern risk catastrophic backtracking on a hostile command?

Python's `re` backtracks: a repeated group that can match the same text in two ways
(`(a|aa)*c`) takes exponential time on `aaaa…a` (38 characters: 15 s), and a filter
runs on every untrusted command. Patterns are checked once, when a profile or an
override is read, on the parser's own tree (`re._parser`, whose optimizer turns
`(a|aa)` into `a(|a)` and `(x|y)` into `[xy]`):

- a repeat of something that repeats (`(a+)+`, `(x{2,})*`);
- a repeat whose body can match nothing (`(a?)*`);
- inside a repeat, alternatives that can start with the same character (`(\\w|\\d)+`,
  `(ab|ac)*`), or one that can match nothing (`(a|aa)*`, after the optimizer).

Conservative: some safe patterns are refused too (`(ab|a)*`); a character class
(`[\\w\\d]+`) or a possessive / atomic form (`(a|aa)*+`, `(?>...)`) says the same safely.
"""

from __future__ import annotations

import re
from typing import Any

try:
    from re import _constants as C  # noqa: N812 - the stdlib's own short name
    from re import _parser as P  # noqa: N812
except ImportError:  # Python < 3.11
    import sre_constants as C  # type: ignore[no-redef]  # noqa: N812
    import sre_parse as P  # type: ignore[no-redef]  # noqa: N812

_REPEATS = (C.MAX_REPEAT, C.MIN_REPEAT)
_SAFE_GROUPS = tuple(getattr(C, n) for n in ("POSSESSIVE_REPEAT", "ATOMIC_GROUP") if hasattr(C, n))
_CATEGORY_RE = {C.CATEGORY_DIGIT: r"\d", C.CATEGORY_WORD: r"\w", C.CATEGORY_SPACE: r"\s"}
_WIDE = "wide"  # a first character that may be anything (., [^x], \D, a backreference)


def problem(pattern: str) -> str | None:
    """Why `pattern` can backtrack catastrophically, or None. Assumes it compiles."""
    try:
        tree = P.parse(pattern)
    except Exception:  # noqa: BLE001 - re.compile has judged it already; never fail here
        return None
    try:
        return _walk(list(tree), in_repeat=False)
    except RecursionError:  # re.compile refuses such depth first; never a traceback here
        return "groups nested too deeply to check"


def _walk(items: list[Any], in_repeat: bool) -> str | None:
    for op, av in items:
        if op in _SAFE_GROUPS:
            continue  # no backtracking into it
        if op in _REPEATS:
            lo, hi, body = av
            repeats = hi is C.MAXREPEAT or hi > 1
            if repeats:
                if in_repeat:
                    return "a repeat inside a repeat (like (a+)+)"
                if _first(list(body))[1]:
                    return "a repeated group that can match nothing (like (a?)*)"
            why = _walk(list(body), in_repeat or repeats)
            if why:
                return why
        elif op is C.BRANCH:
            alts = [list(a) for a in av[1]]
            if in_repeat:
                firsts = [_first(a) for a in alts]
                if any(nullable for _, nullable in firsts):
                    return "alternatives in a repeat, one of which can match nothing (like (a|aa)*)"
                for i, (a, _) in enumerate(firsts):
                    for b, _ in firsts[i + 1:]:
                        if _overlap(a, b):
                            return "alternatives in a repeat that can start alike (like (ab|ac)* or (\\w|\\d)+)"
            for a in alts:
                why = _walk(a, in_repeat)
                if why:
                    return why
        elif op is C.SUBPATTERN:
            why = _walk(list(av[3]), in_repeat)
            if why:
                return why
    return None


def _first(items: list[Any]) -> tuple[list[Any], bool]:
    """(what the sequence's first character may be, whether it can match nothing)."""
    atoms: list[Any] = []
    for op, av in items:
        got, nullable = _first_of(op, av)
        atoms += got
        if not nullable:
            return atoms, False
    return atoms, True


def _first_of(op: Any, av: Any) -> tuple[list[Any], bool]:
    if op is C.LITERAL:
        return [("lit", av)], False
    if op is C.IN:
        if any(o is C.NEGATE for o, _ in av):
            return [_WIDE], False
        return [_atom(o, a) for o, a in av], False
    if op is C.SUBPATTERN:
        return _first(list(av[3]))
    if op in _REPEATS or op in _SAFE_GROUPS:
        if op in _REPEATS or op is getattr(C, "POSSESSIVE_REPEAT", None):
            lo, _hi, body = av
            atoms, nullable = _first(list(body))
            return atoms, nullable or lo == 0
        return _first(list(av))  # an atomic group
    if op is C.BRANCH:
        atoms, nullable = [], False
        for alt in av[1]:
            a, n = _first(list(alt))
            atoms += a
            nullable = nullable or n
        return atoms, nullable
    if op in (C.AT, C.ASSERT, C.ASSERT_NOT):
        return [], True  # zero-width
    if op is C.GROUPREF:
        return [_WIDE], True
    return [_WIDE], False  # ANY, NOT_LITERAL, and what is not known here


def _atom(op: Any, av: Any) -> Any:
    if op is C.LITERAL:
        return ("lit", av)
    if op is C.RANGE:
        return ("range", av)
    if op is C.CATEGORY and av in _CATEGORY_RE:
        return ("cat", av)
    return _WIDE


def _overlap(a: list[Any], b: list[Any]) -> bool:
    return any(_atoms_meet(x, y) for x in a for y in b)


def _atoms_meet(x: Any, y: Any) -> bool:
    if x == _WIDE or y == _WIDE:
        return True
    if x[0] == "cat" and y[0] == "cat":
        return x[1] == y[1] or {x[1], y[1]} == {C.CATEGORY_DIGIT, C.CATEGORY_WORD}
    if y[0] == "cat":
        x, y = y, x
    if x[0] == "cat":  # against a literal or a range: try its characters (a range of many: assume so)
        lo, hi = (y[1], y[1]) if y[0] == "lit" else y[1]
        if hi - lo > 4096:
            return True
        rx = re.compile(_CATEGORY_RE[x[1]])
        return any(rx.match(chr(c)) for c in range(lo, hi + 1))
    lo1, hi1 = (x[1], x[1]) if x[0] == "lit" else x[1]
    lo2, hi2 = (y[1], y[1]) if y[0] == "lit" else y[1]
    return lo1 <= hi2 and lo2 <= hi1
