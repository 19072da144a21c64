"""First-line command filter: a convenience that catches obvious foot-guns, NOT a security boundary.

The real containment is the isolation layer (namespaces, landlock, seccomp).  This module only
stops commands that are clearly destructive before any sandbox is even built, with a readable reason.

How a command is inspected
--------------------------
The command string (callers join argv with ``shlex.join``) is tokenised by a small, quote-aware
shell lexer (linear time, no recursion for nesting).  It splits the text into *simple commands* at
``;``, ``&``, ``&&``, ``||``, ``|``, ``|&``, newlines, ``(``/``)``, and at command substitutions
(``$(...)`` and backticks, including those inside double quotes).  Quotes and backslashes are
removed from words, redirections are set aside, and leading noise is stripped from each simple
command: ``VAR=value`` assignments, reserved words (``if``, ``then``, ``do``, ``!``, ``{`` ...) and
wrappers such as ``sudo``, ``env``, ``nice``, ``timeout``, ``xargs``, ``busybox`` (with their options).
The command word is reduced to its basename (``/sbin/reboot`` -> ``reboot``).  Payloads of
``sh -c``/``bash -c``/``su -c``/``eval`` are inspected recursively (depth-limited).

Built-in rules then match at the *command word position* of each simple command, so
``grep mkfs docs.txt``, ``echo reboot-notes`` and ``cat shutdown.txt`` are allowed while
``ls; sudo /sbin/reboot`` and ``echo "$(mkfs.ext4 /dev/sda)"`` are blocked.  Exceptions: the
``redirect-blockdev`` rule looks at the redirections of a simple command, and ``fork-bomb`` is pure
syntax, so it is searched anywhere in the raw text (it is commonly wrapped in ``sh -c '...'``).

Edge-case decisions
-------------------
* Size: commands longer than ``MAX_COMMAND_LEN`` (1 MiB) characters, or with more than ``MAX_TOKENS``
  (100k) shell tokens including nested ``sh -c``/``eval`` payloads, are blocked with rule ``too-long``
  (far beyond real command lines; a single argv string cannot even exceed 128 KiB); everything
  below that is scanned in full.  The token cap bounds the pure-Python lexer's work (well under 0.5 s);
  the length check applies only when at least one check (blocklist, extras, allowlist) is enabled.
* Nesting: more than ``_MAX_DEPTH`` (8) nested ``sh -c``/``eval`` payloads, or more than
  ``_MAX_NESTING`` (64) nested ``$(``/backtick/double-quote levels -> blocked with rule ``too-deep``.
* ``extra_block`` patterns are searched (``re.search``) in the raw command string; an invalid pattern
  raises ``ValueError``.  Their rule ids are ``custom-1``, ``custom-2``, ... in the given order.
  Their running time is the profile author's responsibility.
* The allowlist is quote-aware: ``git commit -m 'a; b'`` is a single simple command and may match
  ``git *``; an *unquoted* ``;``, ``&``, ``|``, newline, ``(``/``)``, redirect, comment, or any
  ``$(``/backtick (also inside double quotes) makes the command non-simple -> ``rule="allowlist"``.
* Where the lexer simplifies shell grammar it is meant to err towards treating more words as
  commands (heredoc bodies, for example, are scanned like commands) rather than hiding them.
"""

from __future__ import annotations

from .record import record

TYPE_CHECKING = False  # typing costs ~5 ms to import; annotations here are strings anyway
if TYPE_CHECKING:
    import re
    from collections.abc import Sequence
    from typing import Any

__all__ = ["MAX_COMMAND_LEN", "MAX_TOKENS", "Verdict", "check"]

MAX_COMMAND_LEN = 1 << 20  # characters; longer commands are blocked with rule "too-long"
MAX_TOKENS = 100_000  # shell tokens (a word plus its trailing blanks is one); more -> "too-long"
_MAX_DEPTH = 8  # nested `sh -c` / `eval` payloads inspected before giving up with "too-deep"
_SNIPPET = 120  # characters of the offending command quoted in a reason


