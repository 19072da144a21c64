"""RunPlan -> the native stage's program: the child's ordered steps as records.

The order and the step names are the Python child's (sandbox/child.py), so a
setup error names the same step on either path, and the mounts are those of
sandbox/isolation/filesystem.py. Host-side facts the stage cannot know (which
bind sources are symlinks) are resolved here, in the caller's mount namespace.
"""

from __future__ import annotations

import os
import stat
import struct

from ..isolation.filesystem import (
    DEVICES,
    NEW_ROOT,
    PROC_MASKED,
    PROC_READONLY,
    ViewSpec,
)
from ..isolation.rlimits import NAMES as RLIMIT_NUMBERS
from ..isolation.syscalls import (
    CLONE_NEWCGROUP,
    CLONE_NEWNET,
    CLONE_NEWNS,
    MS_BIND,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_PRIVATE,
    MS_RDONLY,
    MS_REC,
    MS_REMOUNT,
)
from ..plan import RunPlan

# Fixed fd numbers in the stage (see stage.c).
CGROUP_FD = 6  # the supervisor's "joined" message (v2)
TEMPLATE_FD = 7
TASKS_FD = 8  # and up: each v1 hierarchy's tasks file, which the stage writes itself into
NETNS_FD = 16  # a ready network namespace (isolation/network.py: ReadyNamespaces)

_LEN = struct.Struct("<I")


class Program:
    """Records of (code, args...); every argument travels as bytes."""

    def __init__(self, fail_step: object = None) -> None:
        self.parts: list[bytes] = []
        self.fail_step = fail_step
        self.slots = 0

    def op(self, code: str, *args: object) -> None:
        out = [code.encode(), bytes([len(args)])]
        for a in args:
            b = a if isinstance(a, bytes) else str(int(a) if isinstance(a, bool) else a).encode("utf-8", "surrogateescape")
            out += [_LEN.pack(len(b)), b, b"\0"]
        self.parts.append(b"".join(out))

    def step(self, name: str) -> None:
        self.op("T", name)
        if name == self.fail_step:  # test-only fault injection: SANDBOXRUN_FAIL_STEP=<step>
            self.op("F", 5, "injected failure (SANDBOXRUN_FAIL_STEP)")

    def sub(self, name: str) -> None:
        self.op("q", name)

    def slot(self) -> int:
        self.slots += 1
        return self.slots - 1

    def mount(self, source: str, target: str, fstype: str, flags: int, data: str = "") -> None:
        self.op("m", source, target, fstype, flags, data)

    def bytes(self) -> bytes:
        return b"".join(self.parts)


def _nul(items: tuple[str, ...] | list[str]) -> bytes:
    return b"\0".join(os.fsencode(p) for p in items)


# ------------------------------------------------------------------------ the view


def _open_sources(p: Program, spec: ViewSpec) -> tuple[list[tuple[object, object, bool]], list[tuple[str, int]]]:
    """Open every bind source and device node before anything is hidden (as the Python child)."""
    p.sub("mount:open-sources")
    opened: list[tuple[object, object, bool]] = []  # (slot or symlink text, BindSpec, is_dir)
    for b in spec.binds:
        try:
            st = os.lstat(b.source)
            if stat.S_ISLNK(st.st_mode):
                opened.append((os.readlink(b.source), b, False))
                continue
        except OSError as e:
            if isinstance(e, FileNotFoundError) and b.optional:
                continue
            st = None  # the stage's own open reports the error, at this step
        k = p.slot()
        p.op("o", k, b.source, 0)
        opened.append((k, b, bool(st and stat.S_ISDIR(st.st_mode))))
    devices = []
    for name in DEVICES:
        k = p.slot()
        p.op("o", k, f"/dev/{name}", 1)
        devices.append((name, k))
    return opened, devices


def _static_part(p: Program, root: str, spec: ViewSpec, opened: list[tuple[object, object, bool]],
                 devices: list[tuple[str, int]]) -> None:
    p.sub("mount:root-tmpfs")
    p.mount("sandboxrun", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=8m")
    for d in ("etc", "proc", "dev", "tmp", "run"):
        p.op("k", f"{root}/{d}", 0o755)
    if spec.workdir_fixed:
        p.op("K", root + spec.workdir, 1)
    p.sub("mount:binds")
    for src, b, is_dir in sorted(opened, key=lambda x: x[1].target.count("/")):  # type: ignore[attr-defined]
        target = root + b.target  # type: ignore[attr-defined]
        if isinstance(src, str):  # merged-/usr symlinks such as /bin -> usr/bin
            p.op("l", src, target, 1)
        else:
            p.op("b", src, target, b.writable, 0, is_dir)  # type: ignore[attr-defined]
    p.sub("mount:dev")
    dev = f"{root}/dev"
    p.mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k")
    for name, k in devices:
        p.op("b", k, f"{dev}/{name}", 1, 1, 0)
    for link, to in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                     ("stderr", "/proc/self/fd/2"), ("ptmx", "pts/ptmx")):
        p.op("l", to, f"{dev}/{link}", 0)
    p.op("k", f"{dev}/shm", 0o1777)
    p.op("k", f"{dev}/pts", 0o755)
    p.sub("mount:etc")
    p.op("l", "/run/sandboxrun/passwd", f"{root}/etc/passwd", 0)
    p.op("l", "/run/sandboxrun/group", f"{root}/etc/group", 0)
    p.op("w", f"{root}/etc/hostname", 0o644, spec.hostname + "\n")
    p.op("w", f"{root}/etc/hosts", 0o644, f"127.0.0.1\tlocalhost {spec.hostname}\n::1\tlocalhost ip6-localhost\n")


