"""Many sandboxed runs at once: `run_many` (library) and `sandboxrun batch FILE.jsonl`.

A worker pool of threads calls `sandbox.run`, which is thread-safe (children come
from a single-threaded fork server), so the parallelism is the sandboxes' own
processes, not Python's. Requests are streamed: at most a small window of them is
in flight or waiting to be yielded, so a file of a million lines never sits in
memory. In ordered mode the window runs ahead of a slow request and results come
out in input order; `ordered=False` yields each as it finishes.

A request that cannot be run (malformed JSON, unknown key, invalid value) becomes
a `BatchError` in its place and the batch goes on.

The batch keeps the cgroups that carry its runs' CPU and process caps from one run to the
next (isolation/cgroups.py, `Slots`) and removes them when it ends.
"""

from __future__ import annotations

import _thread
import collections
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, TYPE_CHECKING, Any

from . import signals, strictjson
from .errors import InputError, SandboxError
from .isolation.cgroups import Slots
from .profile import Profile, load
from .record import field, fields, record
from .result import Result

if TYPE_CHECKING:
    from .supervisor import Cancel

# What a request may carry besides the command: sandbox.run's own arguments and its
# single-setting overrides. Callback and fd arguments (on_stdout, stdin_fd) are left
# out on purpose: a JSONL line must not name a file descriptor of this process.
RUN_KEYS = ("command", "shell", "stdin", "timeout", "env", "cwd", "profile", "id")
OVERRIDE_KEYS = ("memory", "output", "output_overflow", "cpu_time", "kill_grace", "address_space", "processes",
                 "file_size", "open_files", "cpus", "tmp_size", "workdir_size", "ro_bind", "bind", "network",
                 "hostname", "trace")
REQUEST_KEYS = frozenset(RUN_KEYS + OVERRIDE_KEYS)
# What only a trusted request may set (run_many(trusted=True), `batch --trusted`): a host
# directory bound into the run (cwd, bind, ro_bind), another profile (any TOML file of the
# host, its layers off), the network. An untrusted one may lower the profile's limits only.
HOST_KEYS = {"profile": "its profile", "cwd": "a host directory", "bind": "a host directory",
             "ro_bind": "a host directory"}
LIMIT_KEYS = ("timeout", "kill_grace", "cpu_time", "memory", "address_space", "processes", "file_size",
              "open_files", "cpus", "output", "tmp_size", "workdir_size")

WINDOW_PER_WORKER = 4  # ordered mode: results held while an earlier request is still running


@record
class BatchRequest:
    """One request; a dict with the same keys works as well."""

    command: str | list[str]
    shell: bool = False
    stdin: str | bytes | None = None
    timeout: float | str | None = None
    env: dict[str, str] | None = None
    cwd: str | None = None
    profile: str | Profile | None = None  # None: run_many's profile
    id: Any = None  # None: the request's 1-based position (its line number in a file)
    overrides: dict[str, Any] = field(default_factory=dict)  # memory, output, network, ...


@record
class BatchResult(Result):
    """A Result that also carries the request's id, and its line: an explicit id may equal
    another request's, or another's line number, so the line is what tells them apart."""

    id: Any = None
    line: int = 0  # 1-based position in the input (the line number of a JSONL file)

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        return {"id": d.pop("id"), "line": d.pop("line"), **d}


@record
class BatchError:
    """A request that could not be run; it takes the request's place in the output."""

    line: int  # 1-based position in the input (the line number of a JSONL file)
    error: str
    id: Any = None
    status: str = "invalid_request"
    success: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "line": self.line, "status": self.status, "success": False, "error": self.error}

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)


BatchItem = BatchResult | BatchError


class _Invalid:
    """Placeholder for an input line that is already known to be bad."""

    def __init__(self, error: str, id: Any = None) -> None:
        self.error, self.id = error, id


