"""Thin ctypes facade for the syscalls no library wraps on Python 3.11.

mount, umount2, pivot_root, unshare and setns. Everything raises OSError with the
kernel's errno so the child can report `step + errno` to the supervisor.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import ModuleType

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

NAMESPACE_FLAGS = {
    "user": CLONE_NEWUSER,
    "pid": CLONE_NEWPID,
    "mount": CLONE_NEWNS,
    "net": CLONE_NEWNET,
    "ipc": CLONE_NEWIPC,
    "uts": CLONE_NEWUTS,
    "cgroup": CLONE_NEWCGROUP,
}

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_MOVE = 8192
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19
MNT_DETACH = 2

_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(os.uname().machine, 155)
_SYS_OPEN_TREE = 428  # same number on every architecture (new syscalls are unified)
_SYS_MOVE_MOUNT = 429
OPEN_TREE_CLONE = 1
AT_FDCWD = -100
AT_EMPTY_PATH = 0x1000
MOVE_MOUNT_F_EMPTY_PATH = 0x4

_lib: tuple[object, ModuleType] | None = None


def _c() -> tuple[object, ModuleType]:
    """(libc, ctypes), loaded on first use: ctypes costs ~3.5 ms to import, and a run through
    the native stage never needs it. (The Python child's preload calls this before any fork.)"""
    global _lib
    if _lib is None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
        libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)
        libc.unshare.argtypes = (ctypes.c_int,)
        libc.setns.argtypes = (ctypes.c_int, ctypes.c_int)
        _lib = (libc, ctypes)
    return _lib


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = _c()[1].get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _b(s: str | None) -> bytes | None:
    return None if s is None else os.fsencode(s)


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_c()[0].mount(_b(source), _b(target), _b(fstype), flags, _b(data)), f"mount {target}")


def umount2(target: str, flags: int = 0) -> None:
    _check(_c()[0].umount2(_b(target), flags), f"umount {target}")


def pivot_root(new_root: str, put_old: str) -> None:
    _check(_c()[0].syscall(_SYS_PIVOT_ROOT, _b(new_root), _b(put_old)), "pivot_root")


_SYS_RT_SIGPROCMASK = {"x86_64": 14, "aarch64": 135}.get(os.uname().machine, 14)
_SIG_BLOCK = 0


def block_libc_signals() -> None:
    """Block signals 32 and 33 too, which glibc keeps for itself and refuses to block (Python's
    pthread_sigmask goes through it): the raw syscall, on the kernel's 64-bit mask."""
    libc, ctypes = _c()
    mask = ctypes.c_uint64((1 << 31) | (1 << 32))
    _check(libc.syscall(_SYS_RT_SIGPROCMASK, _SIG_BLOCK, ctypes.byref(mask), None, 8), "rt_sigprocmask")


_SYS_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}.get(os.uname().machine, 251)


def reset_io_priority() -> None:
    """The default I/O class and level (a caller's `ionice -c1`, real-time, is not the run's)."""
    _c()[0].syscall(_SYS_IOPRIO_SET, 1, 0, 0)  # IOPRIO_WHO_PROCESS, ourselves, none


def _unshare_by_ctypes(flags: int) -> None:
    _check(_c()[0].unshare(flags), "unshare")


def _setns_by_ctypes(fd: int, nstype: int = 0) -> None:
    _check(_c()[0].setns(fd, nstype), "setns")


# Python >= 3.12 has both in os: no ctypes to load.
unshare = getattr(os, "unshare", _unshare_by_ctypes)
setns = getattr(os, "setns", _setns_by_ctypes)


def open_tree(path: str) -> int:
    """A detached copy of the mount at `path` (OPEN_TREE_CLONE), attachable in another
    mount namespace with move_mount. Returns a close-on-exec fd."""
    libc, ctypes = _c()
    fd = libc.syscall(_SYS_OPEN_TREE, ctypes.c_int(AT_FDCWD), _b(path),  # type: ignore[attr-defined]
                      ctypes.c_uint(OPEN_TREE_CLONE | os.O_CLOEXEC))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"open_tree {path}: {os.strerror(err)}")
    return fd


_SYS_MOUNT_SETATTR = 442
MOUNT_ATTR_IDMAP = 0x00100000


def idmap_tree(tree_fd: int, userns_fd: int) -> None:
    """Make a detached mount (open_tree clone) show ids through a user namespace's maps."""
    libc, ctypes = _c()

    class _MountAttr(ctypes.Structure):
        _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                    ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]

    attr = _MountAttr(MOUNT_ATTR_IDMAP, 0, 0, userns_fd)
    _check(libc.syscall(_SYS_MOUNT_SETATTR, ctypes.c_int(tree_fd), b"", ctypes.c_uint(AT_EMPTY_PATH),
                         ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr))), "mount_setattr(idmap)")


def move_mount(fd: int, target: str) -> None:
    libc, ctypes = _c()
    _check(libc.syscall(_SYS_MOVE_MOUNT, ctypes.c_int(fd), b"", ctypes.c_int(AT_FDCWD), _b(target),
                         ctypes.c_uint(MOVE_MOUNT_F_EMPTY_PATH)), f"move_mount {target}")
