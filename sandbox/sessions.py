"""Background sessions: sandboxed runs that outlive the caller.

Each session is a folder in the state directory, owned by a small monitor process
(`sandbox/monitor.py`, the conmon pattern of podman) that forks the sandbox, keeps
its stdin pipe or terminal, writes its output to capped logs and records its Result.
Every file is plain data on disk, so any later process (CLI, library, server) can
find, read and drive a session; the monitor's control socket does the rest.

    <state>/<id>/
      request.json   what the starter asked for (resolved profile, argv, env, cwd, pty)
      meta.json      id, name, command, pids, state; replaced atomically
      output.log     both streams in arrival order (a terminal's only stream)
      stdout.log     \\ each capped at the profile's limits.log_size: the oldest bytes are
      stderr.log     / dropped and a marker line at the top counts them
      result.json    the final Result, once it ended
      ctl.sock       the monitor's control socket (write, eof, resize, kill, wait)
      poll.offset    where `poll` stopped reading, shared by every caller (flock)
      monitor.log    the monitor's own errors
      sandboxrun-*/  the run's fresh workdir (TMPDIR of the monitor), so nothing leaks

States: starting -> running -> exited, or lost when the monitor died without a
Result (the sandbox died with it: its init has PR_SET_PDEATHSIG(SIGKILL)).
"""

from __future__ import annotations

import base64
import errno
import fcntl
import json
import math
import os
import re
import secrets
import shlex
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from . import record as records
from .errors import EXIT_SANDBOX, InputError, SandboxError, os_bytes, write_failure
from .record import record
from .result import Isolation, Result, utf8_text
from .units import MAX_DURATION

TTL_DEFAULT, TTL_MIN, TTL_MAX = 1800, 60, 10800
START_TIMEOUT = 60.0  # the monitor must report a running sandbox (or a failure) within this
CONNECT_WAIT = 10.0  # how long a request waits for the monitor of a `starting` session to bind its socket
ANSWER_GRACE_S = 2.0  # for the result of a session whose monitor cut a request: it exits just after writing it
LOG_MIN = 1024
TAIL_BYTES = 16384  # output shown by run_or_yield when a run becomes a session
CANCEL_POLL = 0.1  # how soon run_or_yield sees a Cancel (run_async's) while it waits
DEFAULT_LOG_LINES = 200
ID_RE = re.compile(r"^[0-9a-f]{8}$")
_ID_PREFIX_RE = re.compile(r"[0-9a-f]{3,8}\Z")  # (with match: the whole name)
_STREAMS = ("stdout", "stderr")


class SessionSetupError(SandboxError):
    """The host refused what a session needs (its files: a full disk, a file size limit; its
    monitor process: no fds or processes left): nothing ran."""

    exit_code = EXIT_SANDBOX


class SessionBlocked(SandboxError):
    """The first-line filter refused the command; nothing was started."""

    exit_code = EXIT_SANDBOX

    def __init__(self, result: Result) -> None:
        super().__init__(f"blocked: {result.block_reason}")
        self.result = result


# ---------------------------------------------------------------------------- files


def state_dir() -> str:
    """The state directory, created 0700 and checked: a real directory owned by us."""
    path = os.environ.get("SANDBOXRUN_STATE_DIR", "")
    if path and not os.path.isabs(path):  # relative to whichever directory each call runs in
        raise InputError(f"SANDBOXRUN_STATE_DIR={path!r}: expected an absolute path")
    from .hostpaths import SHARED_TREES, SYSTEM_TREES, default_state_dir

    path = default_state_dir()

    if path == "/" or path in SYSTEM_TREES or path in SHARED_TREES:
        raise SandboxError(f"state directory {path}: a directory of the host's own; sessions need one of "
                           "theirs (set SANDBOXRUN_STATE_DIR to a new directory's path)")
    try:
        if os.environ.get("SANDBOXRUN_STATE_DIR"):  # the caller's: it must exist, not appear on a typo
            os.mkdir(path, 0o700)
        else:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise SandboxError(f"state directory {path}: {e.strerror} (set SANDBOXRUN_STATE_DIR)") from None
    try:
        st = os.lstat(path)
    except OSError as e:  # ENOTDIR: XDG_RUNTIME_DIR (say) names a file, which makedirs took as there
        raise SandboxError(f"state directory {path}: {e.strerror} (set SANDBOXRUN_STATE_DIR)") from None
    if not stat.S_ISDIR(st.st_mode):
        raise SandboxError(f"state directory {path}: not a directory (a symlink?)")
    if st.st_uid != os.geteuid():
        raise SandboxError(f"state directory {path}: owned by uid {st.st_uid}, not by you "
                           f"(uid {os.geteuid()}); set SANDBOXRUN_STATE_DIR")
    if st.st_mode & 0o022:  # another user could plant a session folder there, whose pids we would kill
        raise SandboxError(f"state directory {path}: writable by others (mode {stat.S_IMODE(st.st_mode):o}); "
                           "it must be yours alone (chmod go-w, or set SANDBOXRUN_STATE_DIR)")
    return path


def session_ttl() -> float:
    """Seconds a finished session is kept: SANDBOXRUN_SESSION_TTL, clamped to 1 min..3 h."""
    raw = os.environ.get("SANDBOXRUN_SESSION_TTL", "")
    try:
        ttl = float(raw) if raw else TTL_DEFAULT
    except ValueError:
        raise InputError(f"SANDBOXRUN_SESSION_TTL={raw!r}: expected seconds") from None
    if not math.isfinite(ttl):  # nan would never expire anything; inf is no number of seconds
        raise InputError(f"SANDBOXRUN_SESSION_TTL={raw!r}: expected a finite number of seconds")
    return min(max(ttl, TTL_MIN), TTL_MAX)


def _seconds(label: str, value: Any, forever: bool = False) -> float | None:
    """`value` as seconds >= 0: a finite number up to units.MAX_DURATION (socket and select
    timeouts overflow past that); inf means "no limit" (None) where `forever` allows it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise InputError(f"{label}: expected seconds >= 0, got {value!r}")
    if forever and value == math.inf:
        return None
    if not value <= MAX_DURATION:
        raise InputError(f"{label}: expected 0 to {MAX_DURATION:.0f} seconds, got {value!r}")
    return float(value)


def write_json(path: str, data: Any) -> None:
    """Atomically replace `path` (0600, never through a symlink)."""
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(3)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_bytes(path: str) -> bytes | None:
    """The file's bytes; None if there is none. OSError if it cannot be read: a directory in
    its place is EISDIR, anything else that is not a regular file (a FIFO, a device, planted
    by hand) EINVAL, never opened blocking (a FIFO would hang the reader until a writer came)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        return f.read()


def read_json(path: str) -> dict[str, Any] | None:
    """A JSON object from `path`; None if there is none or it cannot be read as one."""
    try:
        data = read_bytes(path)
        out = json.loads(data) if data else None
    except (OSError, ValueError):
        return None
    return out if isinstance(out, dict) else None


_INT, _NUM, _OPT_NUM = (int,), (int, float), (int, float, type(None))
# What the starter and the monitor write to meta.json, by type (see _create and monitor.py).
_META_TYPES: dict[str, tuple[type, ...]] = {
    "id": (str,), "name": (str,), "command": (list,), "pty": (bool,), "profile": (str,), "state": (str,),
    "log_token": (str,), "isolation": (dict,), "created": _NUM, "started_at": _NUM, "ended_at": _NUM,
    "kill_grace": _NUM, "timeout": _OPT_NUM, "starter_pid": _INT, "starter_start": _INT, "monitor_pid": _INT,
    "monitor_start": _INT, "pid": _INT, "pid_start": _INT, "pid_ns": _INT, "proc_dev": _INT,
}