def _as_kwargs(req: Any) -> tuple[Any, dict[str, Any]]:
    """(id, sandbox.run keyword arguments including `command`) for one request."""
    if isinstance(req, BatchRequest):
        d: dict[str, Any] = {f.name: getattr(req, f.name) for f in fields(req) if f.name != "overrides"}
        d = {k: v for k, v in d.items() if v is not None and not (k == "shell" and v is False)}
        if not isinstance(req.overrides, dict):
            raise InputError(f"overrides: expected a dict of setting: value, got {type(req.overrides).__name__}")
        d.update(req.overrides)
    elif isinstance(req, dict):
        d = dict(req)
    else:
        raise InputError(f"expected a JSON object or BatchRequest, got {type(req).__name__}")
    rid = d.pop("id", None)
    unknown = sorted(str(k) for k in d if k not in REQUEST_KEYS)
    if unknown:
        raise InputError(f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                         f"(known: {', '.join(sorted(REQUEST_KEYS))})")
    if "command" not in d:
        raise InputError("missing key 'command'")
    if not isinstance(d.get("shell", False), bool):
        raise InputError(f"shell: expected true or false, got {d['shell']!r}")
    if not isinstance(d.get("env") or {}, dict):
        raise InputError(f"env: expected an object of NAME: value strings, got {type(d['env']).__name__}")
    return rid, d


