"""The per-session monitor: `python -m sandbox.monitor SESSION_DIR READY_FD`.

Started by sessions.start() in the role conmon plays for podman. It detaches (one
fork: the starter reaps the first process at once, so no zombie is left in a
long-lived caller), forks the sandbox while still single-threaded (DirectForker:
unshare and fork need that; rootless, the fork server), and only then starts
threads: the control socket server and its per-connection handlers. The
supervisor's loop runs in the main thread and pumps the output into capped logs.

When the run ends it writes result.json, then meta.json (state "exited"), and exits.
If the monitor is killed, the sandbox's init gets SIGKILL (PR_SET_PDEATHSIG; rootless,
the fork server kills it when the monitor's socket closes), its pid namespace dies
with it, and readers report the session as "lost" (and SIGKILL an init that
survived). SIGTERM/SIGINT to the monitor kill the sandbox the orderly way, and the
Result is still written.

Control protocol: one JSON line per connection, one JSON line back ({"ok": ...}).
  write {data: base64}   to the stdin pipe or the terminal (bounded wait if it is full)
  paste {data: base64}   a write, in ESC[200~ ... ESC[201~ when the program enabled
                         bracketed paste on its terminal (ESC[?2004h), as a terminal does
  eof                    close stdin (a terminal gets its VEOF character, ^D)
  resize {cols, rows}    TIOCSWINSZ on the terminal (the program gets SIGWINCH)
  kill {grace?}          SIGTERM to the init (it forwards to all), SIGKILL after the grace
  wait {timeout?}        answered once the Result is on disk (or after the timeout)
"""

from __future__ import annotations

import base64
import binascii
import fcntl
import json
import os
import resource
import secrets
import signal
import socket
import struct
import sys
import termios
import threading
import time
import traceback
from typing import Any

from .fdwait import readable, writable
from .output import CHUNK, Capture
from .result import Result
from .sessions import (
    MAX_WRITE,
    CappedLog,
    proc_self,
    proc_starttime,
    profile_from_json,
    read_json,
    read_log,
    write_json,
)

WRITE_TIMEOUT = 10.0  # a write waits this long for a command that does not read its input
MAX_REQUEST = (MAX_WRITE + 2) // 3 * 4 + (1 << 16)  # the same, as base64 in a JSON line
BIG_REQUEST = 64 << 10  # a request longer than this is read only while no other such one is: writes (which
# take the write lock in turn anyway) hold at most this much each while they wait (64 at 3 MiB: +250 MB)
_DATA_KEY = b', "data": "'  # how the client sends a write's data (see _parse_request)
START_WAIT = 20.0  # how long the starter is kept waiting for the sandbox's setup
PASTE_ON, PASTE_OFF = b"\x1b[?2004h", b"\x1b[?2004l"


class _Refused(Exception):
    """A control request that cannot be done; its message goes back to the client."""


class _StreamAll(Capture):
    """Every byte goes to the logs (the session's record); nothing is kept in memory.

    The supervisor's own Capture keeps up to limits.output bytes and stops calling
    on_data past that cap, which suits a foreground run but would silence a server's
    log after 1 MiB: the monitor swaps it in (see the report about a Request flag)."""

    @property
    def truncated(self) -> bool:
        return False

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        if self.on_data is not None:
            self.on_data(chunk)

    def read_from(self, fd: int) -> bool:
        try:
            chunk = os.read(fd, CHUNK)
        except BlockingIOError:
            return True
        except OSError:  # EIO: every holder of the terminal's slave side is gone
            return False
        if not chunk:
            return False
        self.feed(chunk)
        return True


