"""LLM tool-call JSON payloads (`run_command`, `run_code_script`) run in the sandbox.

    $ echo '{"action": "run_command", "properties": [{"name": "command", "value": "ls"}]}' \\
        | sandboxrun payload

Values arrive as strings, as the tool prompts that emit these payloads define them
(`env` is a JSON object inside a string). Defaults from those prompts: timeout
30 s (at most 120 s), output capped at 1 MB per stream, cwd `./` (the caller's
current directory, bound read-write at the profile's workdir; never a home directory). Every problem is
reported as `{"error": {"field": ..., "message": ...}}` naming the offending field,
and nothing runs. The reply to a valid payload is the Result plus `returncode`
(the name those prompts' executors read; the same number the CLI exits with) and
the payload's `sequential.prompt` passed through. A payload is at most 16 MiB of strict
JSON (no NaN or Infinity) nested at most 100 arrays/objects deep.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from typing import Any

from . import shellwords, strictjson
from .errors import EXIT_SANDBOX, EXIT_USAGE, InputError, ProfileError, SandboxError
from .profile import Profile
from .record import asdict, field, record

DEFAULT_TIMEOUT = 30.0
MAX_TIMEOUT = 120.0
OUTPUT_CAP = "1MB"  # 1,000,000 bytes per stream
DEFAULT_CWD = "./"
MAX_PAYLOAD_BYTES = 16 * 2**20  # one payload, as sent (a script is capped alike: coderunner.MAX_SCRIPT_BYTES)
MAX_DEPTH = 100  # nested arrays/objects in a payload or a function argument: the reply is built recursively
TOP_LEVEL = ("action", "thinking", "sequential", "properties")
PROPERTIES = {
    "run_command": ("command", "cwd", "timeout", "shell", "shelltype", "env", "description"),
    "run_code_script": ("scriptPath", "fileName", "method", "args", "timeout", "shelltype", "env", "description"),
}
SHELLS = {"bash": "/bin/bash", "sh": "/bin/sh"}
FOREIGN_SHELLS = {"maccmd": "macOS Terminal commands", "windowsbat": "Windows batch (cmd.exe)",
                  "windowsps": "Windows PowerShell"}
METHODS = ("script", "function", "statement")
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
# A payload's cwd is bound read-write: never the root or a system tree, whoever asks.
_SYSTEM_TREES = ("/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/boot", "/dev",
                 "/proc", "/sys", "/run", "/var/lib", "/var/log")
# Nor a home directory: what a workdir holding one of these would hand the model (keys and
# tokens, or a shell's start-up files, which run at the next login).
HOME_FILES = (".ssh", ".gnupg", ".aws", ".netrc", ".git-credentials", ".bashrc", ".bash_profile", ".bash_login",
              ".profile", ".zshrc", ".zshenv", ".zprofile")  # (not .config, .docker, .kube: projects hold those too)
_SHOWN = 80  # characters of a payload's value that an error message shows
_MESSAGE = 1000  # characters of an error message at most: no value of up to 16 MiB comes back whole


def _quoted(text: str, limit: int = _SHOWN) -> str:
    """`text` as an error message shows it: its repr (a lone surrogate escaped), cut to its
    first `limit` characters, with its length, when longer."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


def _label(text: str, limit: int = 40) -> str:
    """A name from the payload (an unknown key or property) as the error's field: cut, and
    a lone surrogate shown as its escape."""
    return strictjson.utf8_text(text if len(text) <= limit else text[:limit] + "...")


class PayloadError(InputError):
    """A payload problem: which field, and what is wrong with it."""

    def __init__(self, field: str, message: str) -> None:
        field, message = _label(field, 120), strictjson.utf8_text(message)
        if len(message) > _MESSAGE:  # (a core error naming a value: a path, a variable)
            message = f"{message[:_MESSAGE]}... ({len(message)} characters)"
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"field": self.field, "message": self.message}}