def _id_problem(rid: Any) -> str | None:
    """Why a request's id (from Python: a JSONL line's is JSON already) cannot be written in
    its result's JSON: an object() made to_json raise, a NaN was written as NaN; a lone
    surrogate ("\\ud800", from a JSONL line too) was echoed, which no strict JSON reader takes."""
    if rid is None or type(rid) is int:
        return None
    try:
        text = rid if type(rid) is str else json.dumps(rid, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        return f"id: expected a JSON value (string, number, true/false, null, list, dict): {e}"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"id: {text[e.start]!r} is a lone surrogate, not valid Unicode text (it could not be echoed)"
    return None


def _within(kw: dict[str, Any], prof: Profile) -> None:
    """Raise InputError unless an untrusted request stays within the batch's profile."""
    hint = "(a request you wrote may: run_many(trusted=True), sandboxrun batch --trusted)"
    if kw.get("profile") == prof.name:  # the batch's own, by its name: the batch's (the name could find another)
        del kw["profile"]
    for key, what in HOST_KEYS.items():
        if kw.get(key) is not None:
            raise InputError(f"{key}: an untrusted request may not choose {what} {hint}")
    asked = {k: kw[k] for k in ("network", "output_overflow", *LIMIT_KEYS) if kw.get(k) is not None}
    if not asked:
        return
    from .profile import _LIMIT_OVERRIDES, with_overrides
    from .units import format_size

    got = with_overrides(prof, **asked)  # a bad value: the profile's own named error, as trusted
    net = kw.get("network")
    if net is not None and got.network != "none" and got.network != prof.network:
        raise InputError(f"network: {net!r} is more than the profile's {prof.network!r} {hint}")
    overflow = kw.get("output_overflow")
    if overflow is not None and overflow not in ("kill", prof.limits.output_overflow):  # drain runs on: more
        raise InputError(f"output_overflow: {overflow!r} is more than the profile's "
                         f"{prof.limits.output_overflow!r} {hint}")
    for key in (k for k in asked if k in LIMIT_KEYS):
        ceiling = getattr(prof.limits, key)
        if key == "timeout" and prof.limits.max_timeout is not None:
            ceiling = prof.limits.max_timeout  # the profile's own cap on a caller's timeout
        new = getattr(got.limits, key)
        if ceiling is not None and (new is None or new > ceiling):
            kind = _LIMIT_OVERRIDES[key]
            shown = format_size(ceiling) if kind == "size" else f"{ceiling:g}s" if kind == "duration" else f"{ceiling:g}"
            said_none = str(asked[key]).strip().lower() in ("unlimited", "none")
            value = f"{asked[key]!r}" + (" (no limit)" if new is None and not said_none else "")
            raise InputError(f"{key}: {value} is above the {shown} of profile {prof.name!r}: an "
                             f"untrusted request may only lower a limit {hint}")


def _run_one(pos: int, req: Any, profile: Profile, slots: Slots | None = None,
             cancel: Cancel | None = None, trusted: bool = False) -> BatchItem:
    from .supervisor import run

    if isinstance(req, _Invalid):
        return BatchError(pos, req.error, pos if req.id is None else req.id)
    rid = req.get("id") if isinstance(req, dict) else getattr(req, "id", None)  # known even when invalid
    try:
        rid, kw = _as_kwargs(req)
        if strictjson.too_deep(rid, MAX_DEPTH - 1) is not None:  # as deep as a JSONL line's id may be
            # (from Python; a line's was refused when read): its result's to_json would overflow the stack
            return BatchError(pos, f"id: nested more than {MAX_DEPTH - 1} levels deep (arrays and objects)", pos)
        problem = _id_problem(rid)
        if problem:
            return BatchError(pos, problem, pos)
        if not trusted:
            _within(kw, profile)
        if kw.get("profile") is None:
            kw["profile"] = profile
        res = run(kw.pop("command"), cgroup_slots=slots, cancel=cancel, **kw)
    except SandboxError as e:
        return BatchError(pos, str(e), pos if rid is None else rid)
    except Exception as e:  # noqa: BLE001 - one broken request must not end the batch
        return BatchError(pos, f"internal error: {type(e).__name__}: {e}", pos if rid is None else rid)
    out = BatchResult.__new__(BatchResult)
    out.__dict__.update(res.__dict__)  # same fields; no copy of the captured output
    out.id = pos if rid is None else rid
    out.line = pos
    return out


MAX_CONCURRENCY = 1024  # a thread and a sandbox each: more is a typo, not a wish (-j 1000000)


def _positive(concurrency: Any, label: str = "concurrency") -> int:
    if concurrency is None:
        return os.cpu_count() or 1
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or not 1 <= concurrency <= MAX_CONCURRENCY:
        raise InputError(f"{label}: expected a whole number from 1 to {MAX_CONCURRENCY}, got {concurrency!r}")
    return concurrency


def run_many(requests: Iterable[Any], concurrency: int | None = None, *, ordered: bool = True,
             profile: str | Profile = "strict", trusted: bool = False) -> Iterator[BatchItem]:
    """Run each request (dict or BatchRequest) in its own sandbox, `concurrency` at a time
    (default: the number of CPUs), and yield a BatchResult (a Result with `.id`) or a
    BatchError per request: in input order, or as they finish with `ordered=False`.

    `profile` bounds every request: one may lower its limits (and turn its network off), but
    choose no other profile, no host directory (cwd, bind, ro_bind), no higher limit: a
    BatchError names the key. `trusted=True` (requests you wrote) lifts that: a request then
    has the caller's say, as sandbox.run's arguments do.

    `requests` may be any iterable, including a generator: it is consumed lazily.
    Closing the iterator early cancels what has not started and kills what runs (its result
    is not wanted), returning once those sandboxes are gone.
    """
    workers = _positive(concurrency)
    if not isinstance(ordered, bool):  # "no" is true to Python
        raise InputError(f"ordered: expected True or False, got {ordered!r}")
    if not isinstance(trusted, bool):
        raise InputError(f"trusted: expected True or False, got {trusted!r}")
    prof = profile if isinstance(profile, Profile) else load(profile)  # a bad profile fails now, not per line
    if isinstance(requests, (str, bytes, dict)) or not hasattr(requests, "__iter__"):
        raise InputError(f"requests: expected an iterable of requests, got {type(requests).__name__}")
    return _stream(enumerate(requests, 1), workers, ordered, prof, trusted=trusted)


def _stream(items: Iterator[tuple[int, Any]] | _Feed, workers: int, ordered: bool,
            prof: Profile, stop: Callable[[], bool] = lambda: False, *, trusted: bool) -> Iterator[BatchItem]:
    """The batch: requests in, results out. One loop in the consumer's thread submits what is
    at hand while the window has room, yields what has ended (in input order when `ordered`),
    and else sleeps until a run ends or a request comes, a quarter second at most: Python runs
    signal handlers in this thread only, and a Ctrl-C the kernel gave a worker must not wait
    for a run to end. `stop()`, asked at each wait, ends the batch early (its runs killed)."""
    from .supervisor import Cancel

    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandboxrun-batch")
    slots = Slots()  # the CPU and pids cgroups, kept from one run to the next (isolation/cgroups.py)
    cancel = Cancel()  # an early end (close, break, Ctrl-C) kills what runs: its results are not wanted
    feed = items if isinstance(items, _Feed) else None
    wake = feed.wake if feed else _Wake()
    window = workers * (WINDOW_PER_WORKER if ordered else 2)
    inflight: collections.deque[Future[BatchItem]] = collections.deque()
    failed: list[BaseException] = []
    more = True
    owner = os.getpid()
    _register(cancel, pool, slots)

    def ended(_fut: Future[BatchItem]) -> None:
        wake.set()

    try:
        while True:
            wake.clear()  # before looking: what ends from here on wakes the wait below
            while more and len(inflight) < window:
                nxt = feed.take(failed) if feed else _pull(items, failed)
                if nxt is _NOT_YET:
                    break
                if nxt is None:
                    more = False
                    break
                with signals.held():  # (a Ctrl-C inside submit left a worker running that no one waited for)
                    fut = pool.submit(_run_one, nxt[0], nxt[1], prof, slots, cancel, trusted)
                    inflight.append(fut)
                fut.add_done_callback(ended)
            if ordered:
                ready = []
                while inflight and inflight[0].done():
                    ready.append(inflight.popleft())
            else:
                ready = [f for f in inflight if f.done()]
                for f in ready:
                    inflight.remove(f)
            for f in ready:
                yield f.result()
            if ready:
                continue
            if not inflight and not more:
                if failed:
                    raise failed[0]
                return
            if stop():
                return
            wake.wait(0.25)
    finally:
        # A forked copy of the caller finalizing its copy of us does nothing: the runs, the
        # cancel pipe and the slot cgroups are its parent's (a cancel there killed the runs).
        # Else each step to its end though a second Ctrl-C or SIGTERM comes meanwhile: one
        # that cut pool.shutdown short left the batch's slot cgroups behind. (Inline, not a
        # function of its own: a call is one more point where that Ctrl-C lands first.)
        if os.getpid() == owner:
            from .supervisor import _Uninterrupted

            steady = _Uninterrupted()
            if feed:
                steady.do(feed.close)
            steady.do(lambda: pool.shutdown(wait=False, cancel_futures=True))  # what has not started never will
            steady.do(cancel.cancel)  # (a no-op for runs that all ended: the batch is over)
            steady.do(_until_ended, inflight, wake)  # the runs under way, killed, and their teardown
            steady.do(pool.shutdown)  # (their workers, done by now)
            steady.do(slots.close)
            steady.do(cancel.close)
            steady.do(_unregister, cancel)
            if sys.exc_info()[1] is None:  # (else the first interrupt is on its way out already)
                steady.raise_pending()


def _until_ended(futures: Iterable[Future[BatchItem]], wake: _Wake) -> None:
    """Waits on the runs' futures, not on their threads: CPython 3.11's Thread.join, cut by a
    Ctrl-C while the thread still runs, marks it stopped (bpo-45274's fix releases the lock
    the running thread holds), so the retried join returned at once, the interpreter exited
    under a run's teardown, and that run's memory cgroup was left. A future is done only
    once its run has returned, torn down. One not started is cancelled here: the pool's own
    cancel, cut by a second Ctrl-C between taking a request off its queue and cancelling its
    future, left that future pending for ever, and the batch waited for it (1 in 30)."""
    for f in futures:
        f.cancel()  # (what runs, or has ended, stays as it is)
    while not all(f.done() for f in futures):
        wake.clear()
        if all(f.done() for f in futures):
            return
        wake.wait(0.1)


class _Wake:
    """threading.Event's set, clear and wait, whose wait a Ctrl-C may cut at any point: the
    Condition inside Event.wait, interrupted as it took its lock back, raised RuntimeError
    ("release unlocked lock") out of the batch. Set is a free lock here; wait takes it (an
    interruptible acquire) and gives it back."""

    def __init__(self) -> None:
        self._free = _thread.allocate_lock()
        self._free.acquire()  # not set
        self._guard = _thread.allocate_lock()

    def set(self) -> None:
        with self._guard:
            if self._free.locked():
                self._free.release()

    def clear(self) -> None:
        with self._guard:
            self._free.acquire(blocking=False)

    def wait(self, timeout: float) -> None:
        if self._free.acquire(timeout=timeout):
            self.set()  # still set: until clear()


_NOT_YET = object()  # a _Feed with no request at hand yet
_live: dict[int, tuple[Cancel, ThreadPoolExecutor, Slots]] = {}  # the batches under way: killed at exit
_live_lock = threading.Lock()
_atexit_registered = False


def _register(cancel: Cancel, pool: ThreadPoolExecutor, slots: Slots) -> None:
    """A batch left open when the interpreter exits (an iterator never closed) is killed then.
    Before: its pool's workers, joined at exit, ran every request of the window to its end.
    The hook runs before concurrent.futures joins them (it is registered after, and these
    hooks run last first). It then finishes the teardown the batch's own did not: a second
    Ctrl-C that came as its `finally` began cut it short, its slot cgroups left."""
    global _atexit_registered
    with _live_lock:
        _live[id(cancel)] = (cancel, pool, slots)
        if not _atexit_registered:
            threading._register_atexit(_kill_live)  # type: ignore[attr-defined]
            _atexit_registered = True


def _unregister(cancel: Cancel) -> None:
    with _live_lock:
        _live.pop(id(cancel), None)


def _forget_batches_at_fork() -> None:
    """A forked copy of the caller kills none of its parent's batches at its exit."""
    global _live_lock
    _live.clear()
    _live_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_batches_at_fork)


