"""Per-run cgroups, parent side: v2, v1, or none.

The supervisor creates `sandboxrun-<owner pid>-<n>` before the child starts, sets
its limits, and moves the child in while the child builds its filesystem; the
child waits for that before it forks anything, so every descendant is counted. After the
run the supervisor reads usage (peak memory, OOM kills, CPU), kills whatever is
left (cgroup.kill on v2, freeze + SIGKILL on v1) and removes the directory.

Names carry `sandboxrun` and the owner's pid, so a start-up sweep can remove
leftovers of a supervisor that was SIGKILLed (`sweep_stale`).

A batch (`run_many`) keeps the cgroups that carry the CPU and process caps for its next
run (`Slots`): one run at a time in each, the limits written anew and the slot found empty
before it is used again. A fresh cpu cgroup per run cost ~3% of a batch's throughput on 2
CPUs (the scheduler places a new task group's first tasks badly: a CPU sits idle) and a
fresh pids cgroup another ~1-2% (mkdir/rmdir). The memory cgroup stays per run: page cache
and kernel objects stay charged to the cgroup that first touched them, so a reused one
would carry one run's charges into the next run's limit and peak.
"""

from __future__ import annotations

import _thread
import errno
import itertools
import os
import time

from .. import signals
from ..record import field, record

ROOT = "/sys/fs/cgroup"
V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct", "freezer")
V2_CONTROLLERS = ("memory", "pids", "cpu")
PREFIX = "sandboxrun-"
_seq = itertools.count()
_lock = _thread.allocate_lock()  # (threading: ~4 ms of a CLI call to import)


class CgroupUnavailable(OSError):
    """No cgroup can be made here; says why (errno + likely cause)."""

    def __str__(self) -> str:  # the reason alone: it ends up in Result.error after "cgroup: "
        return str(self.strerror)


@record
class CgroupLimits:
    """What a run's cgroup limits."""

    memory: int | None
    processes: int | None
    cpus: float | None
    # v1 freezer: only needed to kill processes that are not all in one pid namespace
    freezer: bool = True
    # v1 cpuacct: only needed where the supervisor cannot take the CPU time of the whole
    # tree from wait4 on its PID 1 (the kernel adds every reaped process to its parent's)
    cpu_usage: bool = True


@record
class CgroupStats:
    """What a run's cgroup saw: peak memory, OOM kills, pids limit, CPU."""

    peak_memory: int = 0
    oom_kills: int = 0
    pids_max_hit: bool = False
    cpu_user_s: float | None = None
    cpu_sys_s: float | None = None


def _read(path: str) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # interface files are small: one read
    try:
        return os.read(fd, 65536).decode()
    finally:
        os.close(fd)


