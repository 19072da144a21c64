"""The parent side of one run: prepare, launch, pump, watch the clock, collect.

It knows nothing of mounts or namespaces: it turns a Profile and a request into a
RunPlan (see plan.py), asks a forker for the child, and then only deals with pipes,
a pidfd, a cgroup and the deadline. The child reports setup failures and the
command's exit over a close-on-exec report pipe.
"""

from __future__ import annotations

import _thread
import errno
import fcntl
import os
import select
import stat
import sys
import time
from _collections_abc import Mapping  # what collections.abc re-exports, without importing collections (~2 ms)

from . import profile as profiles
from . import shellwords, signals
from .errors import InputError, os_bytes, write_failure
from .fdwait import readable
from .forker import ChildFds, DirectForker, ForkError, Launched, ServerForker
from .hostpaths import check_writable_bind
from .isolation import cgroups
from .isolation.filesystem import ViewSpec, view_binds
from .isolation.syscalls import NAMESPACE_FLAGS
from .output import Capture
from .plan import PARENT_GONE, SANDBOX_UID, STEPS, RunPlan
from .profile import Profile
from .record import field, record, replace
from .result import Isolation, Result, Usage
from .stdin import FileCopy, StdinSource, check_stream, give_back, write_no_sigpipe
from .workdir import Workdir, run_uid

TYPE_CHECKING = False  # typing costs ~5 ms to import; annotations here are strings anyway
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import Any

    from .isolation.filesystem import BindSpec
    from .profile import Mount

F_SETPIPE_SZ = 1031
ARG_MAX = os.sysconf("SC_ARG_MAX")

_server: ServerForker | None = None
_direct: DirectForker | None = None
_native: Any = None  # native.launch.NativeForker, imported on first use
_one_shot = False
_forker_lock = _thread.allocate_lock()  # (threading: ~4 ms of a CLI call to import)


def _rootless() -> bool:
    """True for an unprivileged caller, also once the CLI's own process has entered a
    user namespace (where geteuid() says 0)."""
    return cgroups.caller_uid() != 0


def use_direct_forker() -> None:
    """For a process that is and stays single-threaded (the CLI): fork from here when
    the Python child is needed, and build each view in full (no templates to keep)."""
    global _one_shot, _direct
    _one_shot = True
    if _rootless():  # its forker enters a user namespace: before anything else happens
        _direct = DirectForker()


def _python_forker() -> DirectForker | ServerForker:
    global _server, _direct
    with _forker_lock:
        if _one_shot:
            if _direct is None:
                _direct = DirectForker()
            return _direct
        if _server is None:
            _server = ServerForker()
            import atexit

            atexit.register(_server.close)
        return _server


def _forker(plan: RunPlan) -> Any:
    """The native stage where it can run the plan (root callers), else the Python child."""
    global _native
    # A caller that ignores SIGCHLD has the kernel reap its children at once: the stage, born
    # of this process, could be gone (its pid even reused) before we hold it. The fork
    # server's children are its own, and it takes SIGCHLD back.
    if not _rootless() and signals.getsignal(signals.SIGCHLD) != signals.SIG_IGN:
        from .native import ops, stage_path

        if ops.supports(plan) and stage_path():
            with _forker_lock:
                if _native is None:
                    from .native.launch import NativeForker

                    # One-shot: no templates to keep, and (without os.unshare, Python < 3.12) the
                    # stage makes the pid namespace, which spares the CLI ctypes' import.
                    _native = NativeForker(templates=not _one_shot,
                                           stage_clones=_one_shot and not hasattr(os, "unshare"))
                    if not _one_shot:
                        import atexit

                        atexit.register(_native.close)
                return _native
    from .native import ops, stage_path

    if ops.supports(plan):
        stage_path()  # built now if it must be, not in the spawn (its run's clock going, a Ctrl-C held)
    forker = _python_forker()
    if isinstance(forker, ServerForker):
        forker.start()  # (likewise: ~0.1 s once per process)
    return forker


# ---------------------------------------------------------------------------- request


@record
class Request:
    """One run, prepared: argv, profile, workdir, environment, streams."""

    argv: list[str]
    profile: Profile
    cwd: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    stdin: bytes | None = None
    stdin_fd: int | None = None  # an open fd to read from instead (CLI --stdin-file)
    # A pipe, socket or file of the caller's, copied to the command's stdin until its end: the
    # command never holds it (nor its file status flags, offset, peer or path).
    stdin_from: int | None = None
    on_stdout: Callable[[bytes], None] | None = None
    on_stderr: Callable[[bytes], None] | None = None
    trace: bool = False
    pty_fd: int | None = None  # the terminal's slave side: the command's stdin/stdout/stderr
    pty_master: int | None = None  # read instead of the stdout pipe when pty_fd is set
    on_started: Callable[[int], None] | None = None  # called with the init's host pid once the command runs
    forward_all: bool = False  # on_stdout/on_stderr get every byte, not only the captured ones
    cgroup_slots: cgroups.Slots | None = None  # a batch's: the CPU and pids cgroups, reused run after run
    cancel: Cancel | None = None  # run_async's, a batch's: kills the run from another thread


_SWITCHES = ("SANDBOXRUN_TRACE", "SANDBOXRUN_NATIVE", "SANDBOXRUN_NO_TEMPLATE")


def check_environment() -> None:
    """The caller's debugging switches: a value that means nothing is an InputError, never a
    guess (to a test for "0", SANDBOXRUN_NATIVE=false would mean on; a mistyped
    SANDBOXRUN_FAIL_STEP would inject nothing while the test believes it did)."""
    env = os.environ
    for name in _SWITCHES:
        value = env.get(name)
        if value and value not in ("0", "1"):
            raise InputError(f"{name}={value[:40]!r}: expected 1 (on) or 0 (off)")
    step = env.get("SANDBOXRUN_FAIL_STEP")
    if step is not None and step not in STEPS:
        raise InputError(f"SANDBOXRUN_FAIL_STEP={step[:40]!r}: not a setup step; expected one of {', '.join(STEPS)}")


def to_argv(command: str | Sequence[str], shell: bool) -> list[str]:
    if isinstance(command, (bytes, bytearray)):
        raise InputError("command: pass a str or a list of str, not bytes")
    if not isinstance(command, (str, list, tuple)):
        raise InputError(f"command: expected a string or a list of strings, got {type(command).__name__}")
    if isinstance(command, str):
        if "\0" in command:
            raise InputError("command contains a NUL byte")
        if shell:
            if not command.strip():
                raise InputError("command is empty")
            argv = ["/bin/sh", "-c", command]
        else:
            if len(command) > ARG_MAX:  # before splitting it: no command line can be this long
                raise InputError(f"command is {len(command)} characters, over ARG_MAX ({ARG_MAX})")
            try:
                argv = shellwords.split(command)
            except ValueError as e:
                raise InputError(f"command: cannot split {command[:80]!r}: {e} (unbalanced quotes?)") from None
    else:
        argv = list(command)
        for i, a in enumerate(argv):
            if not isinstance(a, str):
                raise InputError(f"command[{i}]: expected a string, got {type(a).__name__}")
            if "\0" in a:
                raise InputError(f"command[{i}] contains a NUL byte")
        if shell:
            argv = ["/bin/sh", "-c", shellwords.join(argv) if len(argv) != 1 else argv[0]]
    if not argv or not argv[0]:
        raise InputError("empty command")
    return argv