@record(frozen=True)
class Verdict:
    """The filter's answer: allowed, or the rule that blocked and why."""

    allowed: bool
    rule: str | None  # id of the rule that blocked ("rm-root", "custom-1", "allowlist", ...)
    reason: str | None  # human sentence explaining the block


_ALLOWED = Verdict(True, None, None)


class _Rule:
    # Plain slotted classes, not dataclasses: building a dataclass costs ~1 ms at import time.
    __slots__ = ("description", "id", "regex", "scope")

    def __init__(self, id: str, scope: str, regex: re.Pattern[str], description: str) -> None:
        self.id = id
        # "cmd": re.match on a normalised simple command; "redir": re.match on each redirection
        # ("> /dev/sda"); "raw": re.search on the raw command text
        self.scope = scope
        self.regex = regex
        self.description = description


# --------------------------------------------------------------------------- built-in rules
# Regexes run against normalised text where words are separated by single spaces.  They must stay
# linear: anchored matches, `(?:.* )?` only inside independent lookaheads, possessive quantifiers
# wherever a run could otherwise be re-scanned.
_BLOCKDEV = r"/+dev/+(?:[shv]d[a-z]|xvd[a-z]|nvme[0-9]|mmcblk[0-9]|md[0-9]|dm-[0-9]|disk/|mapper/)"
_ROOT_ARG = r"(?=(?:.* )?/++(?:\*/*+)?+(?: |$))"  # some argument is "/" or "/*" (also "//", "/*/")
_END = r"(?: |$)"

_RULE_SPECS: tuple[tuple[str, str, str, str], ...] = (
    (
        "rm-root",
        "cmd",
        # (recursive flag AND a "/" argument) OR --no-preserve-root anywhere
        r"rm (?:(?=(?:.* )?--no-preserve-root" + _END + r")"
        r"|(?=(?:.* )?(?:-(?=[a-zA-Z]*[rR])[a-zA-Z]++|--recursive)" + _END + r")" + _ROOT_ARG + r")",
        "recursive delete of /",
    ),
    (
        "mkfs",
        "cmd",
        r"(?:mkfs(?:\.[^ ]*+)?|mke2fs|mkswap|wipefs)" + _END,
        "creating or wiping a filesystem destroys the device's data",
    ),
    (
        "dd-blockdev",
        "cmd",
        r"dd (?=(?:.* )?of=" + _BLOCKDEV + r")",
        "dd writing to a block device",
    ),
    (
        "redirect-blockdev",
        "redir",
        r"[0-9]*+(?:>>?|>\||&>>?|<>) " + _BLOCKDEV,
        "shell redirect writing to a block device",
    ),
    (
        "chmod-root",
        "cmd",
        r"chmod (?=(?:.* )?(?:-(?=[cfvR]*R)[cfvR]++|--recursive)" + _END + r")" + _ROOT_ARG,
        "recursive chmod of /",
    ),
    (
        "chown-root",
        "cmd",
        r"(?:chown|chgrp) (?=(?:.* )?(?:-(?=[cfvhHLPR]*R)[cfvhHLPR]++|--recursive)" + _END + r")"
        + _ROOT_ARG,
        "recursive chown/chgrp of /",
    ),
    (
        "fork-bomb",
        "raw",
        # name(){ name|name& };name  -- whitespace-tolerant; lookbehind keeps the search linear
        r"(?<![\w:.-])([\w:.-]++)\s*+\(\s*+\)\s*+\{\s*+\1\s*+\|\s*+\1\s*+&\s*+;?\s*+\}\s*+;?\s*+\1",
        "fork bomb",
    ),
    (
        "shutdown",
        "cmd",
        r"(?:(?:shutdown|reboot|halt|poweroff)" + _END
        + r"|systemctl (?=(?:.* )?(?:poweroff|reboot|halt|kexec|soft-reboot)(?:\.target)?" + _END + r"))",
        "shutting down or rebooting the host",
    ),
    (
        "init-runlevel",
        "cmd",
        r"(?:init|telinit) [06]" + _END,
        "switching to runlevel 0 (halt) or 6 (reboot)",
    ),
    (
        "firewall-disable",
        "cmd",
        r"(?:systemctl (?=(?:.* )?(?:stop|disable|mask|kill)" + _END + r")"
        r"(?=(?:.* )?(?:firewalld|ufw|nftables|ip6?tables)(?:\.service)?" + _END + r")"
        r"|service (?:firewalld|ufw|nftables|ip6?tables) stop" + _END
        + r"|ufw (?=(?:.* )?disable" + _END + r"))",
        "disabling the host firewall",
    ),
    (
        "iptables-flush",
        "cmd",
        r"(?:ip6?tables(?:-legacy|-nft)? (?=(?:.* )?(?:-F[^ ]*+|--flush)" + _END + r")"
        r"|nft (?=(?:.* )?flush" + _END + r"))",
        "flushing the host firewall rules",
    ),
)


