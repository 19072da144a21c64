"""The caller's input, copied to a command's stdin: what may be copied, and how.

The command only ever holds a pipe of the supervisor's, never the caller's fd (a directory
fd opens the host's tree, a socket reaches its peer, a shared file description carries
O_NONBLOCK and the offset back). A pipe or socket is read by the supervisor's event loop
when it polls ready, never by changing its flags; a regular file, which cannot be polled and
whose read may block for as long as its filesystem takes, by a thread of its own, and what
the command did not read of it is given back at the end (a seek). (stdin_fd, the CLI's
--stdin-file, is the one fd handed over: a regular file open read-only, and only where
Landlock confines the run, see supervisor._check_fd and execute.)
"""

from __future__ import annotations

import _thread
import errno
import fcntl
import os
import select
import stat
import sys

from . import signals
from .errors import InputError


def copyable_input(mode: int) -> bool:
    """What stdin_from takes (and the CLI passes on): a pipe, socket or regular file. Never a
    directory (handed in, a way out of the view); a terminal or device is not copied."""
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stat.S_ISREG(mode)


def write_only(fd: int) -> bool:
    """A file opened for writing only, or a pipe's write end: its reads fail (EBADF), which
    the copy would take as the end of the input, or a pipe's never come (a hang)."""
    return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY


def check_stream(fd: object, what: str = "stdin_from") -> None:
    if not isinstance(fd, int) or isinstance(fd, bool):
        raise InputError(f"{what}: expected a file descriptor, got {type(fd).__name__}")
    try:
        mode = os.fstat(fd).st_mode
    except OSError as e:
        raise InputError(f"{what}: fd {fd}: {e.strerror}") from None
    except OverflowError:  # past a C int: no fd is
        raise InputError(f"{what}: fd {fd}: not an open file descriptor (too large)") from None
    if not copyable_input(mode):
        raise InputError(f"{what}: fd {fd} is not a pipe, a socket or a regular file")
    if write_only(fd):
        raise InputError(f"{what}: fd {fd} is open for writing only (a pipe's write end?): nothing to read")


