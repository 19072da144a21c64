"""Creating the child safely, fast.

The kernel refuses unshare(CLONE_NEWUSER) in a multi-threaded process, and forking
a multi-threaded Python process then running Python in the child can deadlock on a
lock another thread held. So the child is only ever forked from a single-threaded
process with a small heap:

* DirectForker: the process itself, when it is known to be single-threaded and
  ours alone (the CLI). No extra interpreter start.
* ServerForker: a fork server started once per caller process
  (`python -m sandbox.forkserver`); requests and the child's pipes travel over a
  Unix socket with SCM_RIGHTS, the child's pidfd comes back the same way. Used by
  the library, from any thread or from asyncio.

Both put the child straight into a fresh pid namespace (unshare(CLONE_NEWPID)
before fork affects only children), so the child is PID 1 and no third process is
needed. A non-root forker first enters a user namespace of its own, mapped to the
caller, which is what lets it create the other namespaces.
"""

from __future__ import annotations

import _thread
import errno
import os
import struct
import sys

from . import signals
from .isolation.syscalls import CLONE_NEWPID, setns, unshare
from .plan import PARENT_GONE, SANDBOX_UID, RunPlan
from .record import record, replace

TYPE_CHECKING = False
if TYPE_CHECKING:
    import resource
    import socket


@record
class ChildFds:
    """The child's stdin/stdout/stderr, report pipe and cgroup sync pipe (or, with
    `cgroup_tasks`, the tasks files of the v1 cgroup the child joins by itself)."""

    stdin: int
    stdout: int
    stderr: int
    report: int
    cgroup: list[int]
    cgroup_tasks: bool = False
    netns: int = -1  # a ready network namespace to enter instead of making one (native stage)
    netns_parent: bool = False  # netns is the parent to make the run's own from (a batch's runs)
    cgroup_dir: int = -1  # the run's cgroup v2 directory, to clone PID 1 into (native stage)

    def all(self) -> list[int]:
        return [self.stdin, self.stdout, self.stderr, self.report, *self.cgroup]


class ForkError(OSError):
    """The forker could not create the child; carries the layer that failed."""

    def __init__(self, step: str, err: int, message: str) -> None:
        super().__init__(err, message)
        self.step = step