def _winsize(fd: int, cols: int, rows: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


class Monitor:
    def __init__(self, sdir: str, ready_fd: int) -> None:
        self.sdir = sdir
        self.ready_fd = ready_fd
        self.meta: dict[str, Any] = read_json(self._p("meta.json")) or {}
        self.req: dict[str, Any] = read_json(self._p("request.json")) or {}
        self.sid = os.path.basename(sdir)
        self.prof: Any = None
        self.logs: dict[str, CappedLog] = {}
        self.pidfd: int | None = None
        self.caller_fd: int | None = None  # ends_with_caller: the starter's pidfd (-1: it has ended)
        self._detach_r, self._detach_w = os.pipe2(os.O_CLOEXEC)  # readable once detached (op "detach")
        self.pid: int | None = None  # the sandbox's child (its init), unreaped while we run it
        self.master: int | None = None
        self.slave: int | None = None
        self.stdin_r: int | None = None
        self.stdin_w: int | None = None
        self.stdin_note = "stdin was closed (eof)"
        self.bracketed_paste = False  # the program asked for it (ESC[?2004h) on its terminal
        self._mode_tail = b""
        self.sock: socket.socket | None = None
        self.killed = False
        self.kill_requested = False
        self.ended = threading.Event()
        self._meta_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self.line_open = False  # the last byte written to the terminal left a line unfinished
        self._kill_lock = threading.Lock()
        self._ready_lock = threading.Lock()
        # One large request (a write of up to 32 MiB: 44 MiB as a line) is read and written at a
        # time: each connection has a thread of its own, and concurrent ones took hundreds of MB.
        self._big = threading.Semaphore(1)

    def _p(self, name: str) -> str:
        return os.path.join(self.sdir, name)

    def _set_meta(self, **kw: Any) -> None:
        with self._meta_lock:
            self.meta.update(kw)
            write_json(self._p("meta.json"), self.meta)

    def _ready(self, status: bytes) -> None:
        """Answer the starter once: R (the command runs) or E (it ended first: see result.json)."""
        with self._ready_lock:
            if self.ready_fd >= 0:
                try:
                    os.write(self.ready_fd, status)
                except OSError:
                    pass
                os.close(self.ready_fd)
                self.ready_fd = -1

    def _announce(self, pid: int) -> None:
        """Say R once the init has spawned the command, so a sandbox whose setup fails is
        reported to the starter as its setup_error, not as a session that runs."""
        path = f"/proc/{pid}/task/{pid}/children"
        deadline = time.monotonic() + START_WAIT
        while not self.ended.is_set() and time.monotonic() < deadline:
            try:
                with open(path, "rb") as f:
                    if f.read().strip():
                        break
            except OSError:
                if not os.path.isdir(f"/proc/{pid}/task/{pid}"):
                    return  # it is gone before it ran: _close answers E with the result
                break  # no such file on this kernel (CONFIG_PROC_CHILDREN): say R now
            time.sleep(0.002)
        if not self.ended.is_set():
            self._ready(b"R")

    # ------------------------------------------------------------------ the run

    def run(self) -> None:
        from . import supervisor

        if not self.req or not self.meta:
            raise RuntimeError(f"{self.sdir}: request.json or meta.json missing")
        # First: a kill or remove of the session while it starts connects to it (and waits in
        # the backlog until the sandbox is forked; a kill is then held in kill_requested).
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.sock.bind("ctl.sock")  # relative: our cwd is the session folder (sun_path is short)
        os.chmod("ctl.sock", 0o600)
        self.sock.listen(16)
        token = secrets.token_hex(8)
        me = proc_self()  # as /proc numbers us: what readers look up
        from .isolation.cgroups import own_pid_namespace

        self._set_meta(monitor_pid=me, monitor_start=proc_starttime(me), log_token=token,
                       pid_ns=own_pid_namespace())
        self.prof = prof = profile_from_json(self.req["profile"])
        if prof.limits.file_size is not None:  # (else the run inherits the starter's, as run() does)
            _lift_file_size()
        if os.geteuid() == 0:
            # Fork from here, while this process has one thread. Not rootless: a direct fork
            # there leaves this process in a pid_for_children namespace it cannot setns back
            # out of, and the kernel then refuses it new threads (EINVAL on CLONE_THREAD); the
            # fork server (made PID 1 of its own pid namespace for this) is used instead.
            supervisor.use_direct_forker()
        pty = bool(self.req.get("pty"))
        cap = prof.limits.log_size
        self.logs["output"] = CappedLog(self._p("output.log"), cap, token)
        if pty:
            self.master, self.slave = os.openpty()
            _winsize(self.master, int(self.req.get("cols", 80)), int(self.req.get("rows", 24)))
            os.set_blocking(self.master, False)
        else:
            self.logs["stdout"] = CappedLog(self._p("stdout.log"), cap, token)
            self.logs["stderr"] = CappedLog(self._p("stderr.log"), cap, token)
            if self.req.get("stdin_file"):
                from .sessions import open_stdin_file

                self.stdin_r = open_stdin_file(self.req["stdin_file"])  # the walk and checks again
                self.stdin_note = "its stdin is a file (stdin/stdin_file at start)"
            else:
                self.stdin_r, self.stdin_w = os.pipe2(os.O_CLOEXEC)
                os.set_blocking(self.stdin_w, False)
        supervisor.Capture = _StreamAll  # type: ignore[misc]
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, self._on_signal)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # (an ignored one is kept across exec) we reap
        request = supervisor.Request(
            argv=list(self.req["argv"]), profile=prof, cwd=self.req.get("cwd"), env=dict(self.req.get("env", {})),
            stdin_fd=self.stdin_r, on_stdout=self._on_stdout, on_stderr=self._on_stderr,
            trace=bool(self.req.get("trace")), pty_fd=self.slave, pty_master=self.master,
            on_started=self._started,
        )
        self._finish(supervisor.execute(request))

    def _on_stdout(self, data: bytes) -> None:
        if "stdout" in self.logs:
            self.logs["stdout"].append(data)
        else:  # a terminal: follow bracketed-paste mode as a terminal emulator does
            seen = self._mode_tail + data
            on, off = seen.rfind(PASTE_ON), seen.rfind(PASTE_OFF)
            if on != off:
                self.bracketed_paste = on > off
            self._mode_tail = seen[-(len(PASTE_ON) - 1):]
        self.logs["output"].append(data)

    def _on_stderr(self, data: bytes) -> None:
        if "stderr" in self.logs:
            self.logs["stderr"].append(data)
        self.logs["output"].append(data)

    def _started(self, pid: int) -> None:
        """The sandbox is forked: from here on threads are safe."""
        from .forker import host_pid

        self.pidfd = os.pidfd_open(pid)
        self.pid = pid
        seen = host_pid(self.pidfd)  # /proc's number for it: ours is another where /proc is an ancestor namespace's
        for name in ("slave", "stdin_r"):  # only the sandbox may hold these now
            fd = getattr(self, name)
            if fd is not None:
                os.close(fd)
                setattr(self, name, None)
        self._set_meta(state="running", pid=seen, pid_start=proc_starttime(seen), started_at=time.time())
        threading.Thread(target=self._serve, daemon=True).start()
        threading.Thread(target=self._announce, args=(seen,), daemon=True).start()
        if self.caller_fd is not None:
            threading.Thread(target=self._end_with_caller, daemon=True).start()
        if self.kill_requested:
            threading.Thread(target=self._kill, daemon=True).start()

    def _end_with_caller(self) -> None:
        """Kill the sandbox once the process that started it has ended, however it ended
        (an MCP server SIGKILLed cannot remove its sessions itself), unless it detached first:
        a start hands its session over to the background once its caller knows the id."""
        gone = self.caller_fd is None or self.caller_fd < 0  # (-1: it had ended before we could watch it)
        watched = [self._detach_r] + ([] if gone else [self.caller_fd])
        ready = readable(watched, 0 if gone else None)  # the caller exits, or detaches
        if self._detach_r in ready:
            return
        if not self.ended.is_set():
            self._kill()

    def _finish(self, res: Result) -> None:
        lim = self.prof.limits
        note = res.stderr.encode()  # only the supervisor's own lines ("sandboxrun: ..."): we kept no output
        if note and "stderr" in self.logs:
            self._on_stderr(note)  # so `log` and `poll` show why it ended, too
        for stream in ("stdout", "stderr"):
            log = self.logs.get(stream) or (self.logs["output"] if stream == "stdout" else None)
            tail, total = (b"", 0) if log is not None else (note, len(note))  # a terminal's stderr: the note
            if log is not None:
                tail, total = read_log(log.path, log.token)[1][-lim.output:], log.total
            setattr(res, stream, tail.decode(errors="replace"))
            setattr(res, f"{stream}_bytes", total)
            setattr(res, f"{stream}_truncated", total > len(tail))
        res.session_id = self.sid
        if self.killed:
            res.error = "killed on request" + (f" ({res.error})" if res.error else "")
        d = res.to_dict()
        d["killed"] = self.killed
        write_json(self._p("result.json"), d)
        self._set_meta(state="exited", ended_at=time.time(), status=res.status, exit_code=res.exit_code)
        self._close()

    def fail(self, message: str) -> None:
        """The monitor itself failed: record a setup_error so callers are not left guessing."""
        if os.path.exists(self._p("result.json")):
            return
        res = Result(command=list(self.req.get("argv", [])), status="setup_error", error=f"monitor: {message}",
                     error_step="monitor", session_id=self.sid, profile=self.meta.get("profile", ""),
                     stderr=f"sandboxrun: session monitor failed: {message}\n",
                     isolation=None)  # not known: never Isolation()'s "host network, no seccomp"
        d = res.to_dict()
        d["killed"] = self.killed
        try:
            write_json(self._p("result.json"), d)
            self._set_meta(state="exited", ended_at=time.time(), status=res.status, exit_code=res.exit_code)
        except OSError:
            pass
        self._close()

    def _close(self) -> None:
        self.ended.set()
        self._ready(b"E")  # it ended before it ran (the starter reads the result)
        if self.sock is not None:
            try:
                os.unlink(self._p("ctl.sock"))
            except OSError:
                pass

    # ------------------------------------------------------------------ control

    def _on_signal(self, _sig: int, _frame: object) -> None:
        self.killed = True
        if self.pidfd is None:
            self.kill_requested = True
        else:
            threading.Thread(target=self._kill, daemon=True).start()

    def _send(self, sig: int) -> None:
        if self.pidfd is not None:
            try:
                signal.pidfd_send_signal(self.pidfd, sig)
            except OSError:
                pass  # already gone (a pidfd never reaches a recycled pid)

    def _kill(self, grace: float | None = None) -> None:
        self.killed = True
        if self.pidfd is None:
            self.kill_requested = True
            return
        if grace is None:
            grace = self.prof.limits.kill_grace
        with self._kill_lock:
            self._send(signal.SIGTERM)  # the init forwards it to every process in the sandbox
        # Not waited under the lock: a second kill with a shorter grace (0: now) ends the
        # sandbox at its own time, instead of queueing behind the first one's grace.
        done = readable([self.pidfd], max(0.0, grace))
        with self._kill_lock:
            if not done and self.pid is not None and self.pidfd is not None:
                from .supervisor import kill_run

                # the pid namespace dies with its init; without one, the init's descendants first
                kill_run(self.pidfd, own_tree="pid" not in self.prof.namespaces)

    def _serve(self) -> None:
        assert self.sock is not None
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        big = False
        with conn:
            try:
                cred = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
                _pid, uid, _gid = struct.unpack("3i", cred)
                if uid not in (0, os.geteuid()):
                    raise _Refused("permission denied")
                conn.settimeout(30)
                # A large write waits its turn within the one deadline of a write (see _write).
                deadline = time.monotonic() + WRITE_TIMEOUT
                buf = bytearray()  # (bytes += was quadratic: 30 MB took seconds)
                while not buf.endswith(b"\n"):
                    chunk = conn.recv(1 << 16)
                    if not chunk:
                        return
                    buf += chunk
                    if len(buf) > MAX_REQUEST:
                        raise _Refused(f"request too large (at most {MAX_WRITE >> 20} MiB of data per write)")
                    if not big and len(buf) > BIG_REQUEST and not buf.endswith(b"\n"):
                        if not self._big.acquire(timeout=max(0.0, deadline - time.monotonic())):
                            n = _drain(conn, buf)  # read (not kept), so that the client reads the answer
                            raise _Refused("the command is not reading its input: an earlier large write still "
                                           f"waits (0 of {n} bytes written)" if n >= 0 else "request too large")
                        big = True
                conn.settimeout(None)
                req = _parse_request(buf)
                del buf  # (only the decoded data is kept while it is written)
                reply = self._dispatch(req, deadline if big else None)
            except _Refused as e:
                reply = {"ok": False, "error": str(e)}
            except Exception as e:  # noqa: BLE001 - a bad request must not end the monitor
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            finally:
                if big:
                    self._big.release()
            try:
                conn.sendall(json.dumps(reply).encode() + b"\n")
            except OSError:
                pass

    def _dispatch(self, req: dict[str, Any], deadline: float | None = None) -> dict[str, Any]:
        op = req.get("op")
        if op == "write":
            return {"ok": True, "written": self._write(_data(req), deadline)}
        if op == "paste":
            data = _data(req)
            if self.bracketed_paste:
                data = b"\x1b[200~" + _without_paste_marks(data) + b"\x1b[201~"
            return {"ok": True, "written": self._write(data, deadline)}
        if op == "eof":
            self._eof()
        elif op == "resize":
            cols, rows = req.get("cols"), req.get("rows")
            if self.master is None:
                raise _Refused("the session has no terminal")
            if not all(isinstance(v, int) and 1 <= v <= 10000 for v in (cols, rows)):
                raise _Refused("cols and rows must be whole numbers from 1 to 10000")
            _winsize(self.master, cols, rows)
            self._set_meta(cols=cols, rows=rows)
        elif op == "kill":
            grace = req.get("grace")
            if grace is not None and (not isinstance(grace, (int, float)) or grace < 0):
                raise _Refused("grace must be seconds >= 0")
            self._kill(grace)
        elif op == "detach":  # the session outlives its starter from now on
            os.write(self._detach_w, b"x")
        elif op == "wait":
            timeout = req.get("timeout")
            ended = self.ended.wait(min(float(timeout), 3600.0) if isinstance(timeout, (int, float)) else 3600.0)
            return {"ok": True, "ended": ended}
        elif op != "status":
            raise _Refused(f"unknown request {op!r}")
        return {"ok": True, "pid": self.meta.get("pid")}

    def _write(self, data: bytes, deadline: float | None = None) -> int:
        # One deadline for the wait behind an earlier write and for this one's own: a write
        # queued behind a stuck one fails whole within WRITE_TIMEOUT, well before its client
        # gives up (a write reported as failed must not land later: a retry would send it twice).
        # (A large one's deadline counts from its connection: it waited for its turn to be read.)
        if deadline is None:
            deadline = time.monotonic() + WRITE_TIMEOUT
        if not self._write_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise _Refused(f"the command is not reading its input: an earlier write still waits (0 of "
                           f"{len(data)} bytes written)")
        try:
            fd = self.master if self.master is not None else self.stdin_w
            if fd is None:
                raise _Refused(f"cannot write: {self.stdin_note}")
            view = memoryview(data)
            written = 0
            while view:
                try:
                    n = os.write(fd, view[:65536])
                except BlockingIOError:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise _Refused(f"the command is not reading its input ({written} of {len(data)} "
                                       "bytes written)") from None
                    writable(fd, min(left, 0.5))
                    continue
                except OSError as e:  # EPIPE / EIO: nobody reads the other end any more
                    raise _Refused(f"the command's input is closed ({written} of {len(data)} bytes written; "
                                   f"{e.strerror})") from None
                self.line_open = view[n - 1:n] not in (b"\r", b"\n")
                view = view[n:]
                written += n
            return written
        finally:
            self._write_lock.release()

    def _eof(self) -> None:
        if self.master is not None:
            try:
                veof = termios.tcgetattr(self.master)[6][termios.VEOF]
            except (termios.error, IndexError):
                veof = b"\x04"
            veof = veof if isinstance(veof, bytes) else bytes([veof])
            # After text on the line, one VEOF only hands that text over: a second ends the input.
            self._write(veof * 2 if self.line_open else veof)
            self.line_open = False
            return
        with self._write_lock:
            if self.stdin_w is not None:
                os.close(self.stdin_w)
                self.stdin_w = None


