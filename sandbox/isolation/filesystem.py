"""The private filesystem view, built in the child's new mount namespace.

A tmpfs becomes the root; system directories are bound read-only, nosuid, nodev;
the workdir is bound read-write at a fixed path; /tmp and /dev/shm are size-capped
tmpfs; /proc is fresh (this pid namespace only) with the kernel knobs read-only or
masked as runc does; /dev holds only null, zero, full, random, urandom, tty and a
private devpts (and, for a terminal run, its terminal at /dev/console). Then pivot_root,
detach the old root, and make / read-only.

Bind sources are opened (O_PATH) before anything is hidden and bound through
/proc/self/fd/N, so a symlink swapped in after validation cannot redirect a bind.

The view is described once, as a list of operations (view_ops, template_ops): the
Python child runs them with apply(), the native stage runs the same list (encoded
by native/ops.py).
"""

from __future__ import annotations

import errno
import os
import stat
import time

from ..record import record
from .syscalls import (
    CLONE_NEWNS,
    MNT_DETACH,
    MS_BIND,
    MS_MOVE,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_PRIVATE,
    MS_RDONLY,
    MS_REC,
    MS_REMOUNT,
    idmap_tree,
    mount,
    move_mount,
    open_tree,
    pivot_root,
    setns,
    umount2,
    unshare,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any

MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
# statvfs f_flag bit -> mount flag that must be kept on a bind remount (the kernel
# locks these inside a user namespace; dropping one is EPERM).
_LOCKED_FLAGS = (
    (os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
    (os.ST_RDONLY, MS_RDONLY), (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME),
    (os.ST_RELATIME, MS_RELATIME),
)
PROC_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC
NEW_ROOT = "/tmp"  # any existing directory: the tmpfs over it is private to our mount namespace
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
# pressure: readable, but a trigger written there is a kernel poller the run would leave running
PROC_READONLY = ("sys", "sysrq-trigger", "irq", "bus", "fs", "pressure")
# cmdline and config.gz: the host's boot arguments and build say more than a run needs (and
# a VM's kernel command line can name its control ports)
# locks: every file lock on the host, with its owner's device and inode (the per-run uid
# leases of concurrent runs among them)
PROC_MASKED = ("kcore", "keys", "key-users", "timer_list", "sched_debug", "latency_stats", "acpi", "scsi", "cmdline",
               "config.gz", "locks")
# The run's own devpts instance holds at most this many terminals: the kernel's pool outside
# the host's reserve (kernel.pty.max - kernel.pty.reserve) is shared by every container and run.
MAX_PTYS = 64
# The workdir cannot be idmapped here and belongs to root (who owns the host's files even
# without capabilities) or to a per-run uid (which the next run to get it would share).
NO_ROOT_FALLBACK = ("cannot idmap {} on this filesystem, and it belongs to root or to a per-run uid: the "
                    "command would run as host uid 0 or as another run; give the directory to an unprivileged owner")
# The 'I' operation's third way, for a read-write bind: where the filesystem cannot idmap,
# bind the clone as it is (the run then writes only where the source's modes let any uid).
IDMAP_OR_AS_IS = 2


@record(frozen=True)
class BindSpec:
    """One bind of the view, as the child applies it."""

    source: str
    target: str
    writable: bool
    optional: bool
    # Read-write, cloned for each run and idmapped onto its ids, as the workdir is (not part
    # of a template): what the run writes there belongs to the source's owner.
    per_run: bool = False
    # A caller's bind (profile.Mount.caller), checked to be no link: one that is by now was
    # swapped since (a concurrent run's workdir can hold it) and is refused, never reproduced.
    caller: bool = False


@record(frozen=True)
class ViewSpec:
    """Everything the child needs to build the filesystem view."""

    binds: tuple[BindSpec, ...]
    workdir_host: str  # "" for a fresh workdir: a size-capped tmpfs, nothing on the host disk
    workdir: str  # inside
    tmp_size: int
    shm_size: int
    hostname: str
    passwd: str  # synthetic /etc/passwd and /etc/group lines
    group: str
    workdir_size: int = 256 * 2**20  # the fresh tmpfs workdir's size
    workdir_owner: tuple[int, int] | None = None  # its uid/gid (None: the mounting user)
    workdir_fixed: bool = True  # the same path for every run (not the profile's "same" as the host)
    # (disk uid, run uid, disk gid, run gid): show the caller's workdir as the run's own
    workdir_idmap: tuple[int, int, int, int] | None = None
    # where the filesystem cannot idmap: run as the directory's owner (never root or a per-run uid)
    workdir_fallback: bool = False
    # (st_dev, st_ino) of the caller's workdir as the supervisor checked it: the child refuses
    # a tree that is another directory (a path component swapped for a link since the check)
    workdir_id: tuple[int, int] | None = None
    # a terminal run: its terminal (fd 0, on the host's devpts, which the run's own devpts
    # instance does not show) is bound at /dev/console, where ttyname() finds it
    console: bool = False
    # per bind (as `binds`), for a per_run one: (st_dev, st_ino) of the source as the supervisor
    # checked it, then (disk uid, run uid, disk gid, run gid) to idmap it with, or None where
    # the run has the owner's ids already; None for the others
    bind_ids: tuple[tuple[tuple[int, int], tuple[int, int, int, int] | None] | None, ...] = ()


def _mkpoint(path: str, is_dir: bool) -> None:
    if os.path.lexists(path):
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if is_dir:
        os.mkdir(path, 0o755)
    else:
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o644))


