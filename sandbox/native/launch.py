"""Start the native stage: posix_spawn (vfork + exec) from any thread of any process.

For a run with a pid namespace, the calling thread first unshares CLONE_NEWPID, which
changes only where that thread's next child is born: the stage starts as PID 1 of the
new namespace and we are its parent (we reap it and hold its pidfd). The thread then
returns to its own namespace at once. Where that unshare would cost more than it saves
(the one-shot CLI on Python 3.11, which has no os.unshare: ctypes' import, ~2.5 ms), the
stage makes the namespace itself: it clones PID 1 as our child and exits (stage.c,
clone_pid_namespace), one short-lived process more (~0.1 ms).
"""

from __future__ import annotations

import _thread
import fcntl
import os

from ..forker import ChildFds, ForkError, Launched, open_template
from ..isolation.syscalls import CLONE_NEWPID, setns, unshare
from ..plan import RunPlan
from . import ops, stage_path

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..isolation.network import ReadyNamespaces

_F_DUPFD_CLOEXEC = 1030


_PIDNS_FD = 5  # stage.c: open when the stage is to make the pid namespace, and send PID 1's pid on it
_INTO_CGROUP_FD = 17  # stage.c: with _PIDNS_FD, the cgroup v2 directory PID 1 is cloned into


def _spawn_stage(path: str, mode: str, program: bytes, fds: dict[int, int], *, pid1: bool = False,
                 stage_clones: bool = False) -> tuple[int, bool]:
    """posix_spawn the stage with `fds` at the given numbers; returns its pid, and whether it
    was born in its cgroup (only where `fds` has _INTO_CGROUP_FD and the kernel could).
    `pid1`: as PID 1 of a new pid namespace, which this thread makes, or with `stage_clones`
    the stage (and the pid returned is then that of the PID 1 it made, our child too)."""
    memfd = os.memfd_create("sandboxrun-stage", os.MFD_CLOEXEC)
    temps: list[int] = []
    try:
        view = memoryview(program)
        while view:
            view = view[os.write(memfd, view):]
        where = {**fds, 3: memfd}
        if pid1 and stage_clones:
            return _spawn_cloning(path, mode, where)
        actions = _file_actions(where, temps)
        actions.append((os.POSIX_SPAWN_CLOSE, _PIDNS_FD))  # an fd 5 of our caller's would say "clone"
        pid = -1
        try:
            with _new_pid_namespace() if pid1 else _no_namespace:
                try:
                    pid = os.posix_spawn(path, [mode], {}, file_actions=actions, setsigmask=())
                except OSError as e:
                    raise ForkError("stage", e.errno or 0, f"cannot start the native stage {path}: {e.strerror}") from None
        except RuntimeError:  # started, but this thread is stuck in its namespace: no run from here
            if pid > 0:
                os.kill(pid, 9)
                _reap(pid)
            raise
        return pid, False
    finally:
        for fd in (memfd, *temps):
            os.close(fd)


def _file_actions(where: dict[int, int], temps: list[int]) -> list[tuple[int, ...]]:
    """dup2 actions putting each fd of `where` at its number; the copies they need go in `temps`."""
    actions: list[tuple[int, ...]] = []
    above = max(where) + 1  # not a round 64: a caller whose soft RLIMIT_NOFILE is 50 has no fd 64
    for target, src in sorted(where.items()):
        # Each source first goes above every target, so no dup2 overwrites a later source.
        high = fcntl.fcntl(src, _F_DUPFD_CLOEXEC, above)
        temps.append(high)
        actions.append((os.POSIX_SPAWN_DUP2, high, target))
    return actions