def _kill_live() -> None:
    with _live_lock:
        live = list(_live.values())
    for _cancel, pool, _slots in live:  # what has not started never will: first, else a worker freed by
        pool.shutdown(wait=False, cancel_futures=True)  # the kill below would start one, at exit
    for cancel, _pool, _slots in live:  # all at once: each wait below is for killed runs
        try:
            cancel.cancel()
        except OSError:
            pass
    for _cancel, pool, slots in live:
        try:
            pool.shutdown(wait=True)
            slots.close()
        except Exception:  # noqa: BLE001 - at exit: the next sandboxrun's sweep takes what is left
            pass


def _pull(items: Iterator[tuple[int, Any]], failed: list[BaseException]) -> tuple[int, Any] | None:
    """The next request, or None at the end; an error of the caller's iterator (or of the
    JSONL reader) ends the input there: it is raised once the runs already started have
    given their results, not instead of them."""
    try:
        return next(items, None)
    except Exception as e:  # noqa: BLE001 - raised again, after the results
        failed.append(e)
        return None


class _Feed:
    """Requests read ahead by a thread of their own (the CLI's JSONL input), so that the
    result of a run that ended is written while the next line has not come: a driver that
    waits for each result before it sends the next line would otherwise wait for ever.
    Reads at most `ahead` requests beyond what the batch took."""

    def __init__(self, items: Iterator[tuple[int, Any]], ahead: int, done: Callable[[], None] = lambda: None) -> None:
        self.wake = _Wake()
        self._items, self._ahead, self._done = items, ahead, done
        self._queue: collections.deque[tuple[int, Any]] = collections.deque()
        self._room = threading.Condition()
        self._end = False
        self._error: BaseException | None = None
        self._closed = False
        threading.Thread(target=self._read, name="sandboxrun-batch-input", daemon=True).start()

    def _read(self) -> None:
        try:
            for item in self._items:
                with self._room:
                    while len(self._queue) >= self._ahead and not self._closed:
                        self._room.wait()
                    if self._closed:
                        return
                    self._queue.append(item)
                self.wake.set()
        except Exception as e:  # noqa: BLE001 - raised in the batch's thread, after the results
            self._error = e
        finally:
            self._done()
            with self._room:
                self._end = True
            self.wake.set()

    def take(self, failed: list[BaseException]) -> tuple[int, Any] | None | object:
        """The next request; None at the end (an error reading is added to `failed`); _NOT_YET."""
        with self._room:
            if self._queue:
                self._room.notify()
                return self._queue.popleft()
            if not self._end:
                return _NOT_YET
        if self._error is not None:  # (set before _end: the reader is done with it)
            failed.append(self._error)
            self._error = None
        return None

    def close(self) -> None:
        """No more reading: the thread stops at its next request (a read that blocks is left to
        the daemon thread; it reads with os.read, holding no lock an exiting interpreter needs)."""
        with self._room:
            self._closed = True
            self._room.notify()