# Every "cmd" rule starts with one of these command words; segments whose command word is not one of
# them skip the rule regexes entirely (keeps the per-segment cost flat for huge inputs).
_CMD_TRIGGER = (
    r"rm|mkfs(?:\.[^ ]*+)?|mke2fs|mkswap|wipefs|dd|chmod|chown|chgrp|shutdown|reboot|halt|poweroff"
    r"|systemctl|init|telinit|service|ufw|ip6?tables(?:-legacy|-nft)?|nft"
)


# Literal fragments every built-in rule needs somewhere in the text (command words, also inside
# `sh -c` payloads, block devices, the fork bomb's punctuation). A command containing none of them
# cannot match, so it skips the lexer and the regexes (whose compilation alone costs ~30 ms: too
# much for a CLI that runs one command).
_NEEDLES = ("rm", "mk", "wipefs", "dd", "ch", "shutdown", "reboot", "halt", "poweroff", "systemctl",
            "init", "service", "ufw", "tables", "nft", "/dev")
_FORK_BOMB_CHARS = ("(", ")", "{", "}", "|", "&")


def _cannot_match(text: str) -> bool:
    """A cheap, conservative pre-check: True only for short plain commands without any needle
    (after removing quotes and backslashes, which the shell would remove: re''boot)."""
    if len(text) > 4096 or "$(" in text or "`" in text:
        return False
    if all(c in text for c in _FORK_BOMB_CHARS):
        return False
    plain = text.replace("'", "").replace('"', "").replace("\\", "")
    return not any(n in plain for n in _NEEDLES)


class _RuleSet:
    __slots__ = ("cmd", "raw", "redir", "trigger")

    def __init__(self, rules: list[_Rule], trigger: re.Pattern[str]) -> None:
        self.raw = tuple(r for r in rules if r.scope == "raw")
        self.redir = tuple(r for r in rules if r.scope == "redir")
        self.cmd = tuple(r for r in rules if r.scope == "cmd")
        self.trigger = trigger


_compiled: dict[str, Any] = {}  # "rules", "lexer": compiled on first use (re and its enum cost a CLI call ~3 ms)


def _rules() -> _RuleSet:
    found = _compiled.get("rules")
    if found is None:
        import re

        rules = [_Rule(i, s, re.compile(p, re.DOTALL), d) for i, s, p, d in _RULE_SPECS]
        found = _compiled["rules"] = _RuleSet(rules, re.compile(_CMD_TRIGGER))
    return found


def pattern_problem(pattern: str) -> str | None:
    """Why an operator's block pattern is refused (no regex, or one RE2 cannot run), or None."""
    from .linear_regex import problem

    return problem(pattern)


def _compile_extra(pattern: str) -> Any:
    from .linear_regex import compile_pattern

    try:
        return compile_pattern(pattern)
    except ValueError as e:
        raise ValueError(f"invalid extra_block pattern {pattern!r}: {e}") from None