def _parse_request(buf: bytearray) -> dict[str, Any]:
    """A request line as a dict. A write's as the client sends it ({..., "data": "BASE64"}) has
    its data decoded straight from the buffer, never copied as text first (json.loads of 44 MiB
    made three copies of it); anything else is parsed as JSON."""
    i = buf.find(_DATA_KEY)
    if i > 0 and buf.endswith(b'"}\n'):
        try:
            head = json.loads(bytes(buf[:i]) + b"}")
            with memoryview(buf) as view:
                data = binascii.a2b_base64(view[i + len(_DATA_KEY):-3], strict_mode=True)
        except ValueError:  # (binascii.Error too): not this shape after all
            pass
        else:
            if isinstance(head, dict) and "data" not in head:
                head["data"] = data
                return head
    out = json.loads(buf)
    if not isinstance(out, dict):
        raise _Refused("a request is a JSON object")
    return out


def _data(req: dict[str, Any]) -> bytes:
    data = req.get("data", "")
    if isinstance(data, bytes):  # decoded by _parse_request already (JSON has no bytes)
        return data
    return base64.b64decode(data, validate=True)


def _drain(conn: socket.socket, buf: bytearray) -> int:
    """Read the rest of a request line without keeping it; the bytes of data it carried
    (-1: not a write's shape, or longer than any request)."""
    total, tail = len(buf), bytes(buf[-8:])
    scratch = bytearray(1 << 16)
    while not tail.endswith(b"\n"):
        n = conn.recv_into(scratch)
        if not n:
            return -1
        total += n
        tail = (tail + bytes(scratch[:n]))[-8:]
        if total > MAX_REQUEST:
            return -1
    i = buf.find(_DATA_KEY)
    if i < 0 or not tail.endswith(b'"}\n'):
        return -1
    b64 = total - (i + len(_DATA_KEY)) - 3
    return b64 // 4 * 3 - tail[:-3].count(b"=")