class _FdLines:
    """readline() straight from a file descriptor (os.read), for the reading thread: a thread
    blocked in a buffered file's readline holds its lock, and the interpreter's exit, which
    closes sys.stdin, would then stop with a fatal error."""

    def __init__(self, fd: int, name: str) -> None:
        self.fd, self.name = fd, name
        self._buf = bytearray()
        self._scanned = 0  # of _buf, searched for a newline already

    def close(self) -> None:
        os.close(self.fd)

    def readline(self, limit: int) -> bytes:
        while True:
            i = self._buf.find(b"\n", self._scanned, limit)
            if i >= 0 or len(self._buf) >= limit:
                n = i + 1 if i >= 0 else limit
                line = bytes(self._buf[:n])
                del self._buf[:n]
                self._scanned = 0
                return line
            self._scanned = len(self._buf)
            try:
                chunk = os.read(self.fd, 1 << 16)
            except OSError as e:  # EIO, EISDIR: the input's fault, named, after the results so far
                raise InputError(f"{self.name}: cannot read: {e.strerror or e}") from None
            if not chunk:
                line = bytes(self._buf)
                self._buf.clear()
                self._scanned = 0
                return line
            self._buf += chunk


# ---------------------------------------------------------------------------- JSONL


MAX_LINE = 64 << 20  # bytes in one request line (its stdin included); a longer one is refused
MAX_SKIP = 1 << 30  # of an over-long line, read past at most this much: an endless one stops the batch
MAX_DEPTH = 64  # arrays and objects in one request line, the line's own object included: a deeper one is
# refused (a valid `"id": [[[...]]]` some hundreds deep overflowed the recursion of to_dict/to_json later)