def _write(path: str, text: str, mode: int = 0o644) -> None:
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
    try:
        os.write(fd, text.encode("utf-8", "surrogateescape"))
    finally:
        os.close(fd)


# ------------------------------------------------------------------ the view as operations
#
# One description of the view, run by either child: apply() below (the Python child) or
# the native stage (native/ops.py encodes the same list; stage.c has the same codes).
#
#   q name                            the sub-step that error reports name
#   m source target fstype flags data mount(2); "" is NULL
#   o slot path optional              open(path, O_PATH|O_NOFOLLOW) into a slot (before anything is hidden)
#   b slot target writable device dir bind a slot's fd onto target (made if absent), then remount
#                                     nosuid[,nodev][,ro] keeping the flags a user namespace locks
#   k path mode / K path dir          mkdir / make a mount point (parents too) if absent
#   D path                            makedirs unless a directory is there
#   l to linkpath if_absent           symlink (if_absent: skip an existing one, make parents)
#   w path mode text                  write a file
#   W slot path                       open_tree clone of path
#   V slot path dev ino               the slot must be this file (device, inode), else EXDEV
#   I slot path du ru dg rg fallback  idmap a clone onto the run's ids; where the filesystem cannot:
#                                     run as the owner (fallback 1, reported), refuse (0), or
#                                     leave the clone as it is (2: a read-write bind)
#   M slot target                     move_mount a clone onto target, then nosuid,nodev (locked flags kept)
#   r path / x path null              a /proc entry read-only / masked (if it exists)
#   P root                            pivot_root into root and detach the old root
#   Q root                            the new root the view is built under: until P, no link may be in
#                                     the way of a path below it (it would resolve on the host)
#   e fd nstype / u flags / c path    setns / unshare / chdir
#   X path / v source target / f path umount2(MNT_DETACH) / move a mount (MS_MOVE) / rmdir: a
#                                     rootless run's /proc from a template


class ViewOps:
    """The ordered operations that build a view."""

    def __init__(self) -> None:
        self.ops: list[tuple[Any, ...]] = []
        self.slots = 0

    def op(self, code: str, *args: Any) -> None:
        self.ops.append((code, *args))

    def sub(self, name: str) -> None:
        self.op("q", name)

    def slot(self) -> int:
        self.slots += 1
        return self.slots - 1

    def mount(self, source: str, target: str, fstype: str, flags: int, data: str = "") -> None:
        self.op("m", source, target, fstype, flags, data)


