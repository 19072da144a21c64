"""Run a Python script, one function of it, or one statement, inside the sandbox.

    >>> r = run_python("calc.py", [2, 3], function="add")
    >>> r.return_value
    5

The script's bytes are read once, scanned (optional), and copied into a private
0700 temp dir (named as a fresh workdir) whose copy is bound read-only at /sandbox/script/NAME. So what
runs is exactly what was scanned, a 0600 script is still readable by the sandbox's
uid, and nothing is ever written into the caller's directory (symlink planting:
Judge0 CVE-2024-28185). A function or statement is run by a small driver
(`python3 -c DRIVER`) that imports the script by path and prints the JSON-encoded
return value on a last line tagged with a random token, so it separates cleanly
from whatever the function printed itself.

The content scan (`[filter] scan` regexes in the profile, empty in `strict`
because the sandbox is the boundary) is a first-line filter: a match returns a
Result with status "blocked" and nothing runs.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
import sys
import time
from collections.abc import Sequence
from typing import Any

from . import strictjson
from .errors import InputError, ProfileError, write_failure
from .profile import Profile
from .record import record
from .result import Result

SCRIPT_DIR = "/sandbox/script"  # where the script appears inside
MAX_SCRIPT_BYTES = 16 * 2**20
_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,200}")

# Runs inside the sandbox with the system python3; data arrives in argv, never in the source.
DRIVER = r"""
import asyncio, importlib.machinery, importlib.util, inspect, json, os, sys
tok, mode, path, what, raw = sys.argv[1:6]
extra = json.loads(raw)
sys.argv = [path] + ([str(a) for a in extra] if mode == "statement" else [])
sys.path.insert(0, os.path.dirname(path))
# (a name without .py found no loader: the driver's own AttributeError)
spec = importlib.util.spec_from_file_location(
    "__sandboxrun_script__", path, loader=importlib.machinery.SourceFileLoader("__sandboxrun_script__", path))
