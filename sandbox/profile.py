"""Isolation profiles: declarative TOML, validated into a frozen Profile.

A profile says what a run may do. Files live in `profiles/` (shipped with the
package) or anywhere on disk; `extends = "strict"` inherits: tables merge key by
key, lists (binds, env_passthrough, filter patterns) are appended to the
parent's, scalars replace. Every error names the file, the key and the value.
"""

from __future__ import annotations

import errno
import os
import stat

from . import record as records
from .errors import InputError, ProfileError
from .record import field, record
from .units import format_size, parse_duration, parse_size

TYPE_CHECKING = False  # typing costs ~5 ms to import; annotations here are strings anyway
if TYPE_CHECKING:
    from typing import Any

# Paths are plain strings (os.path): pathlib costs the CLI ~4 ms to import.
BUILTIN_DIR = os.path.join(os.path.dirname(os.path.realpath(__file__)), "profiles")
NAMESPACES = ("pid", "mount", "net", "ipc", "uts", "cgroup")
NETWORK_MODES = ("none", "host")
REQUIREMENT = ("required", "optional", "off")
OUTPUT_OVERFLOW = ("drain", "kill")  # limits.output_overflow

# schema: table -> {key: kind}; kinds are checked by _coerce.
_SCHEMA: dict[str, dict[str, str]] = {
    "": {"name": "str", "description": "str", "extends": "str"},
    "limits": {
        "timeout": "duration", "kill_grace": "duration", "cpu_time": "duration",
        "memory": "size", "address_space": "size", "processes": "count", "file_size": "size",
        "open_files": "count", "cpus": "float", "output": "size", "tmp_size": "size",
        "shm_size": "size", "log_size": "size", "allow_no_timeout": "bool", "max_timeout": "duration",
        "workdir_size": "size", "output_overflow": "overflow",
    },
    "filesystem": {
        "view": "str", "ro_bind": "binds", "ro_bind_try": "binds", "bind": "binds", "workdir": "str",
    },
    "network": {"mode": "str"},
    "process": {"hostname": "str", "env": "env", "env_passthrough": "strlist"},
    "security": {
        "namespaces": "strlist", "seccomp": "str", "landlock": "str", "cgroup": "str",
    },
    "filter": {"blocklist": "bool", "block": "strlist", "allow": "strlist", "scan": "strlist"},
}
_APPEND_LISTS = {("filesystem", "ro_bind"), ("filesystem", "ro_bind_try"), ("filesystem", "bind"),
                 ("process", "env_passthrough"), ("filter", "block"), ("filter", "allow"), ("filter", "scan")}


@record(frozen=True)
class Mount:
    """A bind mount: a host path seen at a path inside the sandbox."""

    source: str  # absolute host path
    target: str  # absolute path inside the sandbox
    writable: bool = False
    optional: bool = False  # skipped when the source does not exist
    # A caller's bind (--bind, --ro-bind, bind=, ro_bind=), checked to be no link where it was
    # taken (with_overrides): the view refuses its source if it is one by then, where a
    # profile's own link (/bin -> usr/bin) is reproduced.
    caller: bool = False


@record(frozen=True)
class Limits:
    """Resource limits of a run (bytes, seconds, counts; None is unlimited)."""

    timeout: float | None = 30.0  # wall clock; None only when allow_no_timeout
    kill_grace: float = 1.0
    cpu_time: float | None = 30.0  # RLIMIT_CPU seconds
    memory: int | None = 512 * 2**20  # cgroup memory limit
    address_space: int | None = 4 * 2**30  # RLIMIT_AS
    processes: int | None = 64  # cgroup pids.max and RLIMIT_NPROC
    file_size: int | None = 64 * 2**20  # RLIMIT_FSIZE
    open_files: int | None = 256  # RLIMIT_NOFILE
    cpus: float | None = 1.0  # cgroup CPU quota in cores; 0 or "unlimited" (in a file or an override): no quota
    output: int = 2**20  # per stream
    output_overflow: str = "drain"  # past `output`: "drain" (count, discard, run on) or "kill" the run
    tmp_size: int = 64 * 2**20
    workdir_size: int = 256 * 2**20  # the fresh workdir (a tmpfs) when no cwd is given
    shm_size: int = 16 * 2**20
    log_size: int = 8 * 2**20  # background session logs
    allow_no_timeout: bool = False
    max_timeout: float | None = None  # cap on a caller's timeout


@record(frozen=True)
class Profile:
    """A validated isolation profile: what a run may do."""

    name: str
    description: str = ""
    source: str = ""
    limits: Limits = field(default_factory=Limits)
    view: str = "private"  # "private": tmpfs root + binds + pivot_root; "host": no mount namespace
    mounts: tuple[Mount, ...] = ()
    workdir: str = "/work"  # where the workdir appears inside; "same" = at its host path
    network: str = "none"
    hostname: str = "sandbox"
    env: tuple[tuple[str, str], ...] = ()
    env_passthrough: tuple[str, ...] = ()
    namespaces: tuple[str, ...] = NAMESPACES
    seccomp: str = "default"
    landlock: str = "optional"
    cgroup: str = "required"
    # The limits asked for by the caller (memory, cpus) that only a cgroup enforces: they make
    # an optional cgroup required, for a run never silently goes without a limit it was given.
    cgroup_needed_by: tuple[str, ...] = ()
    blocklist: bool = True
    block: tuple[str, ...] = ()
    allow: tuple[str, ...] = ()
    scan: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = records.asdict(self)
        if not self.cgroup_needed_by:  # (set by overrides only: no profile file says it)
            del d["cgroup_needed_by"]
        for m in d["mounts"]:
            if not m["caller"]:  # (likewise)
                del m["caller"]
        d["env"] = dict(self.env)
        lim = d["limits"]
        for k in ("memory", "address_space", "file_size", "output", "tmp_size", "shm_size", "log_size",
                  "workdir_size"):
            lim[k] = format_size(lim[k])
        return d


