"""Counting what runs could leave behind, seen from outside the runner.

Shared by scripts/leakcheck.py (before/after any command, for people) and the soak
test (zero growth after thousands of runs). Everything the runner creates on the
host carries `sandboxrun` in its name (DESIGN.md, "Names on the host"), so most
counters are plain name searches; the supervisor's own fds, threads and RSS come
from /proc of the process being audited.

Nothing here imports the rest of the package at module level: counting must work
even when the runner is broken, and must not start a fork server by itself.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterable, Iterator

from .record import asdict, field, record

NAME = "sandboxrun"
CGROUP_ROOT = "/sys/fs/cgroup"
CGROUP_DEPTH = 4  # v2 parents can sit a few levels down (user.slice/.../); v1 runs sit at the top
# Persistent by design (the v2 leaf our own processes move into), not a per-run leftover.
CGROUP_KEEP = frozenset({f"{NAME}-supervisor"})
STATE_KEEP = frozenset({"uids.lock"})  # the uid allocator's lock file: one per host, by design
FORKSERVER_MARK = "sandbox.forkserver"


# ----------------------------------------------------------------------------- /proc readers


def _proc(pid: int | str, name: str) -> str:
    with open(f"/proc/{pid}/{name}", errors="replace") as f:
        return f.read()


def template_fds() -> set[int]:
    """This process's prepared mount-namespace templates, ready network namespaces and their
    parent (bounded caches that persist between runs by design, like the fork server)."""
    sup = sys.modules.get("sandbox.supervisor")
    forker = getattr(sup, "_native", None)
    ready = getattr(forker, "netns", None)
    net = sys.modules.get("sandbox.isolation.network")
    parent = set(getattr(net, "_parent", ())) - {-1}
    return set((getattr(forker, "templates", None) or {}).values()) | set(ready.fds() if ready else ()) | parent


def open_fds(pid: int | str = "self") -> int:
    """Open file descriptors of a process (the caller's by default), the template cache aside."""
    names = os.listdir(f"/proc/{pid}/fd")
    if pid != "self":
        return len(names)
    cached = template_fds()
    return len([n for n in names if int(n) not in cached]) - 1  # listdir's own fd on /proc/self/fd


def fd_targets(pid: int | str = "self") -> list[str]:
    """What each open fd points at, for a readable leak report."""
    out = []
    base = f"/proc/{pid}/fd"
    for fd in sorted(os.listdir(base), key=int):
        try:
            out.append(f"{fd} -> {os.readlink(f'{base}/{fd}')}")
        except OSError:
            pass
    return out


def _status_field(pid: int | str, key: str) -> int:
    for line in _proc(pid, "status").splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def threads(pid: int | str = "self") -> int:
    return _status_field(pid, "Threads")


def rss_bytes(pid: int | str = "self") -> int:
    return _status_field(pid, "VmRSS") * 1024


def mounts(pid: int | str = "self") -> list[str]:
    """Mount table of a process's mount namespace as 'point fstype source' lines (ids dropped,
    so two snapshots compare by what is mounted, not by mount id)."""
    out = []
    for line in _proc(pid, "mountinfo").splitlines():
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(fields) >= 5 and len(rfields) >= 2:
            out.append(f"{fields[4]} {rfields[0]} {rfields[1]}")
    return out


def runner_mounts(pid: int | str = "self") -> list[str]:
    """Mounts that name the runner: a leaked sandbox root is the tmpfs whose source is `sandboxrun`."""
    return [m for m in mounts(pid) if NAME in m]


# ----------------------------------------------------------------------------- processes


@record(frozen=True)
class Proc:
    pid: int
    ppid: int
    state: str
    comm: str
    cmdline: str

    def __str__(self) -> str:
        return f"{self.pid} (ppid {self.ppid}, {self.state}) {self.comm}: {self.cmdline[:120]}"


def _read_proc(pid: int) -> Proc | None:
    try:
        stat = _proc(pid, "stat")
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # comm may hold spaces and parentheses: split at the last ')'.
    head, _, rest = stat.rpartition(")")
    comm = head.partition("(")[2]
    parts = rest.split()
    if len(parts) < 2:
        return None
    cmd = raw.replace(b"\0", b" ").decode(errors="replace").strip()
    return Proc(pid, int(parts[1]), parts[0], comm, cmd)


def processes() -> Iterator[Proc]:
    """Every process on the machine (that this pid namespace shows)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            p = _read_proc(int(entry))
            if p is not None:
                yield p


def descendants(pid: int, table: Iterable[Proc] | None = None) -> list[Proc]:
    """All descendants of `pid`, from one pass over /proc."""
    procs = list(processes() if table is None else table)
    kids: dict[int, list[Proc]] = {}
    for p in procs:
        kids.setdefault(p.ppid, []).append(p)
    out: list[Proc] = []
    todo = [pid]
    while todo:
        for child in kids.get(todo.pop(), ()):
            out.append(child)
            todo.append(child.pid)
    return out


def forkserver_pids(pid: int | None = None, table: Iterable[Proc] | None = None) -> set[int]:
    """The fork server of process `pid` (this one by default): it persists between runs by
    design. Rootless, it is two processes (an outer waiter and the server as PID 1 of its
    own pid namespace); both carry the same command line."""
    me = os.getpid() if pid is None else pid
    # Sandbox inits are forks of the server: same command line, but renamed (comm).
    return {p.pid for p in descendants(me, table)
            if FORKSERVER_MARK in p.cmdline and p.state != "Z" and p.comm != f"{NAME}-init"}


def stray_children(pid: int | None = None) -> list[Proc]:
    """Descendants of `pid` other than its fork server: after a run there should be none."""
    me = os.getpid() if pid is None else pid
    table = list(processes())
    keep = forkserver_pids(me, table)
    return [p for p in descendants(me, table) if p.pid not in keep]


def zombies(table: Iterable[Proc] | None = None) -> list[Proc]:
    return [p for p in (processes() if table is None else table) if p.state == "Z"]


def runner_zombies(pid: int | None = None) -> list[Proc]:
    """Zombies nobody in our process tree has reaped: ours or our descendants'. (Orphans
    re-parented to init are init's to reap, and on a busy machine mostly other people's.)"""
    me = os.getpid() if pid is None else pid
    table = list(processes())
    ours = {me} | {p.pid for p in descendants(me, table)}
    return [p for p in zombies(table) if p.ppid in ours]


def marked(mark: str) -> list[Proc]:
    """Live processes whose command line carries `mark` (tests tag their runs with one)."""
    me = os.getpid()
    return [p for p in processes() if mark in p.cmdline and p.state != "Z" and p.pid != me]


def sandbox_inits() -> list[Proc]:
    """Sandbox init processes (the child renames itself `sandboxrun-init`), machine-wide."""
    return [p for p in processes() if p.comm == f"{NAME}-init" and p.state != "Z"]


# ----------------------------------------------------------------------------- cgroups, files


def runner_cgroups(owner: int | None = None, root: str = CGROUP_ROOT) -> list[str]:
    """`sandboxrun-*` cgroup directories under every hierarchy; with `owner`, only those of
    the supervisor with that pid (`sandboxrun-<pid>-<n>`). The persistent v2 leaf
    `sandboxrun-supervisor` is not a leftover and is not listed."""
    out: list[str] = []
    seen: set[tuple[int, int]] = set()

    def walk(path: str, depth: int) -> None:
        try:
            st = os.stat(path)
            entries = list(os.scandir(path))
        except OSError:
            return
        if (st.st_dev, st.st_ino) in seen:  # hierarchies mounted twice or symlinked (cpu,cpuacct)
            return
        seen.add((st.st_dev, st.st_ino))
        for e in entries:
            if not e.is_dir(follow_symlinks=depth == 0):
                continue
            if e.name.startswith(NAME):
                if e.name in CGROUP_KEEP:
                    walk(e.path, depth + 1)
                elif owner is None or e.name.startswith(f"{NAME}-{owner}-"):
                    out.append(e.path)
            elif depth < CGROUP_DEPTH:
                walk(e.path, depth + 1)

    walk(root, 0)
    return sorted(out)


def _this_namespace(path: str) -> bool:
    """Named by a supervisor of our pid namespace (or before names said which)."""
    from .isolation.cgroups import own_pid_namespace

    name = os.path.basename(path)
    return "-n" not in name or f"-n{own_pid_namespace():x}-" in name


def _ours_or_stale(path: str, ours: set[int]) -> bool:
    """A run cgroup of our process tree, or one whose supervisor is gone (cgroups.owner_is_gone:
    a pid of another pid namespace is not one of ours, nor judged by our pids)."""
    from .isolation.cgroups import gone_owners

    if cgroup_owner(path) in ours and _this_namespace(path):
        return True
    return bool(gone_owners([os.path.basename(path)]))


def cgroup_owner(path: str) -> int | None:
    """The supervisor pid a runner cgroup's name carries, or None."""
    parts = os.path.basename(path)[len(NAME) + 1:].split("-")
    return int(parts[0]) if parts and parts[0].isascii() and parts[0].isdigit() else None


