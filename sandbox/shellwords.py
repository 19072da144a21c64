"""Split a command string into words as `shlex.split` does (POSIX rules), in linear time;
join words back as `shlex.join` does, without importing `re` (~3 ms of a CLI call, with its enum).

`shlex` builds each word a character at a time (`token = token + c`), which is quadratic
in a word's length: a 1 MB command string took 12 s of the supervisor's CPU before any
size check could refuse it. Here each run of plain characters, each quoted string and
each escape is one regex match. The rules are shlex's, which tests check on random text:
whitespace is space, tab, CR and LF; '...' is literal; inside "..." a backslash escapes
only `"` and `\\`; outside quotes it escapes any character; `''` is an empty word.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    import re

# The characters shlex.quote leaves bare (its `[^\w@%+=:,./-]`, ASCII).
_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_@%+=:,./-")
_patterns: list[re.Pattern[str]] = []  # compiled on the first split


def _compile() -> list[re.Pattern[str]]:
    import re

    # Possessive: no backtracking state is kept per character (a plain `(?:[^"\\]|\\.)*` held
    # ~230 bytes of it per byte of a quoted string: 480 MiB for a 2 MiB command).
    piece = re.compile(r"""
        (?P<space>[ \t\r\n]++)
      | (?P<plain>[^ \t\r\n'"\\]++)
      | '(?P<single>[^']*+)'
      | "(?P<double>(?:[^"\\]++|\\.)*+)"
      | \\(?P<escaped>.)
    """, re.VERBOSE | re.DOTALL)
    _patterns[:] = [piece, re.compile(r'\\(["\\])')]
    return _patterns


def quote(word: str) -> str:
    """As shlex.quote: `word` bare when safe, else in single quotes."""
    if not word:
        return "''"
    if _SAFE.issuperset(word):
        return word
    return "'" + word.replace("'", "'\"'\"'") + "'"


def join(words: list[str]) -> str:
    """As shlex.join."""
    return " ".join(quote(w) for w in words)


def split(text: str) -> list[str]:
    """The words of `text`; ValueError for an unclosed quote or a trailing backslash."""
    piece, in_double = _patterns or _compile()
    words: list[str] = []
    parts: list[str] = []
    in_word = False
    pos, end = 0, len(text)
    while pos < end:
        m = piece.match(text, pos)
        if m is None:  # an unclosed quote, or a backslash at the very end
            raise ValueError("No escaped character" if text[pos] == "\\" else "No closing quotation")
        pos = m.end()
        kind = m.lastgroup
        if kind == "space":
            if in_word:
                words.append("".join(parts))
                parts.clear()
                in_word = False
            continue
        in_word = True
        if kind == "double":
            parts.append(in_double.sub(r"\1", m["double"]))
        else:
            parts.append(m[kind])  # type: ignore[index]
    if in_word:
        words.append("".join(parts))
    return words
