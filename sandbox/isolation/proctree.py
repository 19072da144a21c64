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
* each process is signalled through a pidfd, after its parent has been read again through
  that pidfd's process: a pid that an exited process left to an unrelated one is never
  signalled.
"""

from __future__ import annotations

import os
import signal


def _ppid(pid: int) -> int:
    """The parent of `pid` from /proc, or -1 (gone, or unreadable)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read(512)
    except OSError:
        return -1
    rest = data[data.rfind(b")") + 1:].split()  # the name may hold spaces and parentheses
    try:
        return int(rest[1])
    except (IndexError, ValueError):
        return -1


def visible() -> bool:
    """Whether /proc shows this process under its own pid (not so in a pid namespace that
    the mounted /proc does not belong to, such as a rootless fork server's)."""
    try:
        return int(os.readlink("/proc/self")) == os.getpid()
    except (OSError, ValueError):
        return False


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


def signal_tree(root: int, sig: int) -> int:
    """Send `sig` to every descendant of `root`; how many it reached."""
    tree = descendants(root)
    tree.add(root)
    sent = 0
    for pid in sorted(tree - {root}):
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            if _ppid(pid) in tree:  # read after the pidfd was opened: this very process is ours
                signal.pidfd_send_signal(fd, sig)
                sent += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return sent