def temp_dirs(bases: Iterable[str] | None = None) -> list[str]:
    """`sandboxrun*` entries in the temp directories (fresh workdirs and other scratch)."""
    dirs = dict.fromkeys(bases if bases is not None else ("/tmp", tempfile.gettempdir()))
    out = []
    for base in dirs:
        try:
            out += [os.path.join(base, e) for e in os.listdir(base) if e.startswith(NAME)]
        except OSError:
            pass
    return sorted(out)


def state_roots() -> list[str]:
    """Where background-session and per-run state can live (any that exist). With
    SANDBOXRUN_STATE_DIR set, not /run/sandboxrun: only other callers' sessions are there then
    (and the uid lock), and another root user's `start` made a soak test fail."""
    own = os.environ.get("SANDBOXRUN_STATE_DIR", "")
    roots = [own] if own else [f"/run/{NAME}"]
    sessions = sys.modules.get("sandbox.sessions")
    for attr in ("STATE_DIR", "state_dir"):
        value = getattr(sessions, attr, None)
        if callable(value):
            try:
                value = value()
            except Exception:  # noqa: BLE001 - counting must never fail because a module does
                value = None
        if isinstance(value, (str, os.PathLike)):
            roots.append(os.fspath(value))
    return [r for r in dict.fromkeys(roots) if r and os.path.isdir(r)]