class _ForkSide:
    """What both forkers do in the single-threaded process that forks.

    unshare(CLONE_NEWPID) works once while pid_for_children differs from our own pid
    namespace, so a forker that makes many children switches back with setns after
    each fork. setns needs CAP_SYS_ADMIN over the namespace it returns to: a rootless
    server therefore first makes itself PID 1 of a pid namespace of its own user
    namespace (`own_pid_namespace`).
    """

    def __init__(self, own_pid_namespace: bool = False, preload: bool = True) -> None:
        """`preload`: import what the Python child needs now (a fork server, whose children
        share those pages), else just before the first fork of one (the one-shot CLI, whose
        run the native stage usually takes: ~15 ms of imports it then never pays)."""
        self.preloaded = False
        if preload:
            self._preload()
        self.rootless = os.geteuid() != 0
        # Rootless and not PID 1 of a pid namespace of our own user namespace (the CLI): we
        # could not setns back after an unshare(CLONE_NEWPID), so the stage makes that namespace.
        self.stage_clones = self.rootless and not own_pid_namespace
        self.userns_error: tuple[int, str] | None = None
        if self.rootless:
            try:
                from .isolation.identity import enter_user_namespace

                enter_user_namespace(0, 0)
                if own_pid_namespace:
                    _become_pid1()
            except OSError as e:
                self.userns_error = (e.errno or 0, str(e))
        self._orig_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)

    def _preload(self) -> None:
        from .child import preload

        preload()
        self.preloaded = True

    templates: dict[tuple[object, ...], int] | None = None  # only a long-lived forker keeps them

    def _template_for(self, plan: RunPlan) -> int:
        """A prepared mount namespace for this view (rootless: one that also holds a proc,
        without which a user namespace cannot mount its own; see filesystem.template_ops)."""
        if self.templates is None or plan.view is None:
            return -1
        from .isolation.filesystem import template_key

        key = template_key(plan.view)
        if key is None:
            return -1
        fd = self.templates.get(key)
        if fd is None:
            fd = _make_template(plan, self.rootless)
            if fd < 0:
                return -1
            if len(self.templates) >= 8:  # a few profiles in use at once; drop the oldest
                old = next(iter(self.templates))
                os.close(self.templates.pop(old))
            self.templates[key] = fd
        return fd

    def fork_child(self, plan: RunPlan, fds: ChildFds) -> tuple[int, bool, bool]:
        """The child's pid, whether it was born in its cgroup (the stage, on cgroup v2), and
        whether it runs in a user namespace of its own the plan did not ask for (below)."""
        if self.userns_error and (plan.pid_namespace or plan.unshare_flags):
            err, msg = self.userns_error
            raise ForkError("user_namespace", err, f"cannot create a user namespace: {msg}")
        own_userns = self.rootless and self.userns_error is None and plan.uid < 0 and not plan.nested_userns
        if own_userns:
            # A rootless run without namespaces (nested) would keep our identity: uid 0 of our
            # user namespace. It gets one more, as the rootless profile's runs, and is uid 1000.
            plan = replace(plan, nested_userns=True, uid=SANDBOX_UID, gid=SANDBOX_UID)
        plan.view_template = self._template_for(plan)
        if os.sched_getscheduler(0) != os.SCHED_OTHER:
            # Not after the fork: a real-time child cannot join a v1 cpu cgroup (EINVAL), and
            # the supervisor moves it while it starts. This forker is ours (the fork server,
            # or the one-shot CLI itself); the child resets the rest (child._reset_process_state).
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        stage = plan.extra.get("stage")
        if isinstance(stage, str):
            return (*self._spawn_stage(stage, plan, fds), own_userns)
        if not self.preloaded:
            self._preload()
        if plan.pid_namespace:
            try:
                unshare(CLONE_NEWPID)
            except OSError as e:
                raise ForkError("pid_namespace", e.errno or 0, f"cannot create a pid namespace: {e}") from None
        try:
            pid = os.fork()
        finally:
            if plan.pid_namespace:
                try:
                    setns(self._orig_pidns, CLONE_NEWPID)
                except OSError:
                    pass  # the next unshare then fails with a named error; one-shot forkers need no reset
        if pid == 0:
            try:
                for sig in (signals.SIGCHLD, signals.SIGTERM, signals.SIGINT, signals.SIGHUP):
                    signals.signal(sig, signals.SIG_DFL)  # not the forker's handlers
                signals.pthread_sigmask(signals.SIG_SETMASK, set())  # nor its blocked signals
                for i, fd in enumerate((fds.stdin, fds.stdout, fds.stderr)):
                    os.dup2(fd, i)
                from .child import child_main

                child_main(plan, fds.report, fds.cgroup)
            finally:
                os._exit(125)
        return pid, False, own_userns

    def _spawn_stage(self, path: str, plan: RunPlan, fds: ChildFds) -> tuple[int, bool]:
        """The native stage instead of a Python child (posix_spawn: no copy of our pages), as
        PID 1 of a new pid namespace where the plan has one, copying our template if any; on
        cgroup v2 (fds.cgroup_dir) PID 1 is cloned into the run's cgroup, as for root."""
        from .native.launch import spawn_plan

        return spawn_plan(path, plan, fds, plan.view_template, stage_clones=self.stage_clones)


def _make_template(plan: RunPlan, rootless: bool = False) -> int:
    """Fork a helper that builds the view's static part in a new mount namespace; keep an
    fd to that namespace (it lives as long as the fd) and let the helper go."""
    import socket  # lazy: ~5 ms, only the fork server (rootless) needs it

    from .isolation.filesystem import build_template
    from .isolation.syscalls import CLONE_NEWNS

    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        try:
            ours.close()
            for sig in (signals.SIGCHLD, signals.SIGTERM, signals.SIGINT, signals.SIGHUP):
                signals.signal(sig, signals.SIG_DFL)
            unshare(CLONE_NEWNS)
            assert plan.view is not None
            build_template(plan.view, [""], rootless)
            theirs.send(b"1")
            theirs.recv(1)  # until the forker has opened our namespace
        except BaseException:  # noqa: BLE001 - fall back to building each view in full
            pass
        os._exit(0)
    theirs.close()
    try:
        if ours.recv(1) != b"1":
            return -1
        return open_template(pid)
    except OSError:
        return -1
    finally:
        ours.close()


