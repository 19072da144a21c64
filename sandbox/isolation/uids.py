"""Per-run host uids for root callers (isolate's model).

Each run gets its own uid from a configurable range, so one sandbox's processes and
files are never another's and RLIMIT_NPROC counts just this run. Allocation is
exclusive across threads (an in-process set) and across processes (an OFD byte-range
lock per uid on one lock file, released automatically if the supervisor dies).
"""

from __future__ import annotations

import _thread
import errno
import fcntl
import os
import stat
import struct

from ..errors import InputError

# Above every uid a host hands out to users and services (below 65536; 65534 is nobody), and
# clear of the usual /etc/subuid ranges that start at 100000 and run 65536 per user.
DEFAULT_BASE, DEFAULT_COUNT, LOWEST_BASE = 1_100_000, 65_536, 65_536
LOCK_FILE = "/run/sandboxrun/uids.lock"  # unless SANDBOXRUN_UID_LOCK names another
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)

_in_use: set[int] = set()
_mutex = _thread.allocate_lock()
_range: tuple[int, int, int] | None = None  # base, count, this process's first slot


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise InputError(f"{name}={text!r}: expected a whole number") from None


def uid_range() -> tuple[int, int]:
    """(first uid, count) of the per-run uids, from SANDBOXRUN_UID_BASE/SANDBOXRUN_UID_COUNT."""
    global _range
    if _range is None:
        base, count = _env_int("SANDBOXRUN_UID_BASE", DEFAULT_BASE), _env_int("SANDBOXRUN_UID_COUNT", DEFAULT_COUNT)
        if base < LOWEST_BASE:  # a run would share a uid with a host user, or be root
            raise InputError(f"SANDBOXRUN_UID_BASE={base}: expected at least {LOWEST_BASE}, above the host's "
                             f"own users (the default is {DEFAULT_BASE})")
        if count < 1:
            raise InputError(f"SANDBOXRUN_UID_COUNT={count}: expected at least 1")
        if base + count > 2**32 - 1:  # (uid_t)-1 is "no uid"
            raise InputError(f"SANDBOXRUN_UID_BASE={base} + SANDBOXRUN_UID_COUNT={count}: past the last uid, "
                             f"{2**32 - 2}")
        start = int.from_bytes(os.urandom(4), "little") % count  # (random costs 2 ms to import)
        _range = base, count, start
    return _range[0], _range[1]


def _flock(kind: int, offset: int) -> bytes:
    return struct.pack("hh4xqqi4x", kind, os.SEEK_SET, offset, 1, 0)


