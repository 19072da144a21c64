"""Landlock filesystem rules via raw syscalls (ctypes), applied by the child after no_new_privs.

Landlock is the second line behind the mount namespace: even if a bind mount exposes more than it
should, the process can only touch what the ruleset grants.  Only filesystem rights are handled;
network rights (ABI 4) and scoping (ABI 6) are left to the namespace and seccomp layers.

ctypes is imported on first use, not at import time, to keep this module's import well under 2 ms.
(The child preloads isolation.syscalls, which imports ctypes, so nothing has to be read from disk
after pivot_root.)  ``restrict`` affects the calling thread and its future children: call it from
a single-threaded process such as the forked child.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Sequence
from types import ModuleType

__all__ = ["ACCESS_FILE", "ACCESS_READ_ONLY", "abi_version", "handled_access", "restrict", "scope"]

# Same numbers on x86_64 and aarch64 (and every arch using the generic syscall table).
_SYS_CREATE_RULESET = 444
_SYS_ADD_RULE = 445
_SYS_RESTRICT_SELF = 446

_CREATE_RULESET_VERSION = 1 << 0
_RULE_PATH_BENEATH = 1

# include/uapi/linux/landlock.h
FS_EXECUTE = 1 << 0
FS_WRITE_FILE = 1 << 1
FS_READ_FILE = 1 << 2
FS_READ_DIR = 1 << 3
FS_REMOVE_DIR = 1 << 4
FS_REMOVE_FILE = 1 << 5
FS_MAKE_CHAR = 1 << 6
FS_MAKE_DIR = 1 << 7
FS_MAKE_REG = 1 << 8
FS_MAKE_SOCK = 1 << 9
FS_MAKE_FIFO = 1 << 10
FS_MAKE_BLOCK = 1 << 11
FS_MAKE_SYM = 1 << 12
FS_REFER = 1 << 13  # ABI 2: rename/link across directories
FS_TRUNCATE = 1 << 14  # ABI 3
FS_IOCTL_DEV = 1 << 15  # ABI 5

_ABI1 = (1 << 13) - 1  # the 13 original rights
ACCESS_READ_ONLY = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
# The only rights the kernel accepts on a rule for a non-directory; others there are EINVAL.
ACCESS_FILE = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV


def handled_access(abi: int) -> int:
    """Every filesystem right the given ABI knows.  Later ABIs (6, 7, ...) added no filesystem
    rights, and the kernel rejects rights it does not know, so we stop at what we know."""
    if abi < 1:
        return 0
    rights = _ABI1
    if abi >= 2:
        rights |= FS_REFER
    if abi >= 3:
        rights |= FS_TRUNCATE
    if abi >= 5:
        rights |= FS_IOCTL_DEV
    return rights


_lib: tuple[Callable[..., int], ModuleType, type] | None = None


def _syscall() -> tuple[Callable[..., int], ModuleType, type]:
    """(libc syscall(), the ctypes module, the path_beneath_attr struct type), created once."""
    global _lib
    if _lib is None:
        import ctypes

        class PathBeneathAttr(ctypes.Structure):
            _pack_ = 1  # struct landlock_path_beneath_attr is __attribute__((packed)): 12 bytes
            _fields_ = (("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32))

        fn = ctypes.CDLL(None, use_errno=True).syscall
        fn.restype = ctypes.c_long
        _lib = (fn, ctypes, PathBeneathAttr)
    return _lib


def _fail(what: str, path: str | None = None) -> OSError:
    err = _syscall()[1].get_errno() or errno.EIO
    msg = f"{what}: {os.strerror(err)}"
    return OSError(err, msg, path) if path is not None else OSError(err, msg)


def abi_version() -> int:
    """The kernel's Landlock ABI, or 0 when Landlock is unavailable (not built, disabled at boot, or the
    syscall is refused by a seccomp filter/container runtime with ENOSYS/EPERM)."""
    fn, c, _ = _syscall()
    v = fn(c.c_long(_SYS_CREATE_RULESET), None, c.c_size_t(0), c.c_uint32(_CREATE_RULESET_VERSION))
    if v >= 0:
        return int(v)
    err = c.get_errno()
    if err in (errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
        return 0
    raise OSError(err, f"landlock_create_ruleset(VERSION): {os.strerror(err)}")


def _open_beneath(path: str) -> int | None:
    """O_PATH fd for a rule (symlinks followed: the rule applies to the target), or None if absent."""
    try:
        return os.open(path, os.O_PATH | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None


def restrict(read_only: Sequence[str], read_write: Sequence[str], *, abi: int | None = None) -> int:
    """prepare() then enforce(): see there."""
    rs, use = prepare(read_only, read_write, abi=abi)
    enforce(rs)
    return use


def enforce(rs: int) -> None:
    """Restrict the calling thread (and its future children) to ruleset `rs`, then close it.
    Needs no_new_privs (or CAP_SYS_ADMIN)."""
    fn, c, _ = _syscall()
    try:
        if fn(c.c_long(_SYS_RESTRICT_SELF), c.c_long(rs), c.c_uint32(0)) < 0:
            raise _fail("landlock_restrict_self")
    finally:
        os.close(rs)


SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1  # LANDLOCK_SCOPE_* (ABI 6)


def scope(abi: int) -> bool:
    """Put the caller in a further domain that may signal, and reach abstract unix sockets
    of, only its own processes (ABI 6; False below, where there is nothing to scope). Without
    a pid namespace this is what keeps a run from signalling every other process of its uid.
    Needs no_new_privs (or CAP_SYS_ADMIN)."""
    if abi < 6:
        return False
    fn, c, path_beneath_attr = _syscall()

    class _ScopedAttr(c.Structure):  # struct landlock_ruleset_attr, ABI 6
        _fields_ = [("handled_access_fs", c.c_uint64), ("handled_access_net", c.c_uint64),
                    ("scoped", c.c_uint64)]

    # Every layer denies REFER (rename and link across directories) unless it handles and
    # grants it: this one grants it everywhere, leaving that to the layer above.
    attr = _ScopedAttr(FS_REFER, 0, SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL)
    rs = fn(c.c_long(_SYS_CREATE_RULESET), c.byref(attr), c.c_size_t(c.sizeof(attr)), c.c_uint32(0))
    if rs < 0:
        raise _fail("landlock_create_ruleset (scoped)")
    try:
        root = os.open("/", os.O_PATH | os.O_CLOEXEC)
        try:
            beneath = path_beneath_attr()
            beneath.allowed_access, beneath.parent_fd = FS_REFER, root
            if fn(c.c_long(_SYS_ADD_RULE), c.c_long(rs), c.c_long(_RULE_PATH_BENEATH), c.byref(beneath),
                  c.c_uint32(0)) < 0:
                raise _fail("landlock_add_rule (scoped)", "/")
        finally:
            os.close(root)
    except BaseException:
        os.close(rs)
        raise
    enforce(rs)
    return True


def prepare(read_only: Sequence[str], read_write: Sequence[str], *, abi: int | None = None) -> tuple[int, int]:
    """Allow only ``read_only`` (execute, read files, list dirs) and ``read_write`` (every handled
    right) beneath the given paths; everything else on the filesystem is denied from now on.

    ``abi`` caps the ABI used (the kernel's own ABI is the default and the upper bound).  Paths that do
    not exist are skipped.  The caller must have set no_new_privs (or hold CAP_SYS_ADMIN).  Returns the
    ABI used; raises OSError with the kernel's errno on failure.  With ABI 1 (no REFER right) renames
    and links across directories are always denied (EXDEV), even between read_write paths.

    prepare() only builds the ruleset (returns its fd and the ABI): it opens the rule paths, so
    it can run before a process drops the privileges it needs to reach them; enforce() applies it.
    """
    kernel = abi_version()
    if kernel == 0:
        raise OSError(errno.EOPNOTSUPP, "landlock is not available on this kernel")
    use = kernel if abi is None else min(abi, kernel)
    if use < 1:
        raise ValueError(f"invalid landlock ABI {abi!r}")
    handled = handled_access(use)

    fn, c, path_beneath_attr = _syscall()
    attr = c.c_uint64(handled)  # struct landlock_ruleset_attr up to handled_access_fs (min size)
    rs = fn(c.c_long(_SYS_CREATE_RULESET), c.byref(attr), c.c_size_t(c.sizeof(attr)), c.c_uint32(0))
    if rs < 0:
        raise _fail("landlock_create_ruleset")
    try:
        rules = [(p, ACCESS_READ_ONLY & handled) for p in read_only]
        rules += [(p, handled) for p in read_write]
        beneath = path_beneath_attr()
        for path, access in rules:
            fd = _open_beneath(path)
            if fd is None:
                continue
            try:
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    access &= ACCESS_FILE
                if not access:
                    continue  # the kernel refuses empty rules (ENOMSG)
                beneath.allowed_access = access
                beneath.parent_fd = fd
                r = fn(c.c_long(_SYS_ADD_RULE), c.c_long(rs), c.c_long(_RULE_PATH_BENEATH), c.byref(beneath),
                       c.c_uint32(0))
                if r < 0:
                    raise _fail("landlock_add_rule", path)
            finally:
                os.close(fd)
    except BaseException:
        os.close(rs)
        raise
    return rs, use
