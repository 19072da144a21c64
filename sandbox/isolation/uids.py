"""Per-run host uids for root callers (isolate's model).

Each run gets its own uid from a configurable range, so one sandbox's processes and
files are never another's and RLIMIT_NPROC counts just this run. Allocation is
exclusive across threads (an in-process set) and across processes (an OFD byte-range
lock per uid on one lock file, released automatically if the supervisor dies).
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading

BASE = int(os.environ.get("SANDBOXRUN_UID_BASE", "1100000"))
COUNT = int(os.environ.get("SANDBOXRUN_UID_COUNT", "65536"))
LOCK_FILE = os.environ.get("SANDBOXRUN_UID_LOCK", "/run/sandboxrun/uids.lock")
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)

_in_use: set[int] = set()
_START = int.from_bytes(os.urandom(4), "little") % COUNT  # (random costs 2 ms to import)
_mutex = threading.Lock()


def _flock(kind: int, offset: int) -> bytes:
    return struct.pack("hh4xqqi4x", kind, os.SEEK_SET, offset, 1, 0)


class Lease:
    def __init__(self, uid: int, fd: int) -> None:
        self.uid, self._fd = uid, fd

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # drops the OFD lock
            self._fd = -1
        with _mutex:
            _in_use.discard(self.uid)


def allocate() -> Lease:
    try:
        fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(LOCK_FILE), mode=0o700, exist_ok=True)
        fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    # Each process scans from its own random slot (so processes rarely contend for a lock) and
    # takes the first free one: a process running one command at a time keeps reusing the same
    # uid, whose compiled setup steps are then cached (native/ops.py).
    start = _START
    for i in range(COUNT):
        slot = (start + i) % COUNT
        uid = BASE + slot
        with _mutex:
            if uid in _in_use:
                continue
            _in_use.add(uid)
        try:
            fcntl.fcntl(fd, _F_OFD_SETLK, _flock(fcntl.F_WRLCK, slot))
            return Lease(uid, fd)
        except OSError:
            with _mutex:
                _in_use.discard(uid)
    os.close(fd)
    raise OSError(11, f"no free sandbox uid in {BASE}..{BASE + COUNT - 1}")