class Lease:
    def __init__(self, uid: int, fd: int) -> None:
        self.uid, self._fd = uid, fd

    def release(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1  # marked first: a teardown rerun after an interrupt must not close it twice
            os.close(fd)  # drops the OFD lock
        with _mutex:
            _in_use.discard(self.uid)


def _open_lock_file() -> int:
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
    given = os.environ.get("SANDBOXRUN_UID_LOCK")
    if given is None:
        try:
            return os.open(LOCK_FILE, flags, 0o600)
        except FileNotFoundError:  # our own directory: made on first use
            os.makedirs(os.path.dirname(LOCK_FILE), mode=0o700, exist_ok=True)
            return os.open(LOCK_FILE, flags, 0o600)
    # The caller's path is used as given: a typo must not make directories on the host, and
    # a relative one would be another file (another set of locks) in each working directory.
    if not os.path.isabs(given):
        raise InputError(f"SANDBOXRUN_UID_LOCK={given!r}: expected an absolute path (the lock file "
                         "every run shares)")
    try:
        fd = os.open(given, flags, 0o600)
    except OSError as e:
        raise InputError(f"SANDBOXRUN_UID_LOCK={given!r}: cannot open it as the uid lock file: "
                         f"{e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # /dev/null's locks are anyone's to take
        os.close(fd)
        raise InputError(f"SANDBOXRUN_UID_LOCK={given!r}: not a regular file (the uid lock file must be one "
                         "that only sandboxrun locks)")
    from ..hostpaths import filesystem_type

    kind = filesystem_type(fd)
    if kind in KERNEL_FILESYSTEMS:  # /proc/self/status: another file in each process, locks unshared
        os.close(fd)
        raise InputError(f"SANDBOXRUN_UID_LOCK={given!r}: a file of the kernel's ({kind}), not one that every "
                         "run shares; give a file on a disk or tmpfs")
    return fd


# Filesystems whose files the kernel makes up (per process, per reader): never a shared lock.
KERNEL_FILESYSTEMS = frozenset((
    "proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "configfs", "bpf", "pstore",
    "efivarfs", "fusectl", "devpts", "mqueue", "nsfs", "binfmt_misc", "hugetlbfs", "autofs",
))


def check_lock_file() -> None:
    """Raise InputError now for a bad SANDBOXRUN_UID_LOCK, before a session's monitor would
    meet it."""
    if os.environ.get("SANDBOXRUN_UID_LOCK") is not None:
        os.close(_open_lock_file())


def unmapped(base: int, count: int) -> str | None:
    """Why the per-run ids cannot be given here: our user namespace (`unshare -U
    --map-root-user`: only uid 0) does not map them, so no file or process could take them."""
    for name in ("uid_map", "gid_map"):
        try:
            with open(f"/proc/self/{name}") as f:
                rows = [tuple(int(x) for x in line.split()) for line in f]
        except (OSError, ValueError):
            return None  # no /proc to tell: chown and setuid answer
        if not any(len(r) == 3 and r[0] <= base and base + count <= r[0] + r[2] for r in rows):
            shown = "; ".join(" ".join(map(str, r)) for r in rows)
            return (f"the per-run ids {base}..{base + count - 1} are not mapped in this user namespace "
                    f"(/proc/self/{name}: {shown}): map them (or move them with SANDBOXRUN_UID_BASE and "
                    "SANDBOXRUN_UID_COUNT into what is mapped), or run sandboxrun as an unprivileged user, "
                    "whose runs get a user namespace of their own")
    return None


_mapped: list[bool] = []  # once per process: a namespace's maps are written once


def allocate() -> Lease:
    base, count = uid_range()  # first: a bad range is an InputError, before anything is opened
    if not _mapped:
        why = unmapped(base, count)
        if why:
            raise OSError(errno.EINVAL, why)
        _mapped.append(True)
    fd = _open_lock_file()
    # Each process scans from its own random slot (so processes rarely contend for a lock) and
    # takes the first free one: a process running one command at a time keeps reusing the same
    # uid, whose compiled setup steps are then cached (native/ops.py).
    start = _range[2] if _range else 0
    for i in range(count):
        slot = (start + i) % count
        uid = base + slot
        with _mutex:
            if uid in _in_use:
                continue
            _in_use.add(uid)
        try:
            fcntl.fcntl(fd, _F_OFD_SETLK, _flock(fcntl.F_WRLCK, uid))  # at the uid: any range agrees
            return Lease(uid, fd)
        except OSError:
            with _mutex:
                _in_use.discard(uid)
    os.close(fd)
    raise OSError(11, f"no free sandbox uid in {base}..{base + count - 1}")


def _uids_of(pid: str) -> tuple[int, ...]:
    """The process's uids (real, effective, saved, fs); none for a zombie, already dead. A
    leader whose own thread exited also reads Z while its other threads run: alive."""
    with open(f"/proc/{pid}/status", "rb") as f:
        return _parse_uids(f.read())


def _parse_uids(status: bytes) -> tuple[int, ...]:
    fields = dict(line.split(b":", 1) for line in status.splitlines() if b":" in line)
    state, threads = fields.get(b"State", b"").split()[:1], fields.get(b"Threads", b"1").strip()
    if state in ([b"Z"], [b"X"]) and threads in (b"", b"0", b"1"):
        return ()
    uids = fields.get(b"Uid", b"").split()
    return tuple(int(x) for x in uids)


def in_range(uid: int) -> bool:
    base, count = uid_range()
    return base <= uid < base + count


_OWN_USERNS = ""


def _ours(pid: str) -> bool:
    """In our user namespace: a container's process that maps to a uid of our range (a
    subuid block) is someone else's, never a run of ours."""
    global _OWN_USERNS
    if not _OWN_USERNS:
        _OWN_USERNS = os.readlink("/proc/self/ns/user")
    return os.readlink(f"/proc/{pid}/ns/user") == _OWN_USERNS


def kill_processes_of(uid: int, timeout: float = 2.0) -> int:
    """SIGKILL every process running as `uid` (a run's own uid, never shared), until none is
    left; the number killed. For runs with neither a pid namespace nor a cgroup to kill
    with: their double-forked daemons would outlive them, under a uid the next run gets."""
    import signal
    import time

    from .proctree import read_through, signal_if

    killed = 0
    deadline = time.monotonic() + timeout
    while True:
        found = 0
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                if uid not in _uids_of(pid) or not _ours(pid):
                    continue
            except (OSError, ValueError):
                continue  # gone meanwhile
            # Through a fd of its /proc directory: the pid is /proc's number, which is not ours
            # where /proc belongs to an ancestor pid namespace (pidfd_open takes ours); its uids
            # read through that fd are that process's, not a new one's with its pid.
            found += signal_if(int(pid), signal.SIGKILL, lambda fd: uid in _parse_uids(read_through(fd, "status")))
        killed += found
        if not found or time.monotonic() > deadline:
            return killed
        time.sleep(0.002)  # a process forking as it dies: its children show up next round


_swept = False


def sweep_orphans() -> int:
    """Once per process: kill what runs as a per-run uid that no supervisor holds (the lock
    is free), left by a supervisor SIGKILLed during a run that had neither a pid namespace
    nor a cgroup (`nested` without one); the number of uids swept. The uid's lock is taken
    while its processes are killed, so a run that gets the uid meanwhile cannot be hit."""
    global _swept
    with _mutex:
        if _swept:
            return 0
        _swept = True
    base, count = uid_range()
    found: set[int] = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                uids = [u for u in _uids_of(pid) if base <= u < base + count]
                if uids and _ours(pid):
                    found.update(uids)
            except OSError:
                pass
    swept = 0
    for uid in sorted(found):
        with _mutex:
            if uid in _in_use:
                continue
        fd = _open_lock_file()
        try:
            fcntl.fcntl(fd, _F_OFD_SETLK, _flock(fcntl.F_WRLCK, uid))
        except OSError:
            os.close(fd)  # a live supervisor's run
            continue
        try:
            kill_processes_of(uid)
            swept += 1
        finally:
            os.close(fd)
    return swept
