"""Host paths a run is given: checked once, by the supervisor.

A caller's workdir is bound read-write and, where the filesystem allows, idmapped so that
its owner's files are the run's own. So:

- It must not be, nor contain, a system tree: `cwd="/"` (or `/var`) would hand the run
  /etc/shadow and /var/lib as its own files, writable. Nor a system tree, or a part of one,
  mounted elsewhere (`mount --bind /usr/local /srv/x`): where the directory really is in
  its filesystem (its mount's root, from mountinfo) is compared with where the trees are.
- No component of its path may be a symbolic link. An earlier run can plant one in a
  shared workspace (`ln -s / build`); a later `cwd=".../build"` would then bind whatever it
  points at. The path is opened one component at a time from `/`, each relative to the
  last and never through a link, so a component a concurrent run swaps for a link while
  the check walks cannot redirect it; the child then verifies (device, inode) that what it
  opens by path is the directory the walk ended on.

The same walk checks read-write bind sources, and opens the files the supervisor (perhaps
root) reads for a run: `--stdin-file`, the code runner's script. A planted
`input.txt -> /etc/shadow` would otherwise hand the run the file. And host directories a
run could change (a fresh host workdir, its leftovers in /tmp) are removed by directory
fds, never by path (`remove_tree`).
"""

from __future__ import annotations

import errno
import os
import stat

from .errors import InputError

# Neither these nor anything in them can be a writable workdir or bind.
SYSTEM_TREES = ("/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/boot", "/dev",
                "/proc", "/sys", "/run")
# Not these whole trees (a directory inside one, such as a CI job's workspace under
# /var/lib/jenkins or /root/project, is the caller's choice), nor their ancestors.
SHARED_TREES = ("/var", "/var/lib", "/var/log", "/var/cache", "/var/spool", "/var/tmp", "/opt", "/srv", "/tmp",
                "/root", "/home")


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


class MissingPath(InputError):
    """The path, or a directory on it, does not exist."""


class LinkInPath(InputError):
    """A directory on the path (or the path itself, where that is refused) is a symbolic link."""


class CheckedDir:
    """A directory that passed the checks: its path, and the identity the child verifies."""

    __slots__ = ("path", "dev", "ino", "uid", "gid")

    def __init__(self, path: str, st: os.stat_result) -> None:
        self.path = path
        self.dev, self.ino, self.uid, self.gid = st.st_dev, st.st_ino, st.st_uid, st.st_gid


def _normalised(given: object, what: str) -> tuple[str, str]:
    """(the caller's text, its absolute normalised form); InputError for what is not a path."""
    if not isinstance(given, (str, os.PathLike)):
        raise InputError(f"{what}: expected a path, got {type(given).__name__}")
    text = os.fspath(given)
    if not isinstance(text, str):
        raise InputError(f"{what}: expected a text path, got bytes")
    if not text:
        raise InputError(f"{what}: empty path")
    if "\0" in text:
        raise InputError(f"{what} contains a NUL byte")
    try:
        path = os.path.normpath(os.path.abspath(text))
    except FileNotFoundError:  # os.getcwd(): the directory we were started in was removed
        raise InputError(f"{what}: {text} is relative, and the current directory no longer exists") from None
    return text, "/" + path.lstrip("/")  # normpath keeps a leading "//"


def _refused(message: str, err: int | None) -> InputError:
    e = InputError(message)
    e.errno = err
    return e


