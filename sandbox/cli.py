"""Command line: `sandboxrun [OPTIONS] -- CMD ARGS...` and subcommands.

Exit codes: the command's own; 128+N when a signal ended it; 124 on timeout (as
timeout(1)); 125 when blocked or when the sandbox could not be set up; 2 for bad
arguments, profiles or payloads; 130 on Ctrl-C (143 on SIGTERM, 129 on SIGHUP, 128+N on a timer's
signal or SIGXCPU; `mcp`, a server, ends cleanly with 0). Errors are one line, never a traceback (`--debug` shows one).
"""

from __future__ import annotations

import io
import os
import sys

from . import signals
from .errors import EXIT_SANDBOX, InputError, SandboxError

TYPE_CHECKING = False  # typing costs ~5 ms to import; annotations here are strings anyway
if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable, Sequence
    from typing import Any

EXIT_TIMEOUT = 124
# output_limit: 128 + SIGKILL, the kill output_overflow = "kill" calls for, whether it landed or
# the command had already ended by itself (its exit code, 0 included, is in --json's
# exit_code): the same output gives the same exit code however the reads fell.
EXIT_OUTPUT_LIMIT = 137
EXIT_INTERRUPTED = 130

SUBCOMMANDS = ("run", "check", "profiles", "doctor", "start", "list", "poll", "log", "write", "send-keys",
               "submit", "paste", "kill", "wait", "clear", "remove", "payload", "python", "mcp", "batch")

_SESSION_COMMANDS = ("start", "list", "poll", "log", "write", "send-keys", "submit", "paste", "kill", "wait",
                     "clear", "remove")


def _env_pairs(values: Sequence[str] | None) -> dict[str, str]:
    out = {}
    for item in values or ():
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise SandboxError(f"--env {item!r}: expected NAME=VALUE")
        out[k] = v
    return out


# The run options, for both parsers (this file's plain one and cliargs' argparse one):
# (names, kind, choices, metavar, help); kind "value" takes one value, "list" is repeatable,
# "flag" takes none. The attribute is the first name's (--ro-bind: ro_bind).
RUN_OPTIONS: tuple[tuple[tuple[str, ...], str, tuple[str, ...] | None, str | None, str], ...] = (
    (("--profile", "-p"), "value", None, None, "built-in profile name or a TOML file (default: strict)"),
    (("--timeout", "-t"), "value", None, None, "wall timeout, e.g. 30, 30s, 2m (0 = none, if the profile allows)"),
    (("--memory",), "value", None, None, "memory limit, e.g. 256MiB"),
    (("--cwd",), "value", None, None, "workdir to mount read-write (default: a fresh, size-capped, empty tmpfs)"),
    (("--env", "-e"), "list", None, "K=V", "set a variable inside (repeatable)"),
    (("--ro-bind",), "list", None, "SRC[:DST]", "bind a host path read-only"),
    (("--bind",), "list", None, "SRC[:DST]", "bind a host path read-write"),
    (("--network",), "value", ("none", "loopback", "host"), None, "network mode"),
    (("--stdin-file",), "value", None, "FILE", "feed this file to the command's stdin"),
    (("--shell",), "flag", None, None, "run CMD with /bin/sh -c inside the sandbox"),
    (("--json",), "flag", None, None, "print the Result as JSON instead of streaming output"),
    (("--trace",), "flag", None, None, "record the cost of each child setup step"),
    (("--debug",), "flag", None, None, "show tracebacks for internal errors"),
)
RUN_DEFAULTS = {"profile": "strict"}


def option_attribute(names: tuple[str, ...]) -> str:
    return names[0].lstrip("-").replace("-", "_")


_PLAIN = {name: (kind, option_attribute(names), choices)
          for names, kind, choices, _metavar, _help in RUN_OPTIONS for name in names}


class RunArgs:
    """What argparse's run parser gives (cliargs.add_run_options), for the plain form."""

    def __init__(self) -> None:
        for names, kind, _choices, _metavar, _help in RUN_OPTIONS:
            attribute = option_attribute(names)
            setattr(self, attribute, False if kind == "flag" else RUN_DEFAULTS.get(attribute))
        self.yield_ms: int | None = None
        self.command: list[str] = []