def read_meta(path: str) -> dict[str, Any]:
    """meta.json as its readers rely on it: a field of another type than is ever written
    there (the file edited by hand) is left out, as if not written yet; a TypeError later,
    in whichever command reads it, would say nothing of where the fault is."""
    out = {}
    for key, value in (read_json(path) or {}).items():
        types = _META_TYPES.get(key)
        if types is not None and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)
                                  or (key == "command" and not all(isinstance(a, str) for a in value))):
            continue
        out[key] = value
    return out


def proc_starttime(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks); None if gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rfind(b")") + 2:].split()
    if not fields or fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def _alive(pid: Any, start: Any) -> bool:
    """The process /proc numbers `pid` is the one that started at `start` (never without one:
    a number /proc does not show now may show an unrelated process later)."""
    return isinstance(pid, int) and pid > 0 and start is not None and proc_starttime(pid) == start


def proc_self() -> int:
    """Our pid as /proc numbers it: what is recorded, since readers look processes up there
    (os.getpid() is another number where /proc belongs to an ancestor pid namespace)."""
    from .isolation.proctree import proc_pid

    return proc_pid() or os.getpid()


def proc_dev() -> int | None:
    """The /proc that pids are recorded in and read from (each pid namespace's procfs is a
    device of its own): a reader with another cannot judge them."""
    try:
        return os.stat("/proc").st_dev
    except OSError:
        return None


def _readable_here(m: Mapping[str, Any]) -> bool:
    return m.get("proc_dev") in (None, proc_dev())


def _starter_writes(sdir: str) -> bool | None:
    """True while a starter holds the session folder's lock (it writes the files), None when
    no one does (or the folder cannot be opened: then it is judged by its files)."""
    try:
        fd = os.open(sdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)
    return None


_INIT_NAMES = (b"sandboxrun-init",)  # what a sandbox's init calls itself (comm: both launchers name it so)


def _sandbox_init(proc_fd: int) -> bool:
    """The process of this /proc directory fd is a sandbox's init: it has renamed itself so
    (child.py, native/stage.c), or it is in a run's cgroup (sandboxrun-<owner>-<n>)."""
    from .isolation.cgroups import PREFIX
    from .isolation.proctree import read_through

    if read_through(proc_fd, "comm").rstrip(b"\n") in _INIT_NAMES:
        return True
    for line in read_through(proc_fd, "cgroup").decode(errors="replace").splitlines():
        for part in line.split(":", 2)[-1].split("/"):
            if part.startswith(PREFIX) and part != f"{PREFIX}supervisor":
                return True
    return False


def _kill_if(pid: Any, start: Any, sig: int = signal.SIGKILL, sandbox_init: bool = False) -> None:
    """Signal the process /proc numbers `pid`, if it is still the one that started at
    `start` (and, with `sandbox_init`, is a sandbox's init): checked through a fd of its
    /proc directory, which the signal goes through."""
    if not (isinstance(pid, int) and pid > 0 and start is not None):
        return
    from .isolation.proctree import read_through, signal_if

    def same(fd: int) -> bool:
        text = read_through(fd, "stat")
        fields = text[text.rfind(b")") + 2:].split()
        return bool(fields) and fields[0] not in (b"Z", b"X") and int(fields[19]) == start \
            and (not sandbox_init or _sandbox_init(fd))

    signal_if(pid, sig, same)


MAX_WRITE = 32 << 20  # bytes of data in one write or paste (the monitor refuses more)


def _check_write_size(n: int) -> None:
    if n > MAX_WRITE:
        raise InputError(f"data: {n} bytes; a session takes at most {MAX_WRITE >> 20} MiB per write (write it in parts)")


def _rmtree(path: str) -> None:
    """A session folder, its run's workdir in it (TMPDIR): by directory fds, never through a
    link the run planted, whatever its depth (hostpaths.remove_tree)."""
    from .hostpaths import remove_tree

    error = None
    for _ in range(10):  # a poll of another process may make poll.offset again meanwhile
        error = remove_tree(path)
        if not os.path.lexists(path):
            return
        time.sleep(0.01)
    if error is not None:  # the first thing that stopped it (EROFS, EACCES, EBUSY), not ENOTEMPTY
        raise OSError(error.errno, f"cannot remove the session folder {path}: {error.strerror}")
    raise OSError(errno.ENOTEMPTY, f"cannot remove the session folder {path}")


# ---------------------------------------------------------------------------- capped logs


def log_marker(token: str, dropped: int) -> bytes:
    return f"[sandboxrun:{token}: {dropped} earlier bytes dropped]\n".encode()