def lines(stream: IO[bytes]) -> Iterator[tuple[int, bytes | None]]:
    """(line number, line) per line, never more than MAX_LINE bytes of one in memory; an
    over-long line gives None. One with no end in sight (/dev/zero) raises InputError."""
    n = 0
    while True:
        raw = stream.readline(MAX_LINE + 1)
        if not raw:
            return
        n += 1
        if len(raw) <= MAX_LINE or raw.endswith(b"\n"):
            yield n, raw
            continue
        skipped = len(raw)
        while not raw.endswith(b"\n"):
            raw = stream.readline(1 << 20)
            skipped += len(raw)
            if not raw:
                break
            if skipped > MAX_SKIP:
                raise InputError(f"line {n}: no end of line in its first {MAX_SKIP >> 30} GiB: stopped reading "
                                 "(is this a JSONL file?)")
        yield n, None


def wide_text(first: bytes) -> bool:
    """Whether a file's first line is UTF-16 or UTF-32: a byte order mark, or a JSON object's
    `{` with the NUL that such text gives every ASCII character."""
    return first.startswith((b"\xff\xfe", b"\xfe\xff", b"\0\0\xfe\xff", b"{\0", b"\0{", b"\0\0\0{"))


def read_jsonl(stream: IO[bytes]) -> Iterator[tuple[int, Any]]:
    """(line number, request or _Invalid) per non-blank line, read lazily."""
    for n, raw in lines(stream):
        if raw is None:
            yield n, _Invalid(f"longer than {MAX_LINE >> 20} MiB: not read")
            continue
        if n == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]  # a byte order mark may open the file, as some editors write one
        if not raw.strip():
            continue
        if n == 1 and wide_text(raw):
            # split at the byte \n, its lines are not the text's: no line's result would be its own
            raise InputError("not UTF-8: UTF-16 or UTF-32 text (JSONL is UTF-8: iconv -t UTF-8)")
        if b"\0" in raw:  # no JSON text holds a raw NUL; UTF-16 and UTF-32 hold many
            yield n, _Invalid("not UTF-8 text: NUL bytes (UTF-16 or UTF-32?)")
            continue
        try:
            # UTF-8 only, decoded here: json.loads of bytes guesses UTF-16 or UTF-32 from the
            # first bytes, while lines are split at the byte \n. The line ending goes, so
            # columns count in the line.
            text = raw.decode("utf-8").rstrip("\r\n")
            obj = strictjson.loads(text, unique_keys=True)
        except UnicodeDecodeError as e:
            yield n, _Invalid(f"not UTF-8 ({e.reason} at byte {e.start})")
            continue
        except json.JSONDecodeError as e:
            yield n, _Invalid(f"invalid JSON: {e.msg} at column {e.colno}")
            continue
        except RecursionError:
            yield n, _Invalid("invalid JSON: nested too deeply")
            continue
        except ValueError as e:  # a number of over 4300 digits; NaN, Infinity; a key given twice
            yield n, _Invalid(f"invalid JSON: {e}")
            continue
        if not isinstance(obj, dict):
            yield n, _Invalid(f"expected a JSON object, got {type(obj).__name__}")
            continue
        if strictjson.too_deep(obj, MAX_DEPTH) is not None:  # its id stays the line number: the id may be the deep part
            yield n, _Invalid(f"nested more than {MAX_DEPTH} levels deep (arrays and objects)")
            continue
        yield n, obj