@record
class PayloadRequest:
    """A payload, validated and normalised."""

    action: str
    timeout: float = DEFAULT_TIMEOUT
    cwd: str = ""  # absolute host path of the workdir
    env: dict[str, str] = field(default_factory=dict)
    shelltype: str | None = None
    description: str | None = None
    prompt: Any = None  # sequential.prompt, passed through
    has_prompt: bool = False
    # run_command
    command: str | None = None
    shell: bool = True
    argv: list[str] = field(default_factory=list)
    # run_code_script
    script: str | None = None
    method: str = "script"
    function: str | None = None
    statement: str | None = None
    args: list[Any] = field(default_factory=list)


# ---------------------------------------------------------------------------- parsing


def _props(raw: Any, action: str) -> dict[str, str]:
    if not isinstance(raw, list):
        raise PayloadError("properties", "expected a list of {\"name\": ..., \"value\": ...} objects")
    known = PROPERTIES[action]
    out: dict[str, str] = {}
    seen: set[str] = set()
    for i, item in enumerate(raw):
        where = f"properties[{i}]"
        if not isinstance(item, dict):
            raise PayloadError(where, "expected an object with \"name\" and \"value\"")
        extra = set(item) - {"name", "value"}
        if extra:
            raise PayloadError(where, f"unknown key {_quoted(sorted(extra)[0])} (expected \"name\" and \"value\")")
        name = item.get("name")
        if not isinstance(name, str):
            raise PayloadError(f"{where}.name", "expected a string")
        if name not in known:
            raise PayloadError(_label(name), f"unknown property for {action} (known: {', '.join(known)})")
        if name in seen:  # (a blank or absent value the first time too)
            raise PayloadError(name, "given more than once")
        seen.add(name)
        if "value" not in item:  # as if not given
            continue
        value = item["value"]
        if not isinstance(value, str):  # null too: README's "a non-string value"
            raise PayloadError(name, f"value must be a string, got {_json_type(value)}")
        if "\0" in value:
            raise PayloadError(name, "value contains a NUL byte")
        if value.strip() or name == "command":
            out[name] = value
    return out


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    return {dict: "object", list: "array"}.get(type(v), type(v).__name__)


# Plain decimal seconds: float() also takes "1_0" (10), "inf" and non-ASCII digits.
_SECONDS = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e[-+]?[0-9]+)?s?", re.ASCII)


def _timeout(text: str | None) -> float:
    if text is None:
        return DEFAULT_TIMEOUT
    t = text.strip().lower()
    if not _SECONDS.fullmatch(t):
        raise PayloadError("timeout", f"expected a number of seconds, got {_quoted(text)}")
    v = float(t.removesuffix("s"))
    if not math.isfinite(v) or v <= 0 or v > MAX_TIMEOUT:
        raise PayloadError("timeout", f"{_quoted(text)} is out of range: more than 0 and at most {MAX_TIMEOUT:g} seconds")
    return v


def _bool(name: str, text: str | None, default: bool) -> bool:
    if text is None:
        return default
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise PayloadError(name, f"expected \"true\" or \"false\", got {_quoted(text)}")


def _env(text: str | None) -> dict[str, str]:
    if text is None:
        return {}
    try:
        env = strictjson.loads(text, unique_keys=True)
    except (ValueError, RecursionError) as e:
        raise PayloadError("env", f"expected a JSON object inside the string: {e}") from None
    if not isinstance(env, dict):
        raise PayloadError("env", f"expected a JSON object, got {_json_type(env)}")
    for k, v in env.items():
        if not k or "=" in k or "\0" in k:
            raise PayloadError("env", f"invalid variable name {_quoted(k)}")
        _utf8("env", k)
        if not isinstance(v, str):
            raise PayloadError(f"env.{_label(k)}", f"value must be a string, got {_json_type(v)}")
        if "\0" in v:
            raise PayloadError(f"env.{_label(k)}", "value contains a NUL byte")
        _utf8(f"env.{_label(k)}", v, "surrogateescape")  # as the core checks a variable's value
    return env


