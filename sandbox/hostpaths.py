"""Host directories a run is given read-write: checked once, by the supervisor.

A caller's workdir is bound read-write and, where the filesystem allows, idmapped so that
its owner's files are the run's own. Two things follow:

- It must not be, nor contain, a system tree: `cwd="/"` (or `/var`) would hand the run
  /etc/shadow and /var/lib as its own files, writable.
- No component of its path may be a symbolic link. An earlier run can plant one in a
  shared workspace (`ln -s / build`); a later `cwd=".../build"` would then bind whatever it
  points at. The check walks the path with lstat, and the child verifies that the tree it
  cloned is this directory (device and inode), so a link swapped in after the check is
  refused too.
"""

from __future__ import annotations

import os
import stat

from .errors import InputError

# Neither these nor anything in them can be a writable workdir or bind.
SYSTEM_TREES = ("/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/boot", "/dev",
                "/proc", "/sys", "/run")
# Not these whole trees (a directory inside one, such as a CI job's workspace under
# /var/lib/jenkins or /root/project, is the caller's choice), nor their ancestors.
SHARED_TREES = ("/var", "/var/lib", "/var/log", "/var/cache", "/var/spool", "/opt", "/srv", "/tmp", "/root", "/home")


def system_tree_problem(path: str) -> str | None:
    """Why `path` (absolute, normalised) cannot be given to a run read-write, or None."""
    if path == "/":
        return "/ is the host's root"
    for t in SYSTEM_TREES:
        if path == t or path.startswith(t + "/"):
            return f"{path} is a system directory"
    for t in (*SYSTEM_TREES, *SHARED_TREES):
        if t.startswith(path + "/"):
            return f"{path} contains {t}"
    if path in SHARED_TREES:
        return {"/root": "/root is root's home", "/home": "/home holds every user's home"}.get(
            path, f"{path} is shared by the whole host")
    return None


class CheckedDir:
    """A directory that passed the checks: its path, and the identity the child verifies."""

    __slots__ = ("path", "dev", "ino", "uid", "gid")

    def __init__(self, path: str, st: os.stat_result) -> None:
        self.path = path
        self.dev, self.ino, self.uid, self.gid = st.st_dev, st.st_ino, st.st_uid, st.st_gid


def check_writable_dir(given: object, what: str) -> CheckedDir:
    """Check a host directory that a run gets read-write; raise InputError naming `what`."""
    if not isinstance(given, (str, os.PathLike)):
        raise InputError(f"{what}: expected a path, got {type(given).__name__}")
    text = os.fspath(given)
    if not isinstance(text, str):
        raise InputError(f"{what}: expected a text path, got bytes")
    if not text:
        raise InputError(f"{what}: empty path")
    if "\0" in text:
        raise InputError(f"{what} contains a NUL byte")
    path = os.path.normpath(os.path.abspath(text))
    if path.startswith("//"):
        path = "/" + path.lstrip("/")
    cur = ""
    st = os.lstat("/")
    for part in path.split("/")[1:]:
        cur = f"{cur}/{part}"
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            raise InputError(f"{what}: no such directory: {text}") from None
        except OSError as e:
            raise InputError(f"{what}: {cur}: {e.strerror}") from None
        if stat.S_ISLNK(st.st_mode):
            raise InputError(
                f"{what}: {cur} is a symbolic link; the path of a writable directory may not contain one "
                "(a run can plant links in its workdir): give the real directory")
        if not stat.S_ISDIR(st.st_mode):
            raise InputError(f"{what}: not a directory: {text}")
    problem = system_tree_problem(path)
    if problem:
        raise InputError(f"{what}: {problem}; it cannot be the sandbox's writable directory")
    return CheckedDir(path, st)