def parse_plain_run(argv: Sequence[str]) -> RunArgs | None:
    """The run options in their plain forms (`--name VALUE`, `--name=VALUE`, `-p VALUE`), then
    `--` and the command: what argparse would make of them, without its ~5 ms of imports and
    set-up. None for anything else (an abbreviation, a value that starts with "-", help, a
    mistake, no `--`): argparse parses that, and words its errors."""
    ns = RunArgs()
    i, end = 0, len(argv)
    while i < end:
        arg = argv[i]
        if arg == "--":
            ns.command = list(argv[i + 1:])
            return ns if ns.command else None
        name, eq, value = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        known = _PLAIN.get(name)
        if known is None:
            return None
        kind, attribute, choices = known
        if kind == "flag":
            if eq:
                return None
            setattr(ns, attribute, True)
            i += 1
            continue
        if not eq:
            if i + 1 >= end or argv[i + 1].startswith("-"):
                return None
            value = argv[i + 1]
        i += 1 if eq else 2
        if choices is not None and value not in choices:
            return None
        if kind == "list":
            setattr(ns, attribute, [*(getattr(ns, attribute) or ()), value])
        else:
            setattr(ns, attribute, value)
    return None


def run_kwargs(ns: argparse.Namespace | RunArgs) -> dict[str, Any]:
    kw: dict[str, Any] = {"profile": ns.profile}
    if ns.timeout is not None:
        kw["timeout"] = ns.timeout
    if ns.memory is not None:
        kw["memory"] = ns.memory
    if ns.cwd is not None:
        kw["cwd"] = ns.cwd
    env = _env_pairs(ns.env)
    if env:
        kw["env"] = env
    if ns.ro_bind:
        kw["ro_bind"] = ns.ro_bind
    if ns.bind:
        kw["bind"] = ns.bind
    if ns.network:
        kw["network"] = ns.network
    if ns.trace:
        kw["trace"] = True
    return kw


# The library's names of the run options, as its errors give them (an override's key, or an
# error's first word): the CLI names the option that was typed instead.
_OPTION_OF = {"timeout": "--timeout", "memory": "--memory", "limits.memory": "--memory", "cwd": "--cwd",
              "bind": "--bind", "ro_bind": "--ro-bind", "network": "--network", "env": "--env",
              "stdin_file": "--stdin-file"}


def named_as_option(e: SandboxError) -> str:
    """The message of an error of `run` or `start`, naming --memory where the library said
    `override: limits.memory = ...`, and --stdin-file where it said `stdin_file: ...`."""
    from .errors import ProfileError

    if isinstance(e, ProfileError):
        if e.source != "override" or e.key not in _OPTION_OF:
            return str(e)
        value = "" if e.value is None or isinstance(e.value, (list, tuple, dict)) else repr(e.value)
        if len(value) > 40:  # (a 400-digit --timeout)
            value = value[:30] + f"... ({len(value)} characters)"
        return f"{_OPTION_OF[e.key]}{' ' + value if value else ''}: {e.reason}"
    word, sep, rest = str(e).partition(": ")
    return f"{_OPTION_OF[word]}: {rest}" if sep and word in _OPTION_OF else str(e)


def exit_code_for(result: Any) -> int:
    st = result.status
    if st in ("blocked", "setup_error"):
        return EXIT_SANDBOX
    if st == "timeout":
        return EXIT_TIMEOUT
    if st == "output_limit":
        return EXIT_OUTPUT_LIMIT
    if result.exit_code >= 0:
        return int(result.exit_code)
    if result.signal:
        number = signals.number(result.signal)
        if number:
            return 128 + number
    return EXIT_SANDBOX if st in ("memory_limit", "cpu_limit") else 1


def explain(result: Any) -> str | None:
    """One line for stderr when the run did not end on its own."""
    st = result.status
    if st == "blocked":
        return f"sandboxrun: blocked: {result.block_reason}"
    if st == "setup_error":
        return f"sandboxrun: sandbox setup failed: {result.error}"
    if st == "timeout":
        return f"sandboxrun: timed out ({result.error})"
    if st in ("memory_limit", "cpu_limit", "output_limit"):
        return f"sandboxrun: {st.replace('_', ' ')}: {result.error}"
    if st == "signaled":  # with its error where there is one (the limit a SIGXFSZ is the signal of)
        if not result.error:
            return f"sandboxrun: killed by {result.signal}"
        if result.error.startswith(f"{result.signal},"):
            return f"sandboxrun: killed by {result.error}"
        return f"sandboxrun: killed by {result.signal}: {result.error}"
    if result.exit_code in (126, 127) and result.error:
        return f"sandboxrun: {result.error}"
    if result.stdout_truncated or result.stderr_truncated:
        return (f"sandboxrun: output truncated (stdout {result.stdout_bytes} bytes, "
                f"stderr {result.stderr_bytes} bytes)")
    return None


