"""The private filesystem view, built in the child's new mount namespace.

A tmpfs becomes the root; system directories are bound read-only, nosuid, nodev;
the workdir is bound read-write at a fixed path; /tmp and /dev/shm are size-capped
tmpfs; /proc is fresh (this pid namespace only) with the kernel knobs read-only or
masked as runc does; /dev holds only null, zero, full, random, urandom, tty and a
private devpts. Then pivot_root, detach the old root, and make / read-only.

Bind sources are opened (O_PATH) before anything is hidden and bound through
/proc/self/fd/N, so a symlink swapped in after validation cannot redirect a bind.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Sequence

from ..record import record
from .syscalls import (
    CLONE_NEWNS,
    MNT_DETACH,
    MS_BIND,
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

MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
# statvfs f_flag bit -> mount flag that must be kept on a bind remount (the kernel
# locks these inside a user namespace; dropping one is EPERM).
_LOCKED_FLAGS = (
    (os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
    (os.ST_RDONLY, MS_RDONLY), (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME),
    (os.ST_RELATIME, MS_RELATIME),
)
NEW_ROOT = "/tmp"  # any existing directory: the tmpfs over it is private to our mount namespace
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
PROC_READONLY = ("sys", "sysrq-trigger", "irq", "bus", "fs")
PROC_MASKED = ("kcore", "keys", "timer_list", "sched_debug", "latency_stats", "acpi", "scsi")


@record(frozen=True)
class BindSpec:
    """One bind of the view, as the child applies it."""

    source: str
    target: str
    writable: bool
    optional: bool


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


def _opened(path: str) -> int:
    return os.open(path, os.O_PATH | os.O_CLOEXEC | os.O_NOFOLLOW)


def _mkpoint(path: str, is_dir: bool) -> None:
    if os.path.lexists(path):
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if is_dir:
        os.mkdir(path, 0o755)
    else:
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o644))


def _bind_fd(fd: int, target: str, *, writable: bool, device: bool = False) -> None:
    src = f"/proc/self/fd/{fd}"
    mount(src, target, None, MS_BIND)
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | (0 if device else MS_NODEV) | (0 if writable else MS_RDONLY)
    keep = os.fstatvfs(fd).f_flag
    for st_bit, ms_bit in _LOCKED_FLAGS:
        if keep & st_bit and not (writable and ms_bit == MS_RDONLY) and not (device and ms_bit == MS_NODEV):
            flags |= ms_bit
    mount(None, target, None, flags)


def _write(path: str, text: str, mode: int = 0o644) -> None:
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _open_sources(spec: ViewSpec) -> tuple[list[tuple[int | str, BindSpec, bool]], dict[str, int]]:
    """Open every bind source (O_PATH) and device node before anything is hidden."""
    opened: list[tuple[int | str, BindSpec, bool]] = []  # (fd or symlink text, spec, is_dir)
    for b in spec.binds:
        try:
            st = os.lstat(b.source)
        except FileNotFoundError:
            if b.optional:
                continue
            raise
        if stat.S_ISLNK(st.st_mode):
            opened.append((os.readlink(b.source), b, False))
        else:
            opened.append((_opened(b.source), b, stat.S_ISDIR(st.st_mode)))
    dev_fds = {}
    for name in DEVICES:
        try:
            dev_fds[name] = _opened(f"/dev/{name}")
        except OSError:
            pass
    return opened, dev_fds


def _static_part(root: str, spec: ViewSpec, opened: list[tuple[int | str, BindSpec, bool]],
                 dev_fds: dict[str, int], step: list[str]) -> None:
    """What is the same for every run of a profile: root tmpfs, binds, /dev nodes, /etc."""
    step[0] = "mount:root-tmpfs"
    mount("sandboxrun", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=8m")
    for d in ("etc", "proc", "dev", "tmp", "run"):
        os.mkdir(f"{root}/{d}", 0o755)
    if spec.workdir_fixed:
        _mkpoint(root + spec.workdir, True)

    step[0] = "mount:binds"
    for src, b, is_dir in sorted(opened, key=lambda x: x[1].target.count("/")):
        target = root + b.target
        if isinstance(src, str):  # merged-/usr symlinks such as /bin -> usr/bin
            if not os.path.lexists(target):
                os.makedirs(os.path.dirname(target), exist_ok=True)
                os.symlink(src, target)
            continue
        _mkpoint(target, is_dir)
        _bind_fd(src, target, writable=b.writable)
        os.close(src)

    step[0] = "mount:dev"
    dev = f"{root}/dev"
    mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k")
    for name, fd in dev_fds.items():
        _mkpoint(f"{dev}/{name}", False)
        _bind_fd(fd, f"{dev}/{name}", writable=True, device=True)
        os.close(fd)
    for link, to in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                     ("stderr", "/proc/self/fd/2"), ("ptmx", "pts/ptmx")):
        os.symlink(to, f"{dev}/{link}")
    os.mkdir(f"{dev}/shm", 0o1777)
    os.mkdir(f"{dev}/pts", 0o755)

    step[0] = "mount:etc"
    # passwd and group name the run's uid, so they live in the per-run /run.
    os.symlink("/run/sandboxrun/passwd", f"{root}/etc/passwd")
    os.symlink("/run/sandboxrun/group", f"{root}/etc/group")
    _write(f"{root}/etc/hostname", spec.hostname + "\n")
    _write(f"{root}/etc/hosts", f"127.0.0.1\tlocalhost {spec.hostname}\n::1\tlocalhost ip6-localhost\n")


def _per_run_part(root: str, spec: ViewSpec, workdir: tuple[str, int], step: list[str]) -> None:
    """What each run gets fresh: /tmp, /run, /dev/shm, /dev/pts, the workdir, /proc."""
    step[0] = "mount:tmp"
    mount("tmpfs", f"{root}/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={spec.tmp_size}")
    mount("tmpfs", f"{root}/run", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0755,size=64k")
    os.mkdir(f"{root}/run/sandboxrun", 0o755)
    _write(f"{root}/run/sandboxrun/passwd", spec.passwd)
    _write(f"{root}/run/sandboxrun/group", spec.group)
    dev = f"{root}/dev"
    mount("tmpfs", f"{dev}/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"mode=1777,size={spec.shm_size}")
    mount("devpts", f"{dev}/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620")

    step[0] = "mount:workdir"
    target = root + spec.workdir
    if not os.path.isdir(target):
        os.makedirs(target, 0o755)  # "same": under the fresh /tmp, or in the root before it is sealed
    kind, fd = workdir
    if kind == "tmpfs":
        owner = f",uid={spec.workdir_owner[0]},gid={spec.workdir_owner[1]}" if spec.workdir_owner else ""
        mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0700,size={spec.workdir_size}{owner}")
        return _mount_proc(root, step)
    if kind == "fd":
        _bind_fd(fd, target, writable=True)
    else:  # a detached clone of the workdir made before we left the host's mount namespace
        move_mount(fd, target)
        flags = MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV
        keep = os.statvfs(target).f_flag
        for st_bit, ms_bit in _LOCKED_FLAGS:
            if keep & st_bit and ms_bit != MS_RDONLY:
                flags |= ms_bit
        mount(None, target, None, flags)
    os.close(fd)
    _mount_proc(root, step)


def _mount_proc(root: str, step: list[str]) -> None:
    step[0] = "mount:proc"
    dev = f"{root}/dev"
    proc = f"{root}/proc"
    mount("proc", proc, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for name in PROC_READONLY:
        p = f"{proc}/{name}"
        if os.path.exists(p):
            mount(p, p, None, MS_BIND | MS_REC)
            mount(None, p, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    null = f"{dev}/null"
    for name in PROC_MASKED:
        p = f"{proc}/{name}"
        if os.path.isdir(p):
            mount("tmpfs", p, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=0")
        elif os.path.exists(p) and os.path.exists(null):
            mount(null, p, None, MS_BIND)


def _workdir_tree(spec: ViewSpec, step: list[str]) -> tuple[tuple[str, int], bool]:
    """A detached clone of the caller's workdir, idmapped onto the run's uid when asked.
    Returns it and whether the idmap took (a filesystem without idmapped mounts says EINVAL:
    the caller then runs as the directory's owner instead)."""
    step[0] = "mount:open-workdir"
    tree = open_tree(spec.workdir_host)
    if spec.workdir_idmap is None:
        return ("tree", tree), False
    step[0] = "mount:idmap-workdir"
    from .identity import idmap_userns

    try:
        userns = idmap_userns(*spec.workdir_idmap)
    except OSError:
        return ("tree", tree), False
    try:
        idmap_tree(tree, userns)
        return ("tree", tree), True
    except OSError:
        return ("tree", tree), False
    finally:
        os.close(userns)


def _pivot(root: str, step: list[str]) -> None:
    step[0] = "pivot_root"
    os.chdir(root)
    pivot_root(".", ".")  # runc's trick: stack the old root on the new, then detach it
    umount2(".", MNT_DETACH)
    os.chdir("/")


def _seal_root(step: list[str]) -> None:
    step[0] = "mount:root-readonly"
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def build_view(spec: ViewSpec, step: list[str]) -> bool:
    """Build the whole view in our fresh mount namespace and pivot into it.
    `step[0]` names the sub-step for error reports. True when the workdir is idmapped."""
    step[0] = "mount:private"
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    step[0] = "mount:open-sources"
    opened, dev_fds = _open_sources(spec)
    work: tuple[str, int] = ("tmpfs", -1)
    idmapped = False
    if spec.workdir_idmap is not None:
        work, idmapped = _workdir_tree(spec, step)
    elif spec.workdir_host:
        work = ("fd", os.open(spec.workdir_host, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
    _static_part(NEW_ROOT, spec, opened, dev_fds, step)
    _per_run_part(NEW_ROOT, spec, work, step)  # /proc before pivot: rootless needs a visible one
    _pivot(NEW_ROOT, step)
    _seal_root(step)
    os.chdir(spec.workdir)
    return idmapped


def build_template(spec: ViewSpec, step: list[str]) -> None:
    """The static part of a view, pivoted into and sealed, in the calling process's fresh
    mount namespace: a template that runs copy (enter_template) instead of rebuilding it.
    Saves each run the binds, the pivot and the detach of the host's mount tree."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    opened, dev_fds = _open_sources(spec)
    _static_part(NEW_ROOT, spec, opened, dev_fds, step)
    _pivot(NEW_ROOT, step)
    _seal_root(step)


def enter_template(template_fd: int, spec: ViewSpec, step: list[str]) -> bool:
    """Per run: clone the workdir while still in the host's namespace, switch to a private
    copy of the template, add the per-run mounts. The template's root tmpfs is shared and
    read-only; every writable place is a per-run mount."""
    work: tuple[str, int] = ("tmpfs", -1)
    idmapped = False
    if spec.workdir_host:
        work, idmapped = _workdir_tree(spec, step)
    step[0] = "mount:enter-template"
    setns(template_fd, CLONE_NEWNS)
    unshare(CLONE_NEWNS)
    os.chdir("/")
    if not os.path.isdir(spec.workdir):
        raise OSError(2, f"the template has no mount point for {spec.workdir}")
    _per_run_part("", spec, work, step)
    os.chdir(spec.workdir)
    return idmapped


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
    return (spec.binds, spec.hostname, spec.workdir, ids)


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


def view_binds(mounts: Sequence[object]) -> tuple[BindSpec, ...]:
    """The profile's mounts as binds; the same tuple each time (it is part of cache keys)."""
    binds = _binds.get(mounts)
    if binds is None:
        binds = tuple(BindSpec(m.source, m.target, m.writable, m.optional) for m in mounts)  # type: ignore[attr-defined]
        if len(_binds) >= 64:
            _binds.clear()
        _binds[mounts] = binds
    return binds