def open_template(pid: int) -> int:
    """An fd of the mount namespace of our child `pid`, a template's builder that holds it
    (alive until we let it go), or -1. By the number /proc gives it (from a pidfd), not by
    the one fork() gave us: where /proc belongs to an ancestor pid namespace (a caller in one
    without its own /proc) ours names another process, and its namespace (the host's) would
    have become every run's view."""
    from .fdwait import readable

    pidfd = os.pidfd_open(pid)
    try:
        number = host_pid(pidfd)
        if number <= 0:
            return -1
        fd = os.open(f"/proc/{number}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        if readable([pidfd], 0):  # it exited meanwhile: the number may be another's
            os.close(fd)
            return -1
        return fd
    finally:
        os.close(pidfd)


def _become_pid1() -> None:
    """Fork once; the parent waits and mirrors the exit, the child goes on as PID 1."""
    unshare(CLONE_NEWPID)
    pid = os.fork()
    if pid:
        signals.signal(signals.SIGCHLD, signals.SIG_DFL)
        _, status = os.waitpid(pid, 0)
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def host_pid(pidfd: int) -> int:
    """The pid of a pidfd's process as /proc numbers it: in the pid namespace that /proc
    belongs to (ours, or the host's for a fork server in a pid namespace of its own);
    -1 once it has exited."""
    with open(f"/proc/self/fdinfo/{pidfd}") as f:
        for line in f:
            if line.startswith("Pid:"):
                return int(line.split()[1])
    return -1


@record
class Launched:
    """A started child: its pid (in our pid namespace) and a pidfd."""

    pid: int
    pidfd: int
    direct: bool  # we are the parent and must reap
    pid1: bool = False  # it is PID 1 of the run's pid namespace: its usage is the whole tree's
    in_cgroup: bool = False  # born in the run's cgroup (CLONE_INTO_CGROUP): no move needed
    own_userns: bool = False  # the fork side gave a run without namespaces a user namespace (uid 1000)

    def reap(self) -> resource.struct_rusage | None:
        """Wait for it; its resource usage where we are its parent (with that of every
        process it reaped: as PID 1, all of the run's)."""
        if self.direct:
            try:
                return os.wait4(self.pid, 0)[2]
            except ChildProcessError:
                pass
        return None


def _offer_stage(plan: RunPlan) -> None:
    """Have the forker spawn the native stage for this plan where it can run it (the forkers
    here serve rootless callers; root's use the stage directly, these only where it cannot)."""
    from .native import ops, stage_path

    path = stage_path() if ops.supports(plan) else None
    if path:
        plan.extra["stage"] = path


class DirectForker(_ForkSide):
    clones_into_v2_cgroup = True  # where the stage runs the plan (_ForkSide._spawn_stage)

    def __init__(self) -> None:
        super().__init__(preload=False)
        import gc

        gc.disable()  # a one-shot CLI: no collection may copy pages around the fork
        gc.freeze()

    def spawn(self, plan: RunPlan, fds: ChildFds) -> Launched:
        _offer_stage(plan)
        pid, in_cgroup, own_userns = self.fork_child(plan, fds)
        return Launched(pid, os.pidfd_open(pid), True, in_cgroup=in_cgroup, own_userns=own_userns)


# --------------------------------------------------------------------------- fork server

_HDR = struct.Struct("!I")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _send_msg(sock: socket.socket, obj: object, fds: list[int]) -> None:
    import pickle
    import socket  # lazy: ~5 ms, only the fork server (rootless) needs it

    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    socket.send_fds(sock, [_HDR.pack(len(payload))], fds)
    sock.sendall(payload)


def _recv_msg(sock: socket.socket, maxfds: int) -> tuple[object, list[int]]:
    import socket  # lazy: ~5 ms, only the fork server (rootless) needs it

    hdr, fds, _flags, _addr = socket.recv_fds(sock, _HDR.size, maxfds)
    try:
        if not hdr:
            raise EOFError
        if len(hdr) < _HDR.size:
            hdr += _recv_exact(sock, _HDR.size - len(hdr))
        (n,) = _HDR.unpack(hdr)
        import pickle

        return pickle.loads(_recv_exact(sock, n)), fds
    except BaseException:  # (the rest of it never came: a deadline, the peer gone)
        for fd in fds:
            os.close(fd)
        raise


def serve(fd: int) -> None:
    """The fork server's loop: one request, one fork, one reply; reap children."""
    import socket  # lazy: ~5 ms, only the fork server (rootless) needs it

    os.set_inheritable(fd, False)  # passed to us inheritable: no child of ours may hold our caller's socket
    sock = socket.socket(fileno=fd)
    side = _ForkSide(own_pid_namespace=True)
    import gc

    gc.disable()  # children fork from us: a collection would touch (and copy) every page
    gc.freeze()
    if os.environ.get("SANDBOXRUN_NO_TEMPLATE") != "1":
        side.templates = {}
    children: set[int] = set()
    own_tree: set[int] = set()  # children without a pid namespace: their runs' subreapers

    def reap(_sig: int, _frame: object) -> None:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            children.discard(pid)
            own_tree.discard(pid)

    signals.signal(signals.SIGCHLD, reap)
    pid_namespace = os.stat("/proc/self/ns/pid").st_ino  # the numbering of the pids we reply
    served = 0
    while True:
        served += 1
        if served % 512 == 0:  # the rare cyclic garbage of requests, collected between forks
            gc.collect()
            gc.freeze()
        try:
            msg, fds = _recv_msg(sock, 16)
        except (EOFError, ConnectionError, OSError):
            break
        for f in fds:  # SCM_RIGHTS fds arrive inheritable; none may reach the command
            os.set_inheritable(f, False)
        plan = msg
        try:
            assert isinstance(plan, RunPlan)
            cgroup_dir = fds[-1] if plan.extra.get("cgroup_dir") else -1  # sent last (ServerForker.spawn)
            child_fds = ChildFds(fds[0], fds[1], fds[2], fds[3], fds[4:-1] if cgroup_dir >= 0 else fds[4:],
                                 cgroup_dir=cgroup_dir)
            # No reaping between fork and pidfd_open: a child that fails at once would be
            # gone (its pid maybe reused) before we hold it.
            signals.pthread_sigmask(signals.SIG_BLOCK, {signals.SIGCHLD})
            try:
                pid, in_cgroup, own_userns = side.fork_child(plan, child_fds)
                children.add(pid)
                if not plan.pid_namespace:
                    own_tree.add(pid)
                pidfd = os.pidfd_open(pid)
            finally:
                signals.pthread_sigmask(signals.SIG_UNBLOCK, {signals.SIGCHLD})
            reply: object = ("ok", pid, pid_namespace, in_cgroup, own_userns)
            out = [pidfd]
        except ForkError as e:
            reply, out, pidfd = ("error", e.step, e.errno or 0, e.strerror or str(e)), [], -1
        except Exception as e:  # noqa: BLE001 - the server must survive any request
            reply, out, pidfd = ("error", "fork", 0, f"{type(e).__name__}: {e}"), [], -1
        finally:
            for f in fds:
                os.close(f)
        try:
            _send_msg(sock, reply, out)
        except OSError:
            break
        finally:
            if pidfd >= 0:
                os.close(pidfd)
    # The caller is gone: nothing of its may keep running. A child without a pid namespace
    # catches PARENT_GONE and kills its own descendants (the run's processes, which SIGKILL
    # would orphan out of reach) before it exits. Then SIGKILL (a pid namespace dies with it).
    import time

    for pid in list(own_tree):
        try:
            os.kill(pid, PARENT_GONE)
        except OSError:
            pass
    deadline = time.monotonic() + 2.5
    while own_tree and time.monotonic() < deadline:
        time.sleep(0.02)  # the SIGCHLD handler (reap) removes those that exited
    for pid in list(children):
        try:
            os.kill(pid, signals.SIGKILL)
        except OSError:
            pass
    os._exit(0)


SERVER_REPLY_S = 30.0  # a fork takes milliseconds; this only ends a wait on a server stopped or stuck


class ServerForker:
    """Client side of the fork server; safe from any number of threads."""

    clones_into_v2_cgroup = True  # where the server's stage runs the plan (_ForkSide._spawn_stage)

    def __init__(self) -> None:
        self._lock = _thread.allocate_lock()
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None  # noqa: F821 - a string annotation
        self._owner = 0

    def _start(self) -> socket.socket:
        import socket  # lazy: ~5 ms, only the fork server (rootless) needs it
        import subprocess
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        code = f"import sys; sys.path.insert(0, {pkg_parent!r}); from sandbox.forkserver import main; main()"
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "HOME", "XDG_CACHE_HOME") or k.startswith("SANDBOXRUN_")}
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # find what the caller found
        env["SANDBOXRUN_FORKSERVER_FD"] = str(theirs.fileno())
        from .isolation.rlimits import bytecode_flags

        self._proc = subprocess.Popen(
            [sys.executable, "-s", *bytecode_flags(), "-c", code], pass_fds=[theirs.fileno()], env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=None, close_fds=True,
        )
        theirs.close()
        ours.settimeout(SERVER_REPLY_S)  # a stopped or stuck server must not hang its caller (in a held step)
        self._owner = os.getpid()
        self._sock = ours
        return ours

    def start(self) -> None:
        """Started now if it is not (once per process): before a run's clock, not in its spawn."""
        with self._lock:
            if self._sock is None or self._owner != os.getpid():
                self._sock = self._start()

    def spawn(self, plan: RunPlan, fds: ChildFds) -> Launched:
        _offer_stage(plan)
        sent = fds.all()
        if fds.cgroup_dir >= 0:
            plan.extra["cgroup_dir"] = True
            sent.append(fds.cgroup_dir)
        with self._lock:
            for attempt in (1, 2):
                if self._sock is None or self._owner != os.getpid():
                    self._sock = self._start()
                try:
                    _send_msg(self._sock, plan, sent)
                except OSError:
                    # The server died before this request: nothing was started, start a new one.
                    self._drop()
                    if attempt == 2:
                        raise ForkError("forkserver", 0, "the fork server could not be started") from None
                    continue
                try:
                    reply, rfds = _recv_msg(self._sock, 1)
                    break
                except TimeoutError:
                    self._drop()  # (its children take their parent-death signal)
                    raise ForkError("forkserver", errno.ETIMEDOUT,
                                    f"the fork server did not answer in {SERVER_REPLY_S:g} s") from None
                except (EOFError, OSError):
                    self._drop()  # it died while forking: do not retry a request it may have run
                    raise ForkError("forkserver", 0, "the fork server went away") from None
        assert isinstance(reply, tuple)
        if reply[0] == "error":
            raise ForkError(reply[1], reply[2], reply[3])
        # Its pid as we number it: the server's own where it shares our pid namespace (root);
        # else (rootless: a namespace of its own) /proc's number, from the pidfd.
        ours = reply[2] == os.stat("/proc/self/ns/pid").st_ino
        return Launched(reply[1] if ours else host_pid(rfds[0]), rfds[0], False, in_cgroup=reply[3],
                        own_userns=reply[4])

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        if self._owner not in (0, os.getpid()):  # a forked copy's exit: the server is its parent's
            return
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            if self._proc is not None:
                import subprocess

                try:
                    self._proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
                self._proc = None


def is_single_threaded() -> bool:
    """True when this process has exactly one thread (Python's or any C library's)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Threads:"):
                    return int(line.split()[1]) == 1
    except OSError:
        pass
    import threading

    return threading.active_count() == 1