def state_entries() -> list[str]:
    """Entries under the state roots, two levels deep (one per session or run directory)."""
    out = []
    for root in state_roots():
        for e in os.scandir(root):
            if e.name in STATE_KEEP:
                continue
            out.append(e.path)
            if e.is_dir(follow_symlinks=False):
                try:
                    out += [os.path.join(e.path, x) for x in os.listdir(e.path)]
                except OSError:
                    pass
    return sorted(out)


# ----------------------------------------------------------------------------- snapshots


# Counters that describe the machine rather than what this supervisor (or a dead one) left:
# shown by leakcheck, never counted as a leak, since other users' runs move them.
INFO_ONLY = frozenset({"all_cgroups", "all_sandbox_inits", "zombies"})


@record
class Snapshot:
    """Counters at one moment. `owner` is the supervisor audited (this process by default).

    "Ours" means: of `owner` or a descendant of it, or left by a supervisor that is dead
    (a stale cgroup, an init re-parented to pid 1). Runs of other live supervisors on the
    same machine are only in the all_* counters."""

    owner: int
    fds: int = 0
    threads: int = 0
    rss_bytes: int = 0
    mounts: int = 0
    runner_mounts: int = 0
    cgroups: int = 0  # ours or stale sandboxrun-* run cgroups
    own_cgroups: int = 0  # those named after `owner` itself
    all_cgroups: int = 0
    temp_dirs: int = 0
    children: int = 0  # descendants of `owner` but its fork server
    sandbox_inits: int = 0  # ours or orphaned
    all_sandbox_inits: int = 0
    zombies: int = 0  # machine-wide
    runner_zombies: int = 0  # unreaped children of ours or of our descendants
    state_entries: int = 0
    details: dict[str, list[str]] = field(default_factory=dict, repr=False, compare=False)

    def counters(self) -> dict[str, int]:
        d = asdict(self)
        d.pop("details")
        d.pop("owner")
        return d