def _shelltype(text: str | None) -> str | None:
    if text is None:
        return None
    t = text.strip().lower()
    if t in FOREIGN_SHELLS:
        raise PayloadError("shelltype", f"{t} ({FOREIGN_SHELLS[t]}) is not supported on Linux; use bash")
    if t not in SHELLS:
        raise PayloadError("shelltype", f"unknown shell {_quoted(text)} (supported: {', '.join(SHELLS)})")
    return t


def _utf8(field: str, text: str, errors: str = "strict") -> str:
    """`text`, refused if it holds a lone surrogate (JSON's "\\ud800"): it names no file, and the
    path functions would raise UnicodeEncodeError on it. `errors="surrogateescape"`: the rule the
    core applies to argv (the surrogates that stand for undecodable bytes pass)."""
    try:
        text.encode("utf-8", errors)
    except UnicodeEncodeError as e:
        raise PayloadError(field, f"not valid UTF-8 text: {text[e.start]!r} at offset {e.start} is a lone "
                                  "surrogate") from None
    return text


def _utf8_value(field: str, doc: Any) -> Any:
    """`doc` (a JSON value passed through into the reply), refused if a string or key in it
    holds a lone surrogate, as a string field's value is (the reply would be no UTF-8 text)."""
    try:
        json.dumps(doc, ensure_ascii=False).encode()  # (its depth is checked: at most MAX_DEPTH)
    except UnicodeEncodeError as e:
        raise PayloadError(field, f"not valid UTF-8 text: it holds a lone surrogate, {e.object[e.start]!r}") from None
    return doc


def _check_depth(doc: Any, field: str) -> None:
    """Refuse `doc` if arrays/objects nest in it more than MAX_DEPTH deep: what is built from it
    (the dry run's asdict, the reply's json.dumps) recurses. Iterative, and its memory grows with
    the depth, not the size. The error names `field`, or for a payload the key (and the key or
    index below it) that holds the deep part: "sequential.prompt", "properties[0]"."""
    path = strictjson.too_deep(doc, MAX_DEPTH)
    if path is None:
        return
    where = field
    if field == "payload":  # name the top-level key and what is below it
        for n, key in enumerate(path[:2]):
            where = f"{where}[{key}]" if isinstance(key, int) else key if n == 0 else f"{where}.{key}"
    raise PayloadError(where, f"nested more than {MAX_DEPTH} arrays/objects deep")


