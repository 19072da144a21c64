"""`sandboxrun mcp`: the sandbox as Model Context Protocol tools, over stdio.

Needs the optional extra (`pip install 'sandboxrun[mcp]'`); the core never imports
it. The profile and the workspace are fixed by the server's command line, never
chosen by the model: every run uses `--profile`, and `--workspace DIR` is bound
read-write at the profile's workdir (/work in `strict`); without it each run gets
a fresh empty workdir and nothing persists between calls.

Tools return the structured Result. Failures of the sandbox itself (bad
arguments, a command refused by the first-line filter, a sandbox that could not
be set up) are tool errors (isError) whose text is the reason; what the command
does (non-zero exit, timeout, memory limit) is a normal result with its status.
Works with mcp 1.x (`FastMCP`) and 2.x (`MCPServer`).
"""

# No `from __future__ import annotations`: the tool signatures inside build_server() use
# local Annotated aliases that the SDK must be able to evaluate.
import errno
import functools
import json
import os
import re
import sys
import threading
from collections.abc import Callable
from typing import Annotated, Any

from .errors import InputError, SandboxError, os_bytes
from .profile import Profile
from .strictjson import utf8_text

INSTRUCTIONS = """Run shell commands and Python code in a hardened Linux sandbox (profile {profile}).
Each run starts from a clean process tree with no network beyond its own loopback, read-only system
directories, and limits on time, memory, processes and output. The working directory inside is {workdir};
{workspace}. Use run_command for shell commands, run_python for Python, check_command to ask whether the
first-line filter would refuse a command, and start/poll/log/write/send_keys/kill/remove for long-running or
interactive background processes."""


def _imports() -> tuple[Any, type[Exception], Any]:
    """(server class, ToolError, Field) for whichever mcp SDK is installed."""
    try:
        from pydantic import Field
    except ImportError as e:  # pragma: no cover - pydantic comes with mcp
        raise SandboxError(f"the MCP server needs pydantic: {e}") from None
    try:
        from mcp.server.mcpserver import MCPServer  # mcp >= 2
        from mcp.server.mcpserver.exceptions import ToolError

        return MCPServer, ToolError, Field
    except ImportError:
        pass
    try:
        from mcp.server.fastmcp import FastMCP  # mcp 1.x
        from mcp.server.fastmcp.exceptions import ToolError
    except ImportError:
        raise SandboxError("the MCP server needs the mcp package: pip install 'sandboxrun[mcp]'") from None
    return FastMCP, ToolError, Field


MAX_SESSIONS = 16  # background sessions a server keeps at once (each a monitor process, logs on disk)
HOST_ONLY = ("dir", "pid", "monitor_pid")  # a session's host folder and host pids: nothing the model can use


def _for_peer(info: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in info.items() if k not in HOST_ONLY}