# ---------------------------------------------------------------------------- loading


def builtin_names() -> list[str]:
    return sorted(n.removesuffix(".toml") for n in os.listdir(BUILTIN_DIR) if n.endswith(".toml"))


def _normal(p: str) -> str:
    """`p` as pathlib writes it: no empty or "." components, no trailing slash ("..", kept)."""
    parts = [c for c in p.split("/") if c and c != "."]
    return ("/" if p.startswith("/") else "") + "/".join(parts) or ("/" if p.startswith("/") else ".")


def _stem(p: str) -> str:
    return os.path.splitext(os.path.basename(p))[0]


def _search_dirs() -> list[str]:
    extra = [_normal(p) for p in os.environ.get("SANDBOXRUN_PROFILE_PATH", "").split(":") if p]
    return [*extra, BUILTIN_DIR]


def _not_a_file(p: str) -> str | None:
    """None if `p` is a regular file, else why not. Never raises: a name too long, a search
    dir we may not enter or a name that is no valid file name is a reason, not a crash."""
    try:
        st = os.stat(p)
    except OSError as e:
        return "no such profile file" if e.errno in (errno.ENOENT, errno.ENOTDIR) else f"cannot read: {e.strerror}"
    except ValueError:  # a lone surrogate: no file can have this name
        return "no such profile file (not a valid file name)"
    if stat.S_ISREG(st.st_mode):
        return None
    return "is a directory, not a profile file" if stat.S_ISDIR(st.st_mode) else "not a regular file"


def resolve_path(ref: str, relative_to: str | None = None) -> str:
    """A profile name ("strict") or a path ("./my.toml") to a file path."""
    if "\0" in ref:
        raise ProfileError("profile name contains a NUL byte", key="profile", value=ref)
    if "/" in ref or ref.endswith(".toml"):
        p = _normal(ref)
        if not p.startswith("/") and relative_to is not None:
            p = _normal(os.path.join(relative_to, p))
        why = _not_a_file(p)
        if why:
            raise ProfileError(why, key="profile", value=ref)
        return p
    if len(ref.encode(errors="replace")) > 250:  # NAME_MAX is 255 bytes, with ".toml"
        raise ProfileError("too long for a profile name (a file name has at most 255 bytes)",
                           key="profile", value=ref[:40] + "...")
    skipped = []
    for d in _search_dirs():
        p = os.path.join(d, f"{ref}.toml")
        why = _not_a_file(p)
        if why is None:
            return p
        if why.startswith("cannot read"):  # an unusable SANDBOXRUN_PROFILE_PATH entry: try the next
            skipped.append(f"{d}: {why.split(': ', 1)[1]}")
        elif not why.startswith("no such"):  # a directory or FIFO by that name: never a later one instead
            raise ProfileError(f"{p} {why}", key="profile", value=ref)
    note = f"; skipped {'; '.join(skipped)}" if skipped else ""
    raise ProfileError(f"unknown profile (built-in: {', '.join(builtin_names())}){note}", key="profile", value=ref)


MAX_PROFILE_BYTES = 1 << 20


def _read_toml(path: str) -> dict[str, Any]:
    cached = _parsed_cache(path)
    if cached is not None:
        return cached
    try:
        import tomllib  # ~10 ms with what it imports: only on a cache miss

        with open(path, "rb") as f:
            data = f.read(MAX_PROFILE_BYTES + 1)
        if len(data) > MAX_PROFILE_BYTES:
            raise ProfileError(f"larger than {MAX_PROFILE_BYTES >> 20} MiB: not a profile", source=str(path))
        # A byte order mark, as some Windows editors write: TOML does not allow it, we skip it.
        raw = tomllib.loads(data.removeprefix(b"\xef\xbb\xbf").decode("utf-8"))
        _store_parsed(path, raw)
        return raw
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"malformed TOML: {e}", source=str(path)) from None
    except UnicodeDecodeError as e:
        raise ProfileError(f"not UTF-8 ({e.reason} at byte {e.start})", source=str(path)) from None
    except RecursionError:
        raise ProfileError("malformed TOML: nested too deeply", source=str(path)) from None
    except OSError as e:
        raise ProfileError(f"cannot read: {e.strerror}", source=str(path)) from None


def _cache_entry(path: str) -> tuple[str, tuple[int, int, int]] | None:
    """(cache file name, file stamp) for a profile in a search dir, else None.

    Only named profiles (the built-in dir and SANDBOXRUN_PROFILE_PATH) are cached, one file per
    profile path with the stamp inside, so the cache cannot grow with every profile file a caller
    ever passed (temp files, edits)."""
    try:
        real = os.path.realpath(path)
        if os.path.dirname(real) not in {os.path.realpath(d) for d in _search_dirs()}:
            return None
        st = os.stat(real)
    except OSError:
        return None
    from .isolation.seccomp import _sha256_hex

    return f"profile-{_sha256_hex(real.encode())[:24]}.marshal", (st.st_mtime_ns, st.st_size, st.st_ino)