def _below(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _inside(field: str, path: str, given: str, root: str | None) -> None:
    """Every payload path must resolve inside the root, and not through a hidden directory
    below it (`.ssh`, `.config` are not the model's; nor is a home directory as the workdir:
    _cwd refuses one)."""
    _utf8(field, given)
    if root is not None and not _below(path, root):
        raise PayloadError(field, f"{_quoted(given)} is outside the allowed root {root}")
    below = path[len(root.rstrip("/")):] if root is not None else path
    hidden = [p for p in below.split("/")[:-1 if field == "scriptPath" else None] if p.startswith(".")]
    if hidden:
        raise PayloadError(field, f"{_quoted(given)} goes through the hidden directory {_quoted(hidden[0])}")


def _cwd(text: str | None, base: str, root: str | None = None) -> str:
    given = _utf8("cwd", text) if text is not None else DEFAULT_CWD
    if text is None and root is not None and not _below(os.path.realpath(base), root):
        base = root  # `--root` below where we run: the default ./ is the root (a script's run has no cwd to give)
    # Not realpath: a link in the path (planted by an earlier run) is refused, not followed.
    path = os.path.normpath(os.path.join(base, os.path.expanduser(given)))
    _inside("cwd", path, given, root)
    from .hostpaths import check_writable_dir

    problem = _home_problem(path)

    def home() -> PayloadError:
        where = f"{path} (the default ./, where sandboxrun payload runs)" if text is None else _quoted(given)
        return PayloadError("cwd", f"{where}: {problem}: a payload's workdir is bound read-write, and the model "
                                   "may not write your keys or login files; run it in a project directory, or pass "
                                   "--root PROJECT_DIR")

    try:
        check_writable_dir(path, "cwd")
    except InputError as e:
        # A home itself is named as one: it holds sandboxrun's own cache too (a rootless user's
        # stage is built there), whose refusal said nothing of the home nor what to do instead.
        if problem and not problem.startswith("it holds the home"):
            raise home() from None
        shown = given if len(given) <= _SHOWN else _quoted(given)
        raise PayloadError("cwd", str(e).removeprefix("cwd: ").replace(path, shown, 1)) from None
    if any(path == t or path.startswith(t + "/") for t in _SYSTEM_TREES):
        raise PayloadError("cwd", f"{path} is a system directory; it cannot be the sandbox's writable workdir")
    if problem:
        raise home()
    return path


def _homes() -> set[str]:
    """$HOME, the caller's home and every passwd entry's, resolved."""
    import pwd

    homes = {os.environ.get("HOME") or ""}
    try:
        homes.add(pwd.getpwuid(os.getuid()).pw_dir)
    except KeyError:
        pass
    homes.update(p.pw_dir for p in pwd.getpwall())
    return {os.path.realpath(h) for h in homes if h.startswith("/") and h != "/"}  # ("/": no home, for a few system users)


def _home_problem(path: str) -> str | None:
    """Why `path` (resolved: no link in it) may not be a payload's workdir as a home directory
    (or one that holds a home), else None."""
    for home in sorted(_homes()):
        if home == path:
            return "it is a home directory"
        if _below(home, path):
            return f"it holds the home directory {home}"
    held = [n for n in HOME_FILES if os.path.lexists(os.path.join(path, n))]
    if held:
        return f"it holds {held[0]}, as a home directory does"
    return None


def _script(props: dict[str, str], base: str, root: str | None = None) -> str:
    sp, fn = props.get("scriptPath"), props.get("fileName")
    if sp is None:
        raise PayloadError("scriptPath", "missing: the path of the Python script to run")
    _utf8("scriptPath", sp)  # before realpath, which would raise on it
    if fn is not None:
        _utf8("fileName", fn)
    path = os.path.realpath(os.path.join(base, os.path.expanduser(sp)))
    if os.path.isdir(path):
        if fn is None:
            raise PayloadError("fileName", f"missing: scriptPath {_quoted(sp)} is a directory, name the file in it")
        if "/" in fn or fn in (".", ".."):
            raise PayloadError("fileName", f"expected a file name without '/', got {_quoted(fn)}")
        path = os.path.realpath(os.path.join(path, fn))
    elif fn is not None and os.path.basename(path) != fn and os.path.basename(sp) != fn:
        raise PayloadError("fileName", f"{_quoted(fn)} does not match scriptPath {_quoted(sp)}")
    _inside("scriptPath", path, sp, root)
    if not os.path.exists(path):
        raise PayloadError("scriptPath", f"no such file: {_quoted(sp if fn is None else os.path.join(sp, fn))}")
    if not os.path.isfile(path):
        raise PayloadError("scriptPath", f"not a regular file: {_quoted(sp)}")
    if not path.endswith(".py"):
        raise PayloadError("scriptPath", f"expected a Python script (*.py), got {_quoted(os.path.basename(path))}")
    return path


def _split(field: str, text: str, hint: str = "") -> list[str]:
    """Shell words of `text`; bounded first: no command line is longer than ARG_MAX."""
    limit = os.sysconf("SC_ARG_MAX")
    if len(text) > limit:
        raise PayloadError(field, f"{len(text)} characters, over ARG_MAX ({limit})")
    try:
        return shellwords.split(text)
    except ValueError as e:
        raise PayloadError(field, f"cannot split {text[:80]!r}: {e}{hint}") from None


def _code_target(req: PayloadRequest, method: str, args: str | None) -> None:
    if args is not None:
        _utf8("args", args, "surrogateescape")  # as the core would check it, but naming args
    if method == "script":
        req.args = _split("args", args) if args else []
        return
    if not args or not args.strip():
        what = "the function name (and its arguments)" if method == "function" else "the statement to run"
        raise PayloadError("args", f"missing: method {method!r} needs {what}")
    if method == "statement":
        req.statement = args
        return
    parts = _split("args", args)
    name = parts[0]
    if not all(p.isidentifier() for p in name.split(".")):
        raise PayloadError("args", f"expected a function name first, got {_quoted(name)}")
    req.function = name
    req.args = [_json_or_str(a) for a in parts[1:]]
    for arg in req.args:
        _check_depth(arg, "args")


def _json_or_str(text: str) -> Any:
    """An argument as JSON when it parses as JSON, else as the string: "NaN", "Infinity" and
    "1e999" are not JSON (Python's json reads them as floats no function call can carry)."""
    try:
        return strictjson.loads(text)
    except (ValueError, RecursionError):
        return text


def _check_size(text: object) -> None:
    """Refuse a payload of more than MAX_PAYLOAD_BYTES (a str: as UTF-8)."""
    if isinstance(text, bytes):
        size = len(text)
    elif isinstance(text, str):  # no character is less than a byte: count the bytes only when it may pass
        size = len(text) if len(text) > MAX_PAYLOAD_BYTES or text.isascii() else \
            len(text.encode("utf-8", "surrogatepass"))
    else:
        return
    if size > MAX_PAYLOAD_BYTES:
        raise PayloadError("payload", f"larger than {MAX_PAYLOAD_BYTES >> 20} MiB ({MAX_PAYLOAD_BYTES} bytes): "
                                      "not read")


def parse(text: str | bytes, *, base: str | None = None, root: str | None = None) -> PayloadRequest:
    """Validate a payload; raise PayloadError naming the field. Relative paths resolve against `base`
    (default: the current directory); cwd and scriptPath must resolve inside `root` (default: `base`)."""
    _check_size(text)
    if isinstance(text, bytes):
        try:
            text = text.decode()
        except UnicodeDecodeError as e:
            raise PayloadError("payload", f"not UTF-8: {e}") from None
    if not isinstance(text, str):
        raise PayloadError("payload", f"expected JSON text, got {type(text).__name__}")
    if not text.strip():
        raise PayloadError("payload", "empty input: expected a JSON object")
    try:
        doc = strictjson.loads(text, unique_keys=True)
    except ValueError as e:  # also NaN, Infinity, 1e999, a number of over 4300 digits, a key given twice
        raise PayloadError("payload", f"invalid JSON: {e}") from None
    except RecursionError:
        raise PayloadError("payload", "invalid JSON: nested too deeply") from None
    if not isinstance(doc, dict):
        raise PayloadError("payload", f"expected a JSON object, got {_json_type(doc)}")
    _check_depth(doc, "payload")
    unknown = [k for k in doc if k not in TOP_LEVEL]
    if unknown:
        raise PayloadError(_label(unknown[0]), f"unknown key (known: {', '.join(TOP_LEVEL)})")
    action = doc.get("action")
    if action is None:
        raise PayloadError("action", f"missing (one of: {', '.join(PROPERTIES)})")
    if not isinstance(action, str):
        raise PayloadError("action", f"expected a string, got {_json_type(action)}")
    if action not in PROPERTIES:
        raise PayloadError("action", f"unknown action {_quoted(action)} (one of: {', '.join(PROPERTIES)})")
    req = PayloadRequest(action=action)
    seq = doc.get("sequential")
    if seq is not None:
        if not isinstance(seq, dict):
            raise PayloadError("sequential", f"expected an object, got {_json_type(seq)}")
        if "prompt" in seq:
            req.prompt, req.has_prompt = _utf8_value("sequential.prompt", seq["prompt"]), True
    if "properties" not in doc:
        raise PayloadError("properties", "missing: the list of {\"name\", \"value\"} properties")
    props = _props(doc["properties"], action)
    if base is None:
        try:
            base = os.getcwd()
        except FileNotFoundError:
            raise PayloadError("cwd", "the current directory no longer exists: the payload's paths are relative "
                                      "to it") from None
    # The model writes these paths: by default they stay inside the directory we were started
    # in (a payload naming /root/.ssh or any other host directory is refused); `root="/"` for
    # any directory that is not a system tree.
    root = os.path.realpath(base if root is None else root)
    req.timeout = _timeout(props.get("timeout"))
    req.env = _env(props.get("env"))
    req.shelltype = _shelltype(props.get("shelltype"))
    if "description" in props:
        req.description = _utf8("description", props["description"])  # echoed by --dry-run
    if action == "run_command":
        cmd = props.get("command")
        if cmd is None or not cmd.strip():
            raise PayloadError("command", "missing: the command line to run")
        req.command = cmd
        req.shell = _bool("shell", props.get("shell"), True)
        req.cwd = _cwd(props.get("cwd"), base, root)
        if req.shelltype is not None:
            req.argv = [SHELLS[req.shelltype], "-c", cmd]
        elif req.shell:
            req.argv = ["/bin/sh", "-c", cmd]
        else:
            req.argv = _split("command", cmd, hint=' (set shell to "true"?)')
            if not req.argv:
                raise PayloadError("command", "missing: the command line to run")
    else:
        req.script = _script(props, base, root)
        method = props.get("method", "script").strip().lower()
        if method not in METHODS:
            raise PayloadError("method", f"unknown method {_quoted(props['method'])} (one of: {', '.join(METHODS)})")
        req.method = method
        _code_target(req, method, props.get("args"))
        req.cwd = _cwd(None, base, root)
    return req


# ---------------------------------------------------------------------------- running


def _profile(profile: str | Profile) -> Profile:
    from .profile import load

    return profile if isinstance(profile, Profile) else load(profile)


def _overrides(req: PayloadRequest) -> dict[str, Any]:
    return {"timeout": req.timeout, "output": OUTPUT_CAP, "cwd": req.cwd, "env": req.env or None}


def _checked(req: PayloadRequest, eff: Profile) -> tuple[list[str], dict[str, str], str | None]:
    """The checks the run makes before it starts a sandbox (sandbox.run's, and run_python's
    before them): the argv as the Result shows it, the command's environment, and the
    filter's or content scan's verdict (None, or why it is blocked)."""
    from .supervisor import check_environment, home_in_run, prepare

    check_environment()
    if req.action == "run_command":
        argv, env, blocked = prepare(eff, req.argv, False, req.env or None)
    else:
        from .coderunner import _shown
        from .coderunner import prepare as prepare_python

        _, target, _, full, blocked = prepare_python(req.script or "", req.args, req.function, req.statement, eff)
        argv = _shown(full)
        if blocked is None:  # (the content scan's block comes first: then nothing else is checked)
            from .profile import with_overrides

            # as run_python binds its copy (a path of its own, with no ':' in it, which would split
            # "SRC:DST": the script's may have one): a stand-in source, for the same checks
            eff = with_overrides(eff, ro_bind=[f"{os.devnull}:{target}"])
            _, env, blocked = prepare(eff, full, False, req.env or None)
        else:
            from .supervisor import build_env

            env = build_env(eff, req.env or None)
    return argv, home_in_run(env, eff, req.cwd), blocked


def plan(req: PayloadRequest, profile: str | Profile = "strict") -> dict[str, Any]:
    """What `--dry-run` prints: the normalised request, the sandbox it would get, and the
    verdict of the checks the run makes before it starts one (an error, as the run's, or
    `blocked` with its reason)."""
    from .profile import with_overrides

    prof = _profile(profile)
    try:
        eff = with_overrides(prof, timeout=req.timeout, output=OUTPUT_CAP)
        argv, env, blocked = _checked(req, eff)
    except SandboxError as e:
        raise _payload_error(e) from None
    request = {k: v for k, v in asdict(req).items() if k not in ("prompt", "has_prompt")}
    if req.action == "run_command":
        for k in ("script", "method", "function", "statement", "args"):
            request.pop(k)
    else:
        from .coderunner import SCRIPT_DIR

        for k in ("command", "shell"):
            request.pop(k)
        request["script_inside"] = f"{SCRIPT_DIR}/{os.path.basename(req.script or '')}"
    request["argv"] = argv  # what runs, as the Result's command shows it (the driver's source elided)
    lim = eff.to_dict()["limits"]
    workdir = req.cwd if eff.workdir == "same" else eff.workdir
    mounts = [{"source": m.source, "target": m.target, "mode": "rw" if m.writable else "ro",
               **({"optional": True} if m.optional else {})} for m in eff.mounts]
    mounts.append({"source": req.cwd, "target": workdir, "mode": "rw", "workdir": True})
    if req.script:
        mounts.append({"source": req.script, "target": request["script_inside"], "mode": "ro",
                       "copied": True})
    sandbox = {
        "profile": eff.name, "limits": lim, "mounts": mounts, "workdir": workdir, "network": eff.network,
        "namespaces": list(eff.namespaces), "seccomp": eff.seccomp, "landlock": eff.landlock,
        "cgroup": eff.cgroup, "filter": {"blocklist": eff.blocklist, "block": list(eff.block),
                                         "allow": list(eff.allow), "scan": list(eff.scan)},
        "env": env,  # the profile's, then the payload's
    }
    sandbox.update(_cgroup_here(eff, lim))
    out: dict[str, Any] = {"dry_run": True, "action": req.action, "request": request, "sandbox": sandbox,
                           "blocked": blocked is not None}
    if blocked is not None:
        out["block_reason"] = blocked
    _pass_prompt(out, req)
    return out


# The limits only a run's cgroup carries: where an optional cgroup cannot be made, they go
# unapplied (processes stays an RLIMIT_NPROC, counted in the run's own user namespace).
_CGROUP_LIMITS = ("memory", "cpus")


def _cgroup_here(prof: Profile, lim: dict[str, Any]) -> dict[str, Any]:
    """What this host makes of the profile's cgroup: the limits as shown are only those the
    profile asks for; under `rootless` (cgroup optional) with no usable cgroup, the run would
    get no memory or cpus cap, and under `required` it would not run."""
    if prof.cgroup == "off":
        return {}
    from .isolation import cgroups

    try:
        return {"cgroup_here": cgroups.detect().version}
    except cgroups.CgroupUnavailable as e:
        out: dict[str, Any] = {"cgroup_here": None, "cgroup_unavailable": str(e)}
        if prof.cgroup == "required":
            out["would_fail"] = "cgroup: the profile requires one; the run would be a setup_error"
        else:
            out["limits_not_applied"] = [k for k in _CGROUP_LIMITS if lim.get(k) not in (None, 0)]
        return out


def _pass_prompt(out: dict[str, Any], req: PayloadRequest) -> None:
    if req.has_prompt:
        out["sequential"] = {"prompt": req.prompt}
        out["prompt"] = req.prompt


def _field_of(e: SandboxError) -> str:
    """Best guess at the payload field a core error is about (its message starts with it)."""
    head = str(e).split(":", 1)[0].strip().split("[", 1)[0]
    if head in ("env", "cwd", "timeout", "output", "args", "statement", "function", "script"):
        return {"script": "scriptPath", "function": "args", "statement": "args", "output": "payload"}.get(head, head)
    return "command" if "command" in head else "payload"


def _payload_error(e: SandboxError) -> PayloadError:
    """A core error about a payload's value, as the payload's error naming its field."""
    if isinstance(e, PayloadError):
        return e
    if isinstance(e, ProfileError):  # an override the profile refuses (timeout above its max)
        key = getattr(e, "key", "") or "payload"
        return PayloadError(key if key in ("timeout", "env") else "payload", str(e))
    return PayloadError(_field_of(e), str(e))


def run_request(req: PayloadRequest, profile: str | Profile = "strict") -> dict[str, Any]:
    """Run a parsed payload; the reply dict (Result + returncode + prompt)."""
    from .cli import exit_code_for

    prof = _profile(profile)
    try:
        if req.action == "run_command":
            from .supervisor import run

            res = run(req.argv, profile=prof, **_overrides(req))
        else:
            from .coderunner import run_python

            res = run_python(req.script or "", req.args, function=req.function, statement=req.statement,
                             profile=prof, **_overrides(req))
    except SandboxError as e:
        raise _payload_error(e) from None
    out: dict[str, Any] = {"action": req.action, **res.to_dict(), "returncode": exit_code_for(res)}
    _pass_prompt(out, req)
    return out


def execute(text: str | bytes, *, profile: str | Profile = "strict", dry_run: bool = False,
            base: str | None = None, root: str | None = None) -> dict[str, Any]:
    """Validate and run one payload. Returns the reply dict, or {"error": {"field", "message"}} for a bad
    payload (nothing ran). A bad `profile` (the operator's choice, not the payload's) raises ProfileError.
    `root`: confine the payload's cwd and scriptPath to this directory."""
    prof = _profile(profile)
    try:
        req = parse(text, base=base, root=root)
        return plan(req, prof) if dry_run else run_request(req, prof)
    except SandboxError as e:  # (each is a PayloadError by now; any other is one about the payload too)
        return _payload_error(e).to_dict()


def main(argv: list[str]) -> int:
    from .cliargs import Parser

    p = Parser(prog="sandboxrun payload", usage="sandboxrun payload [--dry-run] [--profile P] [--root DIR] [--file FILE | < payload.json]",
                description="Run one LLM tool-call payload (run_command or run_code_script) read from stdin; "
                            "print one JSON object. Exit: the command's code (as sandboxrun run), 2 for a bad "
                            "payload.")
    p.add_argument("--profile", "-p", default="strict", help="built-in profile name or a TOML file (default: strict)")
    p.add_argument("--dry-run", "-n", action="store_true",
                   help="print the normalised request and its sandbox (profile, limits, mounts); run nothing")
    p.add_argument("--file", metavar="FILE", help="read the payload from FILE instead of stdin")
    p.add_argument("--root", metavar="DIR", help="refuse a cwd or scriptPath that resolves outside DIR "
                                                  "(default: the current directory; / for any non-system one)")
    ns = p.parse_args(argv)
    prof = _profile(ns.profile)  # a bad profile is a one-line CLI error (exit 2)
    for label, value in (("--file", ns.file), ("--root", ns.root)):
        if value == "":  # (an empty --file read stdin instead; checked before any input is read)
            raise InputError(f"{label}: empty path")
    if ns.root is not None and not os.path.isdir(ns.root):
        raise InputError(f"--root: {'not a' if os.path.exists(ns.root) else 'no such'} directory: {ns.root}")
    # At most one byte over the cap: parse refuses that, and /dev/zero is not read to the end.
    if ns.file is not None:
        try:
            with open(ns.file, "rb") as f:
                text: bytes = f.read(MAX_PAYLOAD_BYTES + 1)
        except OSError as e:
            raise InputError(f"--file {ns.file}: {e.strerror}") from None
    else:
        text = sys.stdin.buffer.read(MAX_PAYLOAD_BYTES + 1)
    if not ns.dry_run:
        from . import supervisor

        supervisor.use_direct_forker()  # single-threaded CLI: fork from here
    # From here on, every failure is the payload's: one JSON error object on stdout, exit 2.
    reply = execute(text, profile=prof, dry_run=ns.dry_run, root=ns.root)
    print(json.dumps(reply, indent=2))
    if "error" in reply and len(reply) == 1:
        return EXIT_USAGE
    if ns.dry_run:
        return EXIT_SANDBOX if reply["blocked"] else 0  # as the run would exit, up to starting the sandbox
    return int(reply["returncode"])


__all__ = ["PayloadError", "PayloadRequest", "parse", "plan", "run_request", "execute", "main",
           "DEFAULT_TIMEOUT", "MAX_TIMEOUT", "OUTPUT_CAP", "MAX_PAYLOAD_BYTES", "MAX_DEPTH"]