def _spawn_cloning(path: str, mode: str, where: dict[int, int]) -> tuple[int, bool]:
    """The stage makes the pid namespace: it clones PID 1 as our child (into the cgroup at
    _INTO_CGROUP_FD, where given and the kernel can), sends its pid on _PIDNS_FD ("<pid>
    cgroup" when born there; -errno on failure), and exits."""
    pid_r, pid_w = os.pipe2(os.O_CLOEXEC)
    copies: list[int] = []
    try:
        try:
            actions = _file_actions({**where, _PIDNS_FD: pid_w}, copies)
            if _INTO_CGROUP_FD not in where:  # an fd 17 of our caller's would name a cgroup
                actions.append((os.POSIX_SPAWN_CLOSE, _INTO_CGROUP_FD))
            stage = os.posix_spawn(path, [mode], {}, file_actions=actions, setsigmask=())
        finally:
            for fd in (pid_w, *copies):  # the stage's copies alone now: EOF if it ends without a word
                os.close(fd)
    except OSError as e:
        os.close(pid_r)
        raise ForkError("stage", e.errno or 0, f"cannot start the native stage {path}: {e.strerror}") from None
    text = _read_line(pid_r)
    _reap(stage)
    number, _, where_born = text.partition(" ")
    try:
        pid = int(number)
    except ValueError:
        raise ForkError("stage", 0, f"the native stage sent no pid ({text!r})") from None
    if pid <= 0:
        err = -pid
        raise ForkError("pid_namespace", err, f"cannot create a pid namespace: {os.strerror(err)}")
    return pid, where_born == "cgroup"