class StdinSource:
    """The caller's pipe or socket, copied in chunks as the command takes them: the command
    holds only our pipe, never the caller's fd (its flags, offset or peer), and at most one
    chunk (64 KiB) is held here, so a flood waits in the caller's pipe, not in our memory.
    Read without blocking when epoll says so, yet the caller's open file description is never
    changed (O_NONBLOCK set on it reached every holder of the pipe, a shell's next command
    among them, and stayed set when we were killed): by RWF_NOWAIT; where the kernel has none
    for it (a named FIFO), through a description of our own (the same pipe reopened by
    /proc/self/fd, non-blocking); failing that, a read no longer than FIONREAD says is there
    (another reader of the pipe taking those bytes first would then hold the read until more
    come or the pipe ends). A regular file is copied by a thread of its own (`FileCopy`);
    only a process that cannot start one reads it here, where it is always ready (`pollable`
    False)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.eof = False
        self.pollable = not stat.S_ISREG(os.fstat(fd).st_mode)
        self._how = "nowait"
        self._own = -1  # our own non-blocking description of the caller's FIFO

    def read(self) -> memoryview | None:
        """The next chunk; empty at EOF (or on a read error, which ends the input too);
        None when there was nothing after all."""
        try:
            data = self._read() if self.pollable else memoryview(os.read(self.fd, 65536))
        except BlockingIOError:
            return None
        except OSError:
            data = memoryview(b"")
        if not data:
            self.eof = True
        return data

    def _read(self) -> memoryview:
        if self._how == "nowait":
            buf = bytearray(65536)
            try:
                return memoryview(buf)[:os.preadv(self.fd, [buf], -1, os.RWF_NOWAIT)]
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
            self._how = self._fallback()
        if self._how == "own":
            return memoryview(os.read(self._own, 65536))
        n = unread_in(self.fd)
        if n == 0:  # at its end (the read returns at once), or nothing after all
            p = select.poll()
            p.register(self.fd, select.POLLIN | select.POLLRDHUP)
            ready = p.poll(0)
            if not ready or not ready[0][1] & (select.POLLHUP | select.POLLRDHUP | select.POLLERR):
                raise BlockingIOError
            n = 65536
        return memoryview(os.read(self.fd, min(n, 65536)))

    def _fallback(self) -> str:
        if stat.S_ISFIFO(os.fstat(self.fd).st_mode):
            try:
                own = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                return "bounded"
            a, b = os.fstat(own), os.fstat(self.fd)
            if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino):
                self._own = own
                return "own"
            os.close(own)
        return "bounded"

    def close(self) -> None:
        if self._own >= 0:
            os.close(self._own)
            self._own = -1


class FileCopy:
    """The caller's regular file, copied into the command's stdin by a thread. A file cannot
    be polled and its read blocks for as long as its filesystem takes (a hung NFS server: for
    ever), so it is never read in the loop that keeps the run's deadline. The thread reads
    through a dup of the caller's fd (the same open file: the caller's offset moves on as the
    command reads), holds one 64 KiB chunk, and closes the command's end of the pipe at EOF.
    When the run is over (`finish`), what the command did not read (the chunk held, and what
    is still in the pipe, seen through `probe`, a read end of it that is ours) is given back
    to the file: the caller's offset is left where the command stopped reading, as when a
    command reads a file itself (`{ head -n1; head -n1; } < f` gives lines 1 and 2). The run
    waits for it briefly at its end, never longer (a read stuck in its filesystem then gives
    nothing back).

    RuntimeError when no thread can be started: a process that unshared its children's pid
    namespace and could not switch back (the rootless one-shot CLI forking the Python child)
    may not make threads (EINVAL from clone); `stdin_w` and `probe` are then still the caller's."""

    def __init__(self, fd: int, stdin_w: int, probe: int) -> None:
        self._src = os.dup(fd)
        self._dst = stdin_w  # the thread's once it runs: closed by it
        self._probe = probe  # likewise
        try:
            self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)  # closing _stop_w: the run is over
        except BaseException:
            os.close(self._src)
            raise
        self._late = False  # the run has returned: nothing is given back (under _giving)
        self._giving = _thread.allocate_lock()
        self._done = _thread.allocate_lock()
        self._done.acquire()
        try:
            _thread.start_new_thread(self._copy, ())
        except BaseException:
            for fd in (self._src, self._stop_r, self._stop_w):
                os.close(fd)
            raise

    def _over(self, timeout: int | None, writable: bool = False) -> bool:
        """Whether the run is over, waiting up to `timeout` ms (None: for ever) for that, or
        (`writable`) for room in the command's pipe."""
        p = select.poll()
        p.register(self._stop_r, select.POLLIN)
        if writable:
            p.register(self._dst, select.POLLOUT)
        return any(fd == self._stop_r for fd, _ in p.poll(timeout))

    def _copy(self) -> None:
        held = 0  # read from the file, not yet in the pipe
        try:
            try:
                os.set_blocking(self._dst, False)  # our pipe: a full one never keeps us from the end
                while not self._over(0):
                    data = memoryview(os.read(self._src, 65536))
                    held = len(data)
                    if not data:
                        break
                    while data and not self._over(None, writable=True):
                        try:
                            data = data[write_no_sigpipe(self._dst, data):]
                        except BlockingIOError:
                            pass
                        held = len(data)
                    if data:
                        break
            except OSError:  # a read error ends the input; EPIPE: the command is done with it
                pass
            finally:
                os.close(self._dst)  # EOF for the command
            self._over(None)  # only then is what is left in the pipe unread for good
            with self._giving:  # (a give-back never lands after finish() has let the run return)
                if not self._late:
                    give_back(self._src, held, self._probe)
        finally:
            for fd in (self._src, self._probe, self._stop_r):
                os.close(fd)
            self._done.release()

    def finish(self, timeout: float) -> None:
        """The run is over (the command is gone): what it did not read is given back, at once,
        unless a read is stuck in its filesystem (then the thread ends when that read returns,
        and gives nothing back: the caller may be reading the file by then)."""
        os.close(self._stop_w)
        if self._done.acquire(True, timeout):
            self._done.release()
        else:
            with self._giving:  # (a give-back under way ends first: an lseek)
                self._late = True


def unread_in(fd: int) -> int:
    """The bytes waiting in a pipe or socket (FIONREAD: either end of a pipe)."""
    import termios

    return int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, bytes(4)), sys.byteorder, signed=True)


def give_back(fd: int, held: int, probe: int) -> None:
    """Move the caller's file offset back by what the command did not read: `held` bytes read
    but never written to its pipe, and what is still in that pipe. Never fails the run: a file
    that cannot seek keeps its offset."""
    try:
        n = held + unread_in(probe)
        if n > 0:
            os.lseek(fd, -n, os.SEEK_CUR)
    except OSError:
        pass


def write_no_sigpipe(fd: int, data: memoryview) -> int:
    """os.write to the command's stdin that cannot kill the caller: a command that does not
    read its stdin closes the pipe, and a caller (or the program embedding Python) may have
    SIGPIPE at its default. Blocked for this thread while it writes; one raised is taken."""
    old = signals.pthread_sigmask(signals.SIG_BLOCK, {signals.SIGPIPE})
    try:
        return os.write(fd, data)
    except BrokenPipeError:
        if signals.SIGPIPE not in old:
            signals.sigtimedwait({signals.SIGPIPE}, 0)
        raise
    finally:
        if signals.SIGPIPE not in old:
            signals.pthread_sigmask(signals.SIG_SETMASK, old)