def _utf8(value: Any) -> Any:
    """`value` with each lone surrogate shown as its escape: the SDK cannot write one (a
    PydanticSerializationError lost the whole reply; in an error message, it ended the
    server). They come from names on disk that are not UTF-8 (`\\xff.py` is "\\udcff.py")."""
    if isinstance(value, str):
        return utf8_text(value)
    if isinstance(value, dict):
        return {_utf8(k): _utf8(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_utf8(v) for v in value]
    return value


class Tools:
    """The tool implementations (synchronous; the server runs them in worker threads)."""

    def __init__(self, profile: Profile, workspace: str | None, tool_error: type[Exception],
                 max_sessions: int = MAX_SESSIONS) -> None:
        self.profile = profile
        self.workspace = workspace
        self.max_sessions = max_sessions
        self.ToolError = tool_error
        self.started: list[str] = []  # background sessions this server started (killed on exit)
        self._closing = False  # set by close(): a start that finishes after it removes its session
        self._starting = 0  # starts under way: counted against max_sessions with the started ones
        self._lock = threading.Lock()

    # -- helpers

    def _fail(self, message: str) -> Exception:
        return self.ToolError(_utf8(message))  # a path the model named may not be UTF-8

    def _kw(self, timeout: float | None, cancel: Any = None) -> dict[str, Any]:
        kw: dict[str, Any] = {"profile": self.profile, "cwd": self.workspace}
        if cancel is not None:
            kw["cancel"] = cancel
        if timeout is not None:
            kw["timeout"] = timeout
        return kw

    def _checked(self, res: Any) -> dict[str, Any]:
        if res.status == "blocked":
            raise self._fail(f"blocked, nothing ran: {res.block_reason}")
        if res.status == "setup_error":
            raise self._fail(f"nothing ran: the sandbox could not be set up: {res.error}")
        return res.to_dict()

    def _call(self, fn: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        try:
            return fn(*a, **kw)
        except SandboxError as e:
            raise self._fail(str(e)) from None

    def _script(self, script: str) -> str:
        if self.workspace is None:
            raise self._fail("script: this server has no --workspace; pass the source as `code` instead")
        # realpath would raise ValueError / UnicodeEncodeError: no file has such a name
        if "\0" in script:
            raise self._fail("script: contains a NUL byte")
        try:
            os_bytes(script, "script")
        except InputError as e:
            raise self._fail(str(e)) from None
        path = os.path.realpath(os.path.join(self.workspace, script))
        if path != self.workspace and not path.startswith(self.workspace + os.sep):
            raise self._fail(f"script: {script!r} is outside the workspace")
        return path

    # -- foreground

    def run_command(self, command: str, timeout: float | None = None, stdin: str | None = None,
                    env: dict[str, str] | None = None, cancel: Any = None) -> dict[str, Any]:
        from .supervisor import run

        return self._checked(self._call(run, command, shell=True, stdin=stdin, env=env,
                                        **self._kw(timeout, cancel)))

    def run_python(self, code: str | None = None, script: str | None = None, args: list[Any] | None = None,
                   function: str | None = None, statement: str | None = None, timeout: float | None = None,
                   stdin: str | None = None, cancel: Any = None) -> dict[str, Any]:
        from .coderunner import run_code, run_python

        if (code is None) == (script is None):
            raise self._fail("give exactly one of `code` (Python source) or `script` (a file in the workspace)")
        kw = self._kw(timeout, cancel)
        if code is not None:
            if function is not None or statement is not None:
                raise self._fail("function and statement apply to a `script`, not to `code`")
            bad = [a for a in args or () if not isinstance(a, str)]
            if bad:
                raise self._fail("args: with `code`, arguments must be strings (they become sys.argv[1:])")
            return self._checked(self._call(run_code, code, args or [], stdin=stdin, **kw))
        path = self._script(script or "")
        return self._checked(self._call(run_python, path, args or [], function=function, statement=statement,
                                        stdin=stdin, **kw))

    def check_command(self, command: str) -> dict[str, Any]:
        from .filter import check
        from .supervisor import to_argv

        p = self.profile
        # What run_command would refuse as bad input (a NUL byte, a lone surrogate) is not "allowed".
        self._call(lambda: os_bytes("\0".join(to_argv(command, True)), "command"))
        v = self._call(check, command, blocklist=p.blocklist, extra_block=p.block, allow=p.allow)
        return {"allowed": v.allowed, "rule": v.rule, "reason": v.reason, "profile": p.name}

    # -- background sessions (sandbox/sessions.py); the model sees only the ones this server started

    def _get(self, session_id: str) -> Any:
        from . import sessions

        if session_id not in self.started:
            raise self._fail(f"no session {session_id!r} started by this server (see list)")
        return self._call(sessions.get, session_id)

    def start(self, command: str, timeout: float | None = None, pty: bool = False,
              name: str | None = None) -> dict[str, Any]:
        from . import sessions

        with self._lock:
            if len(self.started) + self._starting >= self.max_sessions:
                # Those gone meanwhile (their TTL swept them, or a `sandboxrun remove`) count no more.
                root = self._call(sessions.state_dir)
                self.started = [sid for sid in self.started if os.path.isdir(os.path.join(root, sid))]
            if len(self.started) + self._starting >= self.max_sessions:
                raise self._fail(f"this server keeps at most {self.max_sessions} background sessions: remove one "
                                 "that has ended (or kill and remove one) first")
            self._starting += 1
        try:
            # ends_with_caller: they are killed on close(), and by their monitors if we are SIGKILLed
            s = self._call(sessions.start, command, shell=True, pty=pty, name=name, ends_with_caller=True,
                           **self._kw(timeout))
        finally:
            with self._lock:
                self._starting -= 1
        res = s.result if s.state == "exited" else None
        if res is not None and res.status == "setup_error":  # a tool error, as run_command's; kept nowhere
            self._call(s.remove, grace=0)
            raise self._fail(f"nothing ran: the sandbox could not be set up: {res.error}")
        with self._lock:
            if not self._closing:
                self.started.append(s.id)
                return _for_peer(s.info())
        try:  # the server closed while this one started: nothing of it may outlive the server
            s.remove(grace=0)
        except Exception:  # noqa: BLE001 - best effort; it may be gone already
            pass
        raise self._fail("the server is shutting down")

    def list_sessions(self) -> dict[str, Any]:
        from . import sessions

        mine = [s for s in self._call(sessions.list_sessions) if s.id in self.started]
        return {"sessions": [_for_peer(s.info()) for s in mine]}

    def poll(self, session_id: str) -> dict[str, Any]:
        return self._call(self._get(session_id).poll).to_dict()

    def log(self, session_id: str, offset: int | None = None, limit: int | None = None,
            stream: str = "output") -> dict[str, Any]:
        page = self._call(self._get(session_id).log, offset=offset, limit=limit, stream=stream)
        hint = page.hint()  # (in the CLI's words: --offset N --limit M)
        return {**page.to_dict(), "hint": hint and hint.replace("--offset ", "offset=").replace("--limit ", "limit=")}

    def write(self, session_id: str, data: str, eof: bool = False) -> dict[str, Any]:
        return {"id": session_id, "written": self._call(self._get(session_id).write, data, eof=eof), "eof": eof}

    def send_keys(self, session_id: str, keys: list[str]) -> dict[str, Any]:
        return {"id": session_id, "written": self._call(self._get(session_id).send_keys, *keys)}

    def kill(self, session_id: str) -> dict[str, Any]:
        s = self._get(session_id)
        res = self._call(s.kill)
        return {"id": session_id, "state": s.state, "result": res.to_dict() if res else None}

    def remove(self, session_id: str) -> dict[str, Any]:
        res = self._call(self._get(session_id).remove)
        with self._lock:  # concurrent removes of one session: the first takes it off the list
            if session_id not in self.started:
                raise self._fail(f"no session {session_id!r} started by this server (removed already)")
            self.started.remove(session_id)
        return {"id": session_id, "removed": True, "result": res.to_dict() if res else None}

    def close(self) -> None:
        """Kill and remove the background sessions this server started and left behind."""
        from . import sessions

        with self._lock:
            self._closing = True
        for sid in list(self.started):
            try:
                sessions.get(sid).remove(grace=0.5)
            except Exception:  # noqa: BLE001 - best effort at shutdown; it may be gone already
                pass
        self.started.clear()


def default_max_runs() -> int:
    return max(2, os.cpu_count() or 1)


def build_server(profile: str | Profile = "strict", workspace: str | None = None, *, max_runs: int | None = None,
                 max_sessions: int = MAX_SESSIONS) -> tuple[Any, Tools]:
    """The MCP server object (FastMCP/MCPServer) with every tool registered, and its Tools.
    At most `max_runs` foreground runs go at once (more calls wait their turn), and at most
    `max_sessions` background sessions are kept."""
    import anyio
    import anyio.to_thread

    from .asyncrun import in_thread
    from .profile import load

    server_cls, tool_error, Field = _imports()
    prof = profile if isinstance(profile, Profile) else load(profile)
    ws = _workspace(workspace)
    tools = Tools(prof, ws, tool_error, max_sessions)
    # The SDK reads its input and writes its replies through anyio's default thread pool (40
    # threads): tool calls that filled it stalled every other request, ping and cancel included.
    # Short tools get a pool of their own; runs a thread each (in_thread), at most max_runs at once.
    tool_threads = anyio.CapacityLimiter(16)
    run_slots = anyio.Semaphore(max_runs or default_max_runs())
    inside = prof.workdir if prof.workdir != "same" else (ws or "a fresh directory")
    where = (f"it is the server's workspace, shared by every call (host directory {ws})" if ws
             else "it is a fresh empty directory for each call; nothing persists between calls")
    server = server_cls("sandboxrun", instructions=INSTRUCTIONS.format(profile=prof.name, workdir=inside,
                                                                       workspace=where), log_level="WARNING")
    low = getattr(server, "_lowlevel_server", None) or getattr(server, "_mcp_server", None)
    if low is not None and hasattr(low, "version"):  # (else mcp 2.x reports "" and 1.x the SDK's own)
        from . import __version__

        low.version = __version__

    def add(fn: Callable[..., Any], name: str, description: str) -> None:
        import inspect

        params = inspect.signature(server.add_tool).parameters
        kw: dict[str, Any] = {"name": name, "description": description}
        if "structured_output" in params:
            kw["structured_output"] = True
        server.add_tool(fn, **kw)

    def threaded(method: Callable[..., dict[str, Any]]) -> Callable[..., Any]:
        async def call(**kw: Any) -> dict[str, Any]:
            return _utf8(await anyio.to_thread.run_sync(functools.partial(method, **kw), limiter=tool_threads))

        return call

    def a_run(method: Callable[..., dict[str, Any]]) -> Callable[..., Any]:
        """A foreground run: a cancelled call (notifications/cancelled) kills its sandbox."""
        async def call(**kw: Any) -> dict[str, Any]:
            async with run_slots:
                return _utf8(await in_thread(lambda cancel: method(cancel=cancel, **kw)))

        return call

    # Every parameter strict: pydantic's lax mode would take "timeout": true as 1 s, "pty": "yes" or
    # "eof": 1 as true, and 2.0 as a line number; a tool error naming the field is what the model
    # needs instead. (Arguments the tool does not have are dropped by the SDK before they reach us.)
    T = Annotated  # short alias for the schemas below
    Cmd = T[str, Field(strict=True, description="Shell command line, run with /bin/sh -c inside the sandbox, e.g. 'ls -la | head'")]
    Timeout = T[float | None, Field(strict=True, description=(
        f"Wall-clock limit in seconds (default {prof.limits.timeout or 'none'}; at most "
        f"{prof.limits.max_timeout or 'the profile limit'}). On timeout the whole process tree is killed."))]
    Sid = T[str, Field(strict=True, description="Session id returned by start (see list)")]

    async def run_command(command: Cmd, timeout: Timeout = None,
                          stdin: T[str | None, Field(strict=True, description="Text fed to the command's stdin")] = None,
                          env: T[dict[str, str] | None, Field(strict=True, description="Extra environment variables")]
                          = None) -> dict[str, Any]:
        return await a_run(tools.run_command)(command=command, timeout=timeout, stdin=stdin, env=env)

    async def run_python(
        code: T[str | None, Field(strict=True, description="Python source to run (python3 -c CODE); "
                                  "give this or `script`")] = None,
        script: T[str | None, Field(strict=True, description="Path of a .py file in the workspace, relative to "
                                    "it; give this or `code`")] = None,
        args: T[list[Any] | None, Field(strict=True, description="Arguments: sys.argv[1:] for code/script "
                                        "(strings), or the function's arguments (any JSON values)")] = None,
        function: T[str | None, Field(strict=True, description="With `script`: import it and call this function "
                                      "with `args`; its return value comes back in return_value")] = None,
        statement: T[str | None, Field(strict=True, description="With `script`: run this statement or expression "
                                       "in the script's namespace; an expression's value comes back in "
                                       "return_value")] = None,
        timeout: Timeout = None,
        stdin: T[str | None, Field(strict=True, description="Text fed to the program's stdin")] = None,
    ) -> dict[str, Any]:
        return await a_run(tools.run_python)(code=code, script=script, args=args, function=function,
                                                statement=statement, timeout=timeout, stdin=stdin)

    async def check_command(command: T[str, Field(strict=True, description="Shell command line to check")]) -> dict[str, Any]:
        return await threaded(tools.check_command)(command=command)

    async def start(command: Cmd, timeout: Timeout = None,
                    pty: T[bool, Field(strict=True, description="Give the command a terminal (needed for send_keys and "
                                       "interactive programs such as shells, REPLs, editors)")] = False,
                    name: T[str | None, Field(strict=True, description="Optional name to remember it by")] = None,
                    ) -> dict[str, Any]:
        return await threaded(tools.start)(command=command, timeout=timeout, pty=pty, name=name)

    async def list_() -> dict[str, Any]:
        return await threaded(tools.list_sessions)()

    async def poll(session_id: Sid) -> dict[str, Any]:
        return await threaded(tools.poll)(session_id=session_id)

    async def log(session_id: Sid,
                  offset: T[int | None, Field(strict=True, description="First line to show, 0-based (default: the last "
                                              "`limit` lines)")] = None,
                  limit: T[int | None, Field(strict=True, description="At most this many lines (default 200)")] = None,
                  stream: T[str, Field(strict=True, description="'output' (both streams interleaved), 'stdout' or "
                                       "'stderr'")] = "output",
                  ) -> dict[str, Any]:
        return await threaded(tools.log)(session_id=session_id, offset=offset, limit=limit, stream=stream)

    async def write(session_id: Sid, data: T[str, Field(strict=True, description="Text to write to the session's stdin "
                                                        "(include '\\n' to end a line)")],
                    eof: T[bool, Field(strict=True, description="Close stdin after writing")] = False,
                    ) -> dict[str, Any]:
        return await threaded(tools.write)(session_id=session_id, data=data, eof=eof)

    async def send_keys(session_id: Sid, keys: T[list[str], Field(strict=True, description="Key names or text, in order, e.g. "
                                                                  "['ls', 'Enter'] or ['C-c']")]) -> dict[str, Any]:
        return await threaded(tools.send_keys)(session_id=session_id, keys=keys)

    async def kill(session_id: Sid) -> dict[str, Any]:
        return await threaded(tools.kill)(session_id=session_id)

    async def remove(session_id: Sid) -> dict[str, Any]:
        return await threaded(tools.remove)(session_id=session_id)

    add(run_command, "run_command", "Run a shell command in the sandbox and wait for it. Returns the Result: "
        "status (ok, nonzero_exit, timeout, memory_limit, ...), exit_code, stdout, stderr, duration_ms, usage.")
    add(run_python, "run_python", "Run Python 3 (standard library only) in the sandbox: inline `code`, or a "
        "`script` from the workspace, optionally one `function` of it or one `statement`. Returns the Result, "
        "plus return_value/return_type for a function or expression.")
    add(check_command, "check_command", "Ask whether the sandbox's first-line filter would refuse a command "
        "line, without running it. Returns allowed, rule and reason.")
    add(start, "start", "Start a command in the background (for servers, long jobs, interactive programs). "
        "It keeps running after this call returns (until it ends, its timeout, or kill). Returns the session "
        "with its id; then use poll, log, write, send_keys, kill, remove.")
    add(list_, "list", "List the background sessions started through this server, with their state.")
    add(poll, "poll", "New output of a background session since the last poll, its state, and the final "
        "Result once it ended.")
    add(log, "log", "Read a background session's output log by lines (offset/limit), without consuming it.")
    add(write, "write", "Write text to a background session's stdin (or its terminal); eof closes stdin.")
    add(send_keys, "send_keys", "Send key presses (Enter, C-c, Up, Tab, ...) and text to a background session started with pty.")
    add(kill, "kill", "Stop a background session (SIGTERM to its whole sandbox, then SIGKILL).")
    add(remove, "remove", "Kill a background session if it still runs, then forget it and delete its logs.")
    return server, tools


_UNREAD = "\0sandboxrun: "  # opens what _StdinLines gives for a line it did not read: no JSON text starts so


class _StdinLines:
    """stdin's lines for the SDK's reader, as its own reader gives them, but never more than
    batch.MAX_LINE bytes of one in memory (its reader held a 100 MB line whole) and UTF-8
    only (its reader replaced what was not): such a line reaches the SDK as a text that is
    no JSON, which _error_reply answers with what was wrong. Like the SDK's own claim of fd 0,
    fd 0 reads /dev/null while serving (nothing the server starts reads the wire)."""

    def __init__(self) -> None:
        import fcntl

        from .batch import lines

        self._fd = fcntl.fcntl(0, fcntl.F_DUPFD_CLOEXEC, 3)
        null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        os.dup2(null, 0)
        os.close(null)
        self._stream = open(self._fd, "rb", closefd=False)  # noqa: SIM115 - the server's whole life
        self._lines = lines(self._stream)
        self._ended = False

    def restore(self) -> None:
        # fd 0 only: the reader's thread may be blocked in a read that a client holding its
        # stdin open never ends, and a close would wait for it (the process exits next).
        os.dup2(self._fd, 0)

    def __aiter__(self) -> "_StdinLines":
        return self

    async def __anext__(self) -> str:
        import _thread
        import asyncio

        # Each line read in a thread of its own, abandoned when cancelled: a read that a client
        # holding stdin open never ends must hold up neither the server's end (a signal, or a
        # client that closed the output) nor the interpreter's exit, which joins the threads of
        # a pool (anyio's) and not these.
        loop = asyncio.get_running_loop()
        read: asyncio.Future[str | None] = loop.create_future()

        def settle(line: str | None, error: BaseException | None) -> None:
            if not read.done():
                read.set_exception(error) if error is not None else read.set_result(line)

        def target() -> None:
            line, error = None, None
            try:
                line = self._next()
            except BaseException as e:  # noqa: BLE001 - raised in the task
                error = e
            try:
                loop.call_soon_threadsafe(settle, line, error)
            except RuntimeError:  # the loop is closed: nobody waits for it
                pass

        pause = 0.01
        while True:
            try:
                _thread.start_new_thread(target, ())
                break
            except RuntimeError:  # no thread to be had now (RLIMIT_NPROC, or memory): the next read waits
                if sys.is_finalizing():
                    raise
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.5)
        line = await read
        if line is None:
            raise StopAsyncIteration
        return line

    def _next(self) -> str | None:
        from .batch import MAX_LINE

        if self._ended:
            return None
        try:
            item = next(self._lines, None)
        except InputError as e:  # no end of line in a GiB: reading stops there, as at the end of input
            self._ended = True
            return f"{_UNREAD}{e}"
        if item is None:
            return None
        raw = item[1]
        if raw is None:
            return f"{_UNREAD}a line longer than {MAX_LINE >> 20} MiB: not read"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            return f"{_UNREAD}not UTF-8 ({e.reason} at byte {e.start})"
        problem = _request_problem(text)
        return text if problem is None else _REPLY + json.dumps(problem)


_REPLY = "\0sandboxrun-reply: "  # opens what _StdinLines gives for a request it answers itself: the error, as JSON
_LONE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # \ud800-\udfff: half of a pair, perhaps alone


def _request_problem(text: str) -> dict[str, Any] | None:
    """The error reply for a request the SDK would get wrong, else None. An id that is no string
    or integer (null, 1.5, true, an object: MCP allows only those two) made the SDK take the
    request for a notification, dropped unanswered; a lone surrogate escape, which is JSON but no
    Unicode text, failed its parser, answered as no JSON at all and without the id."""
    try:
        msg = json.loads(text)
    except (ValueError, RecursionError):
        return None  # the SDK's parser says what is wrong
    if not isinstance(msg, dict) or "method" not in msg or "id" not in msg:
        return None
    rid = msg["id"]
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or isinstance(rid, str) and _utf8(rid) != rid:
        shown = json.dumps(rid)
        return {"code": -32600, "id": None, "message": 'Invalid Request: "id" must be a string or an integer, '
                f"got {shown[:60]}{'...' if len(shown) > 60 else ''}"}
    if _LONE_ESCAPE.search(text) and _has_lone_surrogate(msg):
        return {"code": -32602, "id": rid, "message": "Invalid params: a string holds a lone surrogate escape "
                "(\\ud800-\\udfff without its pair), which is no Unicode text"}
    return None


def _has_lone_surrogate(msg: Any) -> bool:
    stack = [msg]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if _utf8(v) != v:
                return True
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


def _error_reply(error: Exception) -> Any:
    """The reply JSON-RPC prescribes for a line that is no JSON (-32700) or no JSON-RPC message
    (-32600): the SDK dropped both without a word, and the client waited for ever."""
    from mcp.shared.message import SessionMessage
    from mcp.types import ErrorData, JSONRPCError

    details = getattr(error, "errors", None)
    try:
        errors = details() if callable(details) else []
        kinds = {e.get("type") for e in errors}
        first = errors[0].get("input") if errors else None
        # pydantic's own words ("params: Input should be an object"), not the URL its str() ends with
        reason = _utf8(" ".join(f"{'.'.join(map(str, errors[0].get('loc', ())[1:]))}: {errors[0]['msg']}".split())
                       .lstrip(": ")) if errors else ""
        # a message that parsed: its id, when that is one (JSON-RPC: null only when it cannot be read)
        ids = [e["input"].get("id") for e in errors if isinstance(e.get("input"), dict) and "method" in e["input"]]
    except Exception:  # noqa: BLE001 - a detail, not worth failing the reply for
        kinds, first, reason, ids = set(), None, "", []
    bad_json = "json_invalid" in kinds or isinstance(error, ValueError) and not kinds
    code, what = (-32700, "Parse error: not JSON") if bad_json else (-32600, "Invalid Request: not a JSON-RPC message")
    reason = reason or (str(error).splitlines() or [""])[0]
    message = f"{what} ({reason.strip()[:200]})" if reason.strip() else what
    rid = ids[0] if ids and isinstance(ids[0], (str, int)) and not isinstance(ids[0], bool) else None
    if isinstance(first, str) and first.startswith(_REPLY):
        d = json.loads(first[len(_REPLY):])
        code, rid, message = d["code"], d["id"], d["message"]
    elif isinstance(first, str) and first.startswith(_UNREAD):
        message = f"Parse error: {first[len(_UNREAD):]}"
    return SessionMessage(JSONRPCError(jsonrpc="2.0", id=rid, error=ErrorData(code=code, message=message)))


async def _serve_stdio(server: Any, eof_wait: float | None = None, stop: "_Stop | None" = None) -> None:
    """What server.run("stdio") does, answering a malformed line with a JSON-RPC error.
    `stop` cancels it all (calls under way: their sandboxes killed)."""
    import anyio
    from mcp.server.stdio import stdio_server

    low = getattr(server, "_lowlevel_server", None) or server._mcp_server
    stdin = _StdinLines()
    try:
        with anyio.CancelScope() as scope:
            if stop is not None:
                stop.serving(scope)
            async with stdio_server(stdin=stdin) as (read, write):  # type: ignore[arg-type]
                await _relay(low, read, write, eof_wait)
    finally:
        stdin.restore()


async def _relay(low: Any, read: Any, write: Any, eof_wait: float | None = None) -> None:
    """The SDK's server on what the transport read, each line it could not parse answered.
    At the end of the input it waits for the calls under way, `eof_wait` seconds at most."""
    import anyio

    inner_send, inner_read = anyio.create_memory_object_stream[Any](0)
    answers = _Answers(write)

    async def forward() -> None:
        async with inner_send:
            async for item in read:
                if isinstance(item, Exception):
                    try:
                        reply = _error_reply(item)
                    except Exception:  # noqa: BLE001 - an SDK whose types differ: silence, as before
                        continue
                    await write.send(reply)
                else:
                    answers.expect(item)
                    await inner_send.send(item)
            # The end of the input: the calls under way are answered before the SDK hears of it
            # (mcp 2.x answered each "Connection closed" and cancelled it, its sandbox killed).
            with anyio.move_on_after(eof_wait):  # (a bound: a call the SDK would never answer)
                await answers.all()

    async with anyio.create_task_group() as tg:
        tg.start_soon(forward)
        await low.run(inner_read, answers, low.create_initialization_options())


def _same_id(rid: Any) -> Any:
    """An id as the SDK matches it ("7" is 7: its coerce_request_id), None for what is none
    (true would have matched 1, and 1.0 too, where the SDK takes neither for an id)."""
    if isinstance(rid, str):
        try:
            return int(rid)
        except ValueError:
            return rid
    return rid if isinstance(rid, int) and not isinstance(rid, bool) else None


def _message(item: Any) -> Any:
    msg = getattr(item, "message", None)
    return getattr(msg, "root", msg)  # (mcp 1.x wraps it in a RootModel)


class _Answers:
    """The server's side of the wire, counting the requests not answered yet: those the
    client sent, less those answered or cancelled (a cancelled one gets no reply)."""

    def __init__(self, write: Any) -> None:
        self._write = write
        self._open: dict[Any, int] = {}
        self._event: Any = None

    def expect(self, item: Any) -> None:
        msg = _message(item)
        method, rid = getattr(msg, "method", None), getattr(msg, "id", None)
        if method is not None and rid is not None:
            rid = _same_id(rid)
            self._open[rid] = self._open.get(rid, 0) + 1
        elif method == "notifications/cancelled":
            params = getattr(msg, "params", None)
            self._done(params.get("requestId") if isinstance(params, dict) else None)

    def _done(self, rid: Any) -> None:
        rid = _same_id(rid)
        if rid is not None and self._open.get(rid):
            self._open[rid] -= 1
            if not self._open[rid]:
                del self._open[rid]
        if not self._open and self._event is not None:
            self._event.set()

    async def all(self) -> None:
        import anyio

        while self._open:
            self._event = anyio.Event()
            await self._event.wait()

    async def send(self, item: Any) -> None:
        await self._write.send(item)
        msg = _message(item)
        if getattr(msg, "method", None) is None:  # a response or an error
            self._done(getattr(msg, "id", None))

    async def aclose(self) -> None:
        await self._write.aclose()

    async def __aenter__(self) -> "_Answers":
        await self._write.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> Any:
        return await self._write.__aexit__(*exc)

    def __getattr__(self, name: str) -> Any:  # anything else an SDK asks of its stream
        return getattr(self._write, name)


def serve(server: Any, eof_wait: float | None = None,
          ending: tuple[int, ...] = ()) -> None:
    """Serve over stdio until the end of the input (and the calls under way, `eof_wait` s at most).
    SIGINT (when Python's default handler has it) and the signals in `ending` stop the serving
    in order, then raise KeyboardInterrupt."""
    try:
        import anyio
        from mcp.server.stdio import stdio_server  # noqa: F401
        from mcp.shared.message import SessionMessage  # noqa: F401

        if not (hasattr(server, "_lowlevel_server") or hasattr(server, "_mcp_server")):
            raise ImportError("no low-level server")
    except ImportError:  # an SDK without what _serve_stdio uses: its own loop
        server.run("stdio")
        return
    import signal

    taken = [sig for sig in ending if sig != signal.SIGINT]
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        taken.append(signal.SIGINT)  # (else asyncio's runner takes it over, and waits on stdin's reader)
    stop = _Stop()
    before = {sig: signal.signal(sig, stop.handle) for sig in taken}
    try:
        try:
            anyio.run(_serve_stdio, server, eof_wait, stop)
        except Exception:
            if stop.signum is None:
                raise  # (after a stop, what broke on the way out does not matter)
    finally:
        for sig, handler in before.items():
            if sig not in stop.ignored:
                signal.signal(sig, handler)
    if stop.signum is not None:
        raise KeyboardInterrupt(stop.signum)


class _Stop:
    """A signal's handler while serving that raises nothing: it cancels the serving from the
    event loop, at its next turn. Raised as a KeyboardInterrupt wherever the main thread was,
    as before, it broke the state of anyio's cancel scopes when it landed inside one (1 in ~50
    SIGTERMs under load): the server spun in its runner's close, or ended with an internal
    error and then waited for ever on its thread reading stdin."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.ignored: tuple[int, ...] = ()
        self._cancel: Callable[[], None] | None = None

    def serving(self, scope: Any) -> None:
        """Called in the loop, once serving: a signal that came before cancels it at once."""
        import asyncio

        loop = asyncio.get_running_loop()
        self._cancel = lambda: loop.call_soon_threadsafe(scope.cancel)
        if self.signum is not None:
            scope.cancel()

    def handle(self, sig: int, _frame: object) -> None:
        from . import signals

        if self.signum is None:
            self.signum = sig
        if sig in signals.TIMERS:  # an interval timer fires again and again: once asks to end
            for t in signals.TIMERS:
                signals.signal(t, signals.SIG_IGN)
            self.ignored = signals.TIMERS
        if self._cancel is not None:
            try:
                self._cancel()
            except RuntimeError:  # the loop is closed: the serving has ended already
                pass


def _output_lost(error: BaseException) -> OSError | None:
    """The write error, where `error` (perhaps a group from the SDK's tasks) is only the
    output's: a closed pipe (EPIPE), a full disk or /dev/full (ENOSPC), an I/O error."""
    if isinstance(error, BaseExceptionGroup):
        found = [_output_lost(e) for e in error.exceptions]
        return found[0] if found and all(found) else None
    if isinstance(error, OSError) and error.errno in _OUTPUT_ERRNOS:
        return error
    return None


_OUTPUT_ERRNOS = (errno.EPIPE, errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EFBIG)


def _eof_wait(prof: Profile) -> float | None:
    """How long the calls under way may take once the input has ended: the longest a run may
    last (its timeout's cap, its grace, a margin); None where the profile caps no timeout."""
    lim = prof.limits
    return None if lim.max_timeout is None else lim.max_timeout + lim.kill_grace + 30


def _workspace(workspace: str | None, what: str = "--workspace") -> str | None:
    """The workspace's real path; InputError (named `what`) unless it is a directory."""
    if workspace is None:
        return None
    if not isinstance(workspace, str) or not workspace:
        raise InputError(f"{what}: expected a directory's path, got {workspace!r}")  # '' would be the cwd
    if "\0" in workspace:
        raise InputError(f"{what} contains a NUL byte")
    path = os.path.realpath(workspace)  # its links are the operator's, resolved before any run
    if not os.path.exists(path):  # (a file is named as such below)
        raise InputError(f"{what}: no such directory: {workspace}")
    from .hostpaths import check_writable_dir

    return check_writable_dir(path, what).path  # never `/` or a system tree (every call may write it)


def _count(option: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        import argparse

        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if not 1 <= n <= 1024:
            raise argparse.ArgumentTypeError(f"expected 1 to 1024, got {n}")
        return n

    parse.__name__ = option  # argparse names the option in its error
    return parse


def main(argv: list[str]) -> int:
    from .cliargs import Parser

    p = Parser(prog="sandboxrun mcp",
               usage="sandboxrun mcp [--profile P] [--workspace DIR] [--max-runs N] [--max-sessions N]",
               debug_help="log at DEBUG level on stderr, and show the traceback of an error",
                description="Serve the sandbox as MCP tools over stdio (needs: pip install 'sandboxrun[mcp]').")
    p.add_argument("--profile", "-p", default="strict", help="profile for every run (default: strict)")
    p.add_argument("--workspace", "-w", metavar="DIR",
                   help="host directory bound read-write as the workdir of every run (default: a fresh one each run)")
    p.add_argument("--max-runs", type=_count("--max-runs"), metavar="N", default=None,
                   help=f"foreground runs at once; more calls wait their turn (default: the CPUs, at least 2; "
                        f"here {default_max_runs()})")
    p.add_argument("--max-sessions", type=_count("--max-sessions"), metavar="N", default=MAX_SESSIONS,
                   help=f"background sessions kept at once; start refuses more (default {MAX_SESSIONS})")
    ns = p.parse_args(argv)
    from .profile import load

    prof = load(ns.profile)  # bad options fail fast, before the SDK's slow import
    _workspace(ns.workspace)
    server, tools = build_server(prof, ns.workspace, max_runs=ns.max_runs, max_sessions=ns.max_sessions)
    if ns.debug:
        import logging

        logging.getLogger().setLevel(logging.DEBUG)
    from . import signals
    from .supervisor import _Uninterrupted

    ended_early: str | None = None  # why it ended before its input did
    code = 0
    steady = _Uninterrupted()  # a second signal must not cut short the removal of its sessions
    try:
        # (stdout is the protocol channel: nothing else may print there)
        serve(server, _eof_wait(prof), ending=tuple(sig for sig in signals.ENDING if callable(signals.getsignal(sig))))
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM, SIGHUP...: the serving stopped in order
        ended_early = ""
    except Exception as e:
        lost = _output_lost(e)
        if lost is None:
            raise
        if lost.errno == errno.EPIPE:
            ended_early = "sandboxrun: mcp: the client closed the server's output; ending\n"
        else:  # (> /dev/full)
            ended_early = f"sandboxrun: mcp: error: the server's output cannot be written: {lost.strerror}; ending\n"
            code = 1
    finally:
        steady.do(tools.close)
    if ended_early is not None or steady.pending:
        # Exit now, not at the interpreter's exit: that joins the SDK's thread reading stdin,
        # which the client may keep open for ever (the server then took a second signal, with
        # a traceback). A run still going in a worker thread dies with us (its parent-death signal).
        for stream, last in ((sys.stdout, ""), (sys.stderr, ended_early or "")):
            try:
                stream.write(last)
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    return 0
