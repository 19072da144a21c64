"""A run's workdir on the host side: the caller's directory (checked once, hostpaths.py), or
a fresh one: a tmpfs the child mounts, or, for a run without a private view, a host
directory made here, given to the run's uid through an fd of the very directory made, and
removed afterwards (or at a later start, if its supervisor was SIGKILLed).
"""

from __future__ import annotations

import errno
import os
import stat

from .errors import InputError
from .hostpaths import CheckedDir, check_writable_dir, only_ours_to_rename, remove_tree
from .isolation import cgroups


class Workdir:
    """The run's workdir: the caller's directory; or a fresh one: a tmpfs the child mounts
    (path ""), or, without a private view, a host directory removed afterwards."""

    def __init__(self, cwd: str | None, *, in_memory: bool) -> None:
        self.fresh = cwd is None
        self.checked: CheckedDir | None = None  # the caller's directory, as checked
        self.fresh_id: tuple[int, int] | None = None  # a fresh host workdir's (dev, ino)
        if cwd is None and in_memory:
            # The child mounts a size-capped tmpfs: a fill-the-disk loop hits ENOSPC, and
            # nothing of the run ever touches the host's disk.
            sweep_stale()  # (what a SIGKILLed caller left: a code runner's script copy, say)
            self.path = ""
        elif cwd is None:
            sweep_stale()
            # The owner's pid in the name lets a later start remove it if we are SIGKILLed.
            self.path, self.fresh_id = mkdtemp()  # with what the child must find there
        else:
            # Not `/` nor a system tree, no symbolic link in its path (hostpaths.py says why).
            self.checked = check_writable_dir(cwd, "cwd")
            self.path = self.checked.path

    def chown(self, uid: int, gid: int) -> None:
        """Give a fresh host workdir to the run's ids: through an fd of the very directory
        made (never by a path a link could have been put at)."""
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != self.fresh_id:
                raise OSError(errno.EXDEV, f"the fresh workdir {self.path} was replaced")
            os.fchown(fd, uid, gid)
        finally:
            os.close(fd)

    def cleanup(self) -> None:
        if self.fresh and self.path:
            remove_tree(self.path)


_swept = False


def tmpdir() -> str:
    """Where fresh host workdirs go: $TMPDIR where no one but root and us could rename
    an entry on its way (a workdir swapped for a link would be chowned and handed to the
    run), else /tmp."""
    d = os.environ.get("TMPDIR", "")
    return os.path.normpath(d) if d.startswith("/") and only_ours_to_rename(d) else "/tmp"


def mkdtemp() -> tuple[str, tuple[int, int]]:
    """A fresh 0700 workdir and its (dev, ino); our pid in the name lets a later start
    remove it if we are SIGKILLed. (tempfile costs ~5 ms to import, which the CLI does not
    want to pay.)"""
    base = tmpdir()
    for _ in range(100):
        path = f"{base}/sandboxrun-{cgroups.owner_tag()}-{os.urandom(6).hex()}"
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        st = os.lstat(path)
        return path, (st.st_dev, st.st_ino)
    raise OSError(17, f"cannot create a workdir under {base}")


def sweep_stale() -> None:
    """Once per process: remove fresh workdirs of supervisors that died (SIGKILL)."""
    global _swept
    if _swept:
        return
    _swept = True
    base = tmpdir()
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in cgroups.gone_owners(names, "sandboxrun-"):
        path = os.path.join(base, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        # Only our own (made by us, then given to a run's uid): in a shared /tmp anyone can
        # make a directory by that name, and removing a tree someone still changes is not a
        # job to do as root.
        if stat.S_ISDIR(st.st_mode) and (st.st_uid == os.geteuid() or run_uid(st.st_uid)):
            remove_tree(path)


def run_uid(uid: int) -> bool:
    """One of the per-run uids (isolation/uids.py), which no one but our runs has."""
    if cgroups.caller_uid() != 0:  # rootless: no per-run uids
        return False
    from .isolation.uids import in_range

    try:
        return in_range(uid)
    except InputError:  # a bad range is reported where a uid is allocated
        return False
