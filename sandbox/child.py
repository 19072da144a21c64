"""The sandbox's init: runs in the forked child, applies every layer in order,
spawns the command, and stays as PID 1 to reap and forward signals.

Order (each step from its own module; why it sits where it does):
  session       setsid: a new session, detached from the caller's terminal (TIOCSTI)
  pdeathsig     SIGKILL when the forker dies, so nothing runs unsupervised
  namespaces    mount, net, ipc, uts (pid and user were made by the forker)
  filesystem    tmpfs root, binds, /tmp, /dev, /proc, pivot_root (needs CAP_SYS_ADMIN)
  network       loopback up (needs CAP_NET_ADMIN in the new net namespace)
  hostname      (needs CAP_SYS_ADMIN in the new uts namespace)
  cgroup        wait until the supervisor has moved us into the run's cgroup (it does so
                while we build the filesystem: a v1 memory-cgroup move costs milliseconds),
                before any fork, so every descendant is counted; then the cgroup namespace,
                rooted at the run's cgroup
  rlimits       before dropping privileges: raising is impossible afterwards anyway
  fds           close everything above 2 but the report pipe (CLOEXEC) (CVE-2024-21626)
  landlock      build the ruleset while every rule path is still reachable
  identity      bounding set emptied, then uid/gid (or a nested user namespace)
  capabilities  every set cleared
  no_new_privs  exec can never gain privileges (setuid, file caps); not dumpable
  landlock_enforce  filesystem rules a second time, so a mount mistake is not an escape
  seccomp       last: the filter still allows what spawning the command needs
  exec          posix_spawn (vfork+exec: no second Python fork), then init duties

The init keeps the same identity and filter as the command: it needs no privilege
to reap and to signal processes of its own uid. Errors go to the supervisor as
one line on the report pipe: "E <step> <errno> <message>".
"""

from __future__ import annotations

import errno
import os
import resource
import signal
import time

from .isolation import proctree
from .plan import PARENT_GONE, RunPlan, parent_death_signal

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# The command starts with every signal at its default: Python ignores SIGPIPE and SIGXFSZ,
# and a caller may ignore others (ignored signals survive exec).
SPAWN_DEFAULT_SIGNALS = tuple(sorted(signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}))
_HELD = {*FORWARDED, PARENT_GONE, signal.SIGCHLD}  # blocked from before the spawn, taken by init_loop


CHILD_MODULES = ("isolation.syscalls", "isolation.filesystem", "isolation.identity", "isolation.landlock",
                 "isolation.network", "isolation.rlimits", "isolation.seccomp")


def preload() -> None:
    """Import every module the child uses, in the forker, before any fork: after
    pivot_root the package is no longer reachable, and forked children then share
    the pages instead of each importing again."""
    import fcntl  # noqa: F401 - the PTY and network steps use them after pivot_root
    import importlib
    import socket  # noqa: F401
    import termios  # noqa: F401

    import prctl  # noqa: F401

    for mod in CHILD_MODULES:
        try:
            importlib.import_module(f"sandbox.{mod}")
        except ImportError:
            pass  # the child reports it as a setup error at the step that needs it
    from .isolation import syscalls

    syscalls._c()  # ctypes and libc, loaded lazily elsewhere


class StepError(Exception):
    def __init__(self, step: str, err: int, message: str) -> None:
        super().__init__(message)
        self.step, self.errno, self.message = step, err, message


def _report(fd: int, line: str) -> None:
    data = (line.replace("\n", " ") + "\n").encode(errors="replace")
    try:
        os.write(fd, data)
    except OSError:
        pass


def find_executable(name: str, path: str) -> str:
    """Resolve argv[0] inside the sandbox with the sandbox's PATH (like execvp)."""
    if "/" in name:
        return name
    denied = None
    for d in path.split(":"):
        candidate = os.path.join(d or ".", name)
        if os.path.isfile(candidate):
            if os.access(candidate, os.X_OK):
                return candidate
            denied = candidate
    if denied:
        return denied  # posix_spawn then says EACCES -> 126
    raise StepError("exec", 2, f"{name}: command not found")


def _await_cgroup(sync_fd: int) -> None:
    """The supervisor writes b"1\\n" once we are in the run's cgroup, or b"0<errno> <why>\\n".
    (Read to the newline, not EOF: a directly forked child holds a copy of the write end.)"""
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(sync_fd, 4096)
        if not chunk:
            break
        data += chunk
    os.close(sync_fd)
    if data[:1] != b"1":
        err, _, why = data[1:].decode(errors="replace").strip().partition(" ")
        raise StepError("cgroup", int(err) if err.isdigit() else 0, why or "the supervisor went away")