def _open_sources(p: ViewOps, spec: ViewSpec) -> tuple[list[tuple[int | str, BindSpec, bool]], list[tuple[str, int]]]:
    """Open every bind source and device node before anything is hidden. Which sources are
    symlinks (merged /usr: /bin -> usr/bin) is read here, in the host's mount tree."""
    p.sub("mount:open-sources")
    # (slot, symlink text, or None for a per-run bind's mount point; spec; is_dir)
    opened: list[tuple[int | str | None, BindSpec, bool]] = []
    from ..errors import InputError
    from ..hostpaths import MissingPath, lstat_through_real_dirs

    for b in spec.binds:
        try:
            # No link before the last component (one planted in a workspace would pick the
            # source); the child then checks it opened this very file (device, inode).
            st = lstat_through_real_dirs(b.source, f"bind source {b.source}")
            if stat.S_ISLNK(st.st_mode):
                if b.caller:  # only a profile's own links are reproduced (/bin -> usr/bin)
                    raise OSError(errno.ELOOP, f"bind source {b.source} is a symbolic link: it changed after the "
                                  "checks")
                try:
                    opened.append((os.readlink(b.source), b, False))
                except OSError as e:  # (EINVAL: a link no longer)
                    raise OSError(e.errno, f"bind source {b.source} changed after the checks: {e.strerror}") from None
                continue
        except InputError as e:  # gone, or a link, since the profile was checked: a setup failure
            missing = isinstance(e, MissingPath)
            if b.optional and missing:
                continue
            # never a source opened unchecked: it could be reached through a link by then
            raise OSError(errno.ENOENT if missing else e.errno or errno.ELOOP, str(e)) from None  # (EMFILE too)
        if b.per_run:
            opened.append((None, b, stat.S_ISDIR(st.st_mode)))
            continue
        k = p.slot()
        p.op("o", k, b.source, 0)
        p.op("V", k, b.source, st.st_dev, st.st_ino)
        opened.append((k, b, stat.S_ISDIR(st.st_mode)))
    devices = []
    for name in DEVICES:
        k = p.slot()
        p.op("o", k, f"/dev/{name}", 1)
        devices.append((name, k))
    return opened, devices