def _parsed_cache(path: str) -> dict[str, Any] | None:
    """The parsed TOML from the disk cache (the seccomp cache's trusted directory), or None.
    A profile decides what a run may do: only a file we own, not group/world-writable, whose
    stamp matches the profile file's, counts."""
    import marshal

    from .isolation import seccomp

    entry = _cache_entry(path)
    dfd = seccomp._open_cache_dir(seccomp.default_cache_dir()) if entry else None
    if dfd is None:
        return None
    name, stamp = entry  # type: ignore[misc]
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OSError:
        return None
    finally:
        os.close(dfd)
    try:
        import stat as _stat

        st = os.fstat(fd)
        if not seccomp._trusted(st, _stat.S_IFREG) or st.st_size > 1 << 20:
            return None
        data = marshal.loads(os.read(fd, st.st_size + 1))
    except (OSError, ValueError, EOFError, TypeError):
        return None
    finally:
        os.close(fd)
    if isinstance(data, tuple) and len(data) == 2 and data[0] == stamp and isinstance(data[1], dict):
        return data[1]
    return None  # stale (the profile was edited) or not ours: parse, then overwrite


def _store_parsed(path: str, raw: dict[str, Any]) -> None:
    import marshal

    from .isolation import seccomp

    entry = _cache_entry(path)
    dfd = seccomp._open_cache_dir(seccomp.default_cache_dir()) if entry else None
    if dfd is None:
        return
    name, stamp = entry  # type: ignore[misc]
    try:
        seccomp._write_cached(dfd, name, marshal.dumps((stamp, raw)))
        _prune_parsed(dfd)
    except (ValueError, OSError):
        pass  # unmarshallable (datetimes in a profile) or a read-only disk: parse next time
    finally:
        os.close(dfd)


PARSED_CACHE_MAX = 64  # profile files: search dirs come and go (a test's temp dir, an old checkout)


def _prune_parsed(dfd: int) -> None:
    """Keep the newest PARSED_CACHE_MAX parsed profiles (a miss only costs a TOML parse)."""
    from .isolation.seccomp import prune_cache

    prune_cache(dfd, PARSED_CACHE_MAX, lambda e: e.startswith("profile-") and e.endswith(".marshal"))