def count_requests(stream: IO[bytes]) -> int | None:
    """Non-blank lines left in a regular file (read, then rewound); None for a pipe,
    FIFO or device, which can be read only once (or never ends): no total is shown then."""
    import stat

    try:
        if not stat.S_ISREG(os.fstat(stream.fileno()).st_mode):
            return None
        start = stream.tell()  # stdin redirected from a file may not be at its start
        total = sum(1 for _, raw in lines(stream) if raw is None or raw.strip())
        stream.seek(start)
        return total
    except (OSError, InputError):
        return None


class Progress:
    """One `\\r` status line on a terminal: done/total, rate, ETA, failures. Silent otherwise."""

    def __init__(self, stream: IO[str], total: int | None, every: float = 0.1) -> None:
        self.stream, self.total, self.every = stream, total, every
        self.enabled = bool(getattr(stream, "isatty", lambda: False)())
        self.done = self.failures = 0
        self.start = self.last = time.monotonic()
        self.width = 0

    def update(self, item: BatchItem) -> None:
        self.done += 1
        if not item.success:
            self.failures += 1
        now = time.monotonic()
        if self.enabled and now - self.last >= self.every:
            self.last = now
            self._draw(now)

    def line(self, now: float) -> str:
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        count = f"{self.done}/{self.total}" if self.total is not None else f"{self.done}"
        text = f"{count}  {rate:.1f}/s"
        if self.total is not None:
            left = max(self.total - self.done, 0)
            text += f"  ETA {_clock(left / rate) if rate > 0 else '?'}"
        return text + f"  failures {self.failures}"

    def _draw(self, now: float) -> None:
        text = self.line(now)
        pad = " " * max(0, self.width - len(text))
        self.width = len(text)
        try:
            self.stream.write("\r" + text + pad)
            self.stream.flush()
        except OSError:
            self.enabled = False

    def clear(self) -> None:
        """Blank the status line (it is drawn again at the next update)."""
        if self.enabled and self.width:
            try:
                self.stream.write("\r" + " " * self.width + "\r")
                self.stream.flush()
            except OSError:
                self.enabled = False
            self.width = 0
            self.last = 0.0  # drawn again at once

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            try:
                self.stream.write("\n")
                self.stream.flush()
            except OSError:
                pass


def _reader_gone(out: IO[str]) -> Callable[[], bool]:
    """Whether the reader of `out` went away (`| head -1`: a pipe's read end closed, a terminal
    hung up), asked while the batch waits for runs: a write would learn it only with the next
    result, perhaps a timeout later. A file never says so."""
    import select

    try:
        fd = out.fileno()
    except (OSError, ValueError):  # a caller's own stream: no fd to ask
        return lambda: False
    poller = select.poll()
    poller.register(fd, 0)  # no event asked for: POLLERR, POLLHUP and POLLNVAL come anyway
    return lambda: bool(poller.poll(0))