mod = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = mod
spec.loader.exec_module(mod)
if mode == "function":
    fn = mod
    for part in what.split("."):
        if not hasattr(fn, part):
            sys.exit(f"sandboxrun: {os.path.basename(path)} has no function {what!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        sys.exit(f"sandboxrun: {what!r} in {os.path.basename(path)} is not callable")
    value = fn(*extra)
else:
    try:
        code = compile(what, "<statement>", "eval")
    except SyntaxError:
        code = compile(what, "<statement>", "exec")
    value = eval(code, vars(mod))
if inspect.iscoroutine(value):
    value = asyncio.run(value)
out = {"type": type(value).__name__}
try:
    text = json.dumps(dict(out, json=True, value=value), allow_nan=False)
except (TypeError, ValueError, RecursionError):
    text = ""
if not text or len(text) > 65536:  # a value past the output cap was lost, its tagged line left in stdout
    if hasattr(sys, "set_int_max_str_digits"):  # an int of over 4300 digits: its repr, not a ValueError
        sys.set_int_max_str_digits(0)
    try:
        r = repr(value)
    except BaseException as e:  # a list nested past the recursion limit, a __repr__ that raises
        r = f"<{type(value).__name__} object: its repr() raised {type(e).__name__}: {e}>"
    text = json.dumps(dict(out, json=False, repr=r[:65536], truncated=len(r) > 65536))
for s in (sys.stdout, sys.stderr):
    try:
        s.flush()
    except Exception:
        pass
sys.__stdout__.buffer.write(("\n" + tok + text + "\n").encode())
sys.__stdout__.buffer.flush()
"""


@record
class PythonResult(Result):
    """A Result plus what a function or statement returned."""

    returned: bool = False  # the function/statement finished and its value came back
    return_value: Any = None  # the value, JSON-decoded (None when it was not JSON-encodable)
    return_type: str | None = None  # its Python type name
    return_repr: str | None = None  # repr() when the value is not JSON-encodable or its JSON is over 64 KiB
    return_truncated: bool = False  # return_repr is the first 64 KiB of the repr
    return_lost: str | None = None  # why a function that returned gave no value back (the output cap)


def _load_profile(profile: str | Profile) -> Profile:
    from .profile import load

    return profile if isinstance(profile, Profile) else load(profile)


def scan(text: str, prof: Profile, what: str = "script") -> str | None:
    """The first `[filter] scan` pattern that matches `text` (the script, or a statement), as
    a reason naming the line of it; None when none does."""
    from .linear_regex import compile_pattern

    for i, pattern in enumerate(prof.scan):
        try:
            rx = compile_pattern(pattern, multiline=True)  # RE2: linear in the script's length
        except ValueError as e:
            raise ProfileError(str(e), source=prof.source, key=f"filter.scan[{i}]", value=pattern) from None
        m = rx.search(text)
        if m:
            line = text.count("\n", 0, m.start()) + 1
            return f"{what} matches content-scan pattern {pattern!r} (line {line})"
    return None


def _blocked(argv: list[str], prof: Profile, reason: str, started: float) -> PythonResult:
    return PythonResult(command=argv, status="blocked", blocked=True, block_reason=reason, error=reason,
                        isolation=None, profile=prof.name, duration_ms=round((time.monotonic() - started) * 1000, 3))


def _read_script(script: str | os.PathLike[str]) -> tuple[str, bytes]:
    if not isinstance(script, (str, os.PathLike)):
        raise InputError(f"script: expected a path, got {type(script).__name__}")
    path = os.fspath(script)
    if not path or "\0" in path:
        raise InputError("script: empty path or NUL byte")
    if isinstance(path, str):
        from .errors import os_bytes

        os_bytes(path, "script")  # a lone surrogate: an InputError, not a UnicodeEncodeError
    from .hostpaths import open_for_reading

    fd = open_for_reading(path, "script")  # no link anywhere in its path: we may be root
    try:
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise InputError(f"script: not a regular file: {path}")
            data = f.read(MAX_SCRIPT_BYTES + 1)
    except OSError as e:
        raise InputError(f"script: cannot read {path}: {e.strerror}") from None
    if len(data) > MAX_SCRIPT_BYTES:
        raise InputError(f"script: {path} is larger than {MAX_SCRIPT_BYTES} bytes")
    name = os.path.basename(os.path.normpath(path))
    return (name if _SAFE_NAME.fullmatch(name) else "script.py"), data


def _check_target(function: str | None, statement: str | None) -> None:
    if function is not None and statement is not None:
        raise InputError("give either function or statement, not both")
    if function is not None:
        if not isinstance(function, str) or not all(p.isidentifier() for p in function.split(".")):
            raise InputError(f"function: expected a Python name such as main or Class.method, got {function!r}")
    if statement is not None:
        if not isinstance(statement, str) or not statement.strip():
            raise InputError("statement: expected a non-empty string")
        try:
            compile(statement, "<statement>", "exec")
        except SyntaxError as e:
            raise InputError(f"statement: invalid Python: {e.msg} (line {e.lineno})") from None
        except ValueError as e:  # NUL bytes
            raise InputError(f"statement: {e}") from None


def _argv(target: str, args: Sequence[Any], function: str | None, statement: str | None, token: str) -> list[str]:
    if isinstance(args, (str, bytes)):
        raise InputError("args: expected a list of arguments, not a single string")
    if not isinstance(args, (list, tuple)):
        raise InputError(f"args: expected a list of arguments, got {type(args).__name__}")
    args = list(args)
    if function is None and statement is None:
        for i, a in enumerate(args):
            if not isinstance(a, str):
                raise InputError(f"args[{i}]: a script's arguments must be strings, got {type(a).__name__}")
        return ["python3", target, *args]
    try:
        raw = json.dumps(args, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InputError(f"args: must be JSON-encodable to reach the function: {e}") from None
    except RecursionError:
        raise InputError("args: must be JSON-encodable to reach the function: nested too deeply") from None
    if function is not None:
        return ["python3", "-c", DRIVER, token, "function", target, function, raw]
    return ["python3", "-c", DRIVER, token, "statement", target, statement or "", raw]


def _shown(argv: list[str]) -> list[str]:
    """The driver's argv as reported in Result.command: its source and token elided."""
    if argv[1:2] != ["-c"]:
        return argv
    return [argv[0], "-c", "<sandboxrun driver>", *argv[4:]]


_LOST = "stdout reached the output cap before the value was written whole: print less, or raise the output limit"


def _take_return(res: PythonResult, token: str) -> None:
    """Find the driver's tagged last line, remove it from stdout, decode the value."""
    tag = b"\n" + token.encode()
    raw = res.stdout_raw
    at = raw.rfind(tag)
    if at < 0:
        cut = _partial_tag(raw, tag)
        if cut is not None:  # the cap fell inside the tag: no part of it is the program's output
            res.stdout_raw = raw[:cut]
            res.stdout = res.stdout_raw.decode(errors="replace")
        if res.stdout_truncated and res.exit_code == 0:
            res.return_lost = _LOST
        return
    end = raw.find(b"\n", at + len(tag))
    line = raw[at + len(tag): end if end >= 0 else len(raw)]
    try:
        d = strictjson.loads(line)
    except (ValueError, RecursionError):
        d = None
    if not isinstance(d, dict):
        res.stdout_raw = raw[:at]  # the tagged line, cut by the cap (or not the driver's)
        res.stdout = res.stdout_raw.decode(errors="replace")
        res.return_lost = _LOST if res.stdout_truncated and end < 0 else _FORGED
        return
    res.stdout_raw = raw[:at] + (raw[end + 1:] if end >= 0 else b"")
    res.stdout_bytes -= len(raw) - len(res.stdout_raw)  # count only what the program printed
    res.stdout = res.stdout_raw.decode(errors="replace")
    # The line is the sandbox's to write (the token is in its argv): nothing of it is trusted
    # to be the driver's, so each field is checked before it goes into the Result.
    res.returned, res.return_type = True, _text(d.get("type"))
    if d.get("json") is True and "value" in d:
        if _carried(d["value"]):
            res.return_value = d["value"]
        else:
            res.return_repr, res.return_truncated = _repr(d["value"])
    else:
        res.return_repr = _text(d.get("repr"))
        res.return_truncated = d.get("truncated") is True


_FORGED = "the program wrote a line tagged as the return value that the driver does not write"
_VALUE_DEPTH = 64  # a value nested deeper comes back as its repr: what reads a Result walks it recursively


def _text(value: Any) -> str | None:
    """A str the Result can carry as JSON text (a lone surrogate, which no UTF-8 reader takes,
    shown as its escape), else None."""
    return strictjson.utf8_text(value) if isinstance(value, str) else None


def _carried(value: Any) -> bool:
    """Whether `value` goes into a Result as it is: nested at most _VALUE_DEPTH levels, and
    no lone surrogate in a string (Python's JSON writes one, escaped; the MCP SDK's reader
    and every UTF-8 one refuse it)."""
    if strictjson.too_deep(value, _VALUE_DEPTH) is not None:
        return False
    try:
        json.dumps(value, ensure_ascii=False).encode()
        return True
    except (UnicodeEncodeError, ValueError, RecursionError):
        return False


def _repr(value: Any) -> tuple[str, bool]:
    """The repr of a value the Result cannot carry as JSON, cut to 64 KiB as the driver's."""
    try:
        r = repr(value)  # (escapes lone surrogates)
    except RecursionError:
        r = f"<{type(value).__name__} nested too deeply for its repr()>"
    return r[:65536], len(r) > 65536


def _partial_tag(raw: bytes, tag: bytes) -> int | None:
    """Where stdout ends with the start of the tag (the cap cut it), else None."""
    for n in range(min(len(tag), len(raw)), 0, -1):
        if raw.endswith(tag[:n]):
            return len(raw) - n if n > 1 else None  # (one newline alone may be the program's)
    return None


def prepare(script: str | os.PathLike[str], args: Sequence[Any], function: str | None, statement: str | None,
            prof: Profile) -> tuple[bytes, str, str, list[str], str | None]:
    """What run_python checks before it copies the script (a payload's --dry-run shows the
    same): the script's bytes, its path inside, the return token, the argv, and the content
    scan's verdict (None, or why it is blocked)."""
    _check_target(function, statement)
    name, data = _read_script(script)
    target = f"{SCRIPT_DIR}/{name}"
    token = "sbxret" + secrets.token_hex(8)
    argv = _argv(target, args, function, statement, token)
    reason = None
    if prof.scan:
        reason = scan(data.decode(errors="replace"), prof) or (scan(statement, prof, "statement") if statement else None)
    return data, target, token, argv, reason


def run_python(
    script: str | os.PathLike[str],
    args: Sequence[Any] = (),
    *,
    function: str | None = None,
    statement: str | None = None,
    profile: str | Profile = "strict",
    **kw: Any,
) -> PythonResult:
    """Run a Python script in the sandbox (read-only at /sandbox/script/NAME).

    With `function`, import the script and call that function with `args` (any
    JSON values); with `statement`, run that statement or expression in the
    script's namespace (`args` become sys.argv[1:]). The return value comes back
    in `return_value` (JSON-decoded) or `return_repr`. Other keyword arguments go
    to sandbox.run (timeout, cwd, env, stdin, memory, output, network, ro_bind...).
    """
    from .supervisor import run

    started = time.monotonic()
    prof = _load_profile(profile)
    data, target, token, argv, reason = prepare(script, args, function, statement, prof)
    if reason:
        return _blocked(_shown(argv), prof, reason, started)
    from .hostpaths import remove_tree
    from .workdir import mkdtemp, tmpdir

    # Under a $TMPDIR where no one else could swap the new directory for a link (else /tmp),
    # and changed only through its fd: what root writes is that directory. 0700: the run sees
    # the copy through its bind, no one else sees it at all (it may be private); named as a
    # fresh workdir, with our pid, so that a later start removes it if we are SIGKILLed.
    try:
        tmp = mkdtemp()[0]
    except OSError as e:  # (a read-only or full $TMPDIR): the host refused, nothing ran
        from .supervisor import _setup_error

        res = _setup_error(argv, prof, "workdir", e.errno or 0,
                           f"cannot make the script's folder under {tmpdir()}: {e.strerror or e}", started)
        return PythonResult(**{k: getattr(res, k) for k in Result.__record_names__})
    try:
        dfd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            fd = os.open("script.py", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o444,
                         dir_fd=dfd)
        finally:
            os.close(dfd)
        copy = os.path.join(tmp, "script.py")
        try:
            with os.fdopen(fd, "wb") as f:
                os.fchmod(fd, 0o444)  # not the caller's umask's: 077 left the sandbox's user no read
                f.write(data)
        except OSError as e:  # a full $TMPDIR, a file size limit: nothing ran
            from .supervisor import _setup_error

            res = _setup_error(argv, prof, "workdir", e.errno or 0,
                               f"cannot copy the script to {copy}: {write_failure(e)}", started, known=True)
            return PythonResult(**{k: getattr(res, k) for k in Result.__record_names__})
        binds = kw.pop("ro_bind", None) or []
        binds = [binds] if isinstance(binds, str) else list(binds)
        res = run(argv, profile=prof, ro_bind=[*binds, f"{copy}:{target}"], **kw)
    finally:
        remove_tree(tmp)
    out = PythonResult(**{k: getattr(res, k) for k in Result.__record_names__})
    if function is not None or statement is not None:
        _take_return(out, token)
        out.command = _shown(argv)
    return out


def run_code(source: str, args: Sequence[str] = (), *, profile: str | Profile = "strict", **kw: Any) -> PythonResult:
    """Run Python source text (`python3 -c SOURCE ARGS...`), after the same content scan."""
    from .supervisor import run

    started = time.monotonic()
    if not isinstance(source, str) or not source.strip():
        raise InputError("code: expected non-empty Python source")
    if "\0" in source:
        raise InputError("code: contains a NUL byte")
    if not isinstance(args, (list, tuple)) or not all(isinstance(a, str) for a in args):
        raise InputError("args: expected a list of strings")
    prof = _load_profile(profile)
    argv = ["python3", "-c", source, *args]
    reason = scan(source, prof) if prof.scan else None
    if reason:
        return _blocked(argv, prof, reason, started)
    res = run(argv, profile=prof, **kw)
    return PythonResult(**{k: getattr(res, k) for k in Result.__record_names__})


# ---------------------------------------------------------------------------- CLI


def _cli_value(text: str) -> Any:
    """A CLI argument for a function: JSON when it parses (1, true, [1,2], "s"), else the string
    (NaN, Infinity and numbers beyond a float's range too: they are not JSON)."""
    try:
        return strictjson.loads(text)
    except (ValueError, RecursionError):  # RecursionError: "[[[[..." nested too deeply to be JSON here
        return text


def _print_value(res: PythonResult) -> None:
    if not res.returned or (res.return_type == "NoneType"):
        return  # as the REPL: None prints nothing
    text = json.dumps(res.return_value) if res.return_repr is None else res.return_repr
    sys.stdout.write(text + "\n")


def main(argv: list[str]) -> int:
    from .cli import exit_code_for, explain, run_kwargs
    from .cliargs import Parser, add_run_options

    p = Parser(prog="sandboxrun python",
                usage="sandboxrun python [OPTIONS] SCRIPT [ARGS...] [--function NAME | --statement EXPR] "
                      "[-- ARGS...]\n       sandboxrun python [OPTIONS] -c CODE [ARGS...] [-- ARGS...]",
                description="Run a Python script, one function of it, one statement, or CODE, in the sandbox. "
                            "With --function, each ARG is passed as JSON when it parses (1, true, [1,2]), "
                            "else as a string; the return value is printed as JSON on the last line.")
    add_run_options(p, without=("--shell",))  # a script is no shell command line
    g = p.add_mutually_exclusive_group()
    g.add_argument("--function", "-f", metavar="NAME", help="import SCRIPT and call NAME(*ARGS)")
    g.add_argument("--statement", "-s", metavar="EXPR", help="run EXPR in SCRIPT's namespace, print its value")
    p.add_argument("-c", dest="code", metavar="CODE", help="run CODE as python3 -c does (no SCRIPT then)")
    p.add_argument("script", metavar="SCRIPT", nargs="?", help="the Python file (made visible read-only)")
    p.add_argument("args", nargs="*", default=[], metavar="ARGS", help="arguments (after -- when they start with '-')")
    head, sep, tail = (argv[:argv.index("--")], True, argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, False, [])
    ns = p.parse_intermixed_args(head)
    args: list[Any] = [*ns.args, *tail] if sep else list(ns.args)
    if ns.code is not None:
        if ns.function is not None or ns.statement is not None:
            p.error("-c: not with --function or --statement (they name a part of a SCRIPT)")
        if not ns.code.strip():
            p.error("-c: expected non-empty Python source")
        if ns.script is not None:  # with -c, every positional is an argument
            args.insert(0, ns.script)
    elif ns.script is None and args:  # `sandboxrun python -- SCRIPT ARGS`, as `sandboxrun -- CMD ARGS`
        ns.script = args.pop(0)
    elif ns.script is None:
        p.error("a SCRIPT or -c CODE is required")
    if ns.function is not None:
        args = [_cli_value(a) for a in args]
    kw = run_kwargs(ns)
    if ns.stdin_file is not None:
        from .cli import stdin_file_input

        kw.update(stdin_file_input(ns.stdin_file))
    else:
        from .cli import _passes_stdin

        if _passes_stdin():
            kw["stdin_from"] = 0  # `echo x | sandboxrun python s.py`, as `sandboxrun -- cmd` does
    from . import supervisor

    supervisor.use_direct_forker()  # the CLI is single-threaded: fork from here
    plain = ns.function is None and ns.statement is None
    through: tuple[Any, ...] = ()
    if plain and not ns.json:
        from .cli import _WriteThrough

        sys.stdout.flush()
        sys.stderr.flush()
        through = (_WriteThrough(1), _WriteThrough(2))  # never blocking the loop that keeps the deadline
        kw["on_stdout"], kw["on_stderr"] = through[0].write, through[1].write
    if ns.code is not None:
        res = run_code(ns.code, args, **kw)
    else:
        res = run_python(ns.script, args, function=ns.function, statement=ns.statement, **kw)
    for t in through:
        t.finish()
    if ns.json:
        print(res.to_json(indent=2))
        return exit_code_for(res)
    if not plain:
        sys.stdout.buffer.write(res.stdout_raw)
        sys.stdout.flush()
        sys.stderr.buffer.write(res.stderr_raw)
        sys.stderr.flush()
        _print_value(res)
        if res.return_lost:
            sys.stderr.write(f"sandboxrun: no return value: {res.return_lost}\n")
    line = explain(res)
    if line:
        sys.stderr.write(line + "\n")
    return exit_code_for(res)


__all__ = ["PythonResult", "run_python", "run_code", "scan", "main"]