def _walk(path: str, text: str, what: str, noun: str = "directory") -> int:
    """An O_PATH fd of `path`, opened one component at a time from `/`, each relative to the
    last and never through a symbolic link."""
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    cur = ""
    try:
        for part in path.split("/")[1:] if path != "/" else ():
            cur = f"{cur}/{part}"
            try:
                nfd = os.open(part, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except FileNotFoundError:
                raise MissingPath(f"{what}: no such {noun}: {text}") from None
            except NotADirectoryError:
                raise InputError(f"{what}: {cur.rsplit('/', 1)[0]} is not a directory") from None
            except OSError as e:
                raise _refused(f"{what}: {cur}: {e.strerror}", e.errno) from None
            os.close(fd)
            fd = nfd
            if stat.S_ISLNK(os.fstat(fd).st_mode):
                raise LinkInPath(
                    f"{what}: {cur} is a symbolic link; a path the sandbox gets from the host may not contain "
                    "one (a run can plant links in its workdir): give the real path")
        return fd
    except BaseException:
        os.close(fd)
        raise


def _unescape(field: str) -> str:
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def _mounts() -> dict[int, tuple[str, str, str]]:
    """mount id -> (device "major:minor", root within its filesystem, mount point)."""
    out = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split(" - ", 1)[0].split()
            out[int(fields[0])] = (fields[2], _unescape(fields[3]), _unescape(fields[4]))
    return out


def filesystem_type(fd: int) -> str | None:
    """The type of the filesystem the file open at `fd` is on ("ext4", "proc"), from its
    mount (fdinfo's mnt_id in mountinfo); None where that cannot be read."""
    try:
        with open(f"/proc/self/fdinfo/{fd}") as f:
            mnt_id = next(line.split()[1] for line in f if line.startswith("mnt_id:"))
        with open("/proc/self/mountinfo") as f:
            for line in f:
                head, _, tail = line.partition(" - ")
                if head.split(" ", 1)[0] == mnt_id:
                    return tail.split()[0]
    except (OSError, StopIteration, IndexError):
        pass
    return None


def _fs_location(fd: int, path: str, mounts: dict[int, tuple[str, str, str]]) -> tuple[str, str] | None:
    """(device, path within its filesystem) of the file open at `fd`, reached as `path`: where
    a bind mount really shows (`mount --bind /usr/local /srv/x`: /srv/x/bin is /usr/local/bin)."""
    try:
        with open(f"/proc/self/fdinfo/{fd}") as f:
            mnt_id = next(int(line.split()[1]) for line in f if line.startswith("mnt_id:"))
        dev, root, point = mounts[mnt_id]
    except (OSError, StopIteration, KeyError, ValueError):
        return None
    if point != "/" and path != point and not path.startswith(point + "/"):
        return None
    rel = path[len(point):] if point != "/" else path
    return dev, os.path.normpath(f"{root}/{rel}").replace("//", "/")


_TREE_LOCATIONS: list[tuple[str, str, str]] = []


def _tree_locations(mounts: dict[int, tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """(name, device, path within its filesystem) of `/` and every system and shared tree."""
    if not _TREE_LOCATIONS:
        for t in ("/", *SYSTEM_TREES, *SHARED_TREES):
            try:
                real = os.path.realpath(t)
                fd = os.open(real, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                loc = _fs_location(fd, real, mounts)
            finally:
                os.close(fd)
            if loc is not None:
                _TREE_LOCATIONS.append((t, *loc))
    return _TREE_LOCATIONS


def _bound_tree_problem(fd: int, path: str) -> str | None:
    """The path rules once more, on where `path` really is in its filesystem: a system tree,
    or a part of one, bind-mounted elsewhere is still that tree."""
    mounts = _mounts()
    loc = _fs_location(fd, path, mounts)
    if loc is None:
        return None
    dev, fs_path = loc
    trees = [(name, tpath) for name, tdev, tpath in _tree_locations(mounts) if tdev == dev]
    for name, tpath in trees:
        if fs_path == tpath:
            return f"{path} is {name}, mounted there"
    for name, tpath in trees:
        if name in SYSTEM_TREES and fs_path.startswith(tpath.rstrip("/") + "/"):
            return f"{path} is in {name}, mounted there"
        if tpath.startswith(fs_path.rstrip("/") + "/"):
            return f"{path} contains {name}, mounted there"
    return None


def _tree_problem(fd: int, path: str) -> str | None:
    return system_tree_problem(path) or own_files_problem(path) or _bound_tree_problem(fd, path)


def default_state_dir() -> str:
    """Where sessions keep their state, unless SANDBOXRUN_STATE_DIR says (sessions.state_dir)."""
    from .isolation.cgroups import caller_uid  # the real caller, also inside the CLI's user namespace

    path = os.environ.get("SANDBOXRUN_STATE_DIR", "")
    if not path:
        if caller_uid() == 0:
            path = "/run/sandboxrun"
        elif os.path.isabs(os.environ.get("XDG_RUNTIME_DIR", "")):
            path = os.path.join(os.environ["XDG_RUNTIME_DIR"], "sandboxrun")
        elif os.path.isabs(os.environ.get("XDG_STATE_HOME", "")):
            path = os.path.join(os.environ["XDG_STATE_HOME"], "sandboxrun")
        elif os.path.isabs(home := os.environ.get("HOME", "")) and home != "/" and os.path.isdir(home):
            # Not the host's /tmp first: runs of a profile without a mount namespace write there.
            path = os.path.join(home, ".local", "state", "sandboxrun")
        else:
            path = f"/tmp/sandboxrun-{caller_uid()}"
    return os.path.abspath(path)


_OWN_MODULES = ("sandbox", "prctl", "_prctl", "pyseccomp", "seccomp", "psutil")
_own_dirs: tuple[tuple[str, ...], tuple[tuple[str, str], ...]] | None = None


def own_dirs() -> tuple[tuple[str, str], ...]:
    """(what, real path) of what later runs trust, which no run may write: a run that could
    would start the next ones itself, outside any sandbox. sandboxrun's code and the modules
    it loads (a plain module names its whole directory: site-packages), its virtual
    environment, its cache (the native stage; compiled seccomp programs and profiles) and the
    sessions' state (whose pids `kill` signals)."""
    global _own_dirs
    import sys

    from .isolation.seccomp import default_cache_dir

    key = (default_cache_dir(), default_state_dir(), sys.prefix,
           *(getattr(sys.modules.get(n), "__file__", None) or "" for n in _OWN_MODULES))
    if _own_dirs is None or _own_dirs[0] != key:
        found = [("cache", key[0]), ("session state directory", key[1]), *_usual_places()]
        if sys.prefix != sys.base_prefix:
            found.append(("virtual environment", sys.prefix))
        found += [("code", os.path.dirname(f)) for f in key[3:] if f]
        _own_dirs = (key, tuple((what, os.path.realpath(d)) for what, d in found))
    return _own_dirs[1]


def _usual_places() -> list[tuple[str, str]]:
    """The cache and state directories of the caller's other invocations: this one's follow
    HOME, XDG_* and SANDBOXRUN_STATE_DIR, which another may not share."""
    import pwd

    from .isolation.cgroups import caller_uid

    uid = caller_uid()
    if uid == 0:
        return [("cache", "/var/cache/sandboxrun"), ("session state directory", "/run/sandboxrun")]
    out = [("session state directory", f"/run/user/{uid}/sandboxrun")]
    try:
        home = pwd.getpwuid(uid).pw_dir
    except KeyError:  # a uid without a passwd entry: no usual home
        return out
    if os.path.isabs(home) and home != "/":
        out += [("cache", os.path.join(home, ".cache", "sandboxrun")),
                ("session state directory", os.path.join(home, ".local", "state", "sandboxrun"))]
    return out


def own_files_problem(path: str, what: str | None = None) -> str | None:
    """Why a run may not write `path` (absolute, link-free), a directory of its or above or
    below it, or None: it holds, or is inside, one of own_dirs()."""
    for label, d in own_dirs():
        if path == d:
            return f"{what or path} is sandboxrun's own {label}, which a run could rewrite to escape later runs"
        if d.startswith(path.rstrip("/") + "/"):
            return f"{what or path} holds sandboxrun's own {label} ({d}), which a run could rewrite to escape later runs"
        if path.startswith(d + "/"):
            return f"{what or path} is inside sandboxrun's own {label} ({d}), which a run must not write"
    return None


def check_writable_dir(given: object, what: str) -> CheckedDir:
    """Check a host directory that a run gets read-write; raise InputError naming `what`."""
    text, path = _normalised(given, what)
    fd = _walk(path, text, what)
    try:
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode):
            raise InputError(f"{what}: not a directory: {text}")
        problem = _tree_problem(fd, path)
    finally:
        os.close(fd)
    if problem:
        raise InputError(f"{what}: {problem}; it cannot be the sandbox's writable directory")
    if not os.access(path, os.X_OK, effective_ids=os.access in os.supports_effective_ids):
        # An unprivileged caller's run has the caller's ids (a root caller's, which may enter
        # any directory, gets it idmapped or chowned).
        raise InputError(f"{what}: {text}: this user may not enter it (no search permission), "
                         "and neither may its run")
    return CheckedDir(path, st)


def check_writable_bind(given: object, what: str) -> os.stat_result:
    """A read-write bind's source: a file or directory, reached without a link, that is not
    (nor holds) a system tree. Its stat (device, inode and owner: the child checks that it
    binds this very file, and idmaps its owner onto the run's ids)."""
    text, path = _normalised(given, what)
    fd = _walk(path, text, what, "file or directory")
    try:
        problem = _tree_problem(fd, path)
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if problem:
        raise InputError(f"{what}: {problem}; it cannot be bound read-write")
    return st


def open_for_reading(given: object, what: str) -> int:
    """Open a host file that the supervisor (perhaps root) reads for a run, without following
    a link anywhere in its path; refuses a directory. A file descriptor, close-on-exec."""
    text, path = _normalised(given, what)
    fd = _walk(path, text, what, "file")
    try:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise InputError(f"{what}: {text}: is a directory")
        try:  # from the O_PATH fd: the file the walk ended on, not whatever the path names now
            return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as e:
            raise InputError(f"{what}: {text}: {e.strerror}") from None
    finally:
        os.close(fd)


def lstat_through_real_dirs(given: str, what: str) -> os.stat_result:
    """lstat of `given` (absolute) whose directories are reached without a link: the last
    component may be one (a view reproduces it as a link, as /bin -> usr/bin), none before it."""
    text, path = _normalised(given, what)
    parent, name = os.path.split(path)
    fd = _walk(parent, text, what, "file or directory")
    try:
        return os.stat(name, dir_fd=fd, follow_symlinks=False) if name else os.fstat(fd)
    except FileNotFoundError:
        raise MissingPath(f"{what}: no such file or directory: {text}") from None
    except OSError as e:
        raise _refused(f"{what}: {text}: {e.strerror}", e.errno) from None
    finally:
        os.close(fd)


def remove_tree(path: str) -> OSError | None:
    """Remove `path` and all in it by directory fds: never through a symbolic link, never
    outside `path`, even while what is in it changes (in a shared /tmp, anyone may try to
    swap a directory for a link mid-way); directories made unreadable are chmod-ed through
    the fd of what was opened, never by path. Without recursion, and with at most
    MAX_OPEN_DEPTH directories open: a run can leave a chain of any depth (`mkdir a; cd a`
    in a loop), and a deeper part is moved up to `path` itself to be removed from there.
    What stopped it (a mount point, a read-only filesystem) is returned, not raised: as much
    as could be removed is."""
    parent, name = os.path.split(os.path.normpath(path))
    try:
        pfd = os.open(parent or "/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        return e
    try:
        top = _open_entry(pfd, name)
        if top is not None:
            try:
                _empty(top)
            finally:
                os.close(top)
            os.rmdir(name, dir_fd=pfd)
    except OSError as e:
        return e
    finally:
        os.close(pfd)
    return None


MAX_OPEN_DEPTH = 64


def _open_entry(dfd: int, name: str) -> int | None:
    """Unlink the entry `name` of `dfd` if it is not a directory (None), else open it (an
    unreadable one is made readable through the fd of what was opened) and return its fd."""
    try:
        os.unlink(name, dir_fd=dfd)  # a file, link, socket...: unlink never follows a link
        return None
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno not in (errno.EISDIR, errno.EPERM):
            raise
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        return None
    except PermissionError:  # made unreadable (chmod 0): open it without reading, fix it, reopen
        pfd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        try:
            os.chmod(f"/proc/self/fd/{pfd}", 0o700)  # that very directory, through its fd
        finally:
            os.close(pfd)
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)


def _listing(fd: int) -> list[str]:
    try:
        return os.listdir(fd)
    except PermissionError:
        os.chmod(f"/proc/self/fd/{fd}", 0o700)
        return os.listdir(fd)


def _empty(top: int) -> None:
    """Remove everything in the directory `top`, depth first, by an explicit stack of
    [fd, names left, name in its parent]; below MAX_OPEN_DEPTH a directory is renamed into
    `top` (inside the tree still) and taken up from there."""
    stack: list[tuple[int, list[str], str]] = [(top, _listing(top), "")]
    moved = 0
    try:
        while stack:
            fd, names, name = stack[-1]
            if not names:
                stack.pop()
                if stack:  # it is empty now: remove it from its parent
                    os.close(fd)
                    try:
                        os.rmdir(name, dir_fd=stack[-1][0])
                    except FileNotFoundError:
                        pass
                continue
            entry = names.pop()
            try:
                sub = _open_entry(fd, entry)
            except PermissionError:  # its directory is read-only to us: open it up
                os.chmod(f"/proc/self/fd/{fd}", 0o700)
                sub = _open_entry(fd, entry)
            if sub is None:
                continue
            if len(stack) < MAX_OPEN_DEPTH:
                try:
                    stack.append((sub, _listing(sub), entry))
                except BaseException:
                    os.close(sub)
                    raise
                continue
            os.close(sub)
            while True:  # too deep to hold open: up into `top`, under a name of its own
                moved += 1
                up = f".sandboxrun-rm-{moved}-{os.urandom(4).hex()}"
                try:
                    os.rename(entry, up, src_dir_fd=fd, dst_dir_fd=top)
                    break
                except OSError as e:  # (a name the run made first)
                    if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                        raise
            stack[0][1].append(up)
    finally:
        for frame in stack[1:]:
            os.close(frame[0])


def only_ours_to_rename(path: str) -> bool:
    """Every component of `path` a directory (not a link) owned by root or us, and writable
    by no one else unless sticky (where others cannot rename what they do not own)."""
    me = os.geteuid()
    parts = [p for p in os.path.normpath(path).split("/") if p]
    for i in range(len(parts) + 1):
        try:
            st = os.lstat("/" + "/".join(parts[:i]))
        except OSError:
            return False
        if not stat.S_ISDIR(st.st_mode) or st.st_uid not in (0, me):
            return False
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return False
    return True
