"""Command strings are split as `shlex.split` splits them, in linear time."""

from __future__ import annotations

import random
import shlex
import threading

import pytest

from sandbox.shellwords import join, split
from sandbox.supervisor import to_argv

# Every character that matters to the rules, and some that must not (# is no comment).
ALPHABET = ["a", "b", " ", "\t", "\n", "\r", "'", '"', "\\", "#", "é", "$", "\x0b", "\xa0", "\udcff"]


def _shlex(text: str) -> tuple[str, list[str] | None]:
    try:
        return "ok", shlex.split(text)
    except ValueError:
        return "error", None


def _ours(text: str) -> tuple[str, list[str] | None]:
    try:
        return "ok", split(text)
    except ValueError:
        return "error", None


def test_joined_as_shlex_joins() -> None:
    # shlex.join needs re (~3 ms of a CLI call, with its enum); ours quotes the same way.
    rng = random.Random(20261202)
    chars = [*ALPHABET, "@", "%", "+", "=", ":", ",", ".", "/", "-", "_", "0", "Z", ";", "*", "~", "ß"]
    for _ in range(5_000):
        words = ["".join(rng.choice(chars) for _ in range(rng.randint(0, 6))) for _ in range(rng.randint(0, 4))]
        assert join(words) == shlex.join(words), words
        assert split(join(words)) == words


def test_same_words_as_shlex_on_random_text() -> None:
    rng = random.Random(20261201)  # fixed: the same 30,000 strings on every run
    for _ in range(30_000):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 14)))
        assert _ours(text) == _shlex(text), repr(text)


@pytest.mark.parametrize("text", [
    "", "   ", "a b", "'a b' c", '"a \\" b"', '"a \\x b"', "a\\ b", "''", '""', "a''b", "'a\\'", '"a\\\\"',
    "a#b # c", "x 'unclosed", 'x "unclosed', 'x "a\\', "x \\",
])
def test_same_words_as_shlex_on_the_edge_cases(text: str) -> None:
    assert _ours(text) == _shlex(text)


def test_a_long_command_string_is_split_without_quadratic_time() -> None:
    """shlex takes ~12 s of CPU for a 1 MB word (it grows the word a character at a time); a
    hang guard, generous by two orders of magnitude, not a speed goal."""
    done: list[list[str]] = []
    text = "echo " + "a" * 1_500_000 + " 'q " + "b" * 100_000 + "'"
    t = threading.Thread(target=lambda: done.append(to_argv(text, False)), daemon=True)
    t.start()
    t.join(10)
    assert done, "splitting a 1.6 MB command string did not finish in 10 s"
    assert [len(w) for w in done[0]] == [4, 1_500_000, 100_002]


def test_splitting_a_long_quoted_word_holds_no_per_character_state() -> None:
    """A backtracking `(?:[^"\\\\]|\\\\.)*` kept ~230 bytes per character of a quoted string:
    a 20 MB payload peaked at 4.8 GB. Measured in a child, whose peak RSS is its own."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import resource, sys\n"
            "from sandbox.shellwords import split\n"
            "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "words = split('\"' + 'a\\\\\\\\x' * 500_000 + '\"')\n"
            "print(len(words[0]), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         cwd=str(Path(__file__).resolve().parent.parent)).stdout.split()
    assert out[0] == str(3 * 500_000)  # a\x kept as written inside double quotes
    assert int(out[1]) < 64, f"{out[1]} MiB for a 1.5 MB word"
