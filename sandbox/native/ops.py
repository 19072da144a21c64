"""RunPlan -> the native stage's program: the child's ordered steps as records.

The order and the step names are the Python child's (sandbox/child.py), so a
setup error names the same step on either path. The filesystem view is not
described here: isolation/filesystem.py describes it once, as operations that the
Python child runs itself and that are encoded here for the stage.
"""

from __future__ import annotations

import os
import struct

from ..isolation.filesystem import DEVICES, ViewOps, ViewSpec, template_ops, view_ops
from ..isolation.rlimits import NAMES as RLIMIT_NUMBERS
from ..isolation.syscalls import CLONE_NEWCGROUP, CLONE_NEWNET, CLONE_NEWNS
from ..plan import RunPlan, parent_death_signal

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

    def extend(self, view: ViewOps) -> None:
        """The filesystem view's operations (isolation/filesystem.py), encoded as records."""
        for code, *args in view.ops:
            self.op(code, *args)

    def bytes(self) -> bytes:
        return b"".join(self.parts)


def _nul(items: tuple[str, ...] | list[str]) -> bytes:
    return b"\0".join(os.fsencode(p) for p in items)


def template_program(spec: ViewSpec) -> bytes:
    """Build a view's static part in a fresh mount namespace and hold it (op 'H')."""
    p = Program()
    p.step("template")
    p.op("u", CLONE_NEWNS)
    p.extend(template_ops(spec))
    p.op("H")
    return p.bytes()


# ---------------------------------------------------------------------- the steps


MAX_SLOTS = 64  # stage.c: fds held between opening the bind sources and binding them


def supports(plan: RunPlan) -> bool:
    """Plans the stage can run: all but views that hold more fds than the stage has slots for
    (the Python child runs those): one a bind, one a device, one the caller's workdir, one
    a terminal."""
    v = plan.view
    return v is None or len(v.binds) + len(DEVICES) + bool(v.workdir_host) + v.console <= MAX_SLOTS


_compiled: dict[tuple[object, ...], bytes] = {}


def compile_plan(plan: RunPlan, *, template: bool, cgroup: bool, tasks: int = 0, netns: str = "") -> bytes:
    """`cgroup`: wait for the supervisor's "joined" message; `tasks`: how many v1 hierarchies
    to join by ourselves (their tasks files at TASKS_FD...), before PID 1 exists; `netns`:
    "ready", enter the ready network namespace at NETNS_FD instead of making one; "parent",
    make it from the namespace at NETNS_FD (network.parent_namespace).

    Every step but the last depends only on the profile, the run's uid and the workdir,
    which repeat from run to run: that part is compiled once per combination (a full
    build is not cached: it looks at the host's bind sources each time)."""
    key = None
    if template:
        key = (plan.view, plan.extra.get("fallback_ids"), plan.extra.get("fail_step"), plan.unshare_flags,
               plan.pid_namespace, plan.cwd, plan.loopback, plan.hostname, plan.rlimits, plan.uid, plan.gid,
               plan.landlock, plan.landlock_ro, plan.landlock_rw, plan.seccomp_bpf, plan.trace, plan.pty,
               plan.nested_userns, cgroup, tasks, netns)
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


def _steps(plan: RunPlan, *, template: bool, cgroup: bool, tasks: int, netns: str) -> bytes:
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
    p.op("d", parent_death_signal(plan))
    p.step("namespaces")
    now = plan.unshare_flags & ~CLONE_NEWCGROUP
    if template:
        now &= ~CLONE_NEWNS  # made from the template
    if netns:
        now &= ~CLONE_NEWNET  # entered (or made) at the network step
    if now:
        p.op("u", now)
    if plan.view is not None:
        p.step("filesystem")
        p.extend(view_ops(plan.view, TEMPLATE_FD if template else -1, plan.nested_userns))
    else:
        p.step("cwd")
        p.op("c", plan.cwd)
        if plan.extra.get("cwd_id"):
            p.op("C", plan.cwd, *plan.extra["cwd_id"])
    if plan.loopback:
        p.step("network")
        if netns == "ready":
            p.op("e", NETNS_FD, CLONE_NEWNET)  # fresh, loopback already up
        else:
            if netns == "parent":  # (the fds step closes the parent's fd before the exec)
                p.op("e", NETNS_FD, CLONE_NEWNET)
                p.op("u", CLONE_NEWNET)
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
    if plan.nested_userns:  # rootless: one more user namespace, which starts with a full bounding set
        p.op("Y", plan.uid, plan.gid)
        p.op("B", 0)
    elif plan.uid >= 0:
        p.op("B", 0)
        p.op("U", plan.uid, plan.gid)
    else:  # an unprivileged caller without namespaces: keep its identity, drop what it can
        p.op("B", 1)
    p.step("capabilities")
    p.op("Z")
    p.op("d", parent_death_signal(plan))  # the kernel clears the parent-death signal when credentials change
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