def _workdir(p: Program, spec: ViewSpec, fallback: object, *, tree: bool) -> tuple[str, int]:
    """The caller's workdir, opened while the host's namespace is still ours."""
    if spec.workdir_idmap is not None or (tree and spec.workdir_host):
        p.sub("mount:open-workdir")
        k = p.slot()
        if spec.workdir_idmap is not None and fallback:
            p.op("W", k, spec.workdir_host, *spec.workdir_idmap, 1)
        else:
            p.op("W", k, spec.workdir_host)
        return "tree", k
    if spec.workdir_host:
        k = p.slot()
        p.op("o", k, spec.workdir_host, 0)
        return "fd", k
    return "tmpfs", -1


def _per_run_part(p: Program, root: str, spec: ViewSpec, work: tuple[str, int]) -> None:
    p.sub("mount:tmp")
    p.mount("tmpfs", f"{root}/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={spec.tmp_size}")
    p.mount("tmpfs", f"{root}/run", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0755,size=64k")
    p.op("k", f"{root}/run/sandboxrun", 0o755)
    p.op("w", f"{root}/run/sandboxrun/passwd", 0o644, spec.passwd)
    p.op("w", f"{root}/run/sandboxrun/group", 0o644, spec.group)
    dev = f"{root}/dev"
    p.mount("tmpfs", f"{dev}/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"mode=1777,size={spec.shm_size}")
    p.mount("devpts", f"{dev}/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620")
    p.sub("mount:workdir")
    target = root + spec.workdir
    p.op("D", target)
    kind, k = work
    if kind == "tmpfs":
        owner = f",uid={spec.workdir_owner[0]},gid={spec.workdir_owner[1]}" if spec.workdir_owner else ""
        p.mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0700,size={spec.workdir_size}{owner}")
    elif kind == "fd":
        p.op("b", k, target, 1, 0, 1)
    else:
        p.op("M", k, target)
    p.sub("mount:proc")
    proc = f"{root}/proc"
    p.mount("proc", proc, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for name in PROC_READONLY:
        p.op("r", f"{proc}/{name}")
    for name in PROC_MASKED:
        p.op("x", f"{proc}/{name}", f"{dev}/null")


def _pivot_and_seal(p: Program, root: str) -> None:
    p.sub("pivot_root")
    p.op("P", root)
    p.sub("mount:root-readonly")
    p.mount("", "/", "", MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def view_ops(p: Program, spec: ViewSpec, template: bool, fallback: object) -> None:
    """The filesystem step: a copy of a prepared template namespace plus the per-run
    mounts, or (one-shot callers) the whole view."""
    if template:
        work = _workdir(p, spec, fallback, tree=True)
        p.sub("mount:enter-template")
        p.op("e", TEMPLATE_FD, CLONE_NEWNS)
        p.op("u", CLONE_NEWNS)
        p.op("c", "/")
        _per_run_part(p, "", spec, work)
    else:
        p.sub("mount:private")
        p.mount("", "/", "", MS_REC | MS_PRIVATE)
        opened, devices = _open_sources(p, spec)
        work = _workdir(p, spec, fallback, tree=False)
        _static_part(p, NEW_ROOT, spec, opened, devices)
        _per_run_part(p, NEW_ROOT, spec, work)
        _pivot_and_seal(p, NEW_ROOT)
    p.op("c", spec.workdir)


def template_program(spec: ViewSpec) -> bytes:
    """Build a view's static part in a fresh mount namespace and hold it (see filesystem.build_template)."""
    p = Program()
    p.step("template")
    p.op("u", CLONE_NEWNS)
    p.mount("", "/", "", MS_REC | MS_PRIVATE)
    opened, devices = _open_sources(p, spec)
    _static_part(p, NEW_ROOT, spec, opened, devices)
    _pivot_and_seal(p, NEW_ROOT)
    p.op("H")
    return p.bytes()


# ---------------------------------------------------------------------- the steps


MAX_SLOTS = 64  # stage.c: fds held between opening the bind sources and binding them


def supports(plan: RunPlan) -> bool:
    """Plans the stage can run: everything but a rootless caller's nested user namespace
    and views with more binds than the stage has slots for (the Python child runs those)."""
    if plan.nested_userns:
        return False
    return plan.view is None or len(plan.view.binds) + len(DEVICES) + 1 <= MAX_SLOTS


_compiled: dict[tuple[object, ...], bytes] = {}


def compile_plan(plan: RunPlan, *, template: bool, cgroup: bool, tasks: int = 0, netns: bool = False) -> bytes:
    """`cgroup`: wait for the supervisor's "joined" message; `tasks`: how many v1 hierarchies
    to join by ourselves (their tasks files at TASKS_FD...), before PID 1 exists; `netns`:
    enter the ready network namespace at NETNS_FD instead of making one.

    Every step but the last depends only on the profile, the run's uid and the workdir,
    which repeat from run to run: that part is compiled once per combination (a full
    build is not cached: it looks at the host's bind sources each time)."""
    key = None
    if template:
        key = (plan.view, plan.extra.get("fallback_ids"), plan.extra.get("fail_step"), plan.unshare_flags,
               plan.pid_namespace, plan.cwd, plan.loopback, plan.hostname, plan.rlimits, plan.uid, plan.gid,
               plan.landlock, plan.landlock_ro, plan.landlock_rw, plan.seccomp_bpf, plan.trace, plan.pty,
               cgroup, tasks, netns)
        steps = _compiled.get(key)
        if steps is not None:
            return steps + _exec(plan)
    steps = _steps(plan, template=template, cgroup=cgroup, tasks=tasks, netns=netns)
    if key is not None:
        if len(_compiled) >= 256:
            _compiled.clear()
        _compiled[key] = steps
    return steps + _exec(plan)


def _exec(plan: RunPlan) -> bytes:
    p = Program()
    env = [f"{k}={v}" for k, v in plan.env.items()]
    p.op("E", plan.pty, _nul(plan.argv), _nul(env), plan.env.get("PATH", "/usr/bin:/bin"))
    return p.bytes()


def _steps(plan: RunPlan, *, template: bool, cgroup: bool, tasks: int, netns: bool) -> bytes:
    p = Program(plan.extra.get("fail_step"))
    if plan.trace:
        p.op("R")
    if tasks:
        p.step("cgroup")
        p.op("J", "the run's cgroup", *range(TASKS_FD, TASKS_FD + tasks))
    if plan.pid_namespace:
        p.step("pid_namespace")  # made by the caller's thread (launch.py): the stage is born PID 1
    p.step("session")
    p.op("s")
    p.op("n", "sandboxrun-init")
    p.step("pdeathsig")
    p.op("d", 9)
    p.step("namespaces")
    now = plan.unshare_flags & ~CLONE_NEWCGROUP
    if template:
        now &= ~CLONE_NEWNS  # made from the template
    if netns:
        now &= ~CLONE_NEWNET  # entered at the network step
    if now:
        p.op("u", now)
    if plan.view is not None:
        p.step("filesystem")
        view_ops(p, plan.view, template, plan.extra.get("fallback_ids"))
    else:
        p.step("cwd")
        p.op("c", plan.cwd)
    if plan.loopback:
        p.step("network")
        if netns:
            p.op("e", NETNS_FD, CLONE_NEWNET)  # fresh, loopback already up
        else:
            p.op("N")
    if plan.hostname:
        p.step("hostname")
        p.op("h", plan.hostname)
    if cgroup and not tasks:
        p.step("cgroup")
        p.op("g", CGROUP_FD)
    if plan.unshare_flags & CLONE_NEWCGROUP:
        p.step("cgroup_namespace")
        p.op("u", CLONE_NEWCGROUP)
    p.step("rlimits")
    for name, value in plan.rlimits:
        p.op("t", RLIMIT_NUMBERS[name], value)
    p.step("fds")
    p.op("z")
    if plan.landlock != "off":
        p.step("landlock")
        p.op("a", plan.landlock, _nul(plan.landlock_ro), _nul(plan.landlock_rw))
    p.step("identity")
    if plan.uid >= 0:
        p.op("B", 0)
        p.op("U", plan.uid, plan.gid)
    else:  # an unprivileged caller without namespaces: keep its identity, drop what it can
        p.op("B", 1)
    p.step("capabilities")
    p.op("Z")
    p.op("d", 9)  # the kernel clears the parent-death signal when credentials change
    p.step("no_new_privs")
    p.op("p")
    if plan.landlock != "off":
        p.step("landlock_enforce")
        p.op("A")
    if plan.seccomp_bpf:
        p.step("seccomp")
        p.op("S", plan.seccomp_bpf)
    p.step("exec")
    if plan.pty:
        p.op("y")
    return p.bytes()