# --------------------------------------------------------------------------- lexer
# One token regex per context; every character is matched by some alternative, so the scanner always
# advances.  Possessive quantifiers keep each token match linear in the token's length, and the
# common tokens swallow trailing blanks / runs of separators so the Python loop runs once per word.
def _lexer() -> tuple[re.Pattern[str], re.Pattern[str], re.Pattern[str], re.Pattern[str]]:
    found = _compiled.get("lexer")
    if found is None:
        found = _compiled["lexer"] = _compile_lexer()
    return found


def _compile_lexer() -> tuple[re.Pattern[str], re.Pattern[str], re.Pattern[str], re.Pattern[str]]:
    import re

    word = r"[^ \t\n\r'\"\\;&|()<>`$]++"
    cmd = re.compile(
        rf"""
          (?P<wordsp>{word})[ \t]++
        | (?P<word>{word}|\$(?!\())
        | "(?P<dqs>[^"\\$`]*+)"
        | (?P<ws>[ \t]++)
        | (?P<redir>[0-9]*+(?:>>|>\||>&|&>>|&>|<<<|<<-|<<|<>|<&|[<>]))[ \t]*+
        | (?P<sub>\$\()
        | (?P<op>(?:(?:&&|\|\||;;&|;;|;&|\|&|[;&|\n\r])[ \t]*+)++)
        | (?P<open>\(++)
        | (?P<close>\))
        | (?P<bq>`)
        | (?P<sq>'[^']*+'?)
        | (?P<dq>")
        | (?P<esc>\\.?)
        """,
        re.VERBOSE | re.DOTALL,
    )
    dq = re.compile(
        r"(?P<text>[^\"\\$`]++|\$(?!\())|(?P<esc>\\.?)|(?P<sub>\$\()|(?P<bq>`)|(?P<end>\")",
        re.DOTALL,
    )
    assign = re.compile(r"[A-Za-z_][A-Za-z0-9_]*+(?:\[[^\]]*+\])?\+?=")
    short_c = re.compile(r"-[A-Za-z]*c")  # shell option cluster containing -c (-c, -ec, -lc ...)
    return cmd, dq, assign, short_c


# Frame kinds: the lexer keeps an explicit stack (no recursion) for $( ... ), `...` and "...".
_TOP, _PAREN, _BQ, _DQ = range(4)
_MAX_NESTING = 64  # nested $( ` " frames; real commands use a handful, deeper is treated as hostile


class _TooDeep(Exception):
    pass


class _TooLong(Exception):
    pass


class _Frame:
    __slots__ = ("depth", "kind", "parts", "pending", "redirs", "words")

    def __init__(self, kind: int) -> None:
        self.kind = kind
        self.words: list[str] = []
        self.parts: list[str] = []  # pieces of the word being built; non-empty == inside a word
        self.redirs: list[str] = []
        self.pending: str | None = None  # redirect operator waiting for its target word
        self.depth = 0  # unmatched "(" inside a $( ... ) frame


Segment = tuple[list[str], list[str]]  # (words, redirections)


def _end_word(f: _Frame) -> None:
    w = "".join(f.parts)
    f.parts.clear()
    if f.pending is not None:
        f.redirs.append(f"{f.pending} {w}")
        f.pending = None
    else:
        f.words.append(w)


def _end_segment(f: _Frame, segments: list[Segment]) -> None:
    if f.parts:
        _end_word(f)
    if f.words or f.redirs:
        segments.append((f.words, f.redirs))
        f.words, f.redirs = [], []
    f.pending = None