class _WriteThrough:
    """The command's output passed on to our fd as it comes, never blocking the supervisor's
    loop, which also keeps the deadline: a reader that stops reading must not hold the run
    past its timeout. What the reader has room for now is written (PIPE_BUF at a time: a
    pipe that polls writable takes that much without blocking); the rest waits (at most the
    output cap, which the run holds anyway) and is written once the run has ended. A
    reader gone or a full disk: the output is dropped, the exit code stays the command's."""

    def __init__(self, fd: int) -> None:
        import select

        self.fd = fd
        self.pending = bytearray()
        self.dead = False
        self._poll = select.poll()
        self._poll.register(fd, select.POLLOUT)

    def write(self, data: bytes) -> None:
        if not self.dead:
            self.pending += data
            self._drain(block=False)

    def finish(self) -> None:
        self._drain(block=True)

    def _drain(self, *, block: bool) -> None:
        while self.pending and not self.dead:
            if not self._poll.poll(None if block else 0):  # (blocking: an fd the caller made non-blocking waits too)
                return
            try:
                n = os.write(self.fd, self.pending[:1 << 16] if block else self.pending[:4096])
            except BlockingIOError:
                return
            except OSError:  # EPIPE, ENOSPC, EBADF...
                self.dead = True
                self.pending.clear()
                return
            del self.pending[:n]


class _SturdyOut(io.FileIO):
    """fd 1 or 2 under sys.stdout / sys.stderr.

    A fd that another holder of a shared pipe made non-blocking: a write that finds it full
    waits (TextIOWrapper had lost what did not fit: `--json` stopped at 64 KiB, a batch line
    was cut without a word). With `drop`, a reader that went away (`sandboxrun --json ... |
    head`) or a full disk drops the rest, as the streaming mode drops the command's output:
    the exit status stays the command's, never an "internal error" (125 reads as "blocked")."""

    def __init__(self, fd: int, drop: bool) -> None:
        super().__init__(fd, "w", closefd=False)
        self.drop = drop

    def write(self, data: Any) -> int:
        while True:
            try:
                n = super().write(data)
            except OSError:  # EPIPE; ENOSPC (/dev/full, a full disk); EFBIG (ulimit -f)
                if not self.drop:
                    raise
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, self.fileno())  # later writes, and the flush at exit, go nowhere quietly
                os.close(devnull)
                return memoryview(data).nbytes
            if n is not None:
                return n  # (a short write: BufferedWriter writes the rest)
            from .fdwait import writable

            writable(self.fileno(), None)  # full, and non-blocking: wait, never lose it


def _sturdy(name: str, fd: int, drop: bool) -> None:
    out = getattr(sys, name)
    if out is None or out is not getattr(sys, f"__{name}__"):
        return  # someone else's stream (a test's capture, an earlier call): leave it alone
    try:
        out.flush()
    except OSError:
        pass
    try:
        raw = _SturdyOut(fd, drop)
    except (OSError, ValueError):
        return  # no such fd (closed): nothing to guard
    errors = "backslashreplace" if out.errors == "strict" else out.errors  # an ASCII locale: no crash on a name
    setattr(sys, name, io.TextIOWrapper(io.BufferedWriter(raw), encoding=out.encoding, errors=errors,
                                        line_buffering=out.line_buffering, write_through=out.write_through))


def _parse_run(argv: list[str]) -> tuple[argparse.Namespace | RunArgs, list[str]]:
    plain = parse_plain_run(argv)
    if plain is not None:
        return plain, plain.command
    return parse_run_with_argparse(argv)