class _NoNamespace:
    """contextlib.nullcontext, without contextlib's import on the CLI's path."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_no_namespace = _NoNamespace()


class _new_pid_namespace:
    """This thread's next child is PID 1 of a new pid namespace; the thread's own is restored
    on exit (the kernel refuses a second unshare until it is, so a lost restore cannot nest)."""

    def __enter__(self) -> None:
        self.own = os.open("/proc/thread-self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        try:
            unshare(CLONE_NEWPID)
        except OSError as e:
            os.close(self.own)
            raise ForkError("pid_namespace", e.errno or 0, f"cannot create a pid namespace: {e.strerror}") from None

    def __exit__(self, *exc: object) -> None:
        try:
            setns(self.own, CLONE_NEWPID)
        except OSError as e:
            raise RuntimeError(f"cannot return to our own pid namespace: {e}") from None
        finally:
            os.close(self.own)


def _read_line(fd: int) -> str:
    data = b""
    try:
        while not data.endswith(b"\n"):
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    return data.decode(errors="replace").strip()


def spawn_plan(path: str, plan: RunPlan, fds: ChildFds, template: int, *, stage_clones: bool) -> tuple[int, bool]:
    """Compile `plan` for the stage and spawn it with the child's fds at the stage's numbers
    (copying the template namespace `template`, if >= 0): its pid, and whether PID 1 was born
    in the run's cgroup. For NativeForker, and for a rootless caller's fork server."""
    tasks = len(fds.cgroup) if fds.cgroup_tasks else 0
    try:
        program = ops.compile_plan(plan, template=template >= 0, cgroup=bool(fds.cgroup), tasks=tasks,
                                   netns=_netns_mode(fds, plan))
    except OSError as e:  # a bind source gone or reached through a link since the checks
        raise ForkError("filesystem:mount:open-sources", e.errno or 0, e.strerror or str(e)) from None
    where = {0: fds.stdin, 1: fds.stdout, 2: fds.stderr, 4: fds.report}
    if fds.netns >= 0 and plan.loopback:
        where[ops.NETNS_FD] = fds.netns
    if tasks:
        where.update({ops.TASKS_FD + i: fd for i, fd in enumerate(fds.cgroup)})
    elif fds.cgroup:
        where[ops.CGROUP_FD] = fds.cgroup[0]
    if template >= 0:
        where[ops.TEMPLATE_FD] = template
    # cgroup v2: PID 1 cloned into the run's cgroup by the stage (one short-lived process
    # more, ~0.1 ms) spares the supervisor's move of it, an RCU grace period when idle.
    into = fds.cgroup_dir >= 0 and plan.pid_namespace
    if into:
        where[_INTO_CGROUP_FD] = fds.cgroup_dir
    return _spawn_stage(path, "sandboxrun-init" if plan.pid_namespace else "sandboxrun-stage", program, where,
                        pid1=plan.pid_namespace, stage_clones=stage_clones or into)


def _netns_mode(fds: ChildFds, plan: RunPlan) -> str:
    if fds.netns < 0 or not plan.loopback:
        return ""
    return "parent" if fds.netns_parent else "ready"


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


class NativeForker:
    """Spawns each run's stage; keeps prepared mount-namespace templates when long-lived."""

    joins_v1_cgroups = True  # give it each hierarchy's tasks file (ChildFds.cgroup_tasks)
    clones_into_v2_cgroup = True  # give it the run's v2 cgroup directory (ChildFds.cgroup_dir)
    reaps_pid1 = True  # a run with a pid namespace: its PID 1 is our child (Launched.pid1)

    def __init__(self, *, templates: bool, stage_clones: bool = False) -> None:
        """`templates`: keep views' static parts (long-lived callers); `stage_clones`: the stage
        makes each run's pid namespace (callers for whom an unshare costs ctypes' import)."""
        self.templates: dict[tuple[object, ...], int] | None = {} if templates else None
        self.stage_clones = stage_clones
        self._failed: set[tuple[object, ...]] = set()
        self._lock = _thread.allocate_lock()
        self._owner = os.getpid()
        # Network namespaces made ahead (long-lived callers only, like the templates).
        self.netns: ReadyNamespaces | None = None
        if templates:
            from ..isolation.network import ReadyNamespaces  # socket: ~2 ms the one-shot CLI does without

            self.netns = ReadyNamespaces()

    def _template_for(self, plan: RunPlan) -> int:
        if self.templates is None or plan.view is None or os.environ.get("SANDBOXRUN_NO_TEMPLATE") == "1":
            return -1
        from ..isolation.filesystem import template_key

        key = template_key(plan.view)
        if key is None:
            return -1
        with self._lock:
            fd = self.templates.get(key)
            if fd is None:
                if key in self._failed:
                    return -1
                fd = self._make_template(plan)
                if fd < 0:
                    self._failed.add(key)  # build these views in full, without trying each run
                    return -1
                if len(self.templates) >= 8:  # a few profiles in use at once; drop the oldest
                    os.close(self.templates.pop(next(iter(self.templates))))
                self.templates[key] = fd
            return fd

    def _make_template(self, plan: RunPlan) -> int:
        """A stage builds the view's static part in a new mount namespace and holds it until
        we have opened it; any failure falls back to building each view in full."""
        path = stage_path()
        if path is None or plan.view is None:
            return -1
        try:
            program = ops.template_program(plan.view)
        except OSError:
            return -1  # (a bind source gone or swapped: the full build reports it, at its step)
        hold_r, hold_w = os.pipe2(os.O_CLOEXEC)
        rep_r, rep_w = os.pipe2(os.O_CLOEXEC)
        null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
        try:
            pid, _ = _spawn_stage(path, "sandboxrun-template", program, {0: hold_r, 1: null, 2: null, 4: rep_w})
        except ForkError:
            os.close(hold_w)
            os.close(rep_r)
            return -1
        finally:
            for fd in (hold_r, rep_w, null):
                os.close(fd)
        try:
            if _read_line(rep_r) != "R":
                return -1
            return open_template(pid)
        except OSError:
            return -1
        finally:
            os.close(hold_w)  # the stage exits; the namespace lives on in our fd
            _reap(pid)

    def spawn(self, plan: RunPlan, fds: ChildFds) -> Launched:
        path = stage_path()
        if path is None:
            raise ForkError("stage", 0, "the native stage is unavailable")
        pid, in_cgroup = spawn_plan(path, plan, fds, self._template_for(plan), stage_clones=self.stage_clones)
        return Launched(pid, os.pidfd_open(pid), True, pid1=plan.pid_namespace, in_cgroup=in_cgroup)

    def close(self) -> None:
        if self._owner != os.getpid():  # a forked copy's exit: its lock may have been held at the fork
            return
        with self._lock:
            for fd in (self.templates or {}).values():
                os.close(fd)
            if self.templates is not None:
                self.templates.clear()
        if self.netns is not None:
            self.netns.close()
