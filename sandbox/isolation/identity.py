"""Who the command runs as, and with which privileges: none.

Root callers: a real host uid per run (isolate's model), so concurrent runs never
share a uid and RLIMIT_NPROC means something. Rootless callers: the fork side
already lives in a user namespace where it is root (mapped to the caller); here the
child enters one more user namespace that maps the sandbox uid onto it, so the
command is not uid 0 even inside.

Then the bounding set is emptied, every capability set cleared and no_new_privs set:
exec can never gain a privilege back (setuid binaries, file capabilities).
"""

from __future__ import annotations

import os

import prctl

from .syscalls import CLONE_NEWUSER, unshare


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def enter_user_namespace(inside_uid: int, inside_gid: int) -> None:
    """unshare(CLONE_NEWUSER) and map one uid/gid onto our current ones."""
    uid, gid = os.geteuid(), os.getegid()
    unshare(CLONE_NEWUSER)
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{inside_uid} {uid} 1\n")
    _write("/proc/self/gid_map", f"{inside_gid} {gid} 1\n")


def idmap_userns(disk_uid: int, run_uid: int, disk_gid: int, run_gid: int) -> int:
    """An fd of a user namespace mapping disk ids onto the run's (for an idmapped mount):
    files the disk says belong to disk_uid appear as run_uid's, and what run_uid creates is
    stored as disk_uid's. Needs CAP_SETUID/CAP_SETGID (root). A user namespace only lives in
    a process: a helper child makes it, we write its maps, keep an fd, and let it go."""
    r, w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            unshare(CLONE_NEWUSER)
            # Our pid as the mounted /proc knows it (the caller may be in a newer pid namespace).
            os.write(w, os.readlink("/proc/self").encode() + b"\n")
            os.read(w, 1)  # blocks (on our own write end) until killed
        finally:
            os._exit(0)
    os.close(w)
    try:
        seen = os.read(r, 64).strip()
        if not seen.isdigit():
            raise OSError(1, "the helper could not create a user namespace")
        proc = f"/proc/{seen.decode()}"
        _write(f"{proc}/uid_map", f"{disk_uid} {run_uid} 1\n")
        _write(f"{proc}/gid_map", f"{disk_gid} {run_gid} 1\n")
        return os.open(f"{proc}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(r)
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def drop_bounding_set(best_effort: bool = False) -> None:
    """Empty the bounding set (needs CAP_SETPCAP; `best_effort` for callers that lack it)."""
    try:
        prctl.capbset.limit()
    except OSError:
        if not best_effort:
            raise


def become(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)


def clear_capabilities() -> None:
    # Explicit even after setuid: securebits (NO_SETUID_FIXUP) or uid 0 keep them otherwise.
    # Clearing permitted also empties the ambient set.
    prctl.cap_inheritable.limit()
    prctl.cap_effective.limit()
    prctl.cap_permitted.limit()


def no_new_privs() -> None:
    prctl.set_no_new_privs(1)
    # Not dumpable: a process of the same uid cannot open our /proc/<pid>/mem.
    prctl.set_dumpable(0)