def parse_run_with_argparse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The run options, any form argparse takes; a usage error (exit 2) for the rest."""
    import argparse

    from .cliargs import Parser, add_run_options, command_of, integer

    p = Parser(prog="sandboxrun", description="Run CMD in a sandbox.",
               usage="sandboxrun [run] [OPTIONS] -- CMD [ARGS...]")
    add_run_options(p)
    p.add_argument("--yield-ms", type=integer, help="become a background session after this many ms")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    ns = p.parse_args(argv)
    return ns, command_of(p, ns, "sandboxrun [OPTIONS] -- CMD [ARGS...]")


def _passes_stdin() -> bool:
    """Our stdin is a pipe, socket or file: the command reads a copy of it. A terminal is not
    passed on (an interactive program wants `sandboxrun start --pty`), nor a directory or a
    device; the command then reads an empty stdin."""
    from .stdin import check_stream, copyable_input

    try:
        if not copyable_input(os.fstat(0).st_mode):
            return False
    except OSError:
        return False
    check_stream(0, "stdin")  # `<&5` of a write-only fd: an error, as the command itself would get
    return True


def stdin_file_input(given: str, what: str = "--stdin-file") -> dict[str, int]:
    """--stdin-file, as `< F` gives it: a regular file is handed to the command (opened here,
    read-only: an fd of no one else's); a FIFO is waited on until a writer opens it, as the
    shell does (its O_NONBLOCK open read EOF at once: nothing), then copied in as a pipe on
    our stdin is; /dev/null is no input; another device is refused by name. Ctrl-C ends the wait."""
    import stat

    from .hostpaths import open_for_reading

    fd = open_for_reading(given, what)  # no planted link followed; O_NONBLOCK: a FIFO's open never waits
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISREG(mode):
            os.set_blocking(fd, True)
            handed, fd = fd, -1  # (not closed below)
            return {"stdin_fd": handed}
        if stat.S_ISFIFO(mode):
            try:  # the FIFO the walk checked (its fd), not whatever the path names now; blocking
                return {"stdin_from": os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)}
            except OSError as e:
                raise InputError(f"{what}: {given}: {e.strerror}") from None
        if stat.S_ISCHR(mode) and os.path.samestat(os.fstat(fd), os.stat(os.devnull)):
            return {"stdin": b""}  # (`< /dev/null`: no input)
        raise InputError(f"{what}: {given}: a device, not a file or a FIFO: give its data through a pipe")
    finally:
        if fd >= 0:
            os.close(fd)


def cmd_run(argv: list[str], explicit: bool = False) -> int:
    """`sandboxrun [run] ...`; `explicit`: the word `run` was given, so CMD is no mistyped subcommand."""
    ns, cmd = _parse_run(argv)
    kw = run_kwargs(ns)
    # `--shell -- 'echo a' '$HOME'`: the words joined with spaces, one script (as `sh -c "$*"`)
    shell_cmd: Any = " ".join(cmd) if ns.shell and len(cmd) > 1 else (cmd[0] if ns.shell else cmd)
    if ns.yield_ms is not None:
        from .units import MAX_DURATION

        if not 0 <= ns.yield_ms <= MAX_DURATION * 1000:
            raise InputError(f"--yield-ms: expected 0 to {MAX_DURATION * 1000:.0f} milliseconds, got {ns.yield_ms}")
        from .sessions import run_or_yield

        # A session's monitor reads --stdin-file by name; the CLI's own stdin does not reach it.
        res = run_or_yield(shell_cmd, yield_after=ns.yield_ms / 1000, shell=ns.shell, stdin_file=ns.stdin_file,
                           **kw)
        print(res.to_json(indent=2))
        return 0 if res.status == "running" else exit_code_for(res)
    from . import supervisor

    supervisor.use_direct_forker()
    if ns.stdin_file is not None:
        kw.update(stdin_file_input(ns.stdin_file))
    elif _passes_stdin():
        kw["stdin_from"] = 0  # copied in: `echo x | sandboxrun -- cat` as with any wrapper command
    if not ns.json:
        sys.stdout.flush()
        sys.stderr.flush()
        through = (_WriteThrough(1), _WriteThrough(2))
        kw["on_stdout"], kw["on_stderr"] = through[0].write, through[1].write
    res = supervisor.run(shell_cmd, shell=ns.shell, **kw)
    if ns.json:
        print(res.to_json(indent=2))
    else:
        for t in through:  # what a slow reader had no room for yet, now that the run is over
            t.finish()
        line = explain(res)
        hint = "" if explicit else _subcommand_hint(argv, cmd, res)
        if line or hint:
            sys.stderr.write("".join(x + "\n" for x in (line, hint) if x))
            sys.stderr.flush()
    return exit_code_for(res)


def _subcommand_hint(argv: list[str], cmd: list[str], res: Any) -> str:
    """`sandboxrun lsit` runs a command `lsit` (any first word that is no subcommand is the
    command); when it is not found and it looks like a subcommand, say which."""
    if res.exit_code != 127 or not argv or not cmd or argv[0] != cmd[0] or "/" in cmd[0]:
        return ""
    if res.error != f"{cmd[0]}: command not found":
        return ""
    import difflib

    close = difflib.get_close_matches(cmd[0], SUBCOMMANDS, n=1, cutoff=0.7)
    return f"sandboxrun: did you mean `sandboxrun {close[0]}`? ({cmd[0]!r} ran as the command)" if close else ""


def cmd_check(argv: list[str]) -> int:
    import argparse

    from .cliargs import Parser, command_of

    p = Parser(prog="sandboxrun check", description="Say whether the first-line filter lets CMD through.")
    p.add_argument("--profile", "-p", default="strict")
    p.add_argument("--json", action="store_true")
    p.add_argument("command", nargs=argparse.REMAINDER)
    ns = p.parse_args(argv)
    cmd = command_of(p, ns, "sandboxrun check -- CMD [ARGS...]")
    from .filter import check
    from .profile import load
    from .shellwords import join

    prof = load(ns.profile)
    text = cmd[0] if len(cmd) == 1 else join(cmd)
    if not cmd[0]:
        p.error("empty command")  # as `sandboxrun -- ''` says: it would not run
    v = check(text, blocklist=prof.blocklist, extra_block=prof.block, allow=prof.allow)
    if ns.json:
        import json

        print(json.dumps({"allowed": v.allowed, "rule": v.rule, "reason": v.reason}))
    else:
        print("allowed" if v.allowed else f"blocked: {v.reason}")
    return 0 if v.allowed else 1


def cmd_profiles(argv: list[str]) -> int:
    from .cliargs import Parser

    p = Parser(prog="sandboxrun profiles", description="List profiles, or show one resolved.")
    p.add_argument("action", nargs="?", choices=("list", "show"), default="list")
    p.add_argument("name", nargs="?")
    p.add_argument("--json", action="store_true")
    ns = p.parse_intermixed_args(argv)  # `profiles show --json NAME` as `profiles show NAME --json`
    from .profile import builtin_names, load

    if ns.action == "list" and ns.name is not None:
        p.error(f"profiles list takes no name (got {ns.name!r}); to see one: profiles show NAME")
    if ns.action == "show":
        if not ns.name:
            p.error("profiles show NAME")
        import json

        prof = load(ns.name)
        print(json.dumps(prof.to_dict(), indent=2))
        return 0
    rows = []
    for name in builtin_names():
        prof = load(name)
        rows.append({"name": name, "description": " ".join(prof.description.split())})
    if ns.json:
        import json

        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            print(f"{r['name']:<10} {r['description']}")
    return 0


def _dispatch(name: str) -> Callable[[list[str]], int]:
    if name == "run":
        return lambda a: cmd_run(a, explicit=True)
    if name == "check":
        return cmd_check
    if name == "profiles":
        return cmd_profiles
    if name == "doctor":
        from .doctor import main as doctor_main

        return doctor_main
    if name in _SESSION_COMMANDS:
        from .sessions_cli import main as sessions_main

        return lambda a: sessions_main([name, *a])
    if name == "payload":
        from .payload import main as payload_main

        return payload_main
    if name == "python":
        from .coderunner import main as python_main

        return python_main
    if name == "mcp":
        from .mcp_server import main as mcp_main

        return mcp_main
    if name == "batch":
        from .batch import main as batch_main

        return batch_main
    raise AssertionError(name)


def _std_fds() -> None:
    """fds 0-2 the caller closed (`>&-`) become /dev/null: a pipe or file opened later must
    not take their numbers, and output to them is lost, not the run (Python gives a None
    sys.stdout for a closed fd 1, and writing to it failed after the command had run)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free number: this one
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    if sys.stdin is None:
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - fd 0 itself (now /dev/null): an empty input
    if sys.stdout is None:
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - fd 1 itself, for the process's life
    if sys.stderr is None:
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115


def _more_files() -> None:
    """A soft RLIMIT_NOFILE the caller left low (`ulimit -Sn 12`) is raised toward its hard
    limit, as far as 1024: a run holds a few pipes and files of its own (the sandbox sets the
    command's own limit, limits.open_files, whatever ours is)."""
    import resource

    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except OSError:  # prlimit64 denied: left as it is (the run names its rlimits step)
        return
    if soft < 1024 and (hard == resource.RLIM_INFINITY or hard > soft):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (1024 if hard == resource.RLIM_INFINITY else min(1024, hard),
                                                        hard))
        except (OSError, ValueError):
            pass


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if argv is None:
        _std_fds()
    # sandboxrun's own option only: after `--` the words are the command's (`-- grep --debug`).
    debug = "--debug" in (args[:args.index("--")] if "--" in args else args)
    if args[:1] != ["mcp"]:  # mcp's stdout is its protocol, the SDK's to write
        _sturdy("stdout", 1, drop=args[:1] != ["batch"])  # batch stops when its reader goes
    _sturdy("stderr", 2, drop=True)  # our own messages: never worth the exit code
    if args[:1] in (["-h"], ["--help"]):
        print("usage: sandboxrun [run] [OPTIONS] -- CMD [ARGS...]\n       sandboxrun SUBCOMMAND ...\n\n"
              "subcommands: " + ", ".join(SUBCOMMANDS) + "\n\nsandboxrun run --help for run options.")
        return 0
    if args[:1] == ["--version"]:
        from . import __version__

        print(f"sandboxrun {__version__}")
        return 0
    if args[:1] == ["--debug"] and args[1:2] and args[1] in SUBCOMMANDS:
        args = [args[1], "--debug", *args[2:]]  # `sandboxrun --debug list`: list's, not a command named list
    handler = cmd_run
    name = "run"
    if args and args[0] in SUBCOMMANDS:
        name = args[0]
        handler = _dispatch(name)
        args = args[1:]

    def on_term(sig: int, _frame: object) -> None:
        if signals.holding(sig):  # taken at the end of a step it must not cut (signals.held)
            return
        if sig in signals.TIMERS:  # an interval timer (or a CPU limit) fires again and again: once asks to end
            for t in signals.TIMERS:
                signals.signal(t, signals.SIG_IGN)
        raise _Terminated(sig)

    on_term.holds = True  # type: ignore[attr-defined]  # (signals.held leaves it in place)
    for sig in signals.ENDING:  # (their default action ended the CLI at once, nothing torn down or said)
        signals.signal(sig, on_term)
    # What a parent may have left us: an ignored SIGCHLD (the kernel would reap our children
    # before we read their pid or status), and blocked signals (a SIGTERM that never came).
    signals.signal(signals.SIGCHLD, signals.SIG_DFL)
    signals.pthread_sigmask(signals.SIG_UNBLOCK, (signals.SIGINT, *signals.ENDING))
    _more_files()
    try:
        return handler(args)
    except KeyboardInterrupt as e:  # the sandbox is torn down on the way out (finally blocks)
        for sig in (signals.SIGINT, *signals.ENDING):  # one more now would cut short the exit hooks' clean-up
            signals.signal(sig, signals.SIG_IGN)
        # Only these run sandboxes of their own; the other session commands talk to a
        # background session, which runs on (and `check`, `profiles` run none).
        owns = name in ("run", "start", "batch", "payload", "python", "mcp", "doctor")
        if owns and name not in ("start", "mcp", "doctor"):  # (not when it ended before any: a FIFO's wait)
            owns = getattr(sys.modules.get("sandbox.supervisor"), "began", False) or "sandbox.sessions" in sys.modules
        print("sandboxrun: interrupted" + ("; sandbox torn down" if owns else ""), file=sys.stderr)
        return 128 + e.signum if isinstance(e, _Terminated) else EXIT_INTERRUPTED
    except SandboxError as e:
        _traceback_if(debug)
        print(f"sandboxrun: error: {named_as_option(e) if name in ('run', 'start', 'python') else e}",
              file=sys.stderr)
        return e.exit_code
    except Exception as e:  # noqa: BLE001 - a CLI answers with one line, not a traceback
        _traceback_if(debug)
        print(f"sandboxrun: internal error: {type(e).__name__}: {e}" + ("" if debug else
              " (rerun with --debug for details)"), file=sys.stderr)
        return EXIT_SANDBOX


def _traceback_if(debug: bool) -> None:
    """--debug: the traceback too, above the same one line and the same exit code."""
    if debug:
        import traceback

        traceback.print_exc()


class _Terminated(KeyboardInterrupt):
    """SIGTERM, SIGHUP or a timer's signal, unwound as Ctrl-C is; the exit code says which
    (128+N, as shells do)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def entry() -> None:
    try:
        code = main()
    except KeyboardInterrupt:  # before main's own handler is in place (its imports, argument parsing)
        sys.stderr.write("sandboxrun: interrupted\n")
        code = EXIT_INTERRUPTED
    try:
        sys.stdout.flush()
    except OSError:  # EPIPE, ENOSPC: the output is lost, the exit code stays
        pass
    if "atexit" not in sys.modules and "threading" not in sys.modules:
        # Nothing registered to run at exit and no thread to join (the plain run's path
        # imports neither): the interpreter's teardown (~3 ms: every module freed) is skipped.
        try:
            sys.stderr.flush()
        except OSError:
            pass
        os._exit(code)
    sys.exit(code)