def build_env(prof: Profile, extra: Mapping[str, str] | None) -> dict[str, str]:
    if extra is not None and not isinstance(extra, Mapping):
        raise InputError(f"env: expected a mapping of names to strings, got {type(extra).__name__}")
    env = dict(prof.env)
    for name in prof.env_passthrough:
        if name in os.environ:
            env[name] = os.environ[name]
    for k, v in (extra or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise InputError(f"env: {k!r}: names and values must be strings")
        if not k or "=" in k or "\0" in k or "\0" in v:
            raise InputError(f"env: invalid variable {k!r}")
        env[k] = v
    return env


MAX_ARG_STRLEN = 32 * os.sysconf("SC_PAGE_SIZE")  # the kernel's cap on one argument or "K=V", its NUL included


def check_size(argv: list[str], env: dict[str, str]) -> None:
    try:
        lens = [len(a.encode("utf-8", "surrogateescape")) + 1 for a in argv]
        env_lens = [len(k.encode("utf-8", "surrogateescape")) + len(v.encode("utf-8", "surrogateescape")) + 2
                    for k, v in env.items()]
        size = sum(lens) + sum(env_lens) + 8 * (len(lens) + len(env_lens))
    except UnicodeEncodeError:  # a lone surrogate: say which argument or variable (labels only now)
        for i, a in enumerate(argv):
            os_bytes(a, f"command[{i}]")
        for k, v in env.items():
            os_bytes(k, "env key")
            os_bytes(v, f"env[{k!r}]")
        raise
    if size > ARG_MAX:
        raise InputError(f"command and environment are {size} bytes, over ARG_MAX ({ARG_MAX})")
    if max(lens) > MAX_ARG_STRLEN or (env_lens and max(env_lens) > MAX_ARG_STRLEN):
        # execve's E2BIG ("argument list too long", exit 126) looked like a run that failed
        where = next((f"command[{i}]" for i, n in enumerate(lens) if n > MAX_ARG_STRLEN), None) \
            or next(f"env[{k!r}]" for (k, _), n in zip(env.items(), env_lens, strict=True) if n > MAX_ARG_STRLEN)
        raise InputError(f"{where}: over the kernel's limit of {MAX_ARG_STRLEN - 1} bytes for one argument or "
                         "variable (MAX_ARG_STRLEN): pass long data on stdin or in a file")


def prepare(prof: Profile, command: str | Sequence[str], shell: bool, env: Mapping[str, str] | None,
            argv: list[str] | None = None) -> tuple[list[str], dict[str, str], str | None]:
    """What run() checks of a command before any sandbox is started (a payload's --dry-run
    shows the same): its argv, its environment (the profile's, then `env`), the sizes and
    UTF-8 of both (InputError), and the filter's verdict: None, or why it is blocked."""
    argv = to_argv(command, shell) if argv is None else argv  # (run() has made it already)
    full_env = build_env(prof, env)
    check_size(argv, full_env)
    if prof.blocklist or prof.block or prof.allow:
        from .filter import check

        cmd_text = command if isinstance(command, str) else shellwords.join(argv)
        verdict = check(cmd_text, blocklist=prof.blocklist, extra_block=prof.block, allow=prof.allow)
        if not verdict.allowed:
            return argv, full_env, verdict.reason or "blocked"
    return argv, full_env, None


def home_in_run(env: dict[str, str], prof: Profile, workdir: str) -> dict[str, str]:
    """`env` as the command gets it: with no private view, HOME=/tmp (the host's, shared) is
    the run's own workdir instead."""
    if prof.view != "private" and env.get("HOME") == "/tmp":
        return {**env, "HOME": workdir}
    return env


# ---------------------------------------------------------------------------- run


def _isolation(prof: Profile, plan: RunPlan | None, cg: cgroups.RunCgroup | None, host_uid: int | None,
               own_userns: bool = False) -> Isolation:
    """`own_userns`: the fork side gave a rootless run without namespaces one (Launched.own_userns)."""
    lim = prof.limits
    userns = bool(plan and _rootless() and prof.namespaces) or own_userns
    return Isolation(
        namespaces=[n for n in prof.namespaces if n != "net" or prof.network == "none"]
        + (["user"] if userns else []),
        user_namespace=userns,
        filesystem=prof.view if plan else "none",
        uid=SANDBOX_UID if own_userns else plan.uid if plan and plan.uid >= 0 else None,
        host_uid=host_uid,
        network=prof.network,
        seccomp=prof.seccomp,
        no_new_privs=True,
        capabilities="none" if plan is None or plan.uid >= 0 or plan.nested_userns or own_userns
        else "effective and permitted cleared; the bounding set of an unprivileged caller stays",
        cgroup=cg.version if cg else "none",
        limits={
            "timeout_s": lim.timeout, "cpu_time_s": lim.cpu_time, "memory_bytes": lim.memory if cg else None,
            "address_space_bytes": lim.address_space, "processes": lim.processes,
            "file_size_bytes": lim.file_size, "open_files": lim.open_files, "cpus": lim.cpus if cg else None,
            "output_bytes": lim.output, "output_overflow": lim.output_overflow,
            # a private /tmp only comes with the private view: the host view's is the host's own
            "tmp_bytes": lim.tmp_size if plan and prof.view == "private" else None,
        },
    )


def _likely_cause(step: str, err: int) -> str:
    try:
        if err in (errno.EMFILE, errno.ENFILE):  # (the diagnosis below opens files of its own: it would fail too)
            return _no_more_files(err)
        from .doctor import likely_cause

        return likely_cause(step, err)
    except Exception:  # noqa: BLE001 - a diagnosis must never hide the error itself
        return ""


def _setup_error(argv: list[str], prof: Profile, step: str, err: int, message: str, started: float,
                 *, known: bool = False) -> Result:
    # A layer the caller turned off (SANDBOXRUN_CGROUP=none) says so, and a cause we checked
    # (known) is in the message: no cause to guess then.
    cause = _likely_cause(step, err) if not known and "SANDBOXRUN_" not in message else ""
    if cause and cause not in message:
        message = f"{message} (likely cause: {cause})"
    return Result(
        command=argv, status="setup_error", profile=prof.name, isolation=None, error=f"{step}: {message}",
        error_step=step,
        error_errno=err, duration_ms=(time.monotonic() - started) * 1000,
        stderr=f"sandboxrun: setup failed at {step}: {message}\n",
    )


def _identity(cwd: str | None, work: Workdir, prof: Profile) -> tuple[int, int, int | None, Any]:
    """(uid inside, gid inside, host uid, lease) for this run."""
    if _rootless():
        return SANDBOX_UID, SANDBOX_UID, cgroups.caller_uid(), None
    if work.checked is not None and prof.view != "private":
        # No mount namespace: run as the directory's owner so it stays writable; never as
        # root, who owns the host's files (Landlock does not cover chmod or chown).
        c = work.checked
        owner = _unfit_owner(c.uid)
        if owner:
            raise InputError(f"cwd: {c.path} belongs to {owner}; profile {prof.name!r} runs the command as its "
                             "workdir's owner: give it a directory owned by an unprivileged user, or no cwd for a "
                             "fresh one")
        # Not the directory's group, which could be shadow, disk or docker: the owner's
        # permissions are what writing there takes.
        return c.uid, NOGROUP, c.uid, None
    from .isolation.uids import allocate

    lease = allocate()
    return lease.uid, lease.uid, lease.uid, lease


def _unfit_owner(uid: int) -> str | None:
    """Why a run may not run as this directory owner: root owns the host's files; a per-run
    uid (the directory is an earlier run's) would be shared with whichever run gets it next."""
    if uid == 0:
        return "root"
    if not _rootless() and run_uid(uid):
        return f"uid {uid}, a per-run uid (an earlier run made it)"
    return None


def _bind_ids(binds: tuple[BindSpec, ...], mounts: Sequence[Mount], checked: dict[Mount, os.stat_result],
              uid: int, gid: int) -> tuple[tuple[tuple[int, int], tuple[int, int, int, int] | None] | None, ...]:
    """ViewSpec.bind_ids: for each per-run bind, its source as checked here and the idmap of its
    owner onto the run's ids (none where they are the run's already)."""
    out = []
    for b, m in zip(binds, mounts, strict=True):
        st = checked.get(m) if b.per_run else None
        if st is None:
            out.append(None)
            continue
        same = (st.st_uid, st.st_gid) == (uid, gid)
        out.append(((st.st_dev, st.st_ino), None if same else (st.st_uid, uid, st.st_gid, gid)))
    return tuple(out)


def make_plan(req: Request, work: Workdir, uid: int, gid: int) -> RunPlan:
    prof = req.profile
    lim = prof.limits
    rootless = _rootless()
    flags = 0
    for ns in prof.namespaces:
        if ns in ("pid",) or (ns == "net" and prof.network != "none") or (ns == "mount" and prof.view != "private"):
            continue
        flags |= NAMESPACE_FLAGS[ns]
    idmap = None
    extra: dict[str, object] = {}
    if work.checked is not None and not _rootless():
        # The caller's directory, seen through an idmapped mount as the run uid's own: the run
        # keeps its unprivileged uid and what it creates belongs to the directory's owner.
        # Where the filesystem has no idmapped mounts the run falls back to the owner's ids,
        # unless that is root: then it does not run.
        c = work.checked
        idmap = (c.uid, uid, c.gid, gid)
        if not _unfit_owner(c.uid):
            extra["fallback_ids"] = (c.uid, NOGROUP)  # the owner, but never the directory's group
    if "SANDBOXRUN_FAIL_STEP" in os.environ:
        extra["fail_step"] = os.environ["SANDBOXRUN_FAIL_STEP"]
    if prof.workdir == "same" and work.checked is not None and prof.view == "private":
        for m in prof.mounts:  # its mount point would be made through that bind's host directory
            t = m.target.rstrip("/") or "/"
            if work.path == t or work.path.startswith(t + "/"):
                raise InputError(f"cwd: {work.path} is inside the bind at {m.target}; profile {prof.name!r} "
                                 "shows the workdir at its host path, which cannot be made inside a bind")
    inside = work.path if prof.workdir == "same" and work.path else (
        "/work" if prof.workdir == "same" else prof.workdir)
    # The caller's read-write binds: no link in the path, no system tree; for a root caller,
    # idmapped onto the run's per-run ids as the workdir is (view_binds: which ones).
    checked = {m: check_writable_bind(m.source, f"bind {m.source}") for m in prof.mounts if m.writable}
    view = None
    if prof.view == "private":
        name = "root" if uid == 0 else "sandbox"
        binds = view_binds(prof.mounts, per_run=not rootless, workdir=inside)
        view = ViewSpec(
            binds=binds, bind_ids=_bind_ids(binds, prof.mounts, checked, uid, gid),
            workdir_host=work.path, workdir=inside, tmp_size=lim.tmp_size,
            workdir_size=lim.workdir_size, workdir_owner=None if _rootless() else (uid, gid),
            workdir_fixed=prof.workdir != "same" or not work.path,
            workdir_idmap=idmap, workdir_fallback="fallback_ids" in extra,
            workdir_id=(work.checked.dev, work.checked.ino) if work.checked else None,
            # without a uts namespace the name is the host's: /etc/hostname and /etc/hosts say so too
            shm_size=lim.shm_size, console=req.pty_fd is not None,
            hostname=prof.hostname if "uts" in prof.namespaces else os.uname().nodename,
            passwd=f"{name}:x:{uid}:{gid}:sandbox:{req.env.get('HOME') or inside}:/bin/sh\n"
            + ("" if uid == 0 else "root:x:0:0:root:/root:/usr/sbin/nologin\n")
            + "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
            group=f"{name}:x:{gid}:\n" + ("" if gid == 0 else "root:x:0:\n") + "nogroup:x:65534:\n",
        )
    from .isolation.rlimits import fixed

    rl: list[tuple[str, int]] = [("core", 0), *fixed()]
    if lim.cpu_time is not None:
        rl.append(("cpu_time", _cpu_rlimit(lim.cpu_time)))
    for key in ("address_space", "file_size", "open_files", "processes"):
        v = getattr(lim, key)
        if v is not None:
            rl.append((key, v))
    if view is None and (work.checked is not None or work.fresh_id is not None):
        # No mount namespace: the child chdirs to the directory by path, checks that it is
        # the directory checked (or made) here, and gives Landlock "." (not the path again).
        extra["cwd_id"] = (work.checked.dev, work.checked.ino) if work.checked else work.fresh_id
    if view is None and rootless and prof.landlock != "off":
        # No mount namespace: the run writes the host's /tmp and /dev/shm, as the caller (a root
        # caller's runs have uids of their own, which own nothing there).
        from .hostpaths import own_files_problem

        for area in ("/tmp", "/dev/shm"):
            problem = own_files_problem(area, f"{area}, which runs of profile {prof.name!r} may write,")
            if problem:
                raise InputError(f"{problem}: set XDG_CACHE_HOME (the cache), SANDBOXRUN_STATE_DIR (sessions) "
                                 "or install sandboxrun outside it")
    rw = [inside, "/tmp", "/dev"] if view else [
        "." if "cwd_id" in extra else work.path, "/tmp", "/dev", "/dev/shm"]
    rw += [m.target for m in prof.mounts if m.writable]
    bpf = b""
    if prof.seccomp != "off":
        from .isolation.seccomp import cached_bpf

        bpf = cached_bpf(prof.seccomp)
    env = home_in_run(dict(req.env), prof, work.path)  # (view is None unless prof.view is "private")
    return RunPlan(
        argv=req.argv, env=env, unshare_flags=flags, pid_namespace="pid" in prof.namespaces, view=view,
        cwd=inside if view else work.path, loopback=prof.network == "none" and "net" in prof.namespaces,
        hostname=prof.hostname if "uts" in prof.namespaces else None, rlimits=tuple(rl),
        uid=uid if (not rootless or prof.namespaces) else -1, gid=gid,
        nested_userns=rootless and bool(prof.namespaces),
        seccomp_bpf=bpf, landlock=prof.landlock, landlock_ro=("/",), landlock_rw=tuple(rw),
        trace=req.trace, pty=req.pty_fd is not None,
        extra=extra,
    )


NPROC_MARGIN = 8
NOGROUP = 65534  # the group of a run that runs as a directory's owner


def _network_namespace(ready: Any, *, batch: bool) -> tuple[int, bool]:
    """(fd, is_parent) for the stage: a namespace made ahead, whose making is off the run's
    path (a single run: its latency counts); or, in a batch, where every CPU is busy and only
    the CPU a run costs counts, the parent to make the run's own from (network.parent_namespace):
    the stage makes it in C, without the namespace thread's Python and hand-offs."""
    if batch:
        from .isolation.network import parent_namespace

        parent = parent_namespace()
        if parent >= 0:
            return os.dup(parent), True
    return ready.take(), False


def _join_cgroup(cg: cgroups.RunCgroup, pid: int, sync_w: int, born_there: bool = False) -> None:
    """Move the child into its cgroup (while it builds its filesystem), then tell it; one
    `born_there` (cloned into it) is only told."""
    try:
        if not born_there:
            cg.add(pid)
        msg = b"1\n"
    except OSError as e:
        msg = f"0{e.errno or 0} cannot move the sandbox into {cg.dirs[0]}: {e.strerror}\n".encode()
    try:
        os.write(sync_w, msg)
    except OSError:
        pass  # the child is gone already; its exit is reported as usual
    finally:
        os.close(sync_w)


def _no_more_files(err: int) -> str:
    if err == errno.ENFILE:
        return "the system's table of open files is full"
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return (f"this process has as many files open as its RLIMIT_NOFILE allows ({soft}): a run needs a dozen "
            "more (raise the soft limit, ulimit -Sn)")


def _pipe(size: int | None = None) -> tuple[int, int]:
    r, w = os.pipe2(os.O_CLOEXEC)
    if size:
        try:
            fcntl.fcntl(w, F_SETPIPE_SZ, size)
        except OSError:
            pass
    return r, w


began = False  # whether this process has set up a run (the CLI's "sandbox torn down" says so only then)


def execute(req: Request) -> Result:
    """Run one prepared request to completion."""
    global began
    began = True
    started = time.monotonic()
    if req.stdin_fd is not None and not _confines_handed_files(req.profile) and _regular_file(req.stdin_fd):
        # A file handed over is reopened by /proc/self/fd/0, which checks only its owner and
        # mode: one the run's uid may write (0666) was overwritten through a read-only fd. Only
        # Landlock refuses that reopen; without it the file is copied in, as stdin_from is.
        req = replace(req, stdin_from=req.stdin_fd, stdin_fd=None)
    prof = req.profile
    argv = req.argv
    check_size(argv, req.env)
    cg: cgroups.RunCgroup | None = None
    slot: cgroups.Slot | None = None
    cg_error: str | None = None
    work: Workdir | None = None
    lease = None
    plan_pid_namespace = True
    shares_host_dirs = False  # no mount namespace: the run writes the host's /tmp
    opened: list[int] = []
    launched: Launched | None = None
    failing = False  # an exception (a first interrupt) is on its way out: a second one waits behind it
    try:
        try:
            with signals.held():  # (each acquisition kept as it is made: see signals.held)
                work = Workdir(req.cwd, in_memory=prof.view == "private")
        except OSError as e:  # (a read-only or full $TMPDIR): the host refused, nothing ran
            return _setup_error(argv, prof, "workdir", e.errno or 0, f"cannot make the run's workdir: {e}", started)
        try:
            with signals.held():
                uid, gid, host_uid, lease = _identity(req.cwd, work, prof)
        except OSError as e:  # (no writable /run for the uid locks)
            return _setup_error(argv, prof, "identity", e.errno or 0, f"cannot lease the run's uid: {e.strerror or e}", started)
        if work.fresh and work.path and not _rootless():
            try:
                work.chown(uid, gid)
            except OSError as e:
                return _setup_error(argv, prof, "workdir", e.errno or 0, f"cannot give the fresh workdir "
                                    f"{work.path} to the run: {e.strerror or e}", started)
        from .isolation import rlimits

        try:
            plan = make_plan(req, work, uid, gid)
            unreachable = rlimits.beyond_reach(plan.rlimits)
        except rlimits.LimitsUnreadable as e:
            return _setup_error(argv, prof, "rlimits", e.errno or 0, e.strerror, started, known=True)
        except OSError as e:
            from .isolation.seccomp import PolicyUnavailable

            if not isinstance(e, PolicyUnavailable):
                raise
            return _setup_error(argv, prof, "seccomp", e.errno or 0, e.strerror or str(e), started, known=True)
        if unreachable:
            return _setup_error(argv, prof, "rlimits", errno.EPERM, unreachable, started, known=True)
        plan_pid_namespace = plan.pid_namespace
        shares_host_dirs = plan.view is None
        before = time.monotonic()
        forker = _forker(plan)
        # Once per process, the stage's build (a cold cache: ~1 s) or the fork server's start
        # is no part of the run's time: a first run's 0.3 s timeout was spent on gcc.
        started += time.monotonic() - before
        # Held from the cgroup to the hand-over to _supervise: each fd, cgroup and child is kept
        # (in `opened`, `cg`, `launched`) as it is made, for the teardown below (see signals.held).
        with signals.held():
            if prof.cgroup != "off":
                # PID 1 reaps every process of its namespace and we reap PID 1: wait4 then
                # gives the whole tree's CPU time, and v1 needs no cpuacct hierarchy for it.
                whole_tree = plan.pid_namespace and getattr(forker, "reaps_pid1", False)
                try:
                    backend = cgroups.detect()
                    with signals.held():
                        slot = req.cgroup_slots.take(backend) if req.cgroup_slots is not None else None
                        cg = backend.create(cgroups.CgroupLimits(
                            prof.limits.memory, prof.limits.processes, prof.limits.cpus,
                            freezer="pid" not in prof.namespaces, cpu_usage=not whole_tree), slot)
                except OSError as e:
                    cg_error = str(e) if isinstance(e, cgroups.CgroupUnavailable) else f"cannot create the run's cgroup: {e}"
                    if prof.cgroup_needed_by:  # the profile runs without one, but not with these limits
                        asked = " and ".join(prof.cgroup_needed_by)
                        limit = "limits asked for need" if len(prof.cgroup_needed_by) > 1 else "limit asked for needs"
                        return _setup_error(argv, prof, "cgroup", e.errno or 0, f"{cg_error}; the {asked} {limit} "
                                            f"a cgroup (profile {prof.name!r} runs without one only when no {asked} "
                                            "limit is given)", started, known=True)
                    if prof.cgroup == "required":
                        return _setup_error(argv, prof, "cgroup", e.errno or 0, cg_error, started)
            if cg is None and not plan.pid_namespace:
                from .isolation import proctree

                if proctree.proc_pid() is None:  # what ends the run's processes would find none
                    return _setup_error(argv, prof, "proc", errno.ENOENT,
                                        "no pid namespace, no cgroup, and no /proc that shows this process: the "
                                        "run's processes could not be found, nor ended after it", started)
            if cg is not None and prof.limits.processes is not None:
                # The cgroup's pids.max fires first, so pids.events tells the caller the limit was
                # hit (usage.pids_limit_hit); RLIMIT_NPROC, a few tasks above, stays a second line.
                top = rlimits.ceiling("processes")  # the margin no higher than we may set (a caller's ulimit -Hu)
                plan = replace(plan, rlimits=tuple((k, v + NPROC_MARGIN if top is None else min(v + NPROC_MARGIN, top))
                                                   if k == "processes" else (k, v) for k, v in plan.rlimits))
            out_r, out_w = _pipe(1 << 20)
            opened += [out_r, out_w]
            err_r, err_w = _pipe(1 << 20)
            opened += [err_r, err_w]
            rep_r, rep_w = _pipe()
            opened += [rep_r, rep_w]
            stdin_w = -1
            # What the run is given to write (its pipes, its terminal) becomes its host uid's, so that
            # it may reopen them: `echo x > /dev/stderr` opens /proc/self/fd/2 anew, which checks the
            # owner and mode (0600, ours); a terminal is reopened by its name (/dev/console).
            give_to = host_uid if host_uid is not None and not _rootless() and host_uid != os.geteuid() else None
            if req.pty_fd is not None:
                in_r = out_w_ = err_w_ = req.pty_fd
                if give_to is not None:
                    os.fchown(req.pty_fd, give_to, -1)  # as login gives a user their terminal
            else:
                out_w_, err_w_ = out_w, err_w
                if req.stdin_fd is not None:
                    in_r = req.stdin_fd
                elif req.stdin or req.stdin_from is not None:
                    in_r, stdin_w = _pipe()
                    opened += [in_r, stdin_w]
                else:  # an empty pipe, not the host's /dev/null, which /dev/stdin could not reopen
                    in_r, none_w = _pipe()
                    os.close(none_w)
                    opened.append(in_r)
                if give_to is not None:
                    for fd in (out_w, err_w, *([in_r] if req.stdin_fd is None else [])):
                        os.fchown(fd, give_to, -1)
            cg_fds: list[int] = []
            self_join = cg is not None and cg.version == "v1" and getattr(forker, "joins_v1_cgroups", False)
            if self_join:
                assert cg is not None
                try:
                    for d in cg.dirs:
                        cg_fds.append(os.open(os.path.join(d, "tasks"), os.O_WRONLY | os.O_CLOEXEC))
                        opened.append(cg_fds[-1])
                except OSError as e:
                    return _setup_error(argv, prof, "cgroup", e.errno or 0, f"cannot open the run's cgroup: {e}", started)
            elif cg is not None:
                sync_r, sync_w = _pipe()
                opened += [sync_r, sync_w]
                cg_fds = [sync_r]
            cg_dir = -1
            if cg is not None and cg.version == "v2" and plan.pid_namespace and getattr(forker, "clones_into_v2_cgroup", False):
                try:  # PID 1 is cloned into it (CLONE_INTO_CGROUP): no move, no grace period
                    cg_dir = os.open(cg.dirs[0], os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                    opened.append(cg_dir)
                except OSError:
                    cg_dir = -1  # moved as before
            ready = getattr(forker, "netns", None)
            netns, netns_parent = -1, False
            if ready is not None and plan.loopback:
                netns, netns_parent = _network_namespace(ready, batch=req.cgroup_slots is not None)
            if netns >= 0:
                opened.append(netns)
            if lease is not None and cg is None and not plan.pid_namespace:
                # Only the uid can find such a run's processes: clear it, and once per process
                # every uid that a SIGKILLed supervisor's run still holds.
                from .isolation.uids import kill_processes_of, sweep_orphans

                sweep_orphans()
                kill_processes_of(lease.uid)
            try:
                launched = forker.spawn(plan, ChildFds(in_r, out_w_, err_w_, rep_w, cg_fds, self_join, netns,
                                                           netns_parent, cg_dir))
            except ForkError as e:
                return _setup_error(argv, prof, e.step, e.errno or 0, e.strerror or str(e), started)
            # A regular file's copy gives back what the command did not read: what is left in
            # its pipe at the end is seen through a read end of our own (the copy then never
            # meets EPIPE: it waits, with room for nothing more, until the run is over).
            probe = -1
            if stdin_w >= 0 and req.stdin_from is not None and stat.S_ISREG(os.fstat(req.stdin_from).st_mode):
                try:
                    probe = os.dup(in_r)
                    opened.append(probe)
                except OSError:  # (EMFILE: the run goes on, without the give-back)
                    probe = -1
            # Only the child may hold the write ends now, so EOF means it is gone.
            for fd in (out_w, err_w, rep_w, *cg_fds, *([cg_dir] if cg_dir >= 0 else []),
                       *([in_r] if in_r not in (req.stdin_fd, req.pty_fd) else [])):
                os.close(fd)
                opened.remove(fd)
            if cg is not None and not self_join:
                _join_cgroup(cg, launched.pid, sync_w, born_there=launched.in_cgroup)
                opened.remove(sync_w)
            if netns >= 0:
                os.close(netns)  # the child holds it now
                opened.remove(netns)
            if ready is not None and plan.loopback and not netns_parent:
                ready.refill()  # wakes the thread that makes the next runs' namespaces
            if req.pty_master is not None:
                os.close(out_r)  # the terminal carries both streams
                opened.remove(out_r)
                out_r = req.pty_master
        # The hand-over, after the held steps: a signal they held is raised above, while `opened` still has them all.
        # The read ends stay in `opened`, closed with the rest below (_supervise only reads them).
        if stdin_w >= 0:
            opened.remove(stdin_w)  # _supervise closes it (once) when stdin is written
        if probe >= 0:
            opened.remove(probe)  # _supervise's too
        res = _supervise(req, launched, out_r, err_r, rep_r, stdin_w, cg, started,
                         own_tree=not plan.pid_namespace, probe=probe)
        if res.status == "setup_error":
            res.isolation = None  # nothing was applied to a command that never ran
        elif res.isolation is not None:
            abi, fallback_uid = res.isolation.landlock_abi, res.isolation.uid
            res.isolation = _isolation(prof, plan, cg, host_uid, launched.own_userns)
            res.isolation.landlock_abi = abi
            if fallback_uid is not None:
                res.isolation.uid = res.isolation.host_uid = fallback_uid
            if res.isolation.cgroup == "none" and cg_error:
                res.isolation.limits["cgroup_unavailable"] = cg_error
        return res
    except OSError as e:
        if e.errno in (errno.EMFILE, errno.ENFILE) and launched is None:  # (nothing ran yet)
            return _setup_error(argv, prof, "files", e.errno, _no_more_files(e.errno), started, known=True)
        if e.errno == errno.EFBIG and launched is None:  # the set-up program's memfd, under `ulimit -f`
            return _setup_error(argv, prof, "files", e.errno, f"cannot write the run's set-up: {write_failure(e)}",
                                started, known=True)
        failing = True
        raise
    except BaseException:
        failing = True
        raise
    finally:
        # Held: a signal landing between two steps (where no step of _Uninterrupted catches it) left
        # the rest undone, the run's cgroups and fds with it; it is taken at the end instead. One
        # landing before the hold began (the finally's first bytecodes) has the teardown run again,
        # without the steps already done (another thread's run may have the uid or slot by then).
        steady: _Uninterrupted | None = None
        interrupted: BaseException | None = None
        done = False
        tries = 0
        own_cgroup = cg is not None
        while not done:
            try:
                with signals.held():
                    steady = steady or _Uninterrupted()
                    if launched is not None and launched.pidfd >= 0:  # interrupted before _supervise took it over, or in its end
                        steady.do(_end_launched, launched, not plan_pid_namespace)
                    steady.do(_close_all, opened)
                    if cg is not None:
                        steady.do(_remove_quietly, cg)
                        cg = None
                    if slot is not None and req.cgroup_slots is not None:
                        given, slot = slot, None
                        req.cgroup_slots.give_back(given)  # lent again only if nothing of this run is in it
                    if lease is not None:
                        if not own_cgroup and not plan_pid_namespace:  # nothing else can find what it left running
                            from .isolation.uids import kill_processes_of

                            steady.do(kill_processes_of, lease.uid)
                        if shares_host_dirs:  # what it left in the host's /tmp, /dev/shm, IPC: by its uid
                            from .isolation import leftovers

                            steady.do(leftovers.remove_files_of, lease.uid)
                            steady.do(leftovers.remove_ipc_of, lease.uid)
                        steady.do(lease.release)
                        lease = None
                    if work is not None:
                        steady.do(work.cleanup)
                        work = None
                    done = True
            except BaseException as e:  # noqa: BLE001 - before the hold, or held and taken at its end
                interrupted = interrupted or e
                tries += 1
                if tries >= 10:  # (an error of a step's own, not a signal's, would come back each time)
                    break
        if not failing:
            if interrupted is not None:
                raise interrupted
            if steady is not None:
                steady.raise_pending()


class _Uninterrupted:
    """Teardown steps run to their end though a signal interrupts them: a second Ctrl-C (or a
    SIGTERM, which the CLI raises as one) during the first's teardown left the run's cgroups.
    A step so interrupted is run again (each is idempotent); then the interrupt goes on (the first,
    when the teardown itself was on an exception's way out). Any exception counts: a caller's
    own signal handler may raise what it likes (its alarm's exception left cgroups and network
    namespaces behind), and a step that fails for good still lets the next ones run."""

    def __init__(self) -> None:
        self.pending: BaseException | None = None

    def do(self, step: Callable[..., object], *args: object) -> None:
        # (bounds: signals cannot come for ever, but a loop must not trust that; and an error
        # of the step's own, not a signal's, comes back each time)
        for attempt in range(1, 101):
            try:
                step(*args)
                return
            except BaseException as e:  # noqa: BLE001 - raised once the teardown is done
                self.pending = self.pending or e
                if attempt >= (100 if isinstance(e, KeyboardInterrupt) else 10):
                    return

    def raise_pending(self) -> None:
        if self.pending is not None:
            raise self.pending


def _end_launched(launched: Launched, own_tree: bool) -> None:
    """A run's child that _supervise never ended (a Ctrl-C came first): killed, reaped, its pidfd closed."""
    if launched.pidfd >= 0:
        kill_run(launched.pidfd, own_tree)
        launched.reap()
        pidfd, launched.pidfd = launched.pidfd, -1
        os.close(pidfd)


def _close_all(fds: list[int]) -> None:
    while fds:
        fd = fds.pop()  # before the close: a rerun never closes a number twice (another's by then)
        try:
            os.close(fd)
        except OSError:
            pass


def _remove_quietly(cg: cgroups.RunCgroup) -> None:
    try:
        cg.remove()
    except OSError:
        pass


@record
class _Report:
    """What the child said on the report pipe."""

    status: int | None = None
    utime: float = 0.0
    stime: float = 0.0
    maxrss_kb: int = 0
    # The command's own CPU time (user + system), its reaped children's apart: what
    # RLIMIT_CPU, a per-process limit, counts. None: not known (the child could not read it).
    own_cpu: float | None = None
    error: tuple[str, int, str] | None = None
    trace: dict[str, float] = field(default_factory=dict)
    landlock_abi: int = 0
    started: bool = False  # the command was spawned
    uid: int | None = None  # the child fell back to this uid (no idmapped workdir)
    killed: bool = False  # the supervisor sent SIGKILL: the grace after SIGTERM ran out
    at_kill: tuple[float, float, int] | None = None  # the tree's usage just before that SIGKILL
    buf: bytes = b""

    def feed(self, data: bytes) -> None:
        self.buf += data
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            self._line(line.decode(errors="replace"))

    def _line(self, line: str) -> None:
        kind, _, rest = line.partition(" ")
        if kind == "X":
            parts = rest.split()
            self.status = int(parts[0])
            self.utime, self.stime, self.maxrss_kb = float(parts[1]), float(parts[2]), int(parts[3])
            own = float(parts[4]) if len(parts) > 4 else -1.0
            self.own_cpu = own if own >= 0 else None
        elif kind == "E":
            step, err, msg = (rest.split(" ", 2) + ["", ""])[:3]
            self.error = (step, int(err) if err.isdigit() else 0, msg)
        elif kind == "T":
            for kv in rest.split():
                k, _, v = kv.partition("=")
                self.trace[k] = float(v)
        elif kind == "S":
            self.started = True
        elif kind == "A" and rest.startswith("landlock="):
            self.landlock_abi = int(rest.split("=", 1)[1])
        elif kind == "A" and rest.startswith("uid="):
            self.uid = int(rest.split("=", 1)[1])


def _send(launched: Launched, sig: int) -> None:
    try:
        signals.pidfd_send_signal(launched.pidfd, sig)
    except OSError:
        pass


def kill_run(pidfd: int, own_tree: bool) -> None:
    """SIGKILL a run's child (its `pidfd`). `own_tree` (no pid namespace): the child is its
    processes' child subreaper, so they are all its descendants (isolation/proctree.py),
    and killing it first would orphan them out of reach. It is told to end them itself (its
    parent-death signal, PARENT_GONE, which it takes) while we kill what we find too, until
    it has exited or a second has passed; then SIGKILL."""
    if own_tree:
        from .forker import host_pid
        from .isolation import proctree

        try:
            signals.pidfd_send_signal(pidfd, PARENT_GONE)
        except OSError:
            pass
        try:
            root = host_pid(pidfd)  # /proc's number for it, which is not ours where /proc is an ancestor's
        except OSError:
            root = -1
        deadline = time.monotonic() + 1.0
        while root > 0 and time.monotonic() < deadline:
            # Only while the child runs: once it has exited (and maybe been reaped by another
            # thread) its pid may be another process's, whose children are not the run's.
            if readable([pidfd], 0):
                break
            proctree.signal_tree(root, signals.SIGKILL)
            time.sleep(0.002)
    try:
        signals.pidfd_send_signal(pidfd, signals.SIGKILL)
    except OSError:
        pass


def _drain_report(rep_r: int, report: _Report) -> None:
    """The report lines left in the pipe once the child is gone (or killed): never waits."""
    while True:
        try:
            data = os.read(rep_r, 65536)
        except (BlockingIOError, InterruptedError):
            return
        if not data:
            return
        report.feed(data)


class Cancel:
    """Ends runs from another thread: after cancel(), each run given it (one, or a batch's
    all) has its sandbox killed at once (SIGKILL, the whole tree) and returns, `error`
    saying so. Its fd stays readable, so a run supervised later is killed as it starts."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self.cancelled = False
        self._lock = _thread.allocate_lock()  # cancel() and close() come from different threads

    def fileno(self) -> int:
        return self._r

    def cancel(self) -> None:
        with self._lock:
            if not self.cancelled and self._w >= 0:  # (closed: every run it served has ended)
                os.write(self._w, b"x")  # before the flag: a Ctrl-C between them, then a retry
                self.cancelled = True  # (a batch's teardown), wrote nothing, and no run was killed

    def close(self) -> None:
        """Once no run uses it any more."""
        with self._lock:
            fds, self._r, self._w = (self._r, self._w), -1, -1  # marked first: a rerun must not close them twice
            for fd in fds:
                if fd >= 0:
                    os.close(fd)


class _Poller:
    """epoll, each fd under a name (the selectors module costs ~3 ms of a CLI call to import)."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._names: dict[int, str] = {}

    def register(self, fd: int, name: str, events: int = select.EPOLLIN) -> None:
        self._epoll.register(fd, events)
        self._names[fd] = name

    def unregister(self, fd: int) -> None:
        self._epoll.unregister(fd)
        del self._names[fd]

    def poll(self, timeout: float | None) -> list[str]:
        """The names of the ready fds (readable, writable, or at hang-up or error: the reader finds which)."""
        ready = self._epoll.poll(timeout)  # None: until one is ready
        return [self._names[fd] for fd, _events in ready if fd in self._names]

    def close(self) -> None:
        self._epoll.close()


def _usage_before_kill(launched: Launched, report: _Report) -> None:
    """A PID 1 that is SIGKILLed reports nothing, and the kernel reaps the rest of its pid
    namespace without counting their CPU time anywhere: read it from /proc first."""
    if report.killed or report.status is not None:
        return
    from .forker import host_pid
    from .isolation import proctree

    try:
        root = host_pid(launched.pidfd)  # /proc's number for it
    except OSError:
        return
    if root > 0:
        report.at_kill = proctree.tree_usage(root)


def _end_now(launched: Launched, cg: cgroups.RunCgroup | None, own_tree: bool, report: _Report) -> None:
    _usage_before_kill(launched, report)
    report.killed = True
    kill_run(launched.pidfd, own_tree)  # the pid namespace dies with its init
    if cg is not None:
        cg.kill_all()


def _supervise(req: Request, launched: Launched, out_r: int, err_r: int, rep_r: int, stdin_w: int,
               cg: cgroups.RunCgroup | None, started: float, *, own_tree: bool = False, probe: int = -1) -> Result:
    prof = req.profile
    lim = prof.limits
    out = Capture(lim.output, req.on_stdout, forward_all=req.forward_all)
    err = Capture(lim.output, req.on_stderr, forward_all=req.forward_all)
    report = _Report()
    sel = _Poller()
    for fd in (out_r, err_r, rep_r):
        os.set_blocking(fd, False)
    sel.register(out_r, "out")
    sel.register(err_r, "err")
    # The child's few report lines fit its pipe: read as they come only for a caller that
    # waits for the start; else at the end, which spares a wakeup a line (~0.1 ms each).
    watch_report = req.on_started is not None
    if watch_report:
        sel.register(rep_r, "report")
    sel.register(launched.pidfd, "exit")
    cancelled = False
    if req.cancel is not None:
        sel.register(req.cancel.fileno(), "cancel")
    stdin_data = memoryview(req.stdin or b"")
    source: StdinSource | None = None
    file_copy: FileCopy | None = None
    if probe >= 0:  # (a regular file: see execute)
        try:
            file_copy, stdin_w, probe = FileCopy(req.stdin_from, stdin_w, probe), -1, -1
        except (RuntimeError, OSError):  # (OSError: EMFILE, before the loop's own clean-up is in place)
            pass  # no thread in this process: read here (StdinSource), as a file is always ready
    if stdin_w >= 0 and req.stdin_from is not None:
        source = StdinSource(req.stdin_from)
    if stdin_w >= 0:
        os.set_blocking(stdin_w, False)
        if source is not None and source.pollable:
            sel.register(source.fd, "source")  # the command's pipe is written once there is data
        else:
            if source is not None:
                stdin_data = source.read() or stdin_data
            sel.register(stdin_w, "stdin", select.EPOLLOUT)
    open_streams = {"out", "err", "report"} if watch_report else {"out", "err"}
    deadline = started + lim.timeout if lim.timeout else None
    timed_out = False
    term_again = False  # the SIGTERM may have come before the child held its signals
    kill_at: float | None = None
    exited_at: float | None = None
    at_deadline = False  # the deadline has passed once: what was pending then is read first
    kill_overflow = lim.output_overflow == "kill"
    overflowed = ""  # the stream whose output passed the cap, when that ends the run
    try:
        while open_streams or exited_at is None:
            now = time.monotonic()
            if exited_at is None:
                overdue = deadline is not None and not timed_out and now >= deadline
                if overdue and not at_deadline:
                    # What is already pending first: a command that ended at its deadline (its
                    # exit or report line not read yet) did not time out.
                    at_deadline = True
                    if not watch_report:
                        _drain_report(rep_r, report)  # has the command started, or ended?
                elif overdue and report.status is not None:
                    deadline = None  # it ended in time; its init is ending too (bounded all the same)
                    kill_at = now + lim.kill_grace
                elif overdue:
                    timed_out = True
                    _send(launched, signals.SIGTERM)  # init forwards it to every process
                    kill_at = now + lim.kill_grace
                    if not report.started:
                        # A PID 1 drops a signal it neither handles nor holds yet: sent again
                        # once the command is spawned (the child holds every signal by then).
                        term_again = True
                        if not watch_report:
                            watch_report = True
                            sel.register(rep_r, "report")
                            open_streams.add("report")
                if kill_at is not None and now >= kill_at:
                    _end_now(launched, cg, own_tree, report)
                    kill_at = now + 0.5
                wake = [t for t in (deadline if not timed_out else None, kill_at) if t is not None]
                wait = max(0.0, min(wake) - now) if wake else None
            else:
                # Everything in the sandbox is dead; the pipes can only be at EOF, but never
                # wait for a writer we do not know about.
                wait = max(0.0, exited_at + 2.0 - now)
                if wait == 0:
                    break
            for what in sel.poll(wait):
                if what == "out":
                    if not out.read_from(out_r):
                        sel.unregister(out_r)
                        open_streams.discard("out")
                    elif kill_overflow and out.total > lim.output and exited_at is None and not overflowed:
                        overflowed, deadline = "stdout", None
                        _end_now(launched, cg, own_tree, report)
                elif what == "err":
                    if not err.read_from(err_r):
                        sel.unregister(err_r)
                        open_streams.discard("err")
                    elif kill_overflow and err.total > lim.output and exited_at is None and not overflowed:
                        overflowed, deadline = "stderr", None
                        _end_now(launched, cg, own_tree, report)
                elif what == "report":
                    try:
                        data = os.read(rep_r, 65536)
                    except BlockingIOError:
                        continue
                    if data:
                        started_before = report.started
                        report.feed(data)
                        if report.started and not started_before and req.on_started is not None:
                            req.on_started(launched.pid)
                        if report.started and term_again:
                            term_again = False
                            _send(launched, signals.SIGTERM)
                    else:
                        sel.unregister(rep_r)
                        open_streams.discard("report")
                elif what == "exit":
                    sel.unregister(launched.pidfd)
                    exited_at = time.monotonic()
                elif what == "cancel":
                    assert req.cancel is not None
                    sel.unregister(req.cancel.fileno())
                    if exited_at is None:
                        cancelled = True
                        _end_now(launched, cg, own_tree, report)
                elif what == "source":
                    assert source is not None
                    chunk = source.read()
                    if chunk is None:
                        continue  # (woken, but another reader of the caller's pipe was first)
                    stdin_data = chunk
                    sel.unregister(source.fd)
                    if stdin_data or source.eof:
                        sel.register(stdin_w, "stdin", select.EPOLLOUT)  # an empty chunk: EOF to pass on
                elif what == "stdin":
                    try:
                        n = write_no_sigpipe(stdin_w, stdin_data[:65536]) if stdin_data else 0
                        stdin_data = stdin_data[n:]
                    except BlockingIOError:
                        continue
                    except OSError:  # EPIPE: the command does not read its stdin
                        stdin_data = stdin_data[:0]
                        if source is not None:
                            source.eof = True  # nothing more of the caller's is read
                    if stdin_data:
                        continue
                    if source is not None and not source.eof:  # the next chunk
                        if source.pollable:
                            sel.unregister(stdin_w)
                            sel.register(source.fd, "source")
                        else:
                            stdin_data = source.read() or stdin_data
                        continue
                    sel.unregister(stdin_w)
                    os.close(stdin_w)
                    stdin_w = -1
    finally:
        sel.close()
        if source is not None:
            source.close()
        if stdin_w >= 0:
            os.close(stdin_w)
        if exited_at is None:
            kill_run(launched.pidfd, own_tree)
        if file_copy is not None:
            file_copy.finish(0.5)  # the sandbox is gone: at once, unless a read is stuck
        if probe >= 0:
            if source is not None:  # a file read here: what the command did not take goes back
                give_back(source.fd, len(stdin_data), probe)
            os.close(probe)
        if not watch_report:
            _drain_report(rep_r, report)
        rusage = launched.reap()
        pidfd, launched.pidfd = launched.pidfd, -1  # (marked before the close: a rerun of the teardown must not close it twice)
        os.close(pidfd)
    duration = time.monotonic() - started
    with signals.held():  # (a read's fd is not yet in a try right after its open)
        stats = cg.stats() if cg else None
    usage = Usage(wall_s=round(duration, 6))
    usage.cpu_user_s, usage.cpu_sys_s = report.utime, report.stime
    usage.peak_memory_bytes = report.maxrss_kb * 1024
    if rusage is not None and launched.pid1:
        # All of the run's processes, those killed at its end included (the kernel's
        # own accounting; a v1 cpuacct would split user/sys by ticks).
        # Not its ru_maxrss: born by vfork, it inherited the supervisor's own peak at exec.
        usage.cpu_user_s, usage.cpu_sys_s = round(rusage.ru_utime, 6), round(rusage.ru_stime, 6)
    if report.at_kill is not None and report.status is None:  # PID 1 was killed before it reported
        user, system, peak = report.at_kill
        usage.cpu_user_s, usage.cpu_sys_s = max(usage.cpu_user_s, round(user, 6)), max(usage.cpu_sys_s, round(system, 6))
        usage.peak_memory_bytes = max(usage.peak_memory_bytes, peak)
    if stats is not None:
        if stats.cpu_user_s is not None:
            usage.cpu_user_s, usage.cpu_sys_s = round(stats.cpu_user_s, 6), round(stats.cpu_sys_s or 0.0, 6)
        if stats.peak_memory:  # what the memory limit judges (an RSS also counts shared file pages)
            usage.peak_memory_bytes = stats.peak_memory
        usage.oom_kills = stats.oom_kills
        usage.pids_limit_hit = stats.pids_max_hit
    else:  # no cgroup counted them: unknown, not "none happened"
        usage.oom_kills = usage.pids_limit_hit = None
    res = Result(
        command=req.argv, status="ok", profile=prof.name, duration_ms=round(duration * 1000, 3),
        timed_out=timed_out, pid=launched.pid, usage=usage,
        stdout=out.text(), stderr=err.text(), stdout_raw=bytes(out.data), stderr_raw=bytes(err.data),
        stdout_bytes=out.total, stderr_bytes=err.total,
        stdout_truncated=out.truncated, stderr_truncated=err.truncated,
        trace=report.trace or None,
    )
    res.isolation.landlock_abi = report.landlock_abi
    res.isolation.uid = report.uid  # set only when the child fell back to another uid
    _classify(res, report, lim)
    # (total, not truncated: a session's monitor keeps every byte, in its logs)
    past = [name for name, c in (("stdout", out), ("stderr", err)) if c.total > lim.output]
    if kill_overflow and not timed_out and res.status != "setup_error" and past:
        # Also when the command ended before the supervisor read past the cap: the same
        # output gets the same status, however the reads fell. The kill, sent when a read
        # passed the cap before the command's exit was seen, ended it only where it did not
        # end by itself (its own exit code, or a signal of its own, came first).
        stream = overflowed or past[0]
        killed = bool(overflowed) and res.exit_code < 0 and res.signal == "SIGKILL"
        res.status = "output_limit"
        res.error = (f"{stream} passed the output limit of {_size(lim.output)}"
                     + (": the sandbox was killed" if killed else ": the output was cut there (the command had ended)"))
    if cancelled:
        res.error = "cancelled by the caller: the sandbox was killed"
    res.success = res.status == "ok"  # (the schema's word: whatever changed the status above)
    return res


def _size(n: int | None) -> str:
    from .units import format_size

    return format_size(n)


def _cpu_rlimit(cpu_time: float) -> int:
    """RLIMIT_CPU for a limit of `cpu_time` seconds: whole seconds, rounded up (no math import)."""
    return max(1, int(-(-cpu_time // 1)))


def _classify(res: Result, report: _Report, lim: profiles.Limits) -> None:
    if report.error is not None:
        step, err, msg = report.error
        if step == "exec":
            res.exit_code = 127 if err == errno.ENOENT else 126
            res.status = "nonzero_exit"
            res.error = msg
            res.stderr += f"sandboxrun: {msg}\n"
            return
        res.status = "setup_error"
        cause = _likely_cause(step, err) if "SANDBOXRUN_" not in msg else ""  # (an injected fault: no guess)
        if cause and cause not in msg:
            msg = f"{msg} (likely cause: {cause})"
        res.error, res.error_step, res.error_errno = f"{step}: {msg}", step, err
        res.stderr += f"sandboxrun: setup failed at {step}: {msg}\n"
        return
    if res.timed_out:
        res.status = "timeout"
        res.error = f"wall timeout of {lim.timeout:g}s"
        if report.status is not None and os.WIFEXITED(report.status):
            res.exit_code = os.WEXITSTATUS(report.status)  # it ended itself on the SIGTERM
        if report.status is not None and os.WIFSIGNALED(report.status):
            res.signal = signals.name(os.WTERMSIG(report.status))
        elif report.killed:
            res.signal = "SIGKILL"  # it outlived the grace; its init died before it could say
        return
    if report.status is None:  # the init itself was killed (OOM killer, or from outside)
        res.signal = "SIGKILL"
        res.status = "memory_limit" if res.usage.oom_kills else "signaled"
        res.error = "the sandbox was killed" + (" by the OOM killer" if res.usage.oom_kills else "")
        return
    st = report.status
    if os.WIFSIGNALED(st):
        sig = os.WTERMSIG(st)
        res.signal = signals.name(sig)
        # RLIMIT_CPU is per process: the command's own CPU time, not its tree's (two children
        # of 60% each are no limit reached); the tree's where the child could not tell.
        cpu = report.own_cpu if report.own_cpu is not None else res.usage.cpu_user_s + res.usage.cpu_sys_s
        if res.usage.oom_kills and sig == signals.SIGKILL:
            # The run reached its memory limit; whose SIGKILL this was, the kernel does not say
            # (the OOM killer's, or the command's own after a child was OOM-killed).
            res.status, res.error = "memory_limit", (f"SIGKILL after the OOM killer ended a process of the run "
                                                     f"(memory limit {_size(lim.memory)}): likely its kill")
        # The kernel's RLIMIT_CPU signals, told from the command's own `kill -XCPU` by the time
        # used: the kernel's come once it reached the whole seconds the limit was set to (its
        # tick-counted time against this clock's: a few ticks apart at most).
        elif (sig in (signals.SIGXCPU, signals.SIGKILL) and lim.cpu_time
              and cpu >= _cpu_rlimit(lim.cpu_time) - 0.03):
            res.status, res.error = "cpu_limit", f"CPU time limit of {lim.cpu_time:g}s"
        else:
            res.status = "signaled"
            if sig == signals.SIGXFSZ and lim.file_size:
                # The kernel's for a write past RLIMIT_FSIZE, or the command's own `kill -XFSZ`:
                # the exit status does not tell them apart, so no write is claimed.
                res.error = (f"SIGXFSZ, the signal a write past the file size limit of {_size(lim.file_size)} "
                             "gets (limits.file_size)")
        return
    code = os.WEXITSTATUS(st)
    res.exit_code = code
    if code == 0:
        res.status, res.success = "ok", True
    elif res.usage.oom_kills:
        res.status, res.error = "memory_limit", "a process was killed by the OOM killer"
    else:
        res.status = "nonzero_exit"


# ---------------------------------------------------------------------------- public API


def run(
    command: str | Sequence[str],
    *,
    profile: str | Profile = "strict",
    timeout: float | str | None = None,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    stdin: bytes | str | None = None,
    shell: bool = False,
    **overrides: Any,
) -> Result:
    """Run `command` in a sandbox and return its Result. Never raises for what the
    command does; raises SandboxError (InputError/ProfileError) for bad input."""
    cancel = overrides.get("cancel")
    if cancel is not None and not isinstance(cancel, Cancel):
        raise InputError(f"cancel: expected sandbox.supervisor.Cancel, got {type(cancel).__name__}")
    if overrides.get("yield_after") is not None:
        from .sessions import run_or_yield

        return run_or_yield(command, profile=profile, timeout=timeout, cwd=cwd, env=env, stdin=stdin, shell=shell,
                            **overrides)
    overrides.pop("yield_after", None)
    for name in ("stdin_file", "name", "pty", "cols", "rows", "ends_with_caller"):
        if name in overrides:  # else "override: stdin_file: unknown setting", as if a profile's
            raise InputError(f"{name}: a session's option (sandbox.start, or run with yield_after)"
                             + ("; here, stdin_from=an open file" if name == "stdin_file" else ""))
    started = time.monotonic()
    for name, value in (("shell", shell), ("trace", overrides.get("trace", False))):
        if not isinstance(value, bool):  # "no" and "false" are true to Python
            raise InputError(f"{name}: expected True or False, got {value!r}")
    check_environment()
    trace = overrides.pop("trace", False) or os.environ.get("SANDBOXRUN_TRACE") == "1"
    on_stdout = overrides.pop("on_stdout", None)
    on_stderr = overrides.pop("on_stderr", None)
    for name, fn in (("on_stdout", on_stdout), ("on_stderr", on_stderr)):
        if fn is not None and not callable(fn):  # (else a TypeError at the first output, mid-run)
            raise InputError(f"{name}: expected a function of bytes, got {type(fn).__name__}")
    stdin_fd = overrides.pop("stdin_fd", None)
    if stdin_fd is not None:
        _check_fd(stdin_fd)
    stdin_from = overrides.pop("stdin_from", None)
    if stdin_from is not None and (stdin is not None or stdin_fd is not None):
        raise InputError("stdin_from: give one of stdin, stdin_fd and stdin_from")
    if stdin_from is not None:
        check_stream(stdin_from)
    cgroup_slots = overrides.pop("cgroup_slots", None)
    if cgroup_slots is not None and not isinstance(cgroup_slots, cgroups.Slots):
        raise InputError(f"cgroup_slots: expected sandbox.isolation.cgroups.Slots, got {type(cgroup_slots).__name__}")
    overrides.pop("cancel", None)
    prof = profile if isinstance(profile, Profile) else profiles.load(profile)
    prof = profiles.with_overrides(prof, timeout=timeout, **overrides)
    argv = to_argv(command, shell)  # (the command's own errors first)
    if isinstance(stdin, str):
        stdin = os_bytes(stdin, "stdin")
    if stdin is not None and not isinstance(stdin, (bytes, bytearray, memoryview)):
        raise InputError(f"stdin: expected bytes or str, got {type(stdin).__name__}")
    if cwd is not None and not isinstance(cwd, (str, os.PathLike)):
        raise InputError(f"cwd: expected a path, got {type(cwd).__name__}")
    if isinstance(cwd, str):
        os_bytes(cwd, "cwd")
    argv, full_env, blocked = prepare(prof, command, shell, env, argv)
    if blocked is not None:
        return Result(command=argv, status="blocked", blocked=True, block_reason=blocked,
                      error=blocked, profile=prof.name, isolation=None,
                      duration_ms=round((time.monotonic() - started) * 1000, 3))
    req = Request(argv=argv, profile=prof, cwd=os.fspath(cwd) if cwd is not None else None,
                  env=full_env, stdin=bytes(stdin) if stdin else None, stdin_fd=stdin_fd, stdin_from=stdin_from,
                  on_stdout=on_stdout, on_stderr=on_stderr, trace=trace, cgroup_slots=cgroup_slots,
                  cancel=cancel)
    if _in_daemon_thread():
        return _execute_ended_at_exit(req)
    return execute(req)


_landlock_abi: list[int] = []  # the kernel's, once asked


def _confines_handed_files(prof: Profile) -> bool:
    """Whether Landlock will confine the run, so that a file handed to it cannot be reopened
    beyond its fd's rights: "required" does (or the run fails), "off" does not, "optional"
    where the kernel has it (asked once: ctypes is imported for it)."""
    if prof.landlock != "optional":
        return prof.landlock == "required"
    if not _landlock_abi:
        from .isolation import landlock

        try:
            _landlock_abi.append(landlock.abi_version())
        except OSError:
            _landlock_abi.append(0)
    return _landlock_abi[0] > 0


def _regular_file(fd: int) -> bool:
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        return False


def _check_fd(fd: Any) -> None:
    """stdin_fd is handed to the command itself (the CLI's --stdin-file, a file it opened
    read-only): only a regular file open for reading only, which it can neither write nor
    open a path from. A file opened O_RDWR was written (`echo X >&0`), a pipe's write end
    wrote into the caller's pipe, a directory fd listed the host's tree: those go through
    stdin_from, copied through a pipe of ours."""
    if isinstance(fd, bool) or not isinstance(fd, int) or fd < 0:
        raise InputError(f"stdin_fd: expected an open file descriptor (an int >= 0), got {fd!r}")
    try:
        mode = os.fstat(fd).st_mode
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    except OSError as e:
        raise InputError(f"stdin_fd: {fd} is not an open file descriptor ({e.strerror})") from None
    except OverflowError:  # past a C int: no fd is
        raise InputError(f"stdin_fd: {fd} is not an open file descriptor (too large)") from None
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a pipe"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    why = ("not open for reading (O_PATH)" if flags & os.O_PATH else
           next((kind for test, kind in kinds if test(mode)), None) or
           ("not a regular file" if not stat.S_ISREG(mode) else
            "open for writing too" if flags & os.O_ACCMODE != os.O_RDONLY else None))
    if why is not None:
        raise InputError(f"stdin_fd: fd {fd} is {why}: the command is handed only a regular file open for reading "
                         "only (O_RDONLY); give any other input as stdin_from=, copied through a pipe")


# Set in run_async's threads: started by _thread, they have no threading.Thread, and asking
# threading.current_thread() would leave a _DummyThread behind for each (never removed).
unthreaded = _thread._local()


def _in_daemon_thread() -> bool:
    """(A program that never imported threading runs on its main thread.)"""
    if getattr(unthreaded, "daemon", False):
        return True
    threading = sys.modules.get("threading")
    return threading is not None and threading.current_thread().daemon


_exit_cancel: Cancel | None = None  # cancelled at interpreter exit: ends the runs of daemon threads
_exit_own: set[Cancel] = set()  # the callers' own Cancels of such runs (run_async's), cancelled with it
_exit_runs = 0
_exit_hooked = False
_exit_lock = _thread.allocate_lock()


def _execute_ended_at_exit(req: Request) -> Result:
    """A run supervised by a daemon thread (run_async's, a caller's own): the interpreter does
    not wait for it at exit, and froze it mid-run, its cgroups left behind until a later
    sandboxrun's sweep. An exit hook kills it instead and waits for its clean-up."""
    global _exit_cancel, _exit_runs, _exit_hooked
    own = req.cancel
    with _exit_lock:
        if not _exit_hooked:
            import threading

            try:
                threading._register_atexit(_end_runs_at_exit)  # type: ignore[attr-defined]
            except RuntimeError:  # the interpreter is shutting down already
                return execute(req)
            _exit_hooked = True
        if own is not None:
            _exit_own.add(own)
        else:
            if _exit_cancel is None:  # (a pipe, made once: only for runs without a Cancel of their own)
                _exit_cancel = Cancel()
            req.cancel = _exit_cancel
        _exit_runs += 1
    try:
        return execute(req)
    finally:
        with _exit_lock:
            _exit_runs -= 1
            if own is not None:
                _exit_own.discard(own)


def _forget_runs_at_fork() -> None:
    """In a forked copy of the caller: the runs under way, and the forkers serving them, are
    the parent's. Its exit hook, cancelling through the pipe it shares with us, killed them
    (and waited for runs it has no thread of); a lock held at the fork by another thread
    would never be released here."""
    global _exit_cancel, _exit_own, _exit_runs, _exit_lock, _forker_lock, _server, _native
    _exit_cancel, _exit_own, _exit_runs, _exit_lock = None, set(), 0, _thread.allocate_lock()
    _forker_lock, _server, _native = _thread.allocate_lock(), None, None


os.register_at_fork(after_in_child=_forget_runs_at_fork)


def _end_runs_at_exit(wait: float = 5.0) -> None:
    with _exit_lock:
        cancels = [*_exit_own, *([_exit_cancel] if _exit_cancel is not None else [])]
    for cancel in cancels:
        cancel.cancel()
    deadline = time.monotonic() + wait
    while _exit_runs and time.monotonic() < deadline:
        time.sleep(0.01)
