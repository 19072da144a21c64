"""The structured result of one run, and its JSON schema (result.schema.json).

Flat seed fields that agent clients already parse (success, command, exit_code,
stdout, stderr, duration_ms, timed_out, pid, blocked, block_reason) sit beside a
`status` that says why the run ended, usage, truncation, and the isolation
that was actually applied.
"""

from __future__ import annotations

from .record import asdict, field, record

TYPE_CHECKING = False  # typing costs ~5 ms to import; annotations here are strings anyway
if TYPE_CHECKING:
    from typing import Any

# Why a run ended. "ok" and "nonzero_exit" are the command's own doing.
STATUSES = (
    "ok",  # exit 0
    "nonzero_exit",  # exited with a non-zero code
    "signaled",  # killed by a signal it did not get from a limit
    "timeout",  # wall timeout: SIGTERM, grace, SIGKILL
    "memory_limit",  # OOM-killed by the cgroup memory limit
    "cpu_limit",  # RLIMIT_CPU (SIGXCPU/SIGKILL)
    "output_limit",  # output past the cap, with limits.output_overflow = "kill" (else drained: *_truncated)
    "blocked",  # refused by the first-line filter; nothing ran
    "setup_error",  # a required isolation layer could not be applied; nothing ran
    "running",  # a foreground run that became a background session (yield_after)
    "lost",  # background session whose monitor died
)


@record
class Usage:
    """Resources the run used."""

    cpu_user_s: float = 0.0
    cpu_sys_s: float = 0.0
    wall_s: float = 0.0
    peak_memory_bytes: int = 0  # cgroup peak where available, else max RSS of one process
    oom_kills: int | None = None  # None: the run had no cgroup (or no process), so none could be counted
    pids_limit_hit: bool | None = None  # None: no cgroup (RLIMIT_NPROC's refusals are not counted)


@record
class Isolation:
    """What was really applied (never what was merely asked for)."""

    namespaces: list[str] = field(default_factory=list)
    user_namespace: bool = False
    filesystem: str = "none"  # "private" (tmpfs root, binds, pivot_root) or "host"
    uid: int | None = None  # uid the command ran as, as seen inside
    host_uid: int | None = None
    network: str = "host"
    seccomp: str = "off"
    no_new_privs: bool = False
    capabilities: str = "unchanged"  # "none" once every capability (bounding set too) is dropped
    landlock_abi: int = 0
    cgroup: str = "none"  # "v1", "v2" or "none"
    limits: dict[str, Any] = field(default_factory=dict)


@record
class Result:
    """The structured result of one run (see result.schema.json)."""

    command: list[str]
    status: str
    success: bool = False  # status == "ok", and never true for another status
    exit_code: int = -1
    signal: str | None = None
    stdout: str = ""
    stderr: str = ""
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    duration_ms: float = 0.0
    timed_out: bool = False
    pid: int | None = None
    blocked: bool = False
    block_reason: str | None = None
    error: str | None = None  # human-readable reason for setup_error / exec failure / limits
    error_step: str | None = None  # setup_error: the child step that failed
    error_errno: int | None = None
    profile: str = ""
    usage: Usage = field(default_factory=Usage)
    # None where what was applied is not known: a background run still "running", or "lost"
    # (its monitor died). Never Isolation()'s defaults there: they read as "no sandbox at all".
    isolation: Isolation | None = field(default_factory=Isolation)
    trace: dict[str, float] | None = None  # per-step child setup cost in ms (SANDBOXRUN_TRACE=1)
    session_id: str | None = None  # background runs
    # Raw bytes, for callers that need them exactly (not serialised).
    stdout_raw: bytes = field(default=b"", repr=False)
    stderr_raw: bytes = field(default=b"", repr=False)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("stdout_raw")
        d.pop("stderr_raw")
        d["command"] = [utf8_text(a) for a in d["command"]]
        return d

    def to_json(self, **kw: Any) -> str:
        import json

        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Result:
        d = dict(d)
        d["usage"] = Usage(**d.get("usage", {}))
        iso = d.get("isolation", {})
        d["isolation"] = None if iso is None else Isolation(**iso)
        known = cls.__record_names__
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def from_stored(cls, data: bytes) -> Result:
        """A Result as to_json wrote it (a session's result.json), checked against
        result.schema.json first: ValueError naming the first field that is not as written."""
        import json

        d = json.loads(data)  # ValueError (JSONDecodeError, UnicodeDecodeError) if not JSON
        if not _schema:  # read once per process: `list` reads every session's result
            with open(_SCHEMA, "rb") as f:
                _schema.update(json.load(f))
        problem = schema_problem(d, _schema)
        if problem:
            raise ValueError(problem)
        try:
            return cls.from_dict(d)
        except TypeError as e:  # a usage or isolation key the records do not have
            raise ValueError(str(e)) from None


def utf8_text(text: str) -> str:
    """`text` as UTF-8 text for JSON: bytes that were not UTF-8 (a command line's, kept by
    surrogateescape in the str) become U+FFFD, as in every other text field. A lone surrogate
    left in JSON ("\\udcff") is text no strict reader takes."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogateescape" if _escaped_only(text) else "replace").decode("utf-8", "replace")


def _escaped_only(text: str) -> bool:
    return all(not 0xD800 <= ord(c) <= 0xDFFF or 0xDC80 <= ord(c) <= 0xDCFF for c in text)


_SCHEMA = __file__.rsplit("/", 1)[0] + "/result.schema.json"
_schema: dict[str, Any] = {}
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,), "array": (list,), "string": (str,), "integer": (int,), "number": (int, float),
    "boolean": (bool,), "null": (type(None),),
}


def schema_problem(value: Any, schema: dict[str, Any], where: str = "") -> str | None:
    """The first way `value` breaks `schema` (the part of JSON Schema the package's schemas
    use: type, enum, required, properties, additionalProperties, items), else None."""
    at = f"{where}: " if where else ""
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else types
        if not any(isinstance(value, _JSON_TYPES[n]) and (n in ("boolean", "null") or not isinstance(value, bool))
                   for n in names):
            return f"{at}expected {' or '.join(names)}, got {value!r:.60}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{at}{value!r:.60} is not one of {', '.join(map(str, schema['enum']))}"
    if isinstance(value, dict):
        for key in schema.get("required", ()):
            if key not in value:
                return f"{at}{key} is missing"
        props = schema.get("properties", {})
        for key, item in value.items():
            sub = props.get(key, schema.get("additionalProperties"))
            if isinstance(sub, dict):
                problem = schema_problem(item, sub, f"{where}.{key}" if where else key)
                if problem:
                    return problem
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            problem = schema_problem(item, schema["items"], f"{where}[{i}]")
            if problem:
                return problem
    return None
