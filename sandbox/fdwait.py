"""Waiting on file descriptors of any number.

`select.select` refuses a fd numbered 1024 or more (FD_SETSIZE): a caller holding more
files than that (a server with many connections) could not start a run. poll(2) has no
such limit. A pidfd polls readable once its process has exited.
"""

from __future__ import annotations

import select

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence


def _ms(timeout: float | None) -> int | None:
    return None if timeout is None else max(0, int(timeout * 1000 + 0.999))  # rounded up: never a busy loop


def readable(fds: Sequence[int], timeout: float | None) -> list[int]:
    """Those of `fds` that are readable, at their end or in error within `timeout` seconds
    (None: however long it takes; 0: now)."""
    p = select.poll()
    for fd in fds:
        p.register(fd, select.POLLIN)
    return [fd for fd, _events in p.poll(_ms(timeout))]


def writable(fd: int, timeout: float | None) -> bool:
    """Whether `fd` takes a write (or is in error) within `timeout` seconds."""
    p = select.poll()
    p.register(fd, select.POLLOUT)
    return bool(p.poll(_ms(timeout)))
