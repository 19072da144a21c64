"""Network: a fresh net namespace has only a loopback interface, and it is down.

Bringing it up with one ioctl costs ~0.2 ms; pyroute2 (import ~110 ms, ~4 ms per
run) is kept for real link work, not this.
"""

from __future__ import annotations

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


class ReadyNamespaces:
    """A few fresh network namespaces with loopback up, made ahead of the runs that use them.

    Creating a network namespace is the costliest namespace (~0.6 ms with loopback up).
    A long-lived supervisor makes the next one right after it has started a child, in
    the same thread, while the child sets itself up on another CPU: the run then only
    setns()es into it. unshare(CLONE_NEWNET) changes the calling thread alone, which
    returns to its own namespace at once. Each namespace serves one run and is never
    reused (a used one keeps state: TIME_WAIT sockets, abstract socket names).
    """

    def __init__(self, size: int = 2) -> None:
        import threading

        self.size = size
        self._fds: list[int] = []
        self._lock = threading.Lock()
        self._owner = os.getpid()
        self.broken: str | None = None  # why namespaces are not made ahead here

    def _check_owner(self) -> None:
        if self._owner != os.getpid():  # a forked copy of the caller: the fds are shared, drop them
            for fd in self._fds:
                os.close(fd)
            self._fds.clear()
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

    def refill(self) -> None:
        """Make namespaces until `size` are ready (concurrent runs may each have taken one)."""
        while True:
            with self._lock:
                self._check_owner()
                if self.broken or len(self._fds) >= self.size:
                    return
            if not self._make_one():
                return

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
            except OSError as e:  # never leave the caller's thread cut off from its network
                raise RuntimeError(f"sandboxrun: cannot return this thread to its network namespace: {e}") from e
            finally:
                os.close(here)
        if fd < 0:
            return False
        with self._lock:
            self._fds.append(fd)
        return True