class CappedLog:
    """An append-only log kept under `cap` bytes (used by the monitor, one writer).

    Past the cap the file is rewritten (temp file + rename, so readers see either
    version whole) with the newest half kept, cut at a line start where one is near,
    under a marker line that counts every byte dropped so far. The marker carries a
    per-session token the sandboxed program cannot know, so it cannot forge one.
    """

    def __init__(self, path: str, cap: int, token: str) -> None:
        self.path, self.cap, self.token = path, max(cap, LOG_MIN), token
        self.dropped = 0
        self.header = 0  # length of the marker line at the top
        self.size = 0
        self.total = 0
        self.fd = self._open()

    def _open(self) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)

    def append(self, data: bytes) -> None:
        if not data:
            return
        self.total += len(data)
        if self.size + len(data) > self.cap:
            self._compact(data)
            return
        _write_all(self.fd, data)
        self.size += len(data)

    def _compact(self, data: bytes) -> None:
        old = read_bytes(self.path) or b""
        body = old[self.header:] + data
        keep = self.cap // 2
        cut = len(body) - keep
        nl = body.find(b"\n", cut, cut + keep // 4)
        if nl >= 0:
            cut = nl + 1
        self.dropped += cut
        marker = log_marker(self.token, self.dropped)
        tmp = f"{self.path}.tmp"
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            _write_all(fd, marker + body[cut:])
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        os.close(self.fd)
        self.fd = self._open()
        self.header, self.size = len(marker), len(marker) + len(body) - cut

    def close(self) -> None:
        os.close(self.fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def read_log(path: str, token: str) -> tuple[int, bytes]:
    """(bytes dropped before the kept part, the kept bytes) of a capped log; one that is not a
    regular file (a directory, a FIFO put in its place by hand) reads as empty."""
    try:
        data = read_bytes(path) or b""
    except OSError as e:
        if e.errno not in (errno.EISDIR, errno.EINVAL):
            raise
        data = b""
    prefix = f"[sandboxrun:{token}: ".encode()
    if token and data.startswith(prefix):
        end = data.find(b"\n")
        num = data[len(prefix):end].split(b" ", 1)[0]
        if end > 0 and num.isdigit():
            return int(num), data[end + 1:]
    return 0, data


def _poll_offsets(blob: bytes) -> dict[str, int]:
    """Where the last poll stopped, per stream. A position that is not a whole number >= 0
    (the file edited by hand) counts as 0, the start: output again, never a false report of
    dropped bytes or an error."""
    try:
        stored = json.loads(blob or b"{}")
    except ValueError:
        stored = {}
    if not isinstance(stored, dict):
        return {}
    return {k: v for k, v in stored.items() if k in _STREAMS and type(v) is int and v >= 0}


def _incomplete_utf8(data: bytes) -> int:
    """How many bytes at the end start a UTF-8 sequence that is not complete yet."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b < 0x80:
            return 0
        if b >= 0xC0:
            need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            return back if back < need else 0
    return 0


# ---------------------------------------------------------------------------- profile as data


def profile_to_json(prof: Any) -> dict[str, Any]:
    return records.asdict(prof)


def profile_from_json(d: Mapping[str, Any]) -> Any:
    from .profile import Limits, Mount, Profile

    known = {f.name for f in records.fields(Profile)}
    out: dict[str, Any] = {}
    for k, v in d.items():
        if k not in known:
            continue
        if k == "limits":
            v = Limits(**v)
        elif k == "mounts":
            v = tuple(Mount(**m) for m in v)
        elif isinstance(v, list):
            v = tuple(tuple(x) if isinstance(x, list) else x for x in v)
        out[k] = v
    return Profile(**out)


# ---------------------------------------------------------------------------- keys

_NAMED_KEYS: dict[str, bytes] = {
    "enter": b"\r", "return": b"\r", "tab": b"\t", "btab": b"\x1b[Z", "space": b" ",
    "escape": b"\x1b", "esc": b"\x1b", "bspace": b"\x7f", "backspace": b"\x7f",
    "up": b"\x1b[A", "down": b"\x1b[B", "right": b"\x1b[C", "left": b"\x1b[D",
    "home": b"\x1b[H", "end": b"\x1b[F", "pageup": b"\x1b[5~", "ppage": b"\x1b[5~",
    "pagedown": b"\x1b[6~", "npage": b"\x1b[6~", "insert": b"\x1b[2~", "ic": b"\x1b[2~",
    "delete": b"\x1b[3~", "dc": b"\x1b[3~",
    "f1": b"\x1bOP", "f2": b"\x1bOQ", "f3": b"\x1bOR", "f4": b"\x1bOS", "f5": b"\x1b[15~",
    "f6": b"\x1b[17~", "f7": b"\x1b[18~", "f8": b"\x1b[19~", "f9": b"\x1b[20~", "f10": b"\x1b[21~",
    "f11": b"\x1b[23~", "f12": b"\x1b[24~",
}
_CTRL_PUNCT = {"@": 0, "space": 0, "[": 27, "\\": 28, "]": 29, "^": 30, "_": 31, "?": 127}


def key_bytes(key: str, literal: bool = False) -> bytes:
    """One send-keys argument: a named key (Enter, Up, F5, C-c, M-x, M-C-x; names are
    case-insensitive) or, failing that, the text itself. A C- or M- chord that names no key
    (`C-nonsense`, `M-enterr`) is an InputError, not typed: a caller, often a model, meant a key."""
    if literal:
        return os_bytes(key, "key")
    if key.lower() in _NAMED_KEYS:
        return _NAMED_KEYS[key.lower()]
    if key in ("C-", "M-"):
        raise InputError(f"send-keys: unknown key {key!r}: a chord needs its key (C-c, M-x; send text with -L, "
                         "literal=True)")
    if key.startswith("M-") and len(key) > 2:
        rest = key[2:]
        if len(rest) > 1 and rest.lower() not in _NAMED_KEYS and not rest.startswith("C-"):
            raise InputError(f"send-keys: unknown key {key!r}: M- takes one character or a key name "
                             "(send text with -L, literal=True)")
        return b"\x1b" + key_bytes(rest)
    if key.startswith("C-") and len(key) > 2:
        rest = key[2:]
        if len(rest) == 1 and rest.isascii() and rest.isalpha():
            return bytes([ord(rest.lower()) & 0x1F])
        if rest.lower() in _CTRL_PUNCT:
            return bytes([_CTRL_PUNCT[rest.lower()]])
        raise InputError(f"send-keys: unknown key {key!r}: C- takes a letter, space or one of @[\\]^_? "
                         "(send text with -L, literal=True)")
    return os_bytes(key, "key")


# ---------------------------------------------------------------------------- sessions


@record
class PollResult:
    id: str
    state: str
    ended: bool
    stdout: str
    stderr: str
    dropped: int = 0  # bytes that were dropped from the logs before this poll read them
    result: Result | None = None

    def to_dict(self) -> dict[str, Any]:
        d = records.asdict(self)
        d["result"] = self.result.to_dict() if self.result else None
        return d


@record
class LogPage:
    id: str
    stream: str
    lines: list[str]
    offset: int  # index of the first line shown
    total_lines: int
    dropped_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return records.asdict(self)

    def hint(self) -> str | None:
        end = self.offset + len(self.lines)
        if self.offset == 0 and end >= self.total_lines:
            return None
        n = max(len(self.lines), 1)
        shown = f"lines {self.offset}-{end - 1}" if self.lines else f"no lines from {self.offset}"
        parts = [f"{shown} of {self.total_lines} (0-based)"]
        if self.offset > 0:
            parts.append(f"earlier: --offset {max(0, self.offset - n)} --limit {min(n, self.offset)}")  # no overlap
        if end < self.total_lines:
            parts.append(f"later: --offset {end} --limit {n}")
        return "; ".join(parts)


class Session:
    """A handle on one session folder. Every property reads the disk afresh."""

    def __init__(self, sid: str, root: str | None = None) -> None:
        self.id = sid
        self.dir = os.path.join(root or state_dir(), sid)

    def __repr__(self) -> str:
        try:
            state = self.state
        except SandboxError:  # removed: a repr never raises
            state = "removed"
        return f"<Session {self.id} {self.name!r} {state}>"

    # -- what is on disk

    def _path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    @property
    def meta(self) -> dict[str, Any]:
        return read_meta(self._path("meta.json"))

    @property
    def name(self) -> str:
        return str(self.meta.get("name", ""))

    @property
    def command(self) -> list[str]:
        return list(self.meta.get("command", []))

    @property
    def pid(self) -> int | None:
        """The sandbox init's host pid once it runs."""
        return self.meta.get("pid")

    @property
    def pty(self) -> bool:
        return bool(self.meta.get("pty"))

    def _monitor_alive(self, m: Mapping[str, Any]) -> bool:
        if m.get("monitor_pid"):
            return _alive(m["monitor_pid"], m.get("monitor_start"))
        # Not yet recorded by the monitor: alive while the starter still waits for it.
        return _alive(m.get("starter_pid"), m.get("starter_start")) and time.time() - m.get("created", 0) < 600

    def _gone(self) -> InputError:
        return InputError(f"session {self.id} no longer exists (cleared or expired)")

    def _must_exist(self) -> None:
        """For what reads no state first: a removed session's empty log or missing terminal
        would say something untrue."""
        if not os.path.isdir(self.dir):
            raise self._gone()

    @property
    def state(self) -> str:
        if os.path.exists(self._path("result.json")):
            return "exited"
        m = self.meta
        writing = None
        if not m:
            writing = _starter_writes(self.dir)
            m = self.meta  # (written, and the folder let go, since the first read)
        if not m:
            try:
                age = time.time() - os.stat(self.dir).st_mtime
            except FileNotFoundError:
                raise self._gone() from None
            if writing is None:  # its starter (which locks the folder until meta.json is written) is gone:
                # no monitor was started, nothing runs. (A folder just made, not locked yet: 1 s.)
                fresh = age < 1 and not os.path.lexists(self._path("request.json"))
                return "starting" if fresh else "lost"
            return "starting" if age < 60 else "lost"  # a starter is writing it, or is stuck doing so
        if m.get("state") == "lost":
            return "lost"
        if not _readable_here(m):
            # Started where /proc numbers processes otherwise (another pid namespace): its
            # pids mean nothing here, so nothing is killed from here; it is judged lost only
            # once no process is in its monitor's pid namespace (all of it is gone then).
            from .isolation.cgroups import live_pid_namespaces

            live = live_pid_namespaces()
            if live is None or m.get("pid_ns") is None or m["pid_ns"] in live:
                return "running" if m.get("state") == "running" else "starting"
            return self._lost(m)
        if self._monitor_alive(m):
            return "running" if m.get("state") == "running" else "starting"
        if os.path.exists(self._path("result.json")):  # it ended between the two reads
            return "exited"
        # Should the kernel not have killed it with its monitor (PR_SET_PDEATHSIG), nothing may
        # run unsupervised: the pid namespace dies with its init. (Only a sandbox's init: a
        # meta.json edited by hand may name any process of ours.)
        _kill_if(m.get("pid"), m.get("pid_start"), sandbox_init=True)
        return self._lost(m)

    def _lost(self, m: dict[str, Any]) -> str:
        m["state"], m["ended_at"] = "lost", time.time()
        try:
            write_json(self._path("meta.json"), m)  # so the TTL counts from now
        except OSError:
            pass
        return "lost"

    def _stored_result(self) -> Result | None:
        """The Result its monitor wrote (atomically), None before it has. One that cannot be
        read back (edited by hand, a directory in its place) is a `lost` Result that says so:
        never "still running" (it has ended), never a traceback."""
        try:
            data = read_bytes(self._path("result.json"))
            if data is None:
                return None
            return Result.from_stored(data)
        except (OSError, ValueError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            return self._lost_result(f"the session ended, but its result.json cannot be read back ({why})")

    @property
    def result(self) -> Result | None:
        """The final Result once it ended; a `lost` Result when its monitor died."""
        res = self._stored_result()
        if res is None:
            st = self.state
            res = self._stored_result() if st == "exited" else None
            if st != "lost" and res is None:
                return None
        if res is not None:
            return res
        return self._lost_result("the session's monitor died (killed?); its sandbox died with it; "
                                 "output so far is kept")

    def _lost_result(self, error: str) -> Result:
        m = self.meta
        out, out_total = self._tail("stdout", 1 << 20)
        err, err_total = self._tail("stderr", 1 << 20)
        return Result(
            command=self.command, status="lost", session_id=self.id, pid=m.get("pid"),
            profile=m.get("profile", ""), stdout=out.decode(errors="replace"), stderr=err.decode(errors="replace"),
            stdout_bytes=out_total, stderr_bytes=err_total, stdout_truncated=out_total > len(out),
            stderr_truncated=err_total > len(err),
            error=error, isolation=_known_isolation(m),
            duration_ms=round((m.get("ended_at", time.time()) - m.get("started_at", m.get("created", 0))) * 1000, 3),
        )

    def ended_at(self) -> float:
        m = self.meta
        if "ended_at" in m:
            return float(m["ended_at"])
        try:
            return os.stat(self.dir).st_mtime
        except OSError:
            return 0.0

    def info(self) -> dict[str, Any]:
        m = self.meta
        st = self.state
        d = {"id": self.id, "name": m.get("name", ""), "state": st, "pid": m.get("pid"),
             "monitor_pid": m.get("monitor_pid"), "pty": bool(m.get("pty")),
             "command": [utf8_text(a) for a in m.get("command", [])],
             "profile": m.get("profile", ""), "created": m.get("created"), "started_at": m.get("started_at"),
             "ended_at": m.get("ended_at"), "dir": self.dir}
        if st in ("exited", "lost"):
            res = self.result
            if res is not None:
                d.update(status=res.status, exit_code=res.exit_code, signal=res.signal)
        return d

    def _log_file(self, stream: str) -> str:
        if stream == "output" or (stream == "stdout" and self.pty):
            return self._path("output.log")
        return self._path(f"{stream}.log")

    def _read_log(self, stream: str) -> tuple[int, bytes]:
        return read_log(self._log_file(stream), str(self.meta.get("log_token", "")))

    def _tail(self, stream: str, n: int) -> tuple[bytes, int]:
        """(last n bytes, total bytes written) of one stream."""
        if stream == "stderr" and self.pty:
            return b"", 0
        dropped, data = self._read_log(stream)
        return data[-n:] if n else b"", dropped + len(data)

    # -- reading output

    def poll(self) -> PollResult:
        """Output written since the last poll (by any process), and whether it ended."""
        st = self.state  # first: if it had ended, every byte is in the logs already
        ended = st in ("exited", "lost")
        fd = self._open_poll_offset()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            offsets = _poll_offsets(os.pread(fd, 4096, 0))
            out: dict[str, str] = {}
            lost = 0
            for stream in _STREAMS:
                if stream == "stderr" and self.pty:
                    out[stream] = ""
                    continue
                dropped, data = self._read_log(stream)
                off = offsets.get(stream, 0)
                lost += max(0, dropped - off)
                chunk = data[max(off, dropped) - dropped:]
                if not ended:
                    chunk = chunk[:len(chunk) - _incomplete_utf8(chunk)]
                offsets[stream] = max(off, dropped) + len(chunk)
                out[stream] = chunk.decode(errors="replace")
            blob = json.dumps(offsets).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, blob, 0)
        finally:
            os.close(fd)
        return PollResult(self.id, st, ended, out["stdout"], out["stderr"], lost,
                          self.result if ended else None)

    def _open_poll_offset(self) -> int:
        """poll.offset, where the last poll stopped (shared by every process that polls)."""
        try:
            fd = os.open(self._path("poll.offset"),
                         os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO put there by hand: no position to keep
                os.close(fd)
                raise OSError(errno.EINVAL, "not a regular file")
            return fd
        except FileNotFoundError:  # removed (by another process) since its state was read
            raise InputError(f"session {self.id} has been removed") from None
        except OSError as e:  # a read-only state directory: a poll that cannot move on would repeat
            raise SandboxError(f"session {self.id}: cannot keep the poll position in {self.dir} ({e.strerror}); "
                               "`sandboxrun log` reads its output without one") from None

    def _mark_seen(self) -> None:
        """Move the poll position to the end of what is written now."""
        offsets = {}
        for stream in _STREAMS:
            dropped, data = self._read_log(stream)
            offsets[stream] = dropped + len(data)
        fd = self._open_poll_offset()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(offsets).encode(), 0)
        finally:
            os.close(fd)

    def log(self, offset: int | None = None, limit: int | None = None, stream: str = "output") -> LogPage:
        """Lines of a log: from `offset` (0-based), or the last `limit` (default 200) lines."""
        if stream not in ("output", *_STREAMS):
            raise InputError(f"stream: expected output, stdout or stderr, got {stream!r}")
        for label, v in (("offset", offset), ("limit", limit)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise InputError(f"{label}: expected a whole number >= 0, got {v!r}")
        self._must_exist()
        if stream == "stderr" and self.pty:
            dropped, data = 0, b""
        else:
            dropped, data = self._read_log(stream)
        lines = [ln[:-1] if ln.endswith("\r") else ln for ln in data.decode(errors="replace").split("\n")]
        if lines and lines[-1] == "":
            lines.pop()
        if dropped:
            lines.insert(0, f"[sandboxrun: {dropped} earlier bytes dropped (limits.log_size)]")
        n = DEFAULT_LOG_LINES if limit is None else limit
        start = max(0, len(lines) - n) if offset is None else min(offset, len(lines))
        return LogPage(self.id, stream, lines[start:start + n], start, len(lines), dropped)

    # -- driving it

    def _detach(self) -> None:
        """From now on the session outlives the process that started it."""
        try:
            self._ctl({"op": "detach"})
        except SandboxError:
            if self.state in ("running", "starting"):
                raise  # it would die with us though the caller is told it runs on
            # ended already: nothing to hand over

    def _ctl(self, request: dict[str, Any], timeout: float | None = 15.0, data: bytes | None = None) -> dict[str, Any]:
        st = self.state
        if st not in ("running", "starting"):
            raise InputError(f"session {self.id} has {'ended' if st == 'exited' else 'been lost'}; "
                             "nothing to send it")
        dfd = os.open(self.dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(timeout)
            self._connect(sock, f"/proc/self/fd/{dfd}/ctl.sock")
            buf = b""
            cut = ""
            try:
                if data is None:
                    sock.sendall(json.dumps(request).encode() + b"\n")
                else:  # {..., "data": "BASE64"}, sent in parts: no copy of 44 MiB of text (monitor.py reads this shape)
                    sock.sendall(json.dumps(request)[:-1].encode() + b', "data": "')
                    sock.sendall(base64.b64encode(data))
                    sock.sendall(b'"}\n')
                while not buf.endswith(b"\n"):
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    buf += chunk
            except TimeoutError:
                raise SandboxError(f"session {self.id}: its monitor did not answer within {timeout} s") from None
            except OSError as e:  # ECONNRESET, EPIPE: the monitor exited with our request unread
                buf, cut = b"", f" ({e.strerror or e})"
        finally:
            sock.close()
            os.close(dfd)
        if not buf:
            return self._unanswered(request, cut)
        try:
            reply = json.loads(buf)
        except ValueError:
            raise SandboxError(f"session {self.id}: its monitor answered {buf[:80]!r}") from None
        if not reply.get("ok"):
            raise InputError(f"session {self.id}: {reply.get('error', 'refused')}")
        return reply

    def _connect(self, sock: socket.socket, path: str) -> None:
        """Connect to the monitor's socket (by `path`, via /proc/self/fd: a deep state directory
        would exceed sun_path's 108 bytes). A session still `starting` (its monitor alive) may
        not have bound it yet: tried again for up to CONNECT_WAIT seconds, so a kill or remove
        then reaches it (the monitor holds a kill that comes before the sandbox is forked)."""
        deadline = time.monotonic() + CONNECT_WAIT
        while True:
            try:
                sock.connect(path)
                return
            except OSError as e:
                st = self.state
                if st in ("exited", "lost"):
                    raise InputError(f"session {self.id} has ended; nothing to send it") from None
                if st == "starting" and e.errno in (errno.ENOENT, errno.ECONNREFUSED) \
                        and time.monotonic() < deadline:
                    time.sleep(0.02)
                    continue
                raise SandboxError(f"session {self.id}: cannot reach its monitor: {e.strerror or e}") from None

    def _unanswered(self, request: dict[str, Any], cut: str) -> dict[str, Any]:
        """No answer: the session ended while we asked (its monitor exits once the command
        has, and a request it had not read yet is cut). Then closing the command's stdin is
        done already, and anything else is refused as for an ended session."""
        deadline = time.monotonic() + ANSWER_GRACE_S  # the monitor writes the result before it exits
        while self.state not in ("exited", "lost") and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.state not in ("exited", "lost"):
            raise SandboxError(f"session {self.id}: its monitor closed the connection without an answer{cut}")
        if request.get("op") == "eof":
            return {"ok": True}  # its stdin went with it
        raise InputError(f"session {self.id} has ended; nothing to send it")

    def write(self, data: bytes | str, eof: bool = False) -> int:
        """Write to the command's stdin (its terminal for a PTY session); eof closes it."""
        if isinstance(data, str):
            data = os_bytes(data, "data")
        if not isinstance(data, (bytes, bytearray)):
            raise InputError(f"data: expected bytes or str, got {type(data).__name__}")
        n = 0
        if data:
            _check_write_size(len(data))
            n = int(self._ctl({"op": "write"}, data=bytes(data))["written"])
        if eof and not (n == 0 and self.state == "exited"):  # an ended command's stdin is closed already:
            self._ctl({"op": "eof"})                          # the same answer however late we are
        return n

    def _need_pty(self, what: str) -> None:
        if not self.pty:
            self._must_exist()
            raise InputError(f"{what}: session {self.id} has no terminal (start it with --pty / pty=True)")

    def send_keys(self, *keys: str, literal: bool = False) -> int:
        """Named keys (Enter, C-c, Up, ...) and literal text, in order; PTY sessions only."""
        self._need_pty("send-keys")
        if not keys:
            raise InputError("send-keys: no keys given")
        for k in keys:
            if not isinstance(k, str):
                raise InputError(f"send-keys: expected key names or text (str), got {type(k).__name__}")
            if not k:  # as write and paste refuse empty text
                raise InputError("send-keys: an empty key (expected a key name or text)")
        return self.write(b"".join(key_bytes(k, literal) for k in keys))

    def submit(self) -> int:
        """Press Enter (a newline for a session without a terminal)."""
        return self.write(b"\r" if self.pty else b"\n")

    def paste(self, text: str | bytes) -> int:
        """Paste text. On a terminal whose program enabled bracketed paste (ESC[?2004h, as
        readline, zsh, vim, IPython do) it arrives as ESC[200~ text ESC[201~, like a
        terminal emulator sends it, so the program takes it as typed text, not keys."""
        if isinstance(text, str):
            text = os_bytes(text, "text")
        if not isinstance(text, (bytes, bytearray)):
            raise InputError(f"text: expected str or bytes, got {type(text).__name__}")
        if not text:
            return 0
        _check_write_size(len(text))
        return int(self._ctl({"op": "paste"}, data=bytes(text))["written"])

    def resize(self, cols: int, rows: int) -> None:
        self._need_pty("resize")
        _check_size(cols, rows)
        self._ctl({"op": "resize", "cols": cols, "rows": rows})

    def kill(self, grace: float | None = None, timeout: float = 60.0) -> Result | None:
        """SIGTERM to the whole sandbox, SIGKILL after the grace (the profile's kill_grace);
        returns the final Result (None if it did not end within `timeout`)."""
        if grace is not None:  # at most a profile's own most (past the wall timeout, the run's time)
            from .profile import MAX_KILL_GRACE

            grace = _seconds("grace", grace)
            if grace is not None and grace > MAX_KILL_GRACE:
                raise InputError(f"grace: expected 0 to {MAX_KILL_GRACE:g} seconds (as a profile's kill_grace), "
                                 f"got {grace:g}")
        timeout_ = _seconds("timeout", timeout, forever=True) if timeout is not None else None
        st = self.state
        if st in ("running", "starting"):
            req: dict[str, Any] = {"op": "kill"}
            if grace is not None:
                req["grace"] = grace
            try:
                self._ctl(req, timeout=(grace if grace is not None else float(self.meta.get("kill_grace", 1))) + 30)
            except InputError:
                if self.state not in ("exited", "lost"):
                    raise  # the monitor refused: say why, never skip the kill quietly
            except (SandboxError, OSError):
                if self.state in ("running", "starting"):
                    raise
        return self.wait(timeout_)

    def wait(self, timeout: float | None = None) -> Result | None:
        """The final Result; None if still running after `timeout` seconds (None = forever)."""
        if timeout is not None:
            timeout = _seconds("timeout", timeout, forever=True)  # inf: wait forever, as None
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            st = self.state
            if st in ("exited", "lost"):
                return self.result
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            try:  # the monitor answers (or closes) when the run has ended
                req: dict[str, Any] = {"op": "wait"} if left is None else {"op": "wait", "timeout": left}
                self._ctl(req, timeout=None if left is None else left + 5)
            except TimeoutError:
                continue
            except (SandboxError, OSError):
                time.sleep(0.05 if left is None else min(0.05, max(left, 0)))

    def clear(self) -> None:
        """Forget a finished (or lost) session: its folder is removed."""
        st = self.state
        if st in ("running", "starting"):
            raise InputError(f"session {self.id} is still running; `sandboxrun remove {self.id}` "
                             "kills and forgets it")
        try:
            _rmtree(self.dir)
        except OSError as e:  # a read-only state directory, say: named, never an internal error
            raise SandboxError(f"session {self.id}: {e.strerror or e}") from None
        if st == "lost":
            _sweep_cgroups()

    def remove(self, grace: float | None = None) -> Result | None:
        """Kill it if it runs, then forget it. Returns its final Result."""
        res = self.kill(grace) if self.state in ("running", "starting") else self.result
        if self.state in ("running", "starting"):
            raise SandboxError(f"session {self.id} did not end after kill; not removed")
        self.clear()
        return res

    def running_result(self, tail_bytes: int = TAIL_BYTES) -> Result:
        """A Result with status "running": the session id and the tail of its output so far."""
        m = self.meta
        out, out_total = self._tail("stdout", tail_bytes)
        err, err_total = self._tail("stderr", tail_bytes)
        return Result(
            command=self.command, status="running", session_id=self.id, pid=m.get("pid"),
            profile=m.get("profile", ""), stdout=out.decode(errors="replace"), stderr=err.decode(errors="replace"),
            stdout_bytes=out_total, stderr_bytes=err_total, stdout_truncated=out_total > len(out),
            stderr_truncated=err_total > len(err),
            duration_ms=round((time.time() - m.get("started_at", m.get("created", time.time()))) * 1000, 3),
            isolation=_known_isolation(m),
        )


def _known_isolation(meta: Mapping[str, Any]) -> Isolation | None:
    """The isolation the monitor recorded for a run that has not ended, else None (unknown):
    never Isolation()'s defaults, which read as "host network, no seccomp"."""
    iso = meta.get("isolation")
    if isinstance(iso, dict):
        try:
            return Isolation(**iso)
        except TypeError:
            pass
    return None


# ---------------------------------------------------------------------------- finding sessions


def list_sessions(sweep: bool = True) -> list[Session]:
    """Every session in the state directory, oldest first (sweeps expired ones first)."""
    root = state_dir()
    if sweep:
        sweep_expired(root)
    out = []
    for name in os.listdir(root):
        if ID_RE.match(name) and os.path.isdir(os.path.join(root, name)) \
                and not os.path.islink(os.path.join(root, name)):
            out.append(Session(name, root))
    return sorted(out, key=lambda s: (s.meta.get("created", 0), s.id))


def get(ref: str) -> Session:
    """A session by id, by name (the newest running one, else the newest), or by unique id prefix."""
    if not isinstance(ref, str) or not ref or "/" in ref or "\0" in ref or ref in (".", ".."):
        raise InputError(f"session: expected an id or a name, got {ref!r}")
    root = state_dir()
    path = os.path.join(root, ref)
    if ID_RE.match(ref) and os.path.isdir(path) and not os.path.islink(path):
        return Session(ref, root)
    sessions = list_sessions(sweep=False)
    named = [s for s in sessions if s.name == ref]
    prefixed = [s for s in sessions if len(ref) >= 3 and s.id.startswith(ref)]
    if named:
        running = [s for s in named if s.state in ("running", "starting")]
        found = (running or named)[-1]
        others = [s.id for s in prefixed if s.id != found.id]
        if others:  # a name derived from a command (`start -- cafe`) can read as another's id prefix
            raise InputError(f"session {ref!r} is ambiguous: the name of {found.id}, and a prefix of "
                             f"{', '.join(others)}; give the full id")
        return found
    if len(prefixed) == 1:
        return prefixed[0]
    if len(prefixed) > 1:
        raise InputError(f"session {ref!r} is ambiguous: {', '.join(s.id for s in prefixed)}")
    raise InputError(f"no session {ref!r} in {root} (see `sandboxrun list`)")


def sweep_expired(root: str | None = None) -> int:
    """Remove finished and lost sessions older than the TTL; returns how many."""
    root = root or state_dir()
    ttl = session_ttl()
    now = time.time()
    n = 0
    lost = False
    for name in os.listdir(root):
        if not ID_RE.match(name) or os.path.islink(os.path.join(root, name)):
            continue
        s = Session(name, root)
        try:
            st = s.state
        except InputError:
            continue
        if st == "lost":
            lost = True
        if st in ("exited", "lost") and now - s.ended_at() > ttl:
            try:
                _rmtree(s.dir)
            except OSError:
                continue  # one that cannot go now must not stop every later start and list
            n += 1
    if lost:
        _sweep_cgroups()
    return n


def _sweep_cgroups() -> None:
    """A killed monitor leaves its (empty) cgroup, named after its pid: remove such leftovers."""
    try:
        from .isolation import cgroups

        cgroups.detect().sweep_stale()
    except (OSError, ImportError):
        pass


# ---------------------------------------------------------------------------- starting


def _check_size(cols: Any, rows: Any) -> None:
    for label, v in (("cols", cols), ("rows", rows)):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 10000:
            raise InputError(f"{label}: expected a whole number from 1 to 10000, got {v!r}")


# Bidirectional controls: they reorder what a terminal shows after them (U+202E: "evil" reads "live").
_BIDI = frozenset((0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)))


def control_char(c: str) -> bool:
    """A character no name may carry: a C0 or C1 control, DEL (a terminal acts on them:
    ESC starts escape sequences, U+009B is a one-character CSI), or a bidi control."""
    o = ord(c)
    return o < 32 or 0x7F <= o <= 0x9F or o in _BIDI


def printable(text: str) -> str:
    """`text` for a terminal: control characters (control_char) and lone surrogates as
    Python escapes (\\x1b, \\u202e, \\udcff), the rest as it is."""
    if not any(control_char(c) or 0xD800 <= ord(c) <= 0xDFFF for c in text):
        return text
    return "".join(ascii(c)[1:-1] if control_char(c) or 0xD800 <= ord(c) <= 0xDFFF else c for c in text)


def derive_name(argv: Sequence[str]) -> str:
    if len(argv) >= 3 and os.path.basename(argv[0]) in ("sh", "bash", "dash") and argv[1] == "-c":
        text = argv[2]
    else:
        text = shlex.join([os.path.basename(argv[0]), *argv[1:]])
    text = " ".join(text.split())
    # No control character (a name is printed to terminals) nor lone surrogate (not UTF-8): "?".
    text = "".join("?" if control_char(c) or 0xD800 <= ord(c) <= 0xDFFF else c for c in text)
    return text if len(text) <= 40 else text[:39] + "~"


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not 1 <= len(name) <= 64 or "/" in name \
            or any(0xD800 <= ord(c) <= 0xDFFF for c in name):
        shown = repr(name) if not isinstance(name, str) or len(name) <= 80 else f"{name[:60]!r}... ({len(name)} characters)"
        # (a lone surrogate, a byte of a non-UTF-8 argument, could not be written in meta.json's UTF-8)
        raise InputError(f"name: expected 1-64 printable characters without '/', got {shown}")
    bad = next((c for c in name if control_char(c)), None)
    if bad is not None:  # C0, C1 and bidi controls: a terminal that lists it would act on them
        import unicodedata

        what = f"U+{ord(bad):04X} ({unicodedata.name(bad)}), a bidi control" if ord(bad) in _BIDI \
            else f"U+{ord(bad):04X}, a control character"
        raise InputError(f"name: {ascii(name)} holds {what}; choose another")
    if name in (".", ".."):  # get() refuses them (path components): the session could not be found
        raise InputError(f"name: {name!r} cannot name a session; choose another")
    if name != name.strip():
        raise InputError(f"name: {name!r} starts or ends with a space; choose another")
    if _ID_PREFIX_RE.match(name):  # get() takes an id prefix of 3 digits or more: which would it mean?
        raise InputError(f"name: {name!r} looks like a session id or id prefix; choose another")
    return name


@record
class _Prepared:
    profile: Any
    argv: list[str]
    env: dict[str, str]
    cwd: str | None
    started: float


def _prepare(command: Any, profile: Any, timeout: Any, cwd: Any, env: Any, shell: bool, pty: bool,
             overrides: dict[str, Any]) -> _Prepared:
    """Everything a foreground run checks, here in the caller so errors reach it as errors."""
    from . import profile as profiles
    from .supervisor import build_env, check_environment, check_size, to_argv

    check_environment()  # the monitor's, which it inherits: an error here, not a failed monitor
    started = time.time()
    prof = profile if isinstance(profile, profiles.Profile) else profiles.load(profile)
    prof = profiles.with_overrides(prof, timeout=timeout, **overrides)
    argv = to_argv(command, shell)
    env_ = build_env(prof, env)
    if pty:
        env_.setdefault("TERM", "xterm-256color")
    check_size(argv, env_)
    if cwd is not None:
        if not isinstance(cwd, (str, os.PathLike)):
            raise InputError(f"cwd: expected a path, got {type(cwd).__name__}")
        from .hostpaths import check_writable_dir

        cwd = check_writable_dir(cwd, "cwd").path  # as a foreground run: no system tree, no link
    if prof.blocklist or prof.block or prof.allow:
        from .filter import check

        text = command if isinstance(command, str) else shlex.join(argv)
        verdict = check(text, blocklist=prof.blocklist, extra_block=prof.block, allow=prof.allow)
        if not verdict.allowed:
            raise SessionBlocked(Result(command=argv, status="blocked", blocked=True, block_reason=verdict.reason,
                                        error=verdict.reason, profile=prof.name, isolation=None))
    return _Prepared(prof, argv, env_, cwd, started)


def start(
    command: str | Sequence[str],
    *,
    profile: Any = "strict",
    name: str | None = None,
    pty: bool = False,
    cols: int | None = None,
    rows: int | None = None,
    timeout: float | str | None = None,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    shell: bool = False,
    stdin: bytes | str | None = None,
    stdin_file: str | None = None,
    trace: bool = False,
    ends_with_caller: bool = False,
    **overrides: Any,
) -> Session:
    """Start `command` in a sandbox under its own monitor and return once it runs.

    Same isolation and limits as sandbox.run; the wall timeout is the profile's
    (or `timeout`; 0 = none where the profile allows it). stdin stays an open pipe
    for Session.write unless `stdin` (bytes) or `stdin_file` gives fixed input.
    `ends_with_caller`: the session is killed when this process ends (a server's sessions
    then go with it even when it is SIGKILLed); by default it outlives its caller once
    start() has returned (a caller killed before that, which never learnt the id, takes
    the session with it).
    Raises SandboxError for bad input, SessionBlocked when the filter refuses it."""
    for label, flag in (("shell", shell), ("pty", pty), ("trace", trace), ("ends_with_caller", ends_with_caller)):
        if not isinstance(flag, bool):  # "no" and "false" are true to Python
            raise InputError(f"{label}: expected True or False, got {flag!r}")
    if not pty and (cols is not None or rows is not None):
        raise InputError("cols and rows size the session's terminal: only with pty=True")
    cols, rows = 80 if cols is None else cols, 24 if rows is None else rows  # a terminal's usual size
    _check_size(cols, rows)
    if name is not None:
        _check_name(name)
    if stdin is not None and stdin_file is not None:
        raise InputError("give stdin or stdin_file, not both")
    if pty and (stdin is not None or stdin_file is not None):
        raise InputError("a PTY session reads its terminal; stdin/stdin_file cannot be used with pty")
    if isinstance(stdin, str):
        stdin = os_bytes(stdin, "stdin")
    if stdin is not None and not isinstance(stdin, (bytes, bytearray)):
        raise InputError(f"stdin: expected bytes or str, got {type(stdin).__name__}")
    if stdin_file is not None:
        os.close(open_stdin_file(stdin_file))  # readable, no link in its path, a file
        stdin_file = os.path.normpath(os.path.abspath(os.fspath(stdin_file)))
    prep = _prepare(command, profile, timeout, cwd, env, shell, pty, overrides)
    if os.geteuid() == 0:  # root runs lease a uid: a bad lock setting is the caller's error, named now
        from .isolation.uids import check_lock_file

        check_lock_file()
    root = state_dir()
    sweep_expired(root)
    # A name is checked and taken (meta.json says "starting") under one lock: two starts of
    # the same name at once would both pass the check.
    names_lock = _lock_names(root) if name is not None else -1
    try:
        if name is not None:
            for s in list_sessions(sweep=False):
                if s.name == name and s.state in ("running", "starting"):
                    raise InputError(f"name: session {s.id} named {name!r} is still running")
        sess = _create(root, name, names_lock, prep, stdin, stdin_file, pty, cols, rows, trace)
    finally:
        if names_lock >= 0:
            os.close(names_lock)  # (if _create has not released it already)
    if not ends_with_caller:
        sess._detach()  # the caller holds its id now
    return sess


def _lock_names(root: str) -> int:
    try:
        fd = os.open(os.path.join(root, "names.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise SandboxError(f"state directory {root}: cannot open names.lock: {e.strerror}") from None
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _create(root: str, name: str | None, names_lock: int, prep: Any, stdin: bytes | bytearray | None,
            stdin_file: str | None, pty: bool, cols: int, rows: int, trace: bool,
) -> Session:
    sdir = sid = ""
    folder_lock = -1
    for _ in range(32):
        sid = secrets.token_hex(4)
        sdir = os.path.join(root, sid)
        try:
            os.mkdir(sdir, 0o700)
        except FileExistsError:
            continue
        except OSError as e:  # /proc, /sys, a read-only mount: a directory, but not one for files
            raise SandboxError(f"state directory {root}: cannot create a session folder: {e.strerror} "
                               "(set SANDBOXRUN_STATE_DIR)") from None
        try:
            folder_lock = os.open(sdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            fcntl.flock(folder_lock, fcntl.LOCK_EX)  # held until meta.json is written (see state)
            break
        except BaseException as e:  # (EMFILE, Ctrl-C): neither the folder nor its fd is left
            if folder_lock >= 0:
                os.close(folder_lock)
            _abandon(sdir)
            if isinstance(e, OSError):
                raise SandboxError(f"state directory {root}: cannot lock a session folder: {e.strerror}") from None
            raise
    else:
        raise SandboxError(f"cannot create a session folder in {root}")
    try:
        try:
            if stdin is not None:
                stdin_file = os.path.join(sdir, "stdin")
                fd = os.open(stdin_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(stdin)
            write_json(os.path.join(sdir, "request.json"), {
                "argv": prep.argv, "profile": profile_to_json(prep.profile), "cwd": prep.cwd, "env": prep.env,
                "pty": bool(pty), "cols": cols, "rows": rows, "stdin_file": stdin_file, "trace": bool(trace),
                "ends_with_caller": True, "caller_pid": os.getpid(),  # the monitor's parent's number
            })
            write_json(os.path.join(sdir, "meta.json"), {
                "id": sid, "name": name or derive_name(prep.argv), "command": prep.argv, "pty": bool(pty),
                "profile": prep.profile.name, "state": "starting", "created": prep.started,
                "starter_pid": proc_self(), "starter_start": proc_starttime(proc_self()), "proc_dev": proc_dev(),
                "kill_grace": prep.profile.limits.kill_grace, "timeout": prep.profile.limits.timeout,
            })
        except OSError as e:  # a full disk, a file size limit: the host refused, nothing ran
            raise SessionSetupError(f"state directory {root}: cannot write the session's files: "
                                  f"{write_failure(e)}") from None
        finally:
            os.close(folder_lock)
        if names_lock >= 0:
            fcntl.flock(names_lock, fcntl.LOCK_UN)  # the name is visible now: the next may check
        try:
            _spawn_monitor(sdir)
        except OSError as e:  # EMFILE for its pipe, EAGAIN for its fork
            raise SessionSetupError(f"cannot start the session monitor: {e.strerror or e}") from None
    except BaseException:
        _abandon(sdir)
        raise
    return Session(sid, root)


def _monitor_env(sdir: str) -> dict[str, str]:
    keep = ("PATH", "LANG", "LC_ALL", "HOME", "XDG_CACHE_HOME", "XDG_RUNTIME_DIR")
    env = {k: v for k, v in os.environ.items() if k in keep or k.startswith("SANDBOXRUN_")}
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = pkg_parent
    env["TMPDIR"] = sdir  # the run's fresh workdir lands in the session folder and goes with it
    # glibc: a write's buffers (up to 44 MiB) in mmaps of their own, handed back when freed. By
    # default the threshold rises to 32 MiB after the first such free, and then every handler
    # thread's arena keeps what it took (three 24 MiB writes in turn: +87 MB for good).
    env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
    return env


def _above_std(fd: int) -> int:
    if fd > 2:
        return fd
    import fcntl

    try:
        return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    finally:
        os.close(fd)


def _spawn_monitor(sdir: str) -> None:
    # -P: `-m` would put its working directory, the session folder, first on the import path.
    # Numbered 3 or more: the child's stdin/stdout/stderr set-up would take over a 0, 1 or 2
    # (a caller that closed its own got "the session monitor failed: no message").
    from .isolation.rlimits import bytecode_flags

    r, w = (_above_std(fd) for fd in os.pipe())
    err = _above_std(os.open(os.path.join(sdir, "monitor.log"),
                             os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
    try:
        proc = subprocess.Popen(
            [sys.executable, "-s", "-P", *bytecode_flags(), "-m", "sandbox.monitor", sdir, str(w)], pass_fds=(w,), cwd=sdir,
            env=_monitor_env(sdir), start_new_session=True, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=err, close_fds=True,
        )
    finally:
        os.close(w)
        os.close(err)
    try:
        proc.wait()  # it forks the real monitor and exits at once: no zombie of ours later
        status = _read_ready(r, START_TIMEOUT)
    finally:
        os.close(r)
    if status in (b"R", b"E"):
        return
    m = read_meta(os.path.join(sdir, "meta.json"))
    if status == b"T":
        _kill_if(m.get("monitor_pid"), m.get("monitor_start"))  # its sandbox dies with it
    log = (read_bytes(os.path.join(sdir, "monitor.log")) or b"").decode(errors="replace").strip().splitlines()
    why = log[-1] if log else "no message"
    if status == b"T":
        raise SandboxError(f"the session monitor did not start the sandbox within {START_TIMEOUT:g}s: {why}")
    raise SandboxError(f"the session monitor failed: {why}")


def _read_ready(fd: int, timeout: float) -> bytes:
    from .fdwait import readable

    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return b"T"
        if readable([fd], left):
            data = os.read(fd, 1)
            return data or b""


def _abandon(sdir: str) -> None:
    m = read_meta(os.path.join(sdir, "meta.json"))
    _kill_if(m.get("monitor_pid"), m.get("monitor_start"))
    try:
        _rmtree(sdir)
    except OSError as e:
        if e.errno != errno.ENOENT:
            raise


_TO_LOGS = "the output goes to the session's logs"


def open_stdin_file(path: Any, what: str = "stdin_file") -> int:
    """A session's stdin_file, opened as the command gets it (blocking, read-only, no link in
    its path): a regular file or /dev/null. A FIFO read as empty (opened without waiting for a
    writer, which would hold up the start) and a device would be handed over whole: refused."""
    import stat

    from .hostpaths import open_for_reading

    fd = open_for_reading(path, what)
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) or stat.S_ISCHR(st.st_mode) and os.path.samestat(st, os.stat(os.devnull)):
        os.set_blocking(fd, True)
        return fd
    os.close(fd)
    kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) else "a device"
    raise InputError(f"{what}: {path}: {kind}, not a regular file: a session's input is a file, fixed data, "
                     "or what is written to it (`sandboxrun write`, Session.write)")


# The session's monitor is a process of its own: an fd of the caller's does not reach it.
_NO_FD = "a session's input is stdin bytes, a stdin_file by name, or Session.write"


def _wait_or_cancel(sess: Session, timeout: float | None, cancel: Any) -> tuple[Result | None, bool]:
    """(its Result or None after `timeout`, whether `cancel` ended it: then it is removed)."""
    if cancel is None:
        return sess.wait(timeout=timeout), False
    deadline = None if timeout is None else time.monotonic() + timeout
    while not cancel.cancelled:  # in slices: the monitor's wait cannot watch the Cancel's fd
        left = None if deadline is None else deadline - time.monotonic()
        res = sess.wait(timeout=CANCEL_POLL if left is None else max(0.0, min(left, CANCEL_POLL)))
        if res is not None or (left is not None and left <= CANCEL_POLL):
            return res, False
    res = sess.remove(grace=0)  # the caller never learns its id: it must not run on
    if res is None:  # (lost: its monitor died with no Result)
        res = Result(command=list(sess.command or []), status="lost", profile=sess.meta.get("profile", ""),
                     isolation=None)
    res.session_id, res.error = None, "cancelled by the caller: the sandbox was killed"
    return res, True


def run_or_yield(command: str | Sequence[str], yield_after: float, *, tail_bytes: int = TAIL_BYTES,
                 **kwargs: Any) -> Result:
    """Run `command` as a session; if it ends within `yield_after` seconds return its
    Result (and forget the session), else a Result with status "running", its
    session_id and the tail of its output so far (later polls start after it).

    Takes sandbox.run's arguments (profile, timeout, cwd, env, stdin, shell, limit
    overrides) plus start()'s (name, pty, cols, rows, stdin_file)."""
    # Checked before the session starts: a value wait() refused after it would leave one
    # running that the caller never learns of.
    yield_after = _seconds("yield_after", yield_after, forever=True)
    cancel = kwargs.pop("cancel", None)  # run_async's: ends the session while it is waited for
    for bad, why in (("on_stdout", _TO_LOGS), ("on_stderr", _TO_LOGS), ("stdin_fd", _NO_FD), ("stdin_from", _NO_FD)):
        if kwargs.get(bad) is not None:
            raise InputError(f"{bad} cannot be combined with yield_after ({why})")
        kwargs.pop(bad, None)
    try:
        sess = start(command, **{**kwargs, "ends_with_caller": True})  # ends with us until the caller holds its id
    except SessionBlocked as e:
        return e.result
    try:
        res, cancelled = _wait_or_cancel(sess, yield_after, cancel)
    except BaseException:  # Ctrl-C, SIGTERM: the caller never learns its id, so it must not run on
        try:
            sess.remove(grace=0)
        except SandboxError:
            pass
        raise
    if cancelled:  # removed already
        return res  # type: ignore[return-value]
    if res is not None:
        sess.clear()
        res.session_id = None
        return res
    sess._mark_seen()
    if not kwargs.get("ends_with_caller"):
        sess._detach()
    return sess.running_result(tail_bytes)