def _drop_output(out: IO[str]) -> None:
    """Points fd 1 at /dev/null, so that what is still buffered, flushed at exit, is lost quietly."""
    try:
        fd = out.fileno()
    except (OSError, ValueError):  # not a file (a caller's own stream): nothing to point anywhere
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _say(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:  # stderr gone too (2>&1 > /dev/full): the exit code says it
        pass


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def main(argv: list[str]) -> int:
    """`sandboxrun batch FILE.jsonl|-`: exit 0 when every line ran (whatever the commands
    did: see each line's status), 1 when some line could not be run (an invalid request, or
    a sandbox that could not be set up), 2 on bad usage."""
    from .cliargs import Parser, integer

    p = Parser(prog="sandboxrun batch", description="Run one sandboxed request per JSONL line; "
                "print one Result per line (with \"id\"), in input order unless --unordered.")
    p.add_argument("file", help="JSONL file, one request per line, or - for stdin")
    p.add_argument("--unordered", action="store_true", help="print each result as soon as it is done")
    p.add_argument("--concurrency", "-j", type=integer, help=f"runs at once (default: CPUs, {os.cpu_count()})")
    p.add_argument("--profile", "-p", default="strict",
                   help="every line's profile (default: strict); a line may lower its limits, no more")
    p.add_argument("--trusted", action="store_true",
                   help="lines you wrote: each may name its profile, cwd, binds, network and limits")
    ns = p.parse_args(argv)
    workers = _positive(ns.concurrency, "--concurrency")
    prof = load(ns.profile)
    if not ns.file:
        raise InputError("batch: empty file name (give a JSONL file, or - for stdin)")
    if ns.file == "-":
        src: IO[bytes] = sys.stdin.buffer
    else:
        try:  # opened once: a FIFO or /dev/stdin can be read only once
            src = open(ns.file, "rb")  # closed in the finally below
        except OSError as e:
            raise InputError(f"{ns.file}: {e.strerror}") from None
    shown = bool(getattr(sys.stderr, "isatty", lambda: False)())  # the total only feeds the progress line
    progress = Progress(sys.stderr, count_requests(src) if shown else None)
    bad = 0
    out = sys.stdout
    same_terminal = progress.enabled and bool(getattr(out, "isatty", lambda: False)())
    name = "stdin" if src is sys.stdin.buffer else ns.file
    lines = _FdLines(os.dup(src.fileno()), name)  # its own fd: src is closed below, perhaps mid-read
    feed = _Feed(read_jsonl(lines), workers * WINDOW_PER_WORKER, done=lines.close)
    gone = _reader_gone(out)
    results = _stream(feed, workers, not ns.unordered, prof, gone, trusted=ns.trusted)
    try:
        for item in results:
            bad += isinstance(item, BatchError) or item.status == "setup_error"  # neither ran
            try:
                if same_terminal:
                    progress.clear()  # a result line never starts after the status line's text
                out.write(item.to_json() + "\n")
                out.flush()  # a consumer downstream sees each result as it comes
            except OSError as e:  # only the output's: an error reading the input is not caught here
                _drop_output(out)
                if not isinstance(e, BrokenPipeError):  # the reader went away (| head): stop quietly
                    _say(f"sandboxrun: error: stdout cannot be written: {e.strerror or e}")  # ENOSPC (> /dev/full)
                return 1  # the rest of the results are lost; the runs under way are killed below
            progress.update(item)
        if gone():  # stopped early: the runs under way are killed below, as on a failed write
            _drop_output(out)
            return 1
    finally:
        from .supervisor import _Uninterrupted

        steady = _Uninterrupted()  # a second Ctrl-C must not cut the teardown short
        steady.do(results.close)  # cancels what has not started, kills what runs
        steady.do(progress.close)
        if src is not sys.stdin.buffer:
            steady.do(src.close)
    return 1 if bad else 0
