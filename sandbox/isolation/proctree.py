"""A run's processes without a pid namespace: the descendants of its child subreaper.

The `nested` profile has no pid namespace, so `kill(-1)` would reach every process of the
run's uid on the host. Its child (the stage, or the Python child) is the run's child
subreaper instead: every orphan of the run, a double-forked daemon's too, is reparented
to it, so the run's processes are exactly its descendants. This module finds them from
`/proc` and signals them the way stage.c's signal_tree does (the Python child, the
supervisor and the session monitor use it):

* the whole of `/proc` is read first and the tree walked from the root (leaks.py reads
  more of each process, for its reports); zombies are kept in it, since a leader whose own thread exited reads Z while its
  other threads (and its children) run on;
* each process is signalled through a fd of its `/proc/<pid>` directory, which holds that
  very process as a pidfd does (pidfd_send_signal takes either), after its parent has been
  read again through that fd: a pid that an exited process left to an unrelated one is
  never signalled;
* pids are `/proc`'s own numbering, which is not the caller's where `/proc` belongs to an
  ancestor pid namespace (a rootless fork server has one of its own and sees the host's
  `/proc`): `proc_pid()` gives the root there, and a /proc fd, unlike `pidfd_open`, needs
  no pid of the caller's namespace.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable


def _parse_ppid(data: bytes) -> int:
    rest = data[data.rfind(b")") + 1:].split()  # the name may hold spaces and parentheses
    try:
        return int(rest[1])
    except (IndexError, ValueError):
        return -1


def _ppid(pid: int) -> int:
    """The parent of `pid` from /proc, or -1 (gone, or unreadable)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return _parse_ppid(f.read(512))
    except OSError:
        return -1


def proc_pid() -> int | None:
    """This process's pid in /proc's numbering (its own pid, unless /proc belongs to an
    ancestor pid namespace), or None where /proc does not show it at all."""
    try:
        return int(os.readlink("/proc/self"))
    except (OSError, ValueError):
        return None


def descendants(root: int) -> set[int]:
    """Every process below `root` now (zombies included), from one read of /proc."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            ppid = _ppid(int(name))
            if ppid >= 0:
                children.setdefault(ppid, []).append(int(name))
    found: set[int] = set()
    todo = [root]
    while todo:
        for pid in children.get(todo.pop(), ()):
            if pid not in found:
                found.add(pid)
                todo.append(pid)
    return found


def read_through(proc_dir: int, name: str) -> bytes:
    """A file of a process's /proc directory, read through a fd of that directory (so of
    that very process, whatever has its pid since)."""
    fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=proc_dir)
    try:
        data = b""
        while chunk := os.read(fd, 65536):
            data += chunk
        return data
    finally:
        os.close(fd)


def signal_if(pid: int, sig: int, still: Callable[[int], bool]) -> bool:
    """Send `sig` to the process /proc numbers `pid` if `still(fd of its /proc directory)`,
    which reads through that fd: the signal goes through the same fd (pidfd_send_signal takes
    one), so what was checked is what is signalled. Whether it was sent."""
    try:
        fd = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if still(fd):
            signal.pidfd_send_signal(fd, sig)
            return True
    except (OSError, ValueError, IndexError):
        pass
    finally:
        os.close(fd)
    return False


def signal_tree(root: int, sig: int) -> int:
    """Send `sig` to every descendant of `root` (a pid as /proc numbers it); how many it reached."""
    tree = descendants(root)
    tree.add(root)

    def ours(fd: int) -> bool:  # its parent, read through the fd: this very process is still ours
        return _parse_ppid(read_through(fd, "stat")) in tree

    return sum(signal_if(pid, sig, ours) for pid in sorted(tree - {root}))


def tree_usage(root: int) -> tuple[float, float, int]:
    """The CPU time (user, system seconds) of `root` and its descendants now, each with the
    children it has reaped, and the largest peak RSS (VmHWM) among them: what a run's usage
    would lose when its PID 1 is SIGKILLed (the kernel then reaps the rest of its pid
    namespace without adding their time to anyone's). Read just before that kill."""
    tick = os.sysconf("SC_CLK_TCK")
    user = system = peak = 0
    for pid in (root, *descendants(root)):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                data = f.read(2048)
            fields = data[data.rfind(b")") + 1:].split()  # fields[0] is stat's 3rd: utime is its 14th
            user += int(fields[11]) + int(fields[13])  # utime + cutime
            system += int(fields[12]) + int(fields[14])  # stime + cstime
            with open(f"/proc/{pid}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"VmHWM:"):
                        peak = max(peak, int(line.split()[1]) * 1024)
                        break
        except (OSError, ValueError, IndexError):  # gone meanwhile (or a kernel thread's lines)
            continue
    return user / tick, system / tick, peak
