"""The caller's input, copied to a command's stdin: what may be copied, and how.

The command only ever holds a pipe of the supervisor's, never the caller's fd (a directory
fd opens the host's tree, a socket reaches its peer, a shared file description carries
O_NONBLOCK and the offset back). A pipe or socket is read by the supervisor's event loop
when it polls ready; a regular file, which cannot be polled and whose read may block for as
long as its filesystem takes, by a thread of its own.
"""

from __future__ import annotations

import _thread
import fcntl
import os
import stat

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
    if not copyable_input(mode):
        raise InputError(f"{what}: fd {fd} is not a pipe, a socket or a regular file")
    if write_only(fd):
        raise InputError(f"{what}: fd {fd} is open for writing only (a pipe's write end?): nothing to read")


class StdinSource:
    """The caller's pipe or socket, copied in chunks as the command takes them: the command
    holds only our pipe, never the caller's fd (its flags, offset or peer), and at most one
    chunk (64 KiB) is held here, so a flood waits in the caller's pipe, not in our memory.
    Read non-blocking when epoll says so; its file status flags are the caller's again after
    the run. A regular file is copied by a thread of its own (`FileCopy`); only a process that
    cannot start one reads it here, where it is always ready (`pollable` False)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.eof = False
        self.pollable = not stat.S_ISREG(os.fstat(fd).st_mode)
        self._flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        if self.pollable:
            fcntl.fcntl(fd, fcntl.F_SETFL, self._flags | os.O_NONBLOCK)

    def read(self) -> memoryview | None:
        """The next chunk; empty at EOF (or on a read error, which ends the input too);
        None when there was nothing after all."""
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return None
        except OSError:
            data = b""
        if not data:
            self.eof = True
        return memoryview(data)

    def restore(self) -> None:
        if not self.pollable:
            return
        try:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, self._flags)
        except OSError:
            pass


class FileCopy:
    """The caller's regular file, copied into the command's stdin by a thread. A file cannot
    be polled and its read blocks for as long as its filesystem takes (a hung NFS server: for
    ever), so it is never read in the loop that keeps the run's deadline. The thread reads
    through a dup of the caller's fd (the same open file: the caller's offset moves on as the
    command reads), holds one 64 KiB chunk, and ends at EOF or when the command's end of the
    pipe is gone (the run is over). The run waits for it briefly at its end, never longer.

    RuntimeError when no thread can be started: a process that unshared its children's pid
    namespace and could not switch back (the rootless one-shot CLI forking the Python child)
    may not make threads (EINVAL from clone); `stdin_w` is then still the caller's."""

    def __init__(self, fd: int, stdin_w: int) -> None:
        self._src = os.dup(fd)
        self._dst = stdin_w  # the thread's once it runs: closed by it
        self._done = _thread.allocate_lock()
        self._done.acquire()
        try:
            _thread.start_new_thread(self._copy, ())
        except BaseException:
            os.close(self._src)
            raise

    def _copy(self) -> None:
        try:
            while True:
                data = memoryview(os.read(self._src, 65536))
                if not data:
                    return
                while data:
                    data = data[write_no_sigpipe(self._dst, data):]
        except OSError:  # a read error ends the input; EPIPE: the command is done with it
            pass
        finally:
            os.close(self._dst)  # EOF for the command
            os.close(self._src)
            self._done.release()

    def wait(self, timeout: float) -> None:
        """Until the copy has ended: at once when the command read it all or is gone, unless
        a read is stuck in its filesystem (then the thread ends when that read returns)."""
        if self._done.acquire(True, timeout):
            self._done.release()


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