def _static_part(p: ViewOps, root: str, spec: ViewSpec, opened: list[tuple[int | str | None, BindSpec, bool]],
                 devices: list[tuple[str, int]]) -> None:
    """What is the same for every run of a profile: root tmpfs, binds, /dev nodes, /etc."""
    p.sub("mount:root-tmpfs")
    p.mount("sandboxrun", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=8m")
    p.op("Q", root)  # below it, no link may be in the way until pivot_root
    for d in ("etc", "proc", "dev", "tmp", "run"):
        p.op("k", f"{root}/{d}", 0o755)
    if spec.workdir_fixed:
        p.op("K", root + spec.workdir, 1)
    p.sub("mount:binds")
    ordered = sorted(opened, key=lambda x: x[1].target.count("/"))
    for src, b, is_dir in ordered:
        if src is None:  # each run mounts its own clone here (_per_run_binds)
            p.op("K", root + b.target, is_dir)
        elif not isinstance(src, str):
            p.op("b", src, root + b.target, b.writable, 0, is_dir)
    # Then the sources that are links (merged /usr: /bin -> usr/bin), reproduced as links:
    # last, because until pivot_root a link in the new root resolves on the host, and a
    # mount point made below one would be made there.
    for src, b, _ in ordered:
        if isinstance(src, str):
            p.op("l", src, root + b.target, 1)
    p.sub("mount:dev")
    dev = f"{root}/dev"
    p.mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k")
    # Read-only binds: a device node is still written through (open() of a special file
    # does not take the mount's write access), but its inode, the host's, cannot be chmod-ed
    # or touched.
    for name, k in devices:
        p.op("b", k, f"{dev}/{name}", 0, 1, 0)
    for link, to in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                     ("stderr", "/proc/self/fd/2"), ("ptmx", "pts/ptmx")):
        p.op("l", to, f"{dev}/{link}", 0)
    p.op("k", f"{dev}/shm", 0o1777)
    p.op("k", f"{dev}/pts", 0o755)
    if spec.console:
        p.op("K", f"{dev}/console", 0)  # each run binds its terminal here (its own copy of the mount)
    # Sealed: templates share this tmpfs between runs, so nothing may be added to it
    p.mount("", dev, "", MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    p.sub("mount:etc")
    # passwd and group name the run's uid, so they live in the per-run /run.
    p.op("l", "/run/sandboxrun/passwd", f"{root}/etc/passwd", 0)
    p.op("l", "/run/sandboxrun/group", f"{root}/etc/group", 0)
    p.op("w", f"{root}/etc/hostname", 0o644, spec.hostname + "\n")
    p.op("w", f"{root}/etc/hosts", 0o644, f"127.0.0.1\tlocalhost {spec.hostname}\n::1\tlocalhost ip6-localhost\n")


def _clone(p: ViewOps, path: str, checked: tuple[int, int] | None, idmap: tuple[int, int, int, int] | None,
           fallback: int, what: str) -> int:
    """A detached clone of a host path, checked to be the file the supervisor checked (device,
    inode) and idmapped onto the run's ids when asked (`fallback`: see the 'I' operation).
    `what` (workdir, bind) names the sub-steps, the same through either child."""
    p.sub(f"mount:open-{what}")
    k = p.slot()
    p.op("W", k, path)
    if checked is not None:
        p.op("V", k, path, *checked)
    if idmap is not None:
        p.sub(f"mount:idmap-{what}")
        p.op("I", k, path, *idmap, fallback)
    return k


def _workdir(p: ViewOps, spec: ViewSpec, *, tree: bool, own_ns: bool = False) -> tuple[str, int]:
    """The caller's workdir, opened while the host's mount tree is still visible: a detached
    clone (idmapped onto the run's ids when asked), a plain fd, or nothing (a fresh tmpfs).
    own_ns: a rootless caller may clone a tree only in a mount namespace of its own user
    namespace, so it first takes a private copy of the host's (dropped at the template)."""
    if spec.workdir_idmap is not None or (tree and spec.workdir_host):
        if own_ns:
            p.sub("mount:open-workdir")
            p.op("u", CLONE_NEWNS)
        return "tree", _clone(p, spec.workdir_host, spec.workdir_id, spec.workdir_idmap, int(spec.workdir_fallback),
                              "workdir")
    if spec.workdir_host:
        k = p.slot()
        p.op("o", k, spec.workdir_host, 0)
        if spec.workdir_id is not None:
            p.op("V", k, spec.workdir_host, *spec.workdir_id)
        return "fd", k
    return "tmpfs", -1


def _per_run_binds(p: ViewOps, spec: ViewSpec) -> list[tuple[int, str]]:
    """Each per-run bind's source, cloned while the host's mount tree is visible, checked to
    be the file the supervisor checked, and idmapped onto the run's ids (where the
    filesystem cannot, the clone is bound as it is: the run then writes only where the
    source's modes let any uid). [(slot, target)], to attach in _per_run_part."""
    out = []
    for i, b in enumerate(spec.binds):
        if not b.per_run:
            continue
        ids = spec.bind_ids[i] if i < len(spec.bind_ids) else None
        if ids is None:  # never bound unchecked
            raise ValueError(f"no checked source for the read-write bind at {b.target}")
        out.append((_clone(p, b.source, ids[0], ids[1], IDMAP_OR_AS_IS, "bind"), b.target))
    return out


def _console(p: ViewOps, spec: ViewSpec, *, own_ns: bool = False) -> int:
    """A terminal run's terminal (fd 0) as a detached mount, cloned while the host's mount
    tree is visible; its slot, or -1. The terminal is on the host's devpts, which the run's
    own devpts instance does not show: bound at /dev/console, ttyname() finds it there.
    own_ns: first a private copy of the mount tree (a rootless caller's clone, as _workdir's)."""
    if not spec.console:
        return -1
    if own_ns:
        p.op("u", CLONE_NEWNS)
    k = p.slot()
    p.op("G", k)
    return k


def _per_run_part(p: ViewOps, root: str, spec: ViewSpec, work: tuple[str, int], swap_proc: bool = False,
                  console: int = -1, binds: Sequence[tuple[int, str]] = ()) -> None:
    """What each run gets fresh: /tmp, /run, /dev/shm, /dev/pts, its terminal at /dev/console,
    its read-write binds, the workdir, /proc. swap_proc: a rootless run copied from a template
    replaces the template's /proc (below)."""
    p.sub("mount:tmp")
    p.mount("tmpfs", f"{root}/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={spec.tmp_size}")
    p.mount("tmpfs", f"{root}/run", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0755,size=64k")
    p.op("k", f"{root}/run/sandboxrun", 0o755)
    p.op("w", f"{root}/run/sandboxrun/passwd", 0o644, spec.passwd)
    p.op("w", f"{root}/run/sandboxrun/group", 0o644, spec.group)
    dev = f"{root}/dev"
    p.mount("tmpfs", f"{dev}/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"mode=1777,size={spec.shm_size}")
    p.mount("devpts", f"{dev}/pts", "devpts", MS_NOSUID | MS_NOEXEC, f"newinstance,ptmxmode=0666,mode=0620,max={MAX_PTYS}")
    if console >= 0:
        p.op("j", console, f"{dev}/console")
    if binds:
        p.sub("mount:binds-read-write")
        for k, target in sorted(binds, key=lambda x: x[1].count("/")):
            p.op("M", k, root + target)
    p.sub("mount:workdir")
    target = root + spec.workdir
    p.op("D", target)  # "same": under the fresh /tmp, or in the root before it is sealed
    kind, k = work
    if kind == "tmpfs":
        owner = f",uid={spec.workdir_owner[0]},gid={spec.workdir_owner[1]}" if spec.workdir_owner else ""
        p.mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0700,size={spec.workdir_size}{owner}")
    elif kind == "fd":
        p.op("b", k, target, 1, 0, 1)
    else:
        p.op("M", k, target)
    p.sub("mount:proc")  # before pivot_root: a rootless caller needs a visible /proc to mount one
    proc = f"{root}/proc"
    if swap_proc:
        # In a user namespace the kernel mounts a proc only where a fully visible one is
        # already mounted (mount_too_revealing): the template's own. The run's is mounted
        # beside it, the template's (of the fork server's pid namespace) detached, and the
        # run's moved into its place: nothing of the template's proc is left in the run.
        staging = f"{root}/run/.proc"
        p.op("k", staging, 0o555)
        p.mount("proc", staging, "proc", PROC_FLAGS)
        p.op("X", proc)
        p.op("v", staging, proc)
        p.op("f", staging)
    else:
        p.mount("proc", proc, "proc", PROC_FLAGS)
    for name in PROC_READONLY:
        p.op("r", f"{proc}/{name}")
    for name in PROC_MASKED:
        p.op("x", f"{proc}/{name}", f"{dev}/null")


def _pivot_and_seal(p: ViewOps, root: str) -> None:
    p.sub("pivot_root")
    p.op("P", root)
    p.sub("mount:root-readonly")
    p.mount("", "/", "", MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def view_ops(spec: ViewSpec, template_fd: int = -1, rootless: bool = False) -> ViewOps:
    """The filesystem step in a fresh mount namespace: the whole view, or (template_fd >= 0,
    a prepared template namespace) a private copy of the template plus the per-run mounts.
    rootless: the caller is in a user namespace of its own (the rootless fork server)."""
    p = ViewOps()
    if template_fd >= 0:
        work = _workdir(p, spec, tree=True, own_ns=rootless)
        console = _console(p, spec, own_ns=rootless and work[0] != "tree")  # (_workdir's copy serves)
        binds = _per_run_binds(p, spec)  # (never rootless: a rootless run has the caller's ids)
        p.sub("mount:enter-template")
        p.op("e", template_fd, CLONE_NEWNS)
        p.op("u", CLONE_NEWNS)
        p.op("c", "/")
        _per_run_part(p, "", spec, work, swap_proc=rootless, console=console, binds=binds)
    else:
        p.sub("mount:private")
        p.mount("", "/", "", MS_REC | MS_PRIVATE)
        opened, devices = _open_sources(p, spec)
        work = _workdir(p, spec, tree=False)
        console = _console(p, spec)
        binds = _per_run_binds(p, spec)
        _static_part(p, NEW_ROOT, spec, opened, devices)
        _per_run_part(p, NEW_ROOT, spec, work, console=console, binds=binds)
        _pivot_and_seal(p, NEW_ROOT)
    p.sub("chdir:workdir")  # (else its EACCES is put on the last mount's name)
    p.op("c", spec.workdir)
    return p


def template_ops(spec: ViewSpec, rootless: bool = False) -> ViewOps:
    """A view's static part, pivoted into and sealed, in the caller's fresh mount namespace:
    a template that runs copy instead of rebuilding it. Saves each run the binds, the pivot
    and the detach of the host's mount tree. rootless: the template also holds a proc, which
    a run in a user namespace needs to mount its own (each run swaps it for its own)."""
    p = ViewOps()
    p.mount("", "/", "", MS_REC | MS_PRIVATE)
    opened, devices = _open_sources(p, spec)
    _static_part(p, NEW_ROOT, spec, opened, devices)
    if rootless:
        p.sub("mount:proc")
        p.mount("proc", f"{NEW_ROOT}/proc", "proc", PROC_FLAGS)
    _pivot_and_seal(p, NEW_ROOT)
    return p


# ------------------------------------------------------------------ the Python child runs them


def _clone_terminal() -> int:
    """A detached mount of the terminal at fd 0, found by its path in this mount namespace
    (a mount of another namespace cannot be cloned), checked to be that very terminal."""
    path = os.readlink("/proc/self/fd/0")
    if not path.startswith("/"):
        raise OSError(errno.ENOENT, f"the terminal is not on a path: {path}")
    tree = open_tree(path)
    got, want = os.fstat(tree), os.fstat(0)
    if (got.st_dev, got.st_ino, got.st_rdev) != (want.st_dev, want.st_ino, want.st_rdev):
        os.close(tree)
        raise OSError(errno.EXDEV, f"{path} is not the run's terminal")
    return tree


def _move_tree(tree: int, target: str, *, writable: bool, device: bool = False) -> None:
    """Attach a detached tree (closing its fd), then nosuid, nodev unless a device, read-only
    unless writable, keeping the flags the kernel locks."""
    try:
        move_mount(tree, target)
    finally:
        os.close(tree)
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | (0 if device else MS_NODEV) | (0 if writable else MS_RDONLY)
    _remount(target, flags, os.statvfs(target).f_flag, writable=writable, device=device)


def _bind_fd(fd: int, target: str, *, writable: bool, device: bool = False) -> None:
    mount(f"/proc/self/fd/{fd}", target, None, MS_BIND)
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | (0 if device else MS_NODEV) | (0 if writable else MS_RDONLY)
    _remount(target, flags, os.fstatvfs(fd).f_flag, writable=writable, device=device)


def _remount(target: str, flags: int, keep: int, *, writable: bool, device: bool = False) -> None:
    for st_bit, ms_bit in _LOCKED_FLAGS:
        if keep & st_bit and not (writable and ms_bit == MS_RDONLY) and not (device and ms_bit == MS_NODEV):
            flags |= ms_bit
    mount(None, target, None, flags)


def _idmap(tree: int, ids: Sequence[int]) -> bool:
    """Idmap a detached tree onto the run's ids; False where the filesystem cannot (EINVAL)."""
    from .identity import idmap_userns

    try:
        userns = idmap_userns(*ids)
    except OSError:
        return False
    try:
        idmap_tree(tree, userns)
        return True
    except OSError:
        return False
    finally:
        os.close(userns)


def _no_link_below(root: str, path: str) -> None:
    """While a view is built under its new root (before pivot_root), a link there resolves on
    the host: refuse one in any component of `path` below `root` (as stage.c does)."""
    if not root or not path.startswith(root + "/"):
        return
    cur = root
    for part in path[len(root) + 1:].split("/"):
        cur = f"{cur}/{part}"
        try:
            if stat.S_ISLNK(os.lstat(cur).st_mode):
                raise OSError(errno.ELOOP, f"'{cur}' is a link in the way (until pivot_root it would resolve on "
                                           "the host)")
        except FileNotFoundError:
            return


def apply(view: ViewOps, step: list[str]) -> bool:
    """Run the operations in this process (as stage.c does); `step[0]` names the sub-step
    for error reports. False when the workdir could not be idmapped: the caller then runs
    as the directory's owner."""
    slots: dict[int, int] = {}
    idmapped = True
    root = ""  # the new root while the view is built under it ('Q'), until pivot_root
    try:
        for code, *a in view.ops:
            if code == "q":
                step[0] = a[0]
            elif code == "Q":
                root = a[0]
            elif code == "m":
                _no_link_below(root, a[1])
                mount(a[0] or None, a[1], a[2] or None, a[3], a[4] or None)
            elif code == "o":
                try:
                    slots[a[0]] = os.open(a[1], os.O_PATH | os.O_CLOEXEC | os.O_NOFOLLOW)
                except OSError:
                    if not a[2]:
                        raise
            elif code == "b":
                fd = slots.pop(a[0], -1)
                if fd >= 0:  # else an optional source that was absent
                    try:
                        _no_link_below(root, a[1])
                        _mkpoint(a[1], a[4])
                        _bind_fd(fd, a[1], writable=a[2], device=a[3])
                    finally:
                        os.close(fd)
            elif code == "k":
                os.mkdir(a[0], a[1])
            elif code == "K":
                _no_link_below(root, a[0])
                _mkpoint(a[0], a[1])
            elif code == "G":
                try:
                    slots[a[0]] = _clone_terminal()
                except OSError:
                    pass  # (a terminal this mount namespace does not show): no /dev/console
            elif code == "j":
                tree = slots.pop(a[0], -1)
                if tree >= 0:  # else a terminal this namespace did not show
                    _no_link_below(root, a[1])
                    _move_tree(tree, a[1], writable=False, device=True)
            elif code == "D":
                _no_link_below(root, a[0])
                if not os.path.isdir(a[0]):
                    os.makedirs(a[0], 0o755)
            elif code == "l":
                _no_link_below(root, os.path.dirname(a[1]))  # (the link itself may exist)
                if a[2]:
                    if os.path.lexists(a[1]):
                        continue
                    os.makedirs(os.path.dirname(a[1]), exist_ok=True)
                os.symlink(a[0], a[1])
            elif code == "w":
                _no_link_below(root, a[0])
                _write(a[0], a[2], a[1])
            elif code == "W":
                slots[a[0]] = open_tree(a[1])
            elif code == "V":
                st = os.fstat(slots[a[0]])
                if (st.st_dev, st.st_ino) != (a[2], a[3]):
                    kind = "directory" if stat.S_ISDIR(st.st_mode) else "file"  # a bind source may be either
                    raise OSError(errno.EXDEV, f"{a[1]} is no longer the {kind} that was checked "
                                  "(a path component replaced since)")
            elif code == "I":
                if a[6] == IDMAP_OR_AS_IS:  # a read-write bind: bound as it is where it cannot be,
                    if idmapped:  # or where the run has its workdir owner's ids
                        _idmap(slots[a[0]], a[2:6])
                    continue
                idmapped = _idmap(slots[a[0]], a[2:6])
                if not idmapped and not a[6]:
                    raise OSError(errno.EPERM, NO_ROOT_FALLBACK.format(a[1]))
            elif code == "M":
                _no_link_below(root, a[1])
                _move_tree(slots.pop(a[0]), a[1], writable=True)
            elif code == "r":
                if os.path.exists(a[0]):
                    mount(a[0], a[0], None, MS_BIND | MS_REC)
                    mount(None, a[0], None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
            elif code == "x":
                if os.path.isdir(a[0]):
                    mount("tmpfs", a[0], "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=0")
                elif os.path.exists(a[0]) and os.path.exists(a[1]):
                    mount(a[1], a[0], None, MS_BIND)
            elif code == "P":
                root = ""  # from here on links resolve in the view
                os.chdir(a[0])
                pivot_root(".", ".")  # runc's trick: stack the old root on the new, then detach it
                umount2(".", MNT_DETACH)
                os.chdir("/")
            elif code == "e":
                setns(a[0], a[1])
            elif code == "u":
                unshare(a[0])
            elif code == "c":
                os.chdir(a[0])
            elif code == "X":
                umount2(a[0], MNT_DETACH)
            elif code == "v":
                mount(a[0], a[1], None, MS_MOVE)
            elif code == "f":
                os.rmdir(a[0])
            else:
                raise ValueError(f"unknown view operation {code!r}")
    finally:
        for fd in slots.values():
            os.close(fd)
    return idmapped


def build_view(spec: ViewSpec, step: list[str]) -> bool:
    """Build the whole view in our fresh mount namespace and pivot into it.
    True unless the workdir should have been idmapped and could not be."""
    step[0] = "mount:open-sources"  # (its checks, while the operations are made: a source changed since)
    return apply(view_ops(spec), step)


def build_template(spec: ViewSpec, step: list[str], rootless: bool = False) -> None:
    """A view's static part in the calling process's fresh mount namespace (see template_ops)."""
    apply(template_ops(spec, rootless), step)


def enter_template(template_fd: int, spec: ViewSpec, step: list[str], rootless: bool = False) -> bool:
    """Per run: clone the workdir while still in the host's namespace, switch to a private
    copy of the template, add the per-run mounts. The template's root tmpfs is shared and
    read-only; every writable place is a per-run mount."""
    return apply(view_ops(spec, template_fd, rootless), step)


def template_key(spec: ViewSpec) -> tuple[object, ...] | None:
    """What a template depends on, including the identity of each bind source (a file
    replaced on the host, such as ld.so.cache after an upgrade, must not stay stale).
    None when this view cannot use a template."""
    if not spec.workdir_fixed:
        return None
    now = time.monotonic()
    seen = _template_keys.get(spec.binds)
    if seen is not None and now - seen[1] < TEMPLATE_RECHECK_S:
        ids = seen[0]
    else:
        ids = _source_ids(spec)
        if len(_template_keys) >= 64:
            _template_keys.clear()
        _template_keys[spec.binds] = (ids, now)
    return (spec.binds, spec.hostname, spec.workdir, spec.console, ids)


# A replaced bind source is noticed within this long (lstat of every source on every run
# would cost each run ~15 syscalls).
TEMPLATE_RECHECK_S = 1.0
_template_keys: dict[object, tuple[tuple[object, ...], float]] = {}


def _source_ids(spec: ViewSpec) -> tuple[object, ...]:
    ids = []
    for b in spec.binds:
        try:
            st = os.lstat(b.source)
            ids.append((st.st_dev, st.st_ino, st.st_mode))
        except OSError:
            ids.append(None)
    return tuple(ids)


_binds: dict[object, tuple[BindSpec, ...]] = {}


def view_binds(mounts: Sequence[Any], *, per_run: bool = False, workdir: str = "") -> tuple[BindSpec, ...]:
    """The profile's mounts as binds; the same tuple each time (it is part of cache keys).
    per_run: the read-write ones are each run's own clone, idmapped onto its ids (a root
    caller's per-run uids), except one that holds another bind or the workdir (`workdir`,
    inside): those are mounted below it in the template, which a per-run mount would hide."""
    key = (mounts, per_run, workdir)
    binds = _binds.get(key)
    if binds is None:
        def holds_another(m: Any) -> bool:
            below = m.target.rstrip("/") + "/"
            return workdir.startswith(below) or any(o.target.startswith(below) for o in mounts if o is not m)

        binds = tuple(BindSpec(m.source, m.target, m.writable, m.optional,
                               per_run=per_run and m.writable and not holds_another(m),
                               caller=m.caller) for m in mounts)
        if len(_binds) >= 64:
            _binds.clear()
        _binds[key] = binds
    return binds