def _lex(s: str, budget: list[int]) -> tuple[list[Segment], bool]:
    """Split ``s`` into simple commands.  Returns (segments, simple) where ``simple`` is False if any
    operator, redirection, substitution or comment occurred outside single quotes.
    ``budget[0]`` is the number of tokens that may still be read (shared with nested payloads); raises
    _TooLong when it runs out and _TooDeep when substitutions/quotes nest deeper than _MAX_NESTING."""
    cmd_match = _lexer()[0].match
    dq_match = _lexer()[1].match
    segments: list[Segment] = []
    simple = True
    stack = [_Frame(_TOP)]
    cur = stack[0]  # innermost command frame (never a _DQ frame)
    in_dq = False
    pos, n = 0, len(s)
    left = budget[0]

    def push(kind: int) -> _Frame:
        if len(stack) >= _MAX_NESTING:
            raise _TooDeep
        f = _Frame(kind)
        stack.append(f)
        return f

    def pop() -> tuple[_Frame, bool]:
        _end_segment(stack.pop(), segments)
        if stack[-1].kind == _DQ:
            return stack[-2], True
        return stack[-1], False

    while pos < n:
        left -= 1
        if left < 0:
            raise _TooLong
        if in_dq:
            m = dq_match(s, pos)
            assert m is not None  # the alternatives cover every character
            pos = m.end()
            kind = m.lastgroup
            if kind == "text":
                cur.parts.append(m.group())
            elif kind == "esc":
                t = m.group()
                if len(t) == 2 and t[1] in '$`"\\\n':
                    if t[1] != "\n":
                        cur.parts.append(t[1])
                else:
                    cur.parts.append(t)
            elif kind == "end":
                stack.pop()
                in_dq = False
            else:  # sub / bq: a command substitution inside double quotes
                simple = False
                cur = push(_PAREN if kind == "sub" else _BQ)
                in_dq = False
            continue

        m = cmd_match(s, pos)
        assert m is not None
        pos = m.end()
        kind = m.lastgroup
        if kind == "wordsp" or kind == "word":
            t = m.group(kind)
            if t[0] == "#" and not cur.parts:
                # A comment runs to the end of the line; the newline itself is still an operator.
                simple = False
                nl = s.find("\n", m.start())
                pos = n if nl < 0 else nl
            elif kind == "word":
                cur.parts.append(t)
            elif cur.parts or cur.pending is not None:
                cur.parts.append(t)
                _end_word(cur)
            else:
                cur.words.append(t)  # fast path: a plain word followed by blanks
        elif kind == "ws":
            if cur.parts:
                _end_word(cur)
        elif kind == "sq":
            t = m.group()
            cur.parts.append(t[1:-1] if len(t) > 1 and t[-1] == "'" else t[1:])
        elif kind == "dqs":
            cur.parts.append(m.group(kind))  # double-quoted text without $, ` or \\: nothing to expand
        elif kind == "dq":
            cur.parts.append("")  # "" is still a (possibly empty) word
            push(_DQ)
            in_dq = True
        elif kind == "esc":
            t = m.group()
            if t != "\\\n":  # backslash-newline is a line continuation
                cur.parts.append(t[1:])
        elif kind == "redir":
            simple = False
            if cur.parts:
                _end_word(cur)
            cur.pending = m.group("redir")
        elif kind == "sub":
            simple = False
            cur = push(_PAREN)
        elif kind == "bq":
            simple = False
            if cur.kind == _BQ:
                cur, in_dq = pop()
            else:
                cur = push(_BQ)
        elif kind == "close":
            simple = False
            if cur.kind == _PAREN and cur.depth == 0:
                cur, in_dq = pop()
            else:
                cur.depth = max(cur.depth - 1, 0)
                _end_segment(cur, segments)
        else:  # op / open
            simple = False
            if kind == "open":
                cur.depth += len(m.group())
            _end_segment(cur, segments)

    for f in stack:
        if f.kind != _DQ:
            _end_segment(f, segments)
    budget[0] = left
    if len(segments) > 1:
        simple = False
    return segments, simple


# --------------------------------------------------------------------------- normalisation
_RESERVED = frozenset({"!", "{", "}", "if", "then", "else", "elif", "do", "while", "until", "time", "coproc"})

def _opts(spec: str) -> frozenset[str]:
    return frozenset(spec.split())


