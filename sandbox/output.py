"""Capped capture of one output stream.

Up to `cap` bytes are kept; past it, bytes are drained (spliced to /dev/null, no
copy) and counted, never stored, so a flood neither blocks the child nor grows the
supervisor's memory.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

CHUNK = 1 << 16
_devnull = -1


def _null() -> int:
    global _devnull
    if _devnull < 0:
        _devnull = os.open("/dev/null", os.O_WRONLY | os.O_CLOEXEC)
    return _devnull


class Capture:
    def __init__(self, cap: int, on_data: Callable[[bytes], None] | None = None, *,
                 forward_all: bool = False) -> None:
        self.cap = cap
        self.data = bytearray()
        self.total = 0
        self.on_data = on_data
        self.forward_all = forward_all  # on_data sees every byte, past the cap too (session logs)

    @property
    def truncated(self) -> bool:
        return self.total > len(self.data)

    def feed(self, chunk: bytes) -> None:
        """Account for bytes read elsewhere (tests, non-pipe sources)."""
        self.total += len(chunk)
        room = self.cap - len(self.data)
        if room > 0:
            self.data += chunk[:room]
        if self.on_data is not None:
            if self.forward_all:
                self.on_data(chunk)
            elif room > 0:
                self.on_data(chunk[:room])

    def read_from(self, fd: int) -> bool:
        """One read from a non-blocking pipe. False at EOF."""
        room = self.cap - len(self.data)
        if room > 0 or self.forward_all:
            try:
                chunk = os.read(fd, max(CHUNK, min(room, 1 << 20)))
            except BlockingIOError:
                return True
            except OSError:  # EIO: a terminal's slave side is closed
                return False
            if not chunk:
                return False
            self.feed(chunk)
            return True
        try:
            n = os.splice(fd, _null(), 1 << 20, flags=os.SPLICE_F_NONBLOCK)
        except BlockingIOError:
            return True
        except OSError:
            try:
                n = len(os.read(fd, 1 << 20))
            except BlockingIOError:
                return True
        if n == 0:
            return False
        self.total += n
        return True

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")
