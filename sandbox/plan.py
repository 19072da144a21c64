"""RunPlan: everything the child needs, resolved by the supervisor, picklable.

The supervisor turns Profile + request into this plan; the child turns the plan
into ordered steps. The child never reads profiles or the caller's environment.
"""

from __future__ import annotations

from .isolation.filesystem import ViewSpec
from .record import field, record

# The child's parent-death signal when there is no pid namespace (SIGRTMAX): it takes it, to
# kill the run's processes, its descendants, before it exits (stage.c, child.py); with a pid
# namespace SIGKILL, since the namespace dies with its init.
PARENT_GONE = 64
SANDBOX_UID = 1000  # a rootless run's uid/gid in its own user namespace
# Every setup step the child marks (child.py's mark(), the native stage's Program.step()), in
# order: where SANDBOXRUN_FAIL_STEP may inject a failure. (A setup_error may also name steps
# of the supervisor's own, such as user_namespace.)
STEPS = ("session", "pdeathsig", "cgroup", "cgroup_namespace", "namespaces", "pid_namespace", "template",
         "filesystem", "network", "hostname", "rlimits", "fds", "cwd", "identity", "capabilities",
         "no_new_privs", "landlock", "landlock_enforce", "seccomp", "exec")


@record
class RunPlan:
    """What the child does, resolved by the supervisor."""

    argv: list[str]
    env: dict[str, str]
    unshare_flags: int  # namespaces the child creates itself (never pid/user: see forker)
    pid_namespace: bool  # created by the forker, so the child is PID 1
    view: ViewSpec | None  # None: the host's filesystem (no mount namespace)
    cwd: str  # where the command starts, as seen after the view is built
    loopback: bool  # bring lo up in the private net namespace
    hostname: str | None
    rlimits: tuple[tuple[str, int], ...]
    uid: int  # as seen inside
    gid: int
    nested_userns: bool  # rootless: map uid/gid in a fresh user namespace
    seccomp_bpf: bytes
    landlock: str  # required | optional | off
    landlock_ro: tuple[str, ...] = ()
    landlock_rw: tuple[str, ...] = ()
    trace: bool = False
    pty: bool = False  # fd 0 is a terminal the child should make its controlling tty
    view_template: int = -1  # forker's fd of a prepared mount namespace to copy (see filesystem.py)
    parent_pid: int = 0
    extra: dict[str, object] = field(default_factory=dict)


def parent_death_signal(plan: RunPlan) -> int:
    """The child's parent-death signal: SIGKILL with a pid namespace, else PARENT_GONE."""
    return 9 if plan.pid_namespace else PARENT_GONE