def _reset_process_state() -> None:
    """What the caller's own state would otherwise hand the run (as stage.c's
    reset_process_state): umask, personality (setarch -R: no ASLR), nice, I/O class,
    real-time scheduling. The command starts from defaults."""
    os.umask(0o022)
    try:
        with open("/proc/self/personality") as f:
            changed = int(f.read(), 16) != 0
    except (OSError, ValueError):
        changed = True
    if changed:
        import ctypes  # lazy: ~4 ms, only for a caller with a personality set

        ctypes.CDLL(None).personality(0)  # PER_LINUX
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    except OSError:
        pass  # rootless and niced: raising our priority back to 0 is not ours to do
    if os.sched_getscheduler(0) != os.SCHED_OTHER:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    from .isolation.syscalls import reset_io_priority  # (ctypes: preloaded by the forker)

    reset_io_priority()


def _set_proctitle(title: bytes) -> None:
    """Overwrite our argument area, which /proc/PID/cmdline shows, with `title` and NULs.
    Not prctl.set_proctitle: python-prctl looks for that area by walking back at most 8 KiB
    from environ, and past it (a CLI given hundreds of --ro-bind) dereferenced NULL: PID 1
    died of SIGSEGV. The kernel says where the area is (/proc/self/stat: arg_start, arg_end)."""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()  # fields[0] is field 3 (comm may hold spaces)
    start, end = int(fields[45]), int(fields[46])  # fields 48 and 49
    title = title[: max(end - start - 1, 0)]
    fd = os.open("/proc/self/mem", os.O_RDWR | os.O_CLOEXEC)
    try:
        os.pwrite(fd, title.ljust(end - start, b"\0"), start)
    finally:
        os.close(fd)


def _supervised_or_exit(report_fd: int) -> None:
    """The parent-death signal covers a supervisor that dies from now on, not one that died
    before it was armed: then no signal comes and the run would outlive its timeout. The
    supervisor reads the report pipe for the whole run; a pipe without readers polls POLLERR."""
    import select

    p = select.poll()
    p.register(report_fd, select.POLLOUT)
    if any(ev & (select.POLLERR | select.POLLNVAL) for _fd, ev in p.poll(0)):
        os._exit(125)


