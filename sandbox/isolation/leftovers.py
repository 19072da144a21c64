"""What a run without its own mount and IPC namespaces leaves on the host, removed by uid.

The `nested` profile gives up every namespace: its command writes the host's /tmp,
/var/tmp, /dev/shm and POSIX message queues, and makes SysV IPC objects in the host's
IPC namespace. Each run has its own uid (isolation/uids.py), so after the run (and its
processes) are gone, whatever that uid owns in those places is the run's, and goes: the
next run that gets the uid must find nothing of this one's, and nothing of a run may
outlive it.
"""

from __future__ import annotations

import ctypes
import os

SHARED_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue")
IPC_RMID = 0


def remove_files_of(uid: int, dirs: tuple[str, ...] = SHARED_DIRS) -> int:
    """Remove the entries of `dirs` that `uid` owns (whole trees, by directory fds); the count."""
    from ..hostpaths import remove_tree

    removed = 0
    from ..hostpaths import only_ours_to_rename

    tmpdir = os.environ.get("TMPDIR", "")
    # $TMPDIR only where no one else could swap what is removed for a link to elsewhere.
    extra = (tmpdir,) if tmpdir.startswith("/") and only_ours_to_rename(tmpdir) else ()
    for d in dict.fromkeys(d for d in (*dirs, *extra) if d):
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for e in entries:
            try:
                if e.stat(follow_symlinks=False).st_uid != uid:
                    continue
            except OSError:
                continue
            remove_tree(e.path)
            removed += 1
    return removed


def _ipc_ids(kind: str, uid: int) -> list[int]:
    """Ids of the SysV `kind` (shm, sem, msg) objects that `uid` owns, from /proc/sysvipc."""
    try:
        with open(f"/proc/sysvipc/{kind}") as f:
            header, *rows = f.read().splitlines()
    except OSError:
        return []
    names = header.split()
    id_col = names.index({"shm": "shmid", "sem": "semid", "msg": "msqid"}[kind])
    # the owner, or the creator: IPC_SET can give an object away, never its creator uid
    uid_cols = (names.index("uid"), names.index("cuid"))
    ids = []
    for r in rows:
        f = r.split()
        if f and any(int(f[c]) == uid for c in uid_cols):
            ids.append(int(f[id_col]))
    return ids


def remove_ipc_of(uid: int) -> int:
    """Remove the SysV shared memory, semaphores and queues that `uid` owns; the count.
    (No library wraps shmctl/semctl/msgctl for Python: ctypes, as for mount.)"""
    ids = {kind: _ipc_ids(kind, uid) for kind in ("shm", "sem", "msg")}
    if not any(ids.values()):
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    removed = 0
    for i in ids["shm"]:
        removed += libc.shmctl(i, IPC_RMID, None) == 0
    for i in ids["sem"]:
        removed += libc.semctl(i, 0, IPC_RMID) == 0
    for i in ids["msg"]:
        removed += libc.msgctl(i, IPC_RMID, None) == 0
    return removed