def _merge(base: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for table, value in child.items():
        if table == "extends":
            continue
        if isinstance(value, dict) and isinstance(out.get(table), dict):
            merged = dict(out[table])
            for k, v in value.items():
                if (table, k) in _APPEND_LISTS and isinstance(v, list) and isinstance(merged.get(k), list):
                    merged[k] = [*merged[k], *(x for x in v if x not in merged[k])]
                elif table == "process" and k == "env" and isinstance(v, dict) and isinstance(merged.get(k), dict):
                    merged[k] = {**merged[k], **v}
                else:
                    merged[k] = v
            out[table] = merged
        else:
            out[table] = value
    return out


MAX_EXTENDS = 32  # profiles in one `extends` chain, the file's own included


def _load_raw(path: str, seen: tuple[str, ...] = (), raw: dict[str, Any] | None = None) -> dict[str, Any]:
    path = os.path.realpath(path)
    if path in seen:
        chain = " -> ".join(os.path.basename(p) for p in (*seen, path))
        raise ProfileError(f"'extends' forms a cycle: {chain}", source=str(path), key="extends")
    if len(seen) >= MAX_EXTENDS:  # (a chain of ~1000 overflowed the recursion)
        raise ProfileError(f"'extends' chains more than {MAX_EXTENDS} profiles", source=str(path), key="extends")
    raw = _read_toml(path) if raw is None else raw
    parent_ref = raw.get("extends")
    if parent_ref is None:
        return raw
    if not isinstance(parent_ref, str) or not parent_ref:
        raise ProfileError("must be a profile name or path", source=str(path), key="extends", value=parent_ref)
    try:
        parent_path = resolve_path(parent_ref, relative_to=os.path.dirname(path))
    except ProfileError as e:
        raise ProfileError(str(e).split(": ", 1)[-1], source=str(path), key="extends", value=parent_ref) from None
    parent = _load_raw(parent_path, (*seen, path))
    real_parent = os.path.realpath(parent_path)  # a parent is named by its full path, whatever the error
    _own_values(_read_toml(real_parent), real_parent)  # an error of a parent's own names the parent
    merged = _merge(parent, raw)
    merged.pop("name", None) if "name" not in raw else None
    merged.pop("description", None) if "description" not in raw else None
    return merged


_cache: dict[str, tuple[tuple[tuple[str, int], ...], Profile]] = {}


def load(ref: str | os.PathLike[str] = "strict") -> Profile:
    """Load and validate a profile by built-in name or file path (cached until a file changes)."""
    if not isinstance(ref, (str, os.PathLike)):
        raise ProfileError(f"expected a profile name or path, got {type(ref).__name__}", key="profile")
    path = resolve_path(os.fspath(ref))
    hit = _cache.get(str(path))
    if hit is not None and all(_mtime(p) == m for p, m in hit[0]):
        return hit[1]
    real = os.path.realpath(path)
    try:
        own = _read_toml(real)
        raw = _load_raw(path, raw=own)
    except ProfileError as e:
        if e.source != real:
            raise  # a profile it extends: by its full path, as the caller did not name it
        # The file the caller named, as named (as from_dict's errors below), not where links lead
        raise ProfileError(e.reason, source=path, key=e.key, value=e.value) from None
    prof = from_dict(raw, source=str(path), default_name=_stem(path), own=own)
    _cache[str(path)] = (tuple((p, _mtime(p)) for p in _chain(path)), prof)
    return prof


def _mtime(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return -1


def _chain(path: str) -> list[str]:
    """Files a profile was built from (itself and its `extends` ancestors)."""
    out = []
    seen: set[str] = set()
    while path not in seen:
        seen.add(path)
        out.append(str(path))
        parent = _read_toml(path).get("extends")
        if not isinstance(parent, str):
            break
        path = os.path.realpath(resolve_path(parent, relative_to=os.path.dirname(path)))
    return out


# ---------------------------------------------------------------------------- validation


def _coerce(kind: str, value: Any, err: Any) -> Any:
    if kind == "str":
        if not isinstance(value, str):
            raise err("expected a string")
        if "\0" in value:
            raise err("contains a NUL byte")
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise err("expected true or false")
        return value
    if kind in ("size", "duration"):
        try:
            return parse_size(value) if kind == "size" else parse_duration(value)
        except ValueError as e:
            raise err(str(e)) from None
    if kind == "count":
        if isinstance(value, str) and value.lower() in ("unlimited", "none", "off"):
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise err("expected a whole number")
        if value <= 0:
            raise err("must be positive")
        if value > 2**31:
            raise err("is too large")
        return value
    if kind == "float":
        if isinstance(value, str) and value.lower() in ("unlimited", "none", "off"):
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise err("expected a number")
        if value < 0:
            raise err("cannot be negative")
        if value and not 0.01 <= value <= 4096:
            raise err("must be between 0.01 and 4096 (or 0 for no limit)")
        return float(value) or None
    if kind == "overflow":
        if value not in OUTPUT_OVERFLOW:
            raise err(f"expected {' or '.join(map(repr, OUTPUT_OVERFLOW))}")
        return value
    if kind == "strlist":
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            raise err("expected a list of strings")
        if any("\0" in x for x in value):
            raise err("contains a NUL byte")
        return tuple(value)
    if kind == "abspath":
        value = _coerce("str", value, err)
        _check_abs(value, err)
        return value
    if kind == "env":
        if not isinstance(value, dict):
            raise err("expected a table of string values")
        for k, v in value.items():  # a variable named alone: the table may hold all a parent's too
            _check_env_pair(k, v, err)
        return tuple(value.items())
    if kind == "binds":
        return _coerce("strlist", value, err)
    raise AssertionError(kind)


NAME_MAX = 255
# PATH_MAX (4096) less room for the root the view is staged under (the child mounts a bind's
# target there first: past it, the mount failed at setup naming that staging path).
PATH_MAX_INSIDE = 3840


def _check_abs(p: str, err: Any) -> None:
    if not p.startswith("/"):
        raise err("must be an absolute path")
    if ".." in p.split("/"):
        raise err("must not contain '..'")
    try:
        encoded = p.encode("utf-8", "surrogateescape")  # the bytes the kernel gets (os.fsencode's)
    except UnicodeEncodeError as e:  # JSON's "\ud800": a UnicodeEncodeError at setup
        raise err(f"{p[e.start]!r} at offset {e.start} is a lone surrogate, which stands for no bytes "
                  "(not valid UTF-8 text)") from None
    if len(encoded) > PATH_MAX_INSIDE:
        raise err(f"name too long: {len(encoded)} bytes (at most {PATH_MAX_INSIDE})")
    if any(len(part) > NAME_MAX for part in encoded.split(b"/")):
        raise err(f"name too long: a component over {NAME_MAX} bytes")


_HOSTNAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def _check_hostname(name: str, err: Any) -> None:
    """A plain host name: it becomes a line of the sandbox's /etc/hosts (a newline would add
    one of its own) and its UTS name (at most 64 bytes)."""
    if not (0 < len(name) <= 64 and _HOSTNAME_CHARS.issuperset(name) and name[0] != "-"):
        raise err("expected 1-64 letters, digits, '-', '_' or '.', not starting with '-'")


def _check_env_pair(k: str, v: object, err: Any) -> None:
    """One variable of an env table; an error names it (`process.env.A = 1`), not the table."""
    problem = ("expected a string" if not isinstance(v, str) else
               "invalid variable name" if not k or "=" in k or "\0" in k else
               "contains a NUL byte" if "\0" in v else None)
    if problem:
        whole = err("")
        raise ProfileError(problem, source=whole.source, key=f"{whole.key}.{k}", value=v)


def parse_bind(spec: str, *, writable: bool, optional: bool, err: Any, caller: bool = False) -> Mount:
    """"SRC" or "SRC:DST" to a Mount; both absolute, no '..'. caller: an override's (Mount.caller)."""
    src, _, dst = spec.partition(":")
    dst = dst or src
    _check_abs(src, err)
    _check_abs(dst, err)
    if dst.endswith((":ro", ":rw")):  # docker's SRC:DST:MODE would bind at a path named "DST:ro"
        raise err("no :ro/:rw suffix: the list says the mode (ro_bind, bind; --ro-bind, --bind)")
    src, dst = _norm(src), _norm(dst)  # (normpath keeps a leading "//": "//" slipped past the "/" check)
    if dst == "/":
        raise err("cannot bind over the sandbox root")
    if not optional and not os.path.exists(src):
        raise err(f"path does not exist: {src}")
    return Mount(src, dst, writable, optional, caller)


def _no_link_before_last(m: Mount, err: Any) -> None:
    """A profile's bind source with a link before its last component is refused by the view
    at setup (125, every run): say so at load. (A caller's override is checked as an
    InputError where it is taken, its last component too: with_overrides.)"""
    from .hostpaths import LinkInPath, lstat_through_real_dirs

    try:
        lstat_through_real_dirs(m.source, "source")
    except LinkInPath as e:
        raise err(str(e).split(": ", 1)[1]) from None
    except InputError:
        pass  # missing, or not ours to read (root's /root/.pyenv): the view skips or refuses it


HOST_VIEW_BIND = "filesystem.view = 'host' has no private view to bind into: the bind would be ignored"
# Mounted by the sandbox itself after the binds (isolation/filesystem.py): a bind there is hidden.
_SANDBOX_MOUNTS = ("/tmp", "/run", "/dev", "/proc")
# Written by the sandbox itself while it builds the view: a writable bind there would be overwritten.
_SANDBOX_FILES = ("/etc/passwd", "/etc/group", "/etc/hostname", "/etc/hosts")
# The system trees a profile binds read-only: a workdir (a mount of its own) there would hide them.
_SYSTEM_TREES = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/dev", "/run")


def _norm(path: str) -> str:
    return "/" + os.path.normpath(path).lstrip("/")  # normpath keeps a leading "//"


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top + "/")


def _nested_bind_problem(target: str, others: list[str]) -> str | None:
    """A caller's bind nested in another bind (or holding one): its mount point would be made
    through the outer bind's host directory, which a run may have changed (a link swapped in
    while the view is built would make it on the host). A profile's own nesting (/usr and
    /usr/share/zoneinfo) is the operator's."""
    t = _norm(target)
    for o in map(_norm, others):
        if t != o and _under(t, o):
            return f"bind target {t} is inside the bind at {o}: bind what you need there directly, not nested"
        if t != o and _under(o, t):
            return f"bind target {t} holds the bind at {o}: binds of a caller are not nested"
    return None


def _one_per_target(binds: Binds, source: str) -> Binds:
    """Binds with one mount per target: the same bind twice (once tried, once required: the
    required one stands) is kept once; two different binds at one target are refused (the
    last mounted hid the other: a read-write bind over a read-only one made it writable)."""
    out: dict[str, tuple[str, str, Mount]] = {}  # target -> the bind there
    for key, spec, m in binds:
        t = _norm(m.target)
        prev = out.get(t)
        if prev is None:
            out[t] = (key, spec, m)
        elif (prev[2].source, prev[2].writable) == (m.source, m.writable):
            if prev[2].optional and not m.optional:
                out[t] = (key, spec, m)
        else:
            raise ProfileError(f"binds {t}, where filesystem.{prev[0]} = {prev[1]!r} binds too: one mount per "
                               "target (the later would hide the earlier)", source=source,
                               key=f"filesystem.{key}", value=spec)
    return list(out.values())


def _kind_clash(m: Mount, existing: tuple[Mount, ...]) -> str | None:
    """A file bound where another bind has a directory (or the other way), or anything bound
    inside a bound file: its mount would fail at setup (ENOTDIR), naming a staging path
    instead of this bind."""
    def kind(path: str) -> str | None:
        try:
            return "directory" if stat.S_ISDIR(os.stat(path).st_mode) else "file"
        except (OSError, ValueError):
            return None

    target = _norm(m.target)
    for o in existing:
        if _norm(o.target) == target:
            mine, theirs = kind(m.source), kind(o.source)
            if mine and theirs and mine != theirs:
                return f"{target} is where a {theirs} is bound already ({o.source}): a {mine} cannot go there"
        elif target.startswith(_norm(o.target).rstrip("/") + "/"):  # inside another bind: what is there
            if kind(o.source) == "file":
                return f"{target} is inside {_norm(o.target)}, where the file {o.source} is bound: nothing can be bound there"
            below = os.path.join(o.source, os.path.relpath(target, _norm(o.target)))
            mine, theirs = kind(m.source), kind(below)
            if mine and theirs and mine != theirs:
                return f"{target} is a {theirs} in the bind of {o.source}: a {mine} cannot be bound there"
    return None


def workdir_problem(workdir: str) -> str | None:
    """Why a private view's workdir path would hide the sandbox's system, or None."""
    if workdir == "same":
        return None
    w = _norm(workdir)
    if w in ("/", "/etc"):
        return f"the workdir is mounted over {w} and would hide it (use a path of its own, such as /work)"
    for top in _SYSTEM_TREES:
        if _under(w, top):
            return (f"is in the system tree {top}, which the workdir (mounted over it) would hide "
                    "(use a path of its own, such as /work)")
    return None


def bind_problem(target: str, workdir: str) -> str | None:
    """Why a bind at `target` would not be seen in a private view with this workdir, or None."""
    t = _norm(target)
    for top in _SANDBOX_MOUNTS:
        if _under(t, top):
            return f"bind target {t} would be hidden: the sandbox mounts its own {top} over it"
    if t == "/etc":
        return "bind target /etc: the sandbox writes its passwd, group, hostname and hosts there (bind files under /etc)"
    if t in _SANDBOX_FILES:
        return f"bind target {t}: the sandbox writes that file itself (a writable bind would overwrite the source)"
    if workdir != "same":
        w = _norm(workdir)
        if t == w:
            return f"bind target {t} is the workdir: use cwd (--cwd) to run in a host directory"
        if _under(t, w):
            return (f"bind target {t} is under the workdir {w}, which is mounted over it: "
                    "put the files in the cwd (--cwd) directory instead")
    return None


_BIND_KEYS = (("ro_bind", False, False), ("ro_bind_try", False, True), ("bind", True, False))  # (writable, optional)


Binds = list[tuple[str, str, Mount]]  # (key, spec, mount)


def _own_values(raw: dict[str, Any], source: str) -> tuple[dict[str, dict[str, Any]], Binds]:
    """Each table's keys checked one by one (known, of their type, binds that exist): what can
    be wrong with a file on its own, so a parent's error names the parent. Returns the coerced
    values and the parsed binds."""
    values: dict[str, dict[str, Any]] = {}
    for table, content in raw.items():
        if table in _SCHEMA[""]:
            continue
        if table not in _SCHEMA:
            raise ProfileError(f"unknown table or key (known: {', '.join(k for k in _SCHEMA if k)})",
                               source=source, key=table)
        if not isinstance(content, dict):
            raise ProfileError("expected a table", source=source, key=table, value=content)
        values[table] = {}
        for key, value in content.items():
            kind = _SCHEMA[table].get(key)
            if kind is None:
                raise ProfileError(f"unknown key (known: {', '.join(_SCHEMA[table])})",
                                   source=source, key=f"{table}.{key}")
            values[table][key] = _coerce(kind, value, _error_for(source, f"{table}.{key}", value))
    fs = values.get("filesystem", {})
    binds = []
    for key, writable, optional in _BIND_KEYS:
        for spec in fs.get(key, ()):
            err = _error_for(source, f"filesystem.{key}", spec)
            m = parse_bind(spec, writable=writable, optional=optional, err=err)
            _no_link_before_last(m, err)
            binds.append((key, spec, m))
    return values, binds


def from_dict(raw: dict[str, Any], *, source: str = "<dict>", default_name: str = "custom",
              own: dict[str, Any] | None = None) -> Profile:
    """Validate a profile table. `own`: the file's own tables when `raw` also holds what it
    inherits through `extends` (None: all of `raw` is the file's own)."""

    def err_for(key: str, value: Any) -> Any:
        return _error_for(source, key, value)

    values, binds = _own_values(raw, source)
    own = raw if own is None else own
    for key in ("name", "description"):
        if key in raw and not isinstance(raw[key], str):
            raise ProfileError("expected a string", source=source, key=key, value=raw[key])

    lim = values.get("limits", {})
    limits = Limits(**{k: v for k, v in lim.items()})
    if limits.timeout is None or limits.timeout == 0:
        if not limits.allow_no_timeout:
            raise ProfileError("a run without a wall timeout needs limits.allow_no_timeout = true",
                               source=source, key="limits.timeout", value=lim.get("timeout"))
        limits = records.replace(limits, timeout=None)
    check_limits(limits, source, raw.get("limits", {}))  # errors show the value as written
    if limits.allow_no_timeout and limits.max_timeout is not None:
        # A run with no timeout would outlast the cap that a caller's 20m is refused by.
        raise ProfileError(f"contradicts limits.max_timeout = {raw.get('limits', {}).get('max_timeout', limits.max_timeout)!r}"
                           " (a run without a timeout exceeds any cap): set max_timeout = 'unlimited' too",
                           source=source, key="limits.allow_no_timeout", value=True)
    if limits.timeout is not None and limits.max_timeout is not None and limits.timeout > limits.max_timeout:
        raw_lim = raw.get("limits", {})
        max_shown = raw_lim.get("max_timeout", limits.max_timeout)
        raise ProfileError(f"exceeds limits.max_timeout = {max_shown!r} (lower timeout or raise max_timeout)",
                           source=source, key="limits.timeout", value=raw_lim.get("timeout", limits.timeout))

    fs = values.get("filesystem", {})
    binds = _one_per_target(binds, source)
    mounts = [m for _, _, m in binds]
    workdir = fs.get("workdir", "/work")
    if workdir != "same":
        _check_abs(workdir, err_for("filesystem.workdir", workdir))
        workdir = _norm(workdir)  # "/work/" made a mount point named "work/" next to one named "work"
    view = fs.get("view", "private")
    if view not in ("private", "host"):
        raise ProfileError("expected 'private' or 'host'", source=source, key="filesystem.view", value=view)
    problem = workdir_problem(workdir) if view == "private" else None
    if problem:
        raise ProfileError(problem, source=source, key="filesystem.workdir", value=workdir)
    own_fs = own.get("filesystem") or {}
    for i, (key, spec, m) in enumerate(binds):
        if view == "private":
            # against every other bind, before or after it: the mounts' order is not the list's
            problem = bind_problem(m.target, workdir) or _kind_clash(m, tuple(b[2] for j, b in enumerate(binds)
                                                                             if j != i))
        else:  # inherited binds (nested extends strict) are unused; the file's own are a mistake
            problem = HOST_VIEW_BIND if spec in own_fs.get(key, ()) else None
        if problem:
            raise ProfileError(problem, source=source, key=f"filesystem.{key}", value=spec)

    sec = values.get("security", {})
    for key, allowed in (("seccomp", ("default", "off")), ("landlock", REQUIREMENT), ("cgroup", REQUIREMENT)):
        if key in sec and sec[key] not in allowed:
            raise ProfileError(f"expected one of {', '.join(allowed)}", source=source,
                               key=f"security.{key}", value=sec[key])
    for ns in sec.get("namespaces", ()):
        if ns not in NAMESPACES:
            raise ProfileError(f"unknown namespace (known: {', '.join(NAMESPACES)}; 'user' is automatic)",
                               source=source, key="security.namespaces", value=ns)
    namespaces = tuple(n for n in NAMESPACES if n in sec.get("namespaces", NAMESPACES))
    if view == "host" and {"mount", "pid"} & set(namespaces):
        # Without a mount namespace there is no fresh /proc: a pid namespace would still see the
        # host's processes, and the result would claim namespaces that change nothing.
        shown = [n for n in ("mount", "pid") if n in namespaces]
        raise ProfileError(f"filesystem.view = 'host' shares the host's mounts and /proc: remove "
                           f"{' and '.join(map(repr, shown))} from security.namespaces (as nested does), or "
                           "keep the private view", source=source, key="filesystem.view", value=view)
    if view == "private" and "mount" not in namespaces:
        raise ProfileError("filesystem.view = 'private' needs the mount namespace", source=source,
                           key="security.namespaces")

    if sec.get("cgroup") == "off":
        for key in ("memory", "cpus"):  # only a cgroup enforces them: they would silently not apply
            if getattr(limits, key):
                shown = raw.get("limits", {}).get(key, getattr(limits, key))
                raise ProfileError(f"limits.{key} = {shown!r} is enforced only by a cgroup: make it unlimited "
                                   f"({key} = {'0' if key == 'cpus' else repr('unlimited')}) or let the cgroup be "
                                   "'optional'", source=source, key="security.cgroup", value="off")

    net = values.get("network", {}).get("mode", "none")
    if net == "loopback":
        net = "none"
    if net not in NETWORK_MODES:
        raise ProfileError("expected 'none' (own loopback only) or 'host'", source=source,
                           key="network.mode", value=net)
    if net == "none" and "net" not in namespaces:
        raise ProfileError("network.mode = 'none' needs the net namespace", source=source, key="network.mode")

    proc = values.get("process", {})
    for name in proc.get("env_passthrough", ()):
        if not name or "=" in name or any(c in name for c in "*?["):
            raise ProfileError("expected a variable's name (no '=', no patterns): it passed nothing",
                               source=source, key="process.env_passthrough", value=name)
    flt = values.get("filter", {})
    for key in ("block", "scan"):
        for pattern in flt.get(key, ()):
            check_pattern(pattern, err_for(f"filter.{key}", pattern))
    hostname = proc.get("hostname", "sandbox")
    _check_hostname(hostname, err_for("process.hostname", hostname))
    if "uts" not in namespaces and "hostname" in (own.get("process") or {}):  # (an inherited one goes unused)
        raise ProfileError("needs the uts namespace (add 'uts' to security.namespaces): without it the "
                           "sandbox has the host's name", source=source, key="process.hostname", value=hostname)
    if view == "private" and not any(not m.writable for m in mounts):
        raise ProfileError("profile binds nothing read-only, so its sandbox has no /usr and no command can run: "
                           'add extends = "strict" or filesystem.ro_bind', source=source)
    return Profile(
        name=raw.get("name", default_name), description=raw.get("description", ""), source=source,
        # a host view binds nothing: inherited binds are not kept (nor shown by `profiles show`)
        limits=limits, view=view, mounts=tuple(mounts) if view == "private" else (), workdir=workdir, network=net,
        hostname=hostname, env=proc.get("env", ()), env_passthrough=proc.get("env_passthrough", ()),
        namespaces=namespaces, seccomp=sec.get("seccomp", "default"), landlock=sec.get("landlock", "optional"),
        cgroup=sec.get("cgroup", "required"), blocklist=flt.get("blocklist", True), block=flt.get("block", ()),
        allow=flt.get("allow", ()), scan=flt.get("scan", ()),
    )


def check_pattern(pattern: str, err: Any) -> None:
    """A profile's regex must be one RE2 can run (linear time: it cannot hang the filter)."""
    from .linear_regex import problem as pattern_problem

    problem = pattern_problem(pattern)
    if problem:
        raise err(problem)


MIN_OPEN_FILES = 8
_MINIMUMS = {"memory": 4 * 2**20, "tmp_size": 64 * 2**10, "workdir_size": 64 * 2**10, "shm_size": 64 * 2**10, "address_space": 16 * 2**20,
             "file_size": 1, "log_size": 4096}


# A sandbox without these could not be ended in time (kill_grace), or hold its output and
# files in bounded memory.
_NEVER_UNLIMITED = ("kill_grace", "output", "tmp_size", "shm_size", "log_size", "workdir_size")
MAX_PROCESSES = 4 * 1024 * 1024  # PID_MAX_LIMIT: pids.max refuses more
MIN_PROCESSES = 2
MAX_KILL_GRACE = 60.0
MAX_OUTPUT = 2**30  # per stream: the supervisor holds what it captures in memory


def check_limits(limits: Limits, source: str, raw: dict[str, Any]) -> None:
    """Bounds that hold whether a limit came from a file or an override."""
    from .units import format_size

    for key in _NEVER_UNLIMITED:
        if getattr(limits, key) is None:
            raise ProfileError("cannot be unlimited", source=source, key=f"limits.{key}", value=raw.get(key))
    if limits.kill_grace is not None and limits.kill_grace > MAX_KILL_GRACE:  # the run's wall time past its timeout
        raise ProfileError(f"must be at most {MAX_KILL_GRACE:g}s (a run may ignore SIGTERM for this long after its "
                           "timeout)", source=source, key="limits.kill_grace", value=raw.get("kill_grace", limits.kill_grace))
    if limits.cpu_time is not None and (limits.cpu_time < 1 or limits.cpu_time != int(limits.cpu_time)):
        raise ProfileError("must be a whole number of seconds, at least 1s (RLIMIT_CPU counts seconds; "
                           "'unlimited' for none)", source=source, key="limits.cpu_time",
                           value=raw.get("cpu_time", limits.cpu_time))
    if limits.processes is not None and limits.processes < MIN_PROCESSES:
        raise ProfileError(f"must be at least {MIN_PROCESSES} (the sandbox's init and the command)", source=source,
                           key="limits.processes", value=raw.get("processes", limits.processes))
    if limits.processes is not None and limits.processes > MAX_PROCESSES:
        raise ProfileError(f"is above the kernel's most pids ({MAX_PROCESSES})", source=source,
                           key="limits.processes", value=raw.get("processes", limits.processes))

    if limits.output is not None and limits.output > MAX_OUTPUT:
        raise ProfileError(f"must be at most {format_size(MAX_OUTPUT)} per stream (the capture is held in memory)",
                           source=source, key="limits.output", value=raw.get("output", limits.output))
    for key, minimum in _MINIMUMS.items():
        v = getattr(limits, key)
        if v is not None and v < minimum:
            raise ProfileError(f"must be at least {format_size(minimum)}", source=source, key=f"limits.{key}",
                               value=raw.get(key, v))
    if limits.open_files is not None and limits.open_files < MIN_OPEN_FILES:  # else Landlock's setup fails, EMFILE
        raise ProfileError(f"must be at least {MIN_OPEN_FILES} (the sandbox's own set-up holds a few files open "
                           "under this limit)", source=source, key="limits.open_files",
                           value=raw.get("open_files", limits.open_files))


# ---------------------------------------------------------------------------- overrides

_LIMIT_OVERRIDES = {
    "timeout": "duration", "kill_grace": "duration", "cpu_time": "duration", "memory": "size",
    "address_space": "size", "processes": "count", "file_size": "size", "open_files": "count",
    "cpus": "float", "output": "size", "tmp_size": "size", "workdir_size": "size",
    "output_overflow": "overflow",
}


def _error_for(source: str, key: str, value: Any) -> Any:
    return lambda msg: ProfileError(msg, source=source, key=key, value=value)


def with_overrides(profile: Profile, **overrides: Any) -> Profile:
    """Apply single-setting overrides (library kwargs and CLI flags), validated like the file."""
    if not overrides:
        return profile
    src = "override"
    limits = profile.limits
    changes: dict[str, Any] = {}
    for key, value in overrides.items():
        if value is None:
            continue
        err = _error_for(src, key, value)
        if key in _LIMIT_OVERRIDES:
            try:
                v = _coerce(_LIMIT_OVERRIDES[key], value, err)
            except ProfileError as e:
                if key == "timeout" and "too large" in str(e) and limits.max_timeout is not None:
                    raise err(f"exceeds the profile's max_timeout of {limits.max_timeout:g}s") from None
                raise
            if key == "timeout":
                if v is None or v == 0:
                    if not limits.allow_no_timeout:
                        raise err(f"profile {profile.name!r} does not allow running without a timeout")
                    v = None
                elif limits.max_timeout is not None and v > limits.max_timeout:
                    raise err(f"exceeds the profile's max_timeout of {limits.max_timeout:g}s")
            limits = records.replace(limits, **{key: v})
            check_limits(limits, src, {key: value})
        elif key in ("ro_bind", "bind"):
            if not isinstance(value, (str, list, tuple)):
                raise err("expected a path spec SRC[:DST] or a list of them")
            specs = [value] if isinstance(value, str) else list(value)
            if specs and profile.view != "private":
                raise err(f"profile {profile.name!r}: {HOST_VIEW_BIND}")
            extra = tuple(parse_bind(_coerce("str", s, err), writable=key == "bind", optional=False, err=err,
                                     caller=True) for s in specs)
            mounts = list(changes.get("mounts", profile.mounts))
            for spec, m in zip(specs, extra, strict=True):
                at = next((i for i, o in enumerate(mounts) if _norm(o.target) == _norm(m.target)), None)
                same = None if at is None else mounts[at]
                problem = (bind_problem(m.target, profile.workdir)
                           or _nested_bind_problem(m.target, [o.target for o in mounts])
                           or _kind_clash(m, tuple(mounts)))
                if not problem and same and (same.source, same.writable) != (m.source, m.writable):
                    problem = (f"binds {_norm(m.target)}, where {same.source} is bound "  # as a profile file's
                               f"{'read-write' if same.writable else 'read-only'} already: one mount per target "
                               "(the later would hide the earlier)")
                if problem:
                    raise _error_for(src, key, spec)(problem)
                if at is not None and same is not None:  # the same bind again: one mount
                    if same.optional:
                        mounts[at] = records.replace(same, optional=False)  # required now
                    continue
                from .hostpaths import lstat_through_real_dirs

                # No planted link before its last component (the view checks again, and the
                # child that it opened this very file): an InputError now, on every path.
                try:
                    st = lstat_through_real_dirs(m.source, m.source)
                except InputError as e:  # a link before the last component: named as the rest (--ro-bind at the CLI)
                    raise _error_for(src, key, spec)(str(e).removeprefix(f"{m.source}: ")) from None
                if stat.S_ISLNK(st.st_mode):
                    # A profile's own links are reproduced in the view (/bin -> usr/bin); a
                    # caller's could be one a run planted, pointing anywhere on the host.
                    raise _error_for(src, key, spec)(f"{m.source} is a symbolic link: give the real path")
                mounts.append(m)
            changes["mounts"] = tuple(mounts)
        elif key == "network":
            v = "none" if value == "loopback" else value
            if v not in NETWORK_MODES:
                raise err("expected none, loopback or host")
            if v == "none" and "net" not in profile.namespaces:
                raise err(f"profile {profile.name!r} has no net namespace")
            changes["network"] = v
        elif key == "env":
            if not isinstance(value, dict):
                raise err("expected a mapping of names to strings")
            for k, v in value.items():
                if not isinstance(k, str) or not isinstance(v, str):
                    raise err("names and values must be strings")
                _check_env_pair(k, v, err)
            changes["env"] = (*profile.env, *value.items())
        elif key == "hostname":
            v = _coerce("str", value, err)
            _check_hostname(v, err)
            changes["hostname"] = v
        else:
            known = ", ".join([*_LIMIT_OVERRIDES, "ro_bind", "bind", "network", "env", "hostname"])
            raise ProfileError(f"unknown setting (known: {known})", source=src, key=key)
    # (a limit asked for: "unlimited" and cpus 0 ask for none, which no cgroup has to enforce)
    needed = tuple(k for k in ("memory", "cpus") if overrides.get(k) is not None and getattr(limits, k) is not None)
    if needed and profile.cgroup == "off":  # only a cgroup enforces them: never silently dropped
        raise ProfileError(f"profile {profile.name!r} has cgroup = 'off', and only a cgroup enforces this limit",
                           source=src, key=needed[0], value=overrides[needed[0]])
    if needed and profile.cgroup == "optional":
        changes.update(cgroup="required", cgroup_needed_by=tuple(dict.fromkeys((*profile.cgroup_needed_by, *needed))))
    if not changes and limits is profile.limits:
        return profile  # (timeout=None and the like: the very same profile, its cached steps too)
    return records.replace(profile, limits=limits, **changes)
