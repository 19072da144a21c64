"""Network: a fresh net namespace has only a loopback interface, and it is down.

Bringing it up by ioctl (read its flags, set IFF_UP) costs ~0.2 ms; pyroute2 (import ~110 ms, ~4 ms per
run) is kept for real link work, not this.
"""

from __future__ import annotations

import _thread
import fcntl
import os
import socket
import struct

SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1


def loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))


# Buckets of each run namespace's own TCP and UDP socket tables (ReadyNamespaces); the
# kernel's minimum for UDP is 128. A sandbox's handful of sockets needs no more.
CHILD_HASH_BUCKETS = 256
CHILD_HASH_TABLES = ("tcp_child_ehash_entries", "udp_child_hash_entries")


_parent: list[int] = []  # [fd] once made; [-1] where it cannot be
_parent_lock = _thread.allocate_lock()


def parent_namespace() -> int:
    """An fd of a network namespace that no run ever enters, in which the kernel's
    tcp_child_ehash_entries and udp_child_hash_entries are small: a namespace made from it
    gets socket hash tables of its own, and tearing that down purges those few buckets
    instead of walking the host's whole TCP table (~0.3 ms a run). Made once per process,
    by a thread that ends at once (so nothing of ours stays in it); -1 where the kernel has
    neither setting (before 6.1) or refuses. Nothing else of it reaches the children, and
    the host's own settings are untouched."""
    if _parent:
        return _parent[0]
    import threading

    made = [-1]

    def make() -> None:
        from .syscalls import CLONE_NEWNET, unshare

        try:
            unshare(CLONE_NEWNET)  # this thread only, which ends next
            written = 0
            for name in CHILD_HASH_TABLES:  # read from the thread's own namespace
                try:
                    with open(f"/proc/sys/net/ipv4/{name}", "w") as f:
                        f.write(str(CHILD_HASH_BUCKETS))
                    written += 1
                except FileNotFoundError:  # 6.1 has the TCP one only (UDP came in 6.2)
                    pass
            if written:
                made[0] = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            pass

    with _parent_lock:
        if not _parent:
            t = threading.Thread(target=make, name="sandboxrun-netns-parent", daemon=True)
            t.start()
            t.join()
            _parent.append(made[0])
    return _parent[0]


class ReadyNamespaces:
    """A few fresh network namespaces with loopback up, made ahead of the runs that use them.

    Creating a network namespace is the costliest namespace (~1 ms with loopback up, and
    as much again for the kernel to tear it down). A long-lived supervisor keeps a few
    ready; the run's stage only setns()es into one. They are made by a thread of ours
    ("sandboxrun-netns"), woken after each spawn: unshare(CLONE_NEWNET) moves that thread
    alone, which returns to its own namespace at once, and being another thread it runs on
    another CPU than the stage it would otherwise slow down. Each namespace serves one run
    and is never reused (a used one keeps state: TIME_WAIT sockets, abstract socket names).

    The thread makes them from parent_namespace(), so that each gets small socket tables of
    its own. A batch (CPU-bound: every CPU busy) does not use them: its stage makes the run's
    namespace from the same parent itself, which spares this thread's Python and its hand-offs.
    """

    def __init__(self, size: int = 2) -> None:
        import threading

        self.size = size
        self._fds: list[int] = []
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._worker: threading.Thread | None = None
        self._stop = False
        self._owner = os.getpid()
        self.broken: str | None = None  # why namespaces are not made ahead here

    def _check_owner(self) -> None:
        if self._owner != os.getpid():  # a forked copy of the caller: the fds are shared, drop them
            for fd in self._fds:
                os.close(fd)
            self._fds.clear()
            self._worker = None  # threads do not survive a fork
            self._owner = os.getpid()

    def take(self) -> int:
        """A ready namespace's fd (the caller owns it), or -1."""
        with self._lock:
            self._check_owner()
            return self._fds.pop() if self._fds else -1

    def fds(self) -> list[int]:
        return list(self._fds)

    def close(self) -> None:
        with self._lock:
            self._check_owner()
            for fd in self._fds:
                os.close(fd)
            self._fds.clear()
            self._stop = True
            self._wake.notify()

    def refill(self) -> None:
        """Have the thread make namespaces until `size` are ready; returns at once."""
        import threading

        with self._lock:
            self._check_owner()
            if self.broken or len(self._fds) >= self.size:
                return
            self._stop = False
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._work, name="sandboxrun-netns", daemon=True)
                self._worker.start()
            self._wake.notify()

    def wait_ready(self, timeout: float = 5.0) -> bool:
        """Until `size` namespaces are ready (or making them is broken); for tests and audits."""
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self.broken or len(self._fds) >= self.size:
                    return True
            time.sleep(0.001)
        return False

    def _work(self) -> None:
        me = os.getpid()
        try:
            self._enter_parent()
        except RuntimeError as e:
            self.broken = str(e)
            return
        while True:
            with self._lock:
                while not self._stop and self._owner == me and not self.broken and len(self._fds) >= self.size:
                    self._wake.wait()
                if self._stop or self._owner != me or self.broken:
                    return
            try:
                if not self._make_one():
                    return
            except RuntimeError as e:  # this thread could not return to its namespace: stop here
                self.broken = str(e)
                return

    def _enter_parent(self) -> None:
        """Move this thread into the parent namespace (parent_namespace); where there is
        none, stay in our own."""
        from .syscalls import CLONE_NEWNET, setns

        parent = parent_namespace()
        if parent >= 0:
            try:
                setns(parent, CLONE_NEWNET)
            except OSError:
                pass  # made from our own namespace then, with the host's socket tables

    def _make_one(self) -> bool:
        from .syscalls import CLONE_NEWNET, setns, unshare

        here = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        fd = -1
        try:
            unshare(CLONE_NEWNET)
        except OSError as e:
            os.close(here)
            self.broken = str(e)  # the run's own unshare reports the cause, if it matters
            return False
        try:
            loopback_up()
            fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            self.broken = str(e)
        finally:
            try:
                setns(here, CLONE_NEWNET)
            except OSError as e:  # never keep making namespaces from inside one
                raise RuntimeError(f"sandboxrun: cannot return this thread to its network namespace: {e}") from e
            finally:
                os.close(here)
        if fd < 0:
            return False
        with self._lock:
            if self._stop:  # closed meanwhile
                os.close(fd)
                return False
            self._fds.append(fd)
        return True