def snapshot(owner: int | None = None, *, temp_bases: Iterable[str] | None = None) -> Snapshot:
    """Every counter, with the lists behind them in `details` (for messages)."""
    pid = os.getpid() if owner is None else owner
    proc: int | str = "self" if pid == os.getpid() else pid
    table = list(processes())
    alive = {p.pid for p in table if p.state != "Z"}
    below = descendants(pid, table)
    ours = {pid} | {p.pid for p in below}
    keep = forkserver_pids(pid, table)
    kids = [p for p in below if p.pid not in keep]
    zs = zombies(table)
    rzs = [p for p in zs if p.ppid in ours]
    inits = [p for p in table if p.comm == f"{NAME}-init" and p.state != "Z"]
    our_inits = [p for p in inits if p.pid in ours or p.ppid == 1 or p.ppid not in alive]
    all_cgs = runner_cgroups()
    cgs = [c for c in all_cgs if _ours_or_stale(c, ours)]
    own = [c for c in all_cgs if cgroup_owner(c) == pid and _this_namespace(c)]
    mnt = mounts(proc)
    rmnt = [m for m in mnt if NAME in m]
    tmps = temp_dirs(temp_bases)
    state = state_entries()
    return Snapshot(
        owner=pid, fds=open_fds(proc), threads=threads(proc), rss_bytes=rss_bytes(proc), mounts=len(mnt),
        runner_mounts=len(rmnt), cgroups=len(cgs), own_cgroups=len(own), all_cgroups=len(all_cgs),
        temp_dirs=len(tmps), children=len(kids), sandbox_inits=len(our_inits), all_sandbox_inits=len(inits),
        zombies=len(zs), runner_zombies=len(rzs), state_entries=len(state),
        details={
            "fds": fd_targets(proc), "mounts": mnt, "runner_mounts": rmnt, "cgroups": cgs, "own_cgroups": own,
            "all_cgroups": all_cgs, "temp_dirs": tmps, "children": [str(p) for p in kids],
            "sandbox_inits": [str(p) for p in our_inits], "all_sandbox_inits": [str(p) for p in inits],
            "zombies": [str(p) for p in zs], "runner_zombies": [str(p) for p in rzs], "state_entries": state,
        },
    )


def growth(before: Snapshot, after: Snapshot, *, rss_slack: int = 0) -> dict[str, tuple[int, int]]:
    """Counters that grew from `before` to `after` (RSS beyond `rss_slack` bytes), as
    {name: (before, after)}; empty means nothing leaked. INFO_ONLY counters are left out."""
    out = {}
    b, a = before.counters(), after.counters()
    for key, was in b.items():
        if key in INFO_ONLY:
            continue
        now = a[key]
        limit = was + (rss_slack if key == "rss_bytes" else 0)
        if now > limit:
            out[key] = (was, now)
    return out


def new_items(before: Snapshot, after: Snapshot, key: str) -> list[str]:
    """Entries behind counter `key` that exist after but not before (multiset difference)."""
    left = list(before.details.get(key, []))
    out = []
    for item in after.details.get(key, []):
        if item in left:
            left.remove(item)
        else:
            out.append(item)
    return out


def describe(before: Snapshot, after: Snapshot, grown: dict[str, tuple[int, int]]) -> str:
    """A leak report: each grown counter with what is new behind it."""
    lines = []
    for key, (was, now) in grown.items():
        lines.append(f"{key}: {was} -> {now}")
        lines += [f"    + {x}" for x in new_items(before, after, key)[:20]]
    return "\n".join(lines)