def setup(plan: RunPlan, report_fd: int, cgroup_fds: list[int], trace: dict[str, float]) -> None:
    step = [""]
    t = time.perf_counter()

    fail_step = plan.extra.get("fail_step")

    def mark(name: str) -> None:
        """Start step `name`; with tracing, charge the time so far to the previous step."""
        nonlocal t
        if plan.trace and step[0]:
            now = time.perf_counter()
            trace[step[0]] = (now - t) * 1000
            t = now
        step[0] = name
        if name == fail_step:  # test-only fault injection: SANDBOXRUN_FAIL_STEP=<step>
            raise StepError(name, 5, "injected failure (SANDBOXRUN_FAIL_STEP)")

    import prctl  # already imported by the forker: costs nothing here

    _reset_process_state()
    try:
        mark("session")
        os.setsid()
        prctl.set_name("sandboxrun-init")
        _set_proctitle(b"sandboxrun-init")  # /proc/1/cmdline must not show the runner's paths
        mark("pdeathsig")
        prctl.set_pdeathsig(parent_death_signal(plan))  # (getppid() is 0 here: the parent is outside our pid ns)
        _supervised_or_exit(report_fd)
        mark("namespaces")
        from .isolation.syscalls import CLONE_NEWCGROUP, CLONE_NEWNS, unshare

        now = plan.unshare_flags & ~CLONE_NEWCGROUP
        if plan.view_template >= 0:
            now &= ~CLONE_NEWNS  # made from the template below
        if now:
            unshare(now)
        if plan.view is not None:
            mark("filesystem")
            from .isolation import filesystem

            sub = [""]
            try:
                if plan.view_template >= 0:
                    idmapped = filesystem.enter_template(plan.view_template, plan.view, sub, plan.nested_userns)
                else:
                    idmapped = filesystem.build_view(plan.view, sub)
            except OSError as e:
                raise StepError(f"filesystem:{sub[0]}", e.errno or 0, str(e)) from None
            except ValueError as e:  # InputError: a bind source reached through a link since the check
                raise StepError(f"filesystem:{sub[0]}", errno.EPERM, str(e)) from None
            fallback = plan.extra.get("fallback_ids")
            if plan.view.workdir_idmap is not None and not idmapped and fallback:
                # No idmapped mount on this filesystem: run as the workdir's owner instead,
                # so that it stays writable (and say so).
                plan.uid, plan.gid = fallback
                _report(report_fd, f"A uid={plan.uid}")
        else:
            mark("cwd")
            os.chdir(plan.cwd)
            expected = plan.extra.get("cwd_id")
            if expected:
                st = os.stat(".")
                if (st.st_dev, st.st_ino) != tuple(expected):
                    raise StepError("cwd", errno.EXDEV, f"{plan.cwd} is no longer the directory that was checked "
                                    "(a path component replaced since)")
        if plan.loopback:
            mark("network")
            from .isolation.network import loopback_up

            loopback_up()
        if plan.hostname:
            mark("hostname")
            import socket

            socket.sethostname(plan.hostname)
        if cgroup_fds:
            mark("cgroup")
            _await_cgroup(cgroup_fds[0])
        if plan.unshare_flags & CLONE_NEWCGROUP:
            mark("cgroup_namespace")
            unshare(CLONE_NEWCGROUP)
        mark("rlimits")
        from .isolation import rlimits

        rlimits.apply(plan.rlimits)
        mark("fds")
        os.set_inheritable(report_fd, False)  # closed by exec; belt and braces (CVE-2024-21626)
        os.closerange(3, report_fd)
        os.closerange(report_fd + 1, 1 << 20)
        landlock_rs = -1
        if plan.landlock != "off":
            mark("landlock")  # the rules are built while we can still reach every path...
            from .isolation import landlock

            abi = landlock.abi_version()
            if abi == 0:
                if plan.landlock == "required":
                    raise StepError("landlock", 95, "landlock is not available on this kernel")
            else:
                landlock_rs, abi = landlock.prepare(plan.landlock_ro, plan.landlock_rw)
            _report(report_fd, f"A landlock={abi}")
        mark("identity")
        from .isolation import identity

        if plan.nested_userns:
            # A new user namespace starts with a full bounding set: empty it inside.
            identity.enter_user_namespace(plan.uid, plan.gid)
            identity.drop_bounding_set()
        elif plan.uid >= 0:
            identity.drop_bounding_set()
            identity.become(plan.uid, plan.gid)
        else:  # an unprivileged caller without namespaces: keep its identity, drop what it can
            identity.drop_bounding_set(best_effort=True)
        mark("capabilities")
        identity.clear_capabilities()
        # The kernel clears the parent-death signal when credentials change: arm it again.
        prctl.set_pdeathsig(parent_death_signal(plan))
        _supervised_or_exit(report_fd)
        mark("no_new_privs")
        identity.no_new_privs()
        if landlock_rs >= 0:
            mark("landlock_enforce")  # ...and enforced once no_new_privs is set
            landlock.enforce(landlock_rs)
            global _SCOPE_ABI
            _SCOPE_ABI = abi  # the command's own scoped domain, made at the spawn (_spawn_scoped)
        if plan.seccomp_bpf:
            mark("seccomp")
            from .isolation.seccomp import load_bpf

            load_bpf(plan.seccomp_bpf)
        mark("exec")
    except StepError:
        raise
    except OSError as e:
        raise StepError(step[0], e.errno or 0, str(e)) from None
    except Exception as e:  # noqa: BLE001 - a bug or an unexpected refusal: still a named setup error
        raise StepError(step[0], 0, f"{type(e).__name__}: {e}") from None


_SCOPE_ABI = 0  # Landlock's ABI where the command gets a scoped domain of its own (>= 6)