def _without_paste_marks(data: bytes) -> bytes:
    """Pasted text without bracketed paste's own marks: an ESC[201~ in it would end the paste
    early and what follows would arrive as typed keys (`text ESC[201~ rm -rf ~ CR`). Removed
    until none is left, as a removal may join the parts of another."""
    while True:
        cleaned = data.replace(b"\x1b[201~", b"").replace(b"\x1b[200~", b"")
        if cleaned == data:
            return data
        data = cleaned


def _caller_pidfd(req: dict[str, Any]) -> int | None:
    """For a session that ends with its caller (start(ends_with_caller=True)): a pidfd of the
    starter, our parent until we detach, or -1 when it is gone already. Taken before the fork,
    and kept only while the starter is still our parent: then the pidfd cannot name a stranger
    that reused its pid."""
    if not req.get("ends_with_caller"):
        return None
    parent = os.getppid()
    if parent == 0:  # the starter is in an ancestor pid namespace: no number of it to watch
        return None
    try:
        fd = os.pidfd_open(parent)
    except OSError:
        return -1
    if os.getppid() != parent or parent != req.get("caller_pid"):
        os.close(fd)
        return -1
    return fd


def _lift_file_size() -> None:
    # The starter's soft `ulimit -f` would cut this process's logs and result; the run's own
    # limit is the profile's file_size, set in the sandbox.
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[1].isdigit():
        print("usage: python -m sandbox.monitor SESSION_DIR READY_FD (started by sandboxrun start)", file=sys.stderr)
        return 2
    sdir, ready_fd = os.path.abspath(argv[0]), int(argv[1])
    mon = Monitor(sdir, ready_fd)  # reads the session's files (one thread still: fork-safe)
    mon.caller_fd = _caller_pidfd(mon.req)  # before the fork: the starter is our parent until then
    if os.fork():
        os._exit(0)  # the starter reaps this one; the monitor goes on, reparented
    os.umask(0o077)
    os.set_inheritable(ready_fd, False)
    code = 0
    try:
        mon.run()
    except BaseException as e:  # noqa: BLE001 - record it in the session, then go
        traceback.print_exc()
        mon.fail(f"{type(e).__name__}: {e}")
        code = 1
    try:
        sys.stderr.flush()
    except OSError:
        pass
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