def _read_opt(path: str) -> str:
    """The file's text, or "" when it does not exist (an interface file of a missing controller)."""
    try:
        return _read(path)
    except FileNotFoundError:
        return ""


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _kv(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


def _pid_alive(pid: int) -> bool:
    """A zombie is not alive: a SIGKILLed supervisor that its parent has not reaped (for good,
    where PID 1 never reaps) kept its cgroups from the sweep."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        state = stat[stat.rindex(b")") + 2:][:1]
        if state in (b"Z", b"X"):  # its leader exited: alive only while another of its threads is
            return len(os.listdir(f"/proc/{pid}/task")) > 1
    except (OSError, ValueError):
        pass
    return True


def _rmdir_retry(path: str, tries: int = 50) -> None:
    for i in range(tries):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno != errno.EBUSY or i == tries - 1:
                raise
            time.sleep(0.002 * (i + 1))


@record
class RunCgroup:
    """One run's cgroup: a directory per hierarchy (v1) or one (v2)."""

    version: str  # "v1" | "v2"
    dirs: list[str]  # one per hierarchy (v1) or one (v2)
    procs_files: list[str] = field(default_factory=list)
    # controller -> its directory: v1 always; v2 only where a slot carries pids and cpu
    by_controller: dict[str, str] = field(default_factory=dict)
    shared: list[str] = field(default_factory=list)  # of `dirs`: the slot's, left for the next run
    pids_max_base: int = 0  # a slot's pids.events "max" before this run (the counter never resets)

    def add(self, pid: int) -> None:
        """Move a process (all its threads) into the cgroup, in every hierarchy."""
        for p in self.procs_files:
            _write(p, str(pid))

    def _file(self, name: str) -> str | None:
        """The interface file `name` ("memory.peak", ...) in the hierarchy of its controller
        (no lookups: this is on every run's path). None when that controller is not here."""
        if self.version == "v2" or not self.by_controller:
            if self.version == "v2":
                return os.path.join(self.by_controller.get(name.split(".", 1)[0], self.dirs[0]), name)
            for d in self.dirs:  # a RunCgroup made without the mapping (the stale sweep)
                p = os.path.join(d, name)
                if os.path.exists(p):
                    return p
            return None
        d = self.by_controller.get(name.split(".", 1)[0])
        return os.path.join(d, name) if d else None

    def pids(self) -> list[int]:
        out: set[int] = set()
        for d in self.dirs:
            try:
                out.update(int(x) for x in _read(os.path.join(d, "cgroup.procs")).split())
            except OSError:
                pass
        return sorted(out)

    def stats(self) -> CgroupStats:
        s = CgroupStats()
        try:
            if self.version == "v2":
                d = self.dirs[0]
                # Each file on its own: memory.peak is 5.19+, and a controller that is not
                # enabled has no files; what is there is still reported.
                text = _read_opt(os.path.join(d, "memory.peak"))
                if text:
                    s.peak_memory = int(text.split()[0])
                s.oom_kills = _kv(_read_opt(os.path.join(d, "memory.events"))).get("oom_kill", 0)
                pids = _kv(_read_opt(self._file("pids.events") or "")).get("max", 0)
                s.pids_max_hit = pids > self.pids_max_base
                cpu = _kv(_read_opt(os.path.join(d, "cpu.stat")))
                if "user_usec" in cpu:
                    s.cpu_user_s = cpu["user_usec"] / 1e6
                    s.cpu_sys_s = cpu.get("system_usec", 0) / 1e6
            else:
                def text(name: str) -> str:
                    p = self._file(name)
                    return _read_opt(p) if p else ""

                peak = text("memory.max_usage_in_bytes")
                if peak:
                    s.peak_memory = int(peak)
                s.oom_kills = _kv(text("memory.oom_control")).get("oom_kill", 0)
                s.pids_max_hit = _kv(text("pids.events")).get("max", 0) > self.pids_max_base
                u, sy = text("cpuacct.usage_user"), text("cpuacct.usage_sys")
                if u and sy:
                    s.cpu_user_s = int(u) / 1e9
                    s.cpu_sys_s = int(sy) / 1e9
        except (OSError, ValueError):
            pass
        return s

    def kill_all(self) -> None:
        """SIGKILL every process in the cgroup, including ones that escaped the process group."""
        if self.version == "v2":
            p = os.path.join(self.dirs[0], "cgroup.kill")
            if os.path.exists(p):
                try:
                    _write(p, "1")
                    return
                except OSError:
                    pass
        # Frozen, nothing can fork between reading the pid list and the kills.
        freezer = self._file("cgroup.freeze" if self.version == "v2" else "freezer.state")
        if freezer and not os.path.exists(freezer):
            freezer = None
        frozen, thawed = ("1", "0") if freezer and freezer.endswith("cgroup.freeze") else ("FROZEN", "THAWED")
        if freezer:
            try:
                _write(freezer, frozen)
            except OSError:
                freezer = None
        for _ in range(100):
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                self._kill_member(pid)
            if freezer:
                try:
                    _write(freezer, thawed)  # a frozen task cannot die
                except OSError:
                    pass
            time.sleep(0.001)

    def _kill_member(self, pid: int) -> None:
        """SIGKILL `pid` if it is (still) in this cgroup: unfrozen, a pid read from
        cgroup.procs may have exited and been given to another process since. The pidfd
        holds the process we then check, so a number reused after it is never signalled."""
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return  # gone
        try:
            if self._holds(pid):
                signals.pidfd_send_signal(fd, signals.SIGKILL)
        except OSError:
            pass
        finally:
            os.close(fd)

    def _holds(self, pid: int) -> bool:
        """Whether /proc says `pid` is in one of our directories (true where /proc cannot say)."""
        try:
            with open(f"/proc/{pid}/cgroup") as f:
                paths = [line.rstrip("\n").split(":", 2)[-1] for line in f]
        except FileNotFoundError:
            return False  # exited: the pidfd's process is gone too
        except OSError:
            return True  # (hidepid) as before: the list was read just now
        names = {os.path.basename(d) for d in self.dirs}
        return any(os.path.basename(p) in names for p in paths)

    def remove(self) -> None:
        """Remove the run's own directories (a slot's stay for the next run). Usually empty
        by now (the pid namespace died with its init): rmdir at once, and kill what is left
        only when the kernel says the cgroup is busy."""
        own = [d for d in self.dirs if d not in self.shared]
        try:
            for d in own:
                try:
                    os.rmdir(d)
                except FileNotFoundError:
                    pass
            return
        except OSError:
            pass  # EBUSY: someone is still in there (or, v2, a cgroup below: a slot's run)
        if self.version == "v2":
            for d in own:
                for child in _subdirs(d):
                    RunCgroup("v2", [child]).remove()
        if self.pids():
            self.kill_all()
        for d in own:
            _rmdir_retry(d)


def _subdirs(d: str) -> list[str]:
    try:
        return [e.path for e in os.scandir(d) if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []


@record
class Slot:
    """A batch's cgroups for the CPU and process caps, lent to one run at a time (`Slots`).
    v1: controller ("cpu", "pids") -> its directory; v2: "" -> the directory each run's own
    cgroup is made in (pids.max and cpu.max on it, memory enabled for the run's below)."""

    version: str
    dirs: dict[str, str]

    def is_empty(self) -> bool:
        """No process in it, and (v2) no run's cgroup left below it."""
        for d in dict.fromkeys(self.dirs.values()):
            if _read(os.path.join(d, "cgroup.procs")).strip() or (self.version == "v2" and _subdirs(d)):
                return False
        return True

    def remove(self) -> None:
        """Whatever is in it is killed; then it goes."""
        for d in dict.fromkeys(self.dirs.values()):
            RunCgroup(self.version, [d]).remove()


class Slots:
    """One batch's slots: taken by a run, given back after it, removed at close(). A slot
    given back with a process still in it is not lent again: it is emptied and removed."""

    def __init__(self) -> None:
        self._free: list[Slot] = []
        self._made: list[Slot] = []
        self._unavailable = False  # the backend could not make one: runs make their own
        self._closed = False  # a run that outlives close() (its worker was never waited for) lends none
        self._lock = _thread.allocate_lock()

    def take(self, backend: Backend) -> Slot | None:
        with self._lock:
            if self._free:
                return self._free.pop()
            if self._unavailable or self._closed:
                return None
        try:
            slot = backend.make_slot()
        except OSError:
            slot = None
        with self._lock:
            if slot is None:
                self._unavailable = True
            elif not self._closed:
                self._made.append(slot)
                return slot
        if slot is not None:  # made while the batch closed: no one would remove it
            try:
                slot.remove()
            except OSError:
                pass
        return None

    def give_back(self, slot: Slot) -> None:
        try:
            empty = slot.is_empty()
        except OSError:
            empty = False
        if empty:
            with self._lock:
                if not self._closed:
                    self._free.append(slot)
                    return
        with self._lock:
            if slot in self._made:  # (close() forgets a slot it could not remove, a run still in it)
                self._made.remove(slot)
        try:
            slot.remove()
        except OSError:
            pass  # the start-up sweep of a later supervisor takes it

    def close(self) -> None:
        """Run again after an interrupt, it removes what is left (each slot forgotten only
        once it is gone)."""
        while True:
            with self._lock:
                self._closed = True
                self._free = []
                if not self._made:
                    return
                slot = self._made[-1]
            try:
                slot.remove()
            except OSError:
                pass
            with self._lock:
                if self._made and self._made[-1] is slot:
                    self._made.pop()


class Backend:
    version = "none"

    def create(self, limits: CgroupLimits, slot: Slot | None = None) -> RunCgroup:
        raise NotImplementedError

    def make_slot(self) -> Slot | None:
        return None

    def sweep_stale(self) -> int:
        return 0


def owner_tag() -> str:
    """What names a run's cgroup or fresh workdir after its supervisor: its pid, its pid
    namespace and a token of its own ("<pid>-n<inode>-t<token>"). Cgroup hierarchies and
    /tmp are shared by callers in other pid namespaces, where the same pid is another
    process (a name with the pid alone let a supervisor judge, and kill, the live run of a
    caller elsewhere), and a pid namespace's inode is reused once it is gone."""
    pid, ns, token = _own()
    return f"{pid}-n{ns:x}-t{token}"


_OWN: tuple[int, int, str] | None = None
INIT_PID_NAMESPACE = 0xEFFFFFFC  # the kernel's PROC_PID_INIT_INO: whose /proc shows every process


_own_lock = _thread.allocate_lock()
os.register_at_fork(after_in_child=lambda: globals().update(_own_lock=_thread.allocate_lock()))


def _own() -> tuple[int, int, str]:
    """(our pid, our pid namespace's inode, our token), looked up again after a fork. Made
    once under a lock: threads that each made a token of their own took one another's runs
    for those of a dead supervisor ("our pid, another token"), and the sweep removed a live
    run's fresh workdir."""
    global _OWN
    own = _OWN
    if own is None or own[0] != os.getpid():
        with _own_lock:
            own = _OWN
            if own is None or own[0] != os.getpid():
                try:
                    ns = os.stat("/proc/self/ns/pid").st_ino
                except OSError:
                    ns = 0
                _OWN = own = (os.getpid(), ns, os.urandom(3).hex())
    return own


def own_pid_namespace() -> int:
    return _own()[1]


def live_pid_namespaces() -> set[int] | None:
    """The pid namespaces some process is in now; None where we cannot see every process."""
    if own_pid_namespace() != INIT_PID_NAMESPACE:
        return None
    out: set[int] = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                link = os.readlink(f"/proc/{name}/ns/pid")  # "pid:[4026531836]"
                out.add(int(link[link.index("[") + 1:-1]))
            except FileNotFoundError:
                pass  # exited meanwhile
            except PermissionError:
                if name == "1":
                    continue  # our namespace's init: in it, whatever it lets us read
                return None  # (root without CAP_SYS_PTRACE): a namespace we cannot see is not dead
            except (OSError, ValueError):
                return None
    return out


def owner_is_gone(rest: str, live: set[int] | None = None) -> bool:
    """For a name's part after the prefix ("<pid>-n<ns>-t<token>-..." or an older
    "<pid>-..."): its supervisor is dead. One of another pid namespace, whose pids mean
    nothing here, only when no process is in that namespace any more (`live`: what
    live_pid_namespaces said; None: we cannot tell, so it is not ours to judge)."""
    parts = rest.split("-")
    if len(parts) < 2 or not (parts[0].isascii() and parts[0].isdigit()):
        return False  # (not a run's: /tmp/sandboxrun-<uid> is a user's session state)
    owner = int(parts[0])
    tags = {p[0]: p[1:] for p in parts[1:3] if p[:1] in ("n", "t")}
    if "n" not in tags:  # an older name: the pid alone
        return owner != os.getpid() and not _pid_alive(owner)
    try:
        ns = int(tags["n"], 16)
    except ValueError:
        return False
    pid, own_ns, token = _own()
    if ns != own_ns:
        return live is not None and ns not in live
    if owner == pid:
        return tags.get("t", token) != token  # our pid, another token: its holder before us
    return not _pid_alive(owner)


def _name() -> str:
    return f"{PREFIX}{owner_tag()}-{next(_seq)}"


def gone_owners(names: list[str], prefix: str = PREFIX) -> list[str]:
    """Those of `names` (with `prefix`) whose supervisor is dead (owner_is_gone); the live
    pid namespaces are read only when a name of another one is there."""
    own_ns = f"-n{own_pid_namespace():x}-"
    foreign = any("-n" in n and own_ns not in n for n in names)
    live = live_pid_namespaces() if foreign else None
    return [n for n in names if n.startswith(prefix) and owner_is_gone(n[len(prefix):], live)]


class V1Backend(Backend):
    version = "v1"

    def __init__(self, mounts: dict[str, str]) -> None:
        self.mounts = mounts  # controller -> mount point (cpu and cpuacct may share one)
        self.memsw: bool | None = None
        self.tcpmem: bool | None = None

    def make_slot(self) -> Slot | None:
        name = f"{_name()}-slot"
        dirs: dict[str, str] = {}
        try:
            for c in ("cpu", "pids"):
                base = self.mounts.get(c)
                if base is not None:
                    d = os.path.join(base, name)
                    if d not in dirs.values():
                        os.mkdir(d, 0o755)
                    dirs[c] = d
        except OSError:
            for d in dict.fromkeys(dirs.values()):
                try:
                    os.rmdir(d)
                except OSError:
                    pass
            raise
        return Slot("v1", dirs) if dirs else None

    def _from_slot(self, limits: CgroupLimits, slot: Slot | None) -> dict[str, str]:
        """controller -> the slot's directory, for the caps this run has, in hierarchies that
        carry no controller it must have to itself (memory; cpuacct and freezer when wanted)."""
        if slot is None:
            return {}
        own = {"memory", *(("cpuacct",) if limits.cpu_usage else ()), *(("freezer",) if limits.freezer else ())}
        wants = {"cpu": bool(limits.cpus), "pids": limits.processes is not None}
        out = {}
        for c, d in slot.dirs.items():
            mates = {k for k, base in self.mounts.items() if base == self.mounts.get(c)}
            if wants.get(c) and not mates & own:
                out[c] = d
        return out

    def create(self, limits: CgroupLimits, slot: Slot | None = None) -> RunCgroup:
        name = _name()
        dirs: list[str] = []
        shared = self._from_slot(limits, slot)
        try:
            skip = {"freezer": not limits.freezer, "cpuacct": not limits.cpu_usage, "cpu": not limits.cpus}
            wanted = {c: p for c, p in self.mounts.items() if not skip.get(c) and c not in shared}
            for base in dict.fromkeys(wanted.values()):
                d = os.path.join(base, name)
                dirs.append(d)  # first: a signal just after the mkdir must still find it to undo
                os.mkdir(d, 0o755)
            slot_dirs = list(dict.fromkeys(shared.values()))
            cg = RunCgroup("v1", dirs + slot_dirs, [os.path.join(d, "cgroup.procs") for d in dirs + slot_dirs],
                           {**{c: os.path.join(base, name) for c, base in wanted.items()}, **shared},
                           shared=slot_dirs)
            mem = cg._file("memory.limit_in_bytes")
            if limits.memory is not None and mem:
                _write(mem, str(limits.memory))
                if self.memsw is None:  # swap accounting is a boot option: look once
                    self.memsw = os.path.exists(mem.replace("memory.limit_in", "memory.memsw.limit_in"))
                if self.memsw:
                    _write(mem.replace("memory.limit_in", "memory.memsw.limit_in"), str(limits.memory))
                # v1 charges socket buffers to no limit until a tcp limit is set (v2 charges them
                # to memory.max): without it, a run's unread loopback traffic holds host memory
                # up to the global tcp_mem/udp_mem. The counter covers every protocol's buffers.
                tcp = mem.replace("memory.limit_in", "memory.kmem.tcp.limit_in")
                if self.tcpmem is None:
                    self.tcpmem = os.path.exists(tcp)
                if self.tcpmem:
                    _write(tcp, str(limits.memory))
            pids = cg._file("pids.max")
            if limits.processes is not None:
                if not pids:
                    raise CgroupUnavailable(errno.ENOTSUP, "the v1 pids controller is not mounted: "
                                            "cannot limit processes")
                _write(pids, str(limits.processes))
                if "pids" in shared:
                    cg.pids_max_base = _kv(_read(os.path.join(shared["pids"], "pids.events"))).get("max", 0)
            quota = cg._file("cpu.cfs_quota_us")
            if limits.cpus:
                if not quota:
                    raise CgroupUnavailable(errno.ENOTSUP, "the v1 cpu controller is not mounted: "
                                            "cannot limit CPU")
                # Written for every run, a slot's too: the write also refills the period's quota
                # and unthrottles, so a run never inherits the throttling of the one before it.
                _write(quota, str(int(limits.cpus * 100_000)))
            return cg
        except BaseException:  # an OSError, or a signal (KeyboardInterrupt): nothing of it may stay
            for d in reversed(dirs):
                try:
                    os.rmdir(d)
                except OSError:
                    pass
            raise

    def sweep_stale(self) -> int:
        n = 0
        for base in dict.fromkeys(self.mounts.values()):
            try:
                names = [e for e in os.listdir(base) if e.startswith(PREFIX)]
            except OSError:
                continue
            for e in gone_owners(names):
                try:
                    RunCgroup("v1", [os.path.join(base, e)]).remove()
                    n += 1
                except OSError:
                    pass
        return n


def _set_limit(cg_dir: str, name: str, value: str) -> None:
    """Write one v2 limit; a missing file means its controller is not enabled for us."""
    path = os.path.join(cg_dir, name)
    try:
        _write(path, value)
    except FileNotFoundError:
        controller = name.split(".")[0]
        parent = os.path.dirname(cg_dir)
        raise OSError(errno.ENOTSUP, f"cgroup v2 controller '{controller}' is not enabled in {parent} "
                      f"(no {name}); enable/delegate it, or make that limit unlimited in the profile") from None


class V2Backend(Backend):
    version = "v2"

    def __init__(self, parent: str) -> None:
        self.parent = parent  # a cgroup where we may create children with the controllers enabled

    def make_slot(self) -> Slot | None:
        """A cgroup for pids.max and cpu.max, each run's own (memory) made below it."""
        d = os.path.join(self.parent, f"{_name()}-slot")
        os.mkdir(d, 0o755)
        try:
            _write(os.path.join(d, "cgroup.subtree_control"), "+memory")
        except OSError:
            _rmdir_retry(d)
            raise
        return Slot("v2", {"": d})

    def create(self, limits: CgroupLimits, slot: Slot | None = None) -> RunCgroup:
        caps = slot.dirs[""] if slot is not None else None
        d = os.path.join(caps or self.parent, _name())
        cg = RunCgroup("v2", [d], [os.path.join(d, "cgroup.procs")],
                       by_controller={"pids": caps, "cpu": caps} if caps else {})
        try:
            os.mkdir(d, 0o755)
            if limits.memory is not None:
                _set_limit(d, "memory.max", str(limits.memory))
                sw = os.path.join(d, "memory.swap.max")
                if os.path.exists(sw):  # absent without swap accounting: then there is no swap to limit
                    _write(sw, "0")
            where = caps or d
            if limits.processes is not None:
                _set_limit(where, "pids.max", str(limits.processes))
            elif caps and os.path.exists(os.path.join(caps, "pids.max")):
                _write(os.path.join(caps, "pids.max"), "max")  # what the slot's last run had
            if caps:
                cg.pids_max_base = _kv(_read_opt(os.path.join(caps, "pids.events"))).get("max", 0)
            if limits.cpus:
                _set_limit(where, "cpu.max", f"{int(limits.cpus * 100_000)} 100000")
            elif caps and os.path.exists(os.path.join(caps, "cpu.max")):
                _write(os.path.join(caps, "cpu.max"), "max 100000")
            return cg
        except BaseException:  # an OSError, or a signal (KeyboardInterrupt): nothing of it may stay
            try:
                _rmdir_retry(d)
            except OSError:
                pass  # (not made: the mkdir itself failed)
            raise

    def sweep_stale(self) -> int:
        n = 0
        try:
            names = [e for e in os.listdir(self.parent) if e.startswith(PREFIX)]
        except OSError:
            return 0
        for e in gone_owners(names):
            try:
                RunCgroup("v2", [os.path.join(self.parent, e)]).remove()
                n += 1
            except OSError:
                pass
        return n


def _mountinfo() -> list[tuple[str, str, str]]:
    """(mount point, fstype, super options) for cgroup mounts."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            rfields = right.split()
            if len(rfields) >= 3 and rfields[0] in ("cgroup", "cgroup2"):
                out.append((fields[4], rfields[0], rfields[2]))
    return out


def _own_v2_cgroup() -> str:
    with open("/proc/self/cgroup") as f:
        for line in f:
            if line.startswith("0::"):
                return line[3:].strip()
    return "/"


_caller_uid: list[int] = []  # found once (functools.cache: ~3 ms of a CLI call to import)


def caller_uid() -> int:
    """Our euid as the parent user namespace sees it. The CLI's DirectForker makes its own
    process root of a user namespace mapped to the caller; geteuid() then says 0, but the
    cgroup tree still belongs to whoever owned it before."""
    if not _caller_uid:
        _caller_uid.append(_find_caller_uid())
    return _caller_uid[0]


def _find_caller_uid() -> int:
    uid = os.geteuid()
    try:
        for line in _read("/proc/self/uid_map").splitlines():
            inside, outside, count = (int(x) for x in line.split())
            if inside <= uid < inside + count:
                return outside + uid - inside
    except (OSError, ValueError):
        pass
    return uid


def _enable_controllers(cg_dir: str) -> None:
    """Enable memory/pids/cpu for children of cg_dir, moving the processes in cg_dir into a
    leaf when the "no internal processes" rule refuses it (EBUSY), as nsjail does. The
    move is repeated a few times: a process may fork between reading the list and the write."""
    available = _read(os.path.join(cg_dir, "cgroup.controllers")).split()
    enabled = _read(os.path.join(cg_dir, "cgroup.subtree_control")).split()
    want = " ".join(f"+{c}" for c in V2_CONTROLLERS if c in available and c not in enabled)
    if not want:
        return
    control = os.path.join(cg_dir, "cgroup.subtree_control")
    leaf = os.path.join(cg_dir, f"{PREFIX}supervisor")
    for attempt in range(6):
        try:
            _write(control, want)
            return
        except OSError as e:
            if e.errno != errno.EBUSY or attempt == 5:
                raise
        os.makedirs(leaf, exist_ok=True)
        for pid in _read(os.path.join(cg_dir, "cgroup.procs")).split():
            try:
                _write(os.path.join(leaf, "cgroup.procs"), pid)
            except OSError:
                pass  # exited meanwhile, or not ours to move: the next write says EBUSY again


_backend: Backend | None = None
_backend_error: CgroupUnavailable | None = None


def detect() -> Backend:
    """The backend for this host; raises CgroupUnavailable with a reason."""
    global _backend, _backend_error
    with _lock:
        if _backend is not None:
            return _backend
        if _backend_error is not None:
            raise _backend_error
        try:
            _backend = _detect()
            try:
                _backend.sweep_stale()
            except OSError:
                pass
            return _backend
        except CgroupUnavailable as e:
            _backend_error = e
            raise


def _detect() -> Backend:
    forced = os.environ.get("SANDBOXRUN_CGROUP")  # "v1", "v2" or "none", for tests and odd hosts
    if forced not in (None, "", "v1", "v2", "none"):
        from ..errors import InputError

        raise InputError(f"SANDBOXRUN_CGROUP={forced!r}: expected v1, v2 or none (or unset: detect)")
    mounts = _mountinfo()
    v1 = {}
    v2_root = None
    for point, fstype, opts in mounts:
        if fstype == "cgroup":
            for c in V1_CONTROLLERS:
                if c in opts.split(","):
                    v1.setdefault(c, point)
        elif v2_root is None:
            v2_root = point
    uid = caller_uid()
    if forced == "none":
        raise CgroupUnavailable(errno.ENOTSUP, "cgroups disabled by SANDBOXRUN_CGROUP=none")
    if "memory" in v1 and forced != "v2":
        if not all(os.access(p, os.W_OK) for p in set(v1.values())):
            raise CgroupUnavailable(
                errno.EACCES,
                f"cgroup v1 hierarchies under {ROOT} are not writable by uid {uid}: v1 has no delegation "
                "to unprivileged users")  # (the run's error adds what to do: supervisor._likely_cause)
        return V1Backend(v1)
    if v2_root is not None and forced != "v1":
        own = _own_v2_cgroup()
        # As root on the host, a top-level cgroup; otherwise (rootless, or inside a container with
        # a cgroup namespace) our own cgroup, which must be delegated to us.
        base = v2_root if uid == 0 and own in ("/", "") else os.path.join(v2_root, own.lstrip("/"))
        if uid == 0 and own not in ("/", "") and os.access(v2_root, os.W_OK):
            base = v2_root
        try:
            _enable_controllers(base)
        except OSError as e:
            raise CgroupUnavailable(
                e.errno or errno.EACCES,
                f"cannot enable cgroup v2 controllers in {base}: {os.strerror(e.errno or 13)}"
                + ("" if uid == 0 else " (not delegated to this user: systemd-run --user -p Delegate=yes)")) from None
        available = _read(os.path.join(base, "cgroup.subtree_control")).split()
        if "memory" not in available or "pids" not in available:
            raise CgroupUnavailable(errno.ENOTSUP, f"cgroup v2 at {base} lacks the memory/pids controllers "
                                    f"(enabled: {' '.join(available) or 'none'})")
        return V2Backend(base)
    raise CgroupUnavailable(errno.ENOENT, f"no usable cgroup hierarchy mounted under {ROOT}")