def _spawn_scoped(path: str, plan: RunPlan) -> int:
    """fork, then in the child alone: its session, a Landlock domain of its own that may signal
    (and reach the abstract sockets of) only its own processes, so neither us nor, without a
    pid namespace, any other process of its uid; then exec. An error comes back on a pipe."""
    from .isolation import landlock

    r, w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the command's side
        what = b"E"
        try:
            os.close(r)
            if plan.pty:
                os.setpgid(0, 0)
            else:
                os.setsid()
            what = b"S"
            landlock.scope(_SCOPE_ABI)
            what = b"E"
            for sig in SPAWN_DEFAULT_SIGNALS:
                try:
                    signal.signal(sig, signal.SIG_DFL)
                except (OSError, ValueError):
                    pass
            signal.pthread_sigmask(signal.SIG_SETMASK, ())
            os.execve(path, plan.argv, plan.env)
        except OSError as e:
            os.write(w, what + str(e.errno or 0).encode())
        except BaseException:  # noqa: BLE001 - never return into the child's own code
            os.write(w, what + str(errno.EINVAL).encode())
        os._exit(127)
    os.close(w)
    try:
        said = os.read(r, 64)
    finally:
        os.close(r)
    if said:
        os.waitpid(pid, 0)
        err = int(said[1:] or b"0")
        if said[:1] == b"S":
            raise StepError("landlock_scope", err, f"landlock scope for the command: {os.strerror(err)}")
        raise OSError(err, os.strerror(err))
    return pid


def _foreground(pid: int) -> None:
    """Make the command's group the terminal's foreground. Never fatal once it runs: it may
    have left its group already, and a failure here must not leave it behind unattended."""
    try:
        os.tcsetpgrp(0, pid)
        os.killpg(pid, signal.SIGCONT)  # in case it stopped on SIGTTIN/SIGTTOU before that
    except OSError:
        pass


def _spawn(plan: RunPlan) -> int:
    path = find_executable(plan.argv[0], plan.env.get("PATH", "/usr/bin:/bin"))
    try:
        if _SCOPE_ABI >= 6:
            pid = _spawn_scoped(path, plan)
            if plan.pty:
                _foreground(pid)
            return pid
        if plan.pty:  # same session (we own the terminal), own foreground process group
            pid = os.posix_spawn(path, plan.argv, plan.env, setpgroup=0, setsigdef=SPAWN_DEFAULT_SIGNALS,
                                 setsigmask=())
            _foreground(pid)
            return pid
        return os.posix_spawn(path, plan.argv, plan.env, setsid=True, setsigdef=SPAWN_DEFAULT_SIGNALS,
                              setsigmask=())
    except OSError as e:
        err = e.errno or 0
        what = {2: "command not found", 13: "permission denied", 8: ENOEXEC_WHY,
                21: "is a directory", 7: "argument list too long"}.get(err, os.strerror(err))
        if err == errno.EACCES and os.path.isdir(path):  # execve's EACCES for a directory: named as shells do
            what = "is a directory"
        if err == errno.ENOENT and os.path.isfile(path):
            what = missing_interpreter(path)
        raise StepError("exec", err, f"{plan.argv[0]}: {what}") from None


ENOEXEC_WHY = "exec format error (no #! line, and not a program for this machine)"


def missing_interpreter(path: str) -> str:
    """Why execve said ENOENT of a file that is there: the interpreter its #! line names, or
    an ELF program's loader, is missing (as the native stage says it)."""
    try:
        with open(path, "rb") as f:
            head = f.read(255)
    except OSError:
        head = b""
    if head.startswith(b"#!"):
        name = head[2:].split(b"\n")[0].lstrip(b" \t").replace(b"\t", b" ").split(b" ")[0]
        cr = name.endswith(b"\r")  # as the kernel reads it: a CR stays in the name
        shown = name[:-1] + b"^M" if cr else name
        return (f"bad interpreter: {shown.decode(errors='replace')}: not found (its #! line"
                + (", which ends in a CR: CRLF line endings?)" if cr else ")"))
    if head.startswith(b"\x7fELF"):
        return "the ELF interpreter (dynamic loader) it names was not found"
    return "command not found"


_PROC_PID: int | None = None  # our pid as /proc numbers it (not a rootless fork server's own numbering)
_WALL = 0x40000000  # <linux/wait.h> __WALL: threads' and clone children too


def signal_descendants(sig: int) -> int:
    """Without a pid namespace (the nested profile) the run's processes are this process's
    descendants (isolation/proctree.py): kill(-1) would reach every process of the uid on
    the host or, in a rootless fork server's pid namespace, every concurrent run of its
    caller. How many were signalled."""
    if _PROC_PID is None:
        # No /proc shows us (none is mounted): nothing can find our descendants but
        # kill(-1), which reaches every process we may signal.
        try:
            os.kill(-1, sig)
        except OSError:
            pass
        return 0
    return proctree.signal_tree(_PROC_PID, sig)