# wrapper -> (options that take a separate argument, positional arguments before the wrapped command)
_WRAPPERS: dict[str, tuple[frozenset[str], int]] = {
    "sudo": (
        _opts(
            "-u -g -h -p -C -D -r -t -U -T --user --group --host --prompt --close-from --chdir "
            "--role --type --other-user --command-timeout"
        ),
        0,
    ),
    "doas": (frozenset({"-u", "-C"}), 0),
    "env": (frozenset({"-u", "-C", "-S", "--unset", "--chdir", "--split-string"}), 0),
    "nice": (frozenset({"-n", "--adjustment"}), 0),
    "ionice": (frozenset({"-c", "-n", "-p", "-P", "-u", "--class", "--classdata"}), 0),
    "time": (frozenset({"-f", "-o", "--format", "--output"}), 0),
    "timeout": (frozenset({"-s", "-k", "--signal", "--kill-after"}), 1),
    "stdbuf": (frozenset({"-i", "-o", "-e"}), 0),
    "xargs": (
        _opts(
            "-a -d -E -I -L -n -P -s --arg-file --delimiter --max-args --max-procs --max-chars "
            "--max-lines --process-slot-var"
        ),
        0,
    ),
    "chroot": (frozenset({"--userspec", "--groups"}), 1),
    "flock": (frozenset({"-w", "-E", "--timeout", "--conflict-exit-code"}), 1),
    "taskset": (frozenset(), 1),
    "watch": (frozenset({"-n", "--interval"}), 0),
    "exec": (frozenset({"-a"}), 0),
    "nohup": (frozenset(), 0),
    "setsid": (frozenset(), 0),
    "command": (frozenset(), 0),
    "builtin": (frozenset(), 0),
    "unbuffer": (frozenset(), 0),
    "busybox": (frozenset(), 0),
    "toybox": (frozenset(), 0),
}
_SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "mksh", "ash", "yash"})
_SHELL_OPTS_WITH_ARG = frozenset({"-o", "+o", "-O", "+O", "--rcfile", "--init-file"})


def _basename(word: str) -> str:
    return word.rsplit("/", 1)[-1] if "/" in word else word


def _strip_prefixes(words: list[str]) -> list[str]:
    """Drop assignments, reserved words and wrappers so that words[0] is the real command."""
    assign = _lexer()[2]
    i, n = 0, len(words)
    while i < n:
        w = words[i]
        if w in _RESERVED or assign.match(w):
            i += 1
            continue
        base = _basename(w)
        spec = _WRAPPERS.get(base)
        if spec is None:
            break
        opts_with_arg, positionals = spec
        i += 1
        while i < n:
            a = words[i]
            if a == "--":
                i += 1
                break
            if not a.startswith("-"):
                break
            if base == "command" and a in ("-v", "-V"):
                return []  # `command -v reboot` only looks the name up
            i += 2 if a in opts_with_arg else 1
        i += positionals
    return words[i:]


def _shell_payload(base: str, args: list[str]) -> str | None:
    """The command string run by ``sh -c X``, ``su -c X`` or ``eval X...``; None if there is none."""
    if base == "eval":
        return " ".join(args)
    if base in _SHELLS:
        short_c = _lexer()[3]
        has_c = False
        i = 0
        while i < len(args):
            a = args[i]
            if a in ("--", "-"):
                i += 1
                break
            if not a or a[0] not in "-+":
                break
            if a in _SHELL_OPTS_WITH_ARG:
                i += 2
                continue
            if not a.startswith("--") and short_c.match(a):
                has_c = True
            i += 1
        return args[i] if has_c and i < len(args) else None
    if base in ("su", "runuser"):
        for i, a in enumerate(args):
            if a in ("-c", "--command", "--session-command") and i + 1 < len(args):
                return args[i + 1]
            if a.startswith("--command="):
                return a[len("--command=") :]
    return None


# --------------------------------------------------------------------------- checking
def _blocked(rule: _Rule, text: str) -> Verdict:
    snippet = text if len(text) <= _SNIPPET else text[: _SNIPPET - 3] + "..."
    return Verdict(False, rule.id, f"blocked by rule '{rule.id}': {rule.description} (matched {snippet!r})")


_TOO_DEEP = Verdict(
    False,
    "too-deep",
    "blocked by rule 'too-deep': substitutions or nested shell payloads (sh -c, eval) are nested too "
    "deeply or are too large to inspect",
)


def _too_long(what: str) -> Verdict:
    return Verdict(False, "too-long", f"blocked by rule 'too-long': {what}; refusing to inspect it")


_TOKENS_EXCEEDED = f"command has more than {MAX_TOKENS} shell tokens (counting nested sh -c/eval payloads)"


def _scan(s: str, depth: int, budget: list[int]) -> tuple[Verdict | None, bool]:
    """Apply the built-in rules to ``s``; returns (first block or None, whether s is a simple command).
    ``budget`` is the token budget shared with nested payloads, so ``eval eval eval ...`` cannot make
    the work quadratic."""
    rules = _rules()
    for r in rules.raw:
        m = r.regex.search(s)
        if m:
            return _blocked(r, m.group()), False
    try:
        segments, simple = _lex(s, budget)
    except _TooDeep:
        return _TOO_DEEP, False
    except _TooLong:
        return _too_long(_TOKENS_EXCEEDED), False
    for words, redirs in segments:
        for red in redirs:
            for r in rules.redir:
                if r.regex.match(red):
                    return _blocked(r, red), simple
        words = _strip_prefixes(words)
        if not words:
            continue
        base = _basename(words[0])
        if rules.trigger.fullmatch(base):
            text = " ".join([base, *words[1:]])
            for r in rules.cmd:
                if r.regex.match(text):
                    return _blocked(r, text), simple
        payload = _shell_payload(base, words[1:])
        if payload is not None:
            if depth >= _MAX_DEPTH:
                return _TOO_DEEP, simple
            verdict, _ = _scan(payload, depth + 1, budget)
            if verdict is not None:
                return verdict, simple
    return None, simple


def check(
    command: str,
    *,
    blocklist: bool = True,
    extra_block: Sequence[str] = (),
    allow: Sequence[str] = (),
) -> Verdict:
    """Decide whether ``command`` may run.  Order: built-in blocklist, ``extra_block``, allowlist."""
    extras = [_compile_extra(p) for p in extra_block]  # config errors surface even for empty commands
    if not (blocklist or extras or allow):
        return _ALLOWED
    if len(command) > MAX_COMMAND_LEN:
        return _too_long(f"command is {len(command)} characters, more than {MAX_COMMAND_LEN}")

    stripped = command.strip(" \t\r\n\f\v")
    simple: bool | None = None
    if blocklist and not extras and not allow and _cannot_match(command):
        return _ALLOWED
    if blocklist:
        verdict, simple = _scan(stripped, 0, [MAX_TOKENS])
        if verdict is not None:
            return verdict
    for i, (pattern, rx) in enumerate(zip(extra_block, extras, strict=True), 1):
        m = rx.search(command)  # RE2: linear in the command, whatever the operator wrote
        if m:
            rid = f"custom-{i}"
            hit = m.group() if len(m.group()) <= _SNIPPET else m.group()[: _SNIPPET - 3] + "..."
            return Verdict(False, rid, f"blocked by rule '{rid}': matched block pattern '{pattern}' (at {hit!r})")
    if allow:
        if simple is None:
            try:
                simple = _lex(stripped, [MAX_TOKENS])[1]
            except _TooDeep:
                simple = False
            except _TooLong:
                return _too_long(_TOKENS_EXCEEDED)
        if not simple:
            return Verdict(
                False,
                "allowlist",
                "blocked by rule 'allowlist': shell chaining, redirection, substitution or comments "
                "are not permitted when an allowlist is configured",
            )
        from fnmatch import fnmatchcase

        if not any(fnmatchcase(stripped, g) for g in allow):
            return Verdict(
                False,
                "allowlist",
                f"blocked by rule 'allowlist': command matches none of the allowed patterns {list(allow)!r}",
            )
    return _ALLOWED