def kill_descendants(seconds: float = 1.0) -> None:
    """Kill and reap every descendant, until this process has no child left (or `seconds`
    have passed: a result is never held up long for a process that keeps moving)."""
    if _PROC_PID is None:
        return  # (see signal_descendants): not without a /proc that shows them
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            while os.waitpid(-1, os.WNOHANG | _WALL)[0] > 0:
                pass
        except ChildProcessError:
            return  # no child: no descendant either (orphans come to us)
        signal_descendants(signal.SIGKILL)
        time.sleep(0.002)


def init_loop(main_pid: int, report_fd: int, pid1: bool) -> None:
    """PID 1 duties: forward signals to everything, reap orphans, report the main exit.
    Without a pid namespace: the same for this process's descendants only.

    The signals acted on (and SIGCHLD) are blocked since before the spawn and taken one at a
    time with sigwaitinfo: no work runs in a handler, so a flood of them cannot nest scans
    until a RecursionError, and none slips in between a check and a wait."""
    while True:
        sig = signal.sigwaitinfo(_HELD).si_signo
        if sig == PARENT_GONE and not pid1:  # nobody is left to report to
            kill_descendants()
            os._exit(0)
        if sig in FORWARDED:
            if pid1:
                try:
                    os.kill(-1, sig)  # every process we may signal in this pid namespace
                except OSError:
                    pass
            else:
                signal_descendants(sig)
            continue
        while True:  # SIGCHLD: every child that has exited
            try:
                # Which one, left unreaped: the command's own CPU time is read while it is a zombie
                ready = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                os._exit(0)
            if ready is None or ready.si_pid == 0:
                break
            own = own_cpu_time(main_pid) if ready.si_pid == main_pid else -1.0
            pid, status, _ru = os.wait4(ready.si_pid, 0)  # (a zombie: no wait)
            if pid == main_pid:
                if not pid1:
                    kill_descendants()
                total = resource.getrusage(resource.RUSAGE_CHILDREN)
                _report(report_fd, f"X {status} {total.ru_utime:.6f} {total.ru_stime:.6f} {total.ru_maxrss} {own:.6f}")
                os._exit(0)  # the kernel now kills whatever is left in the namespace


def own_cpu_time(pid: int) -> float:
    """The CPU time of process `pid` alone (what RLIMIT_CPU counts; its wait4 rusage adds its
    reaped children's), from its CPU clock, which a zombie still has: -1 if unreadable.
    The clock's id as glibc's and musl's clock_getcpuclockid make it (CPUCLOCK_SCHED), as the
    native stage reads it."""
    try:
        return time.clock_gettime((~pid << 3) | 2)
    except OSError:
        return -1.0


def child_main(plan: RunPlan, report_fd: int, cgroup_fds: list[int]) -> None:
    """Entry point in the forked child. Never returns."""
    try:
        if not plan.pid_namespace:
            global _PROC_PID
            _PROC_PID = proctree.proc_pid()
        trace: dict[str, float] = {}
        setup(plan, report_fd, cgroup_fds, trace)
        if plan.pty:
            import fcntl
            import termios

            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        # The plan says whether we have a pid namespace, not getpid(): a caller that entered
        # one without forking (unshare --pid) makes its first child, us, its PID 1.
        if not plan.pid_namespace:  # the run's orphans come to us, not to the host's init
            import prctl

            prctl.set_child_subreaper(1)
        # Held from before the spawn, for init_loop to take: by default a parent-death signal or
        # a SIGTERM would end us and leave the command to the host's init. Every other signal
        # too (pending, never acted on): without a pid namespace or a Landlock scope the command
        # could end us with any signal whose default is to terminate, orphaning its processes.
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        if not plan.pid_namespace:  # (a PID 1 of its own ignores them: no handler of ours)
            from .isolation.syscalls import block_libc_signals

            block_libc_signals()
        t = time.perf_counter()
        pid = _spawn(plan)
        if plan.trace:
            trace["exec"] = (time.perf_counter() - t) * 1000
        if trace:
            _report(report_fd, "T " + " ".join(f"{k}={v:.4f}" for k, v in trace.items()))
        _report(report_fd, f"S {pid}")
        init_loop(pid, report_fd, plan.pid_namespace)
    except StepError as e:
        _report(report_fd, f"E {e.step} {e.errno} {e.message}")
        os._exit(125)
    except BaseException as e:  # noqa: BLE001 - never let Python unwind into the forker's code
        _report(report_fd, f"E child 0 {type(e).__name__}: {e}")
        os._exit(125)
    os._exit(125)
