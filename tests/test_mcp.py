"""The MCP server as an independent client meets it: the SDK's own stdio client
spawns `python -m sandbox mcp`, lists the tools and calls them."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp")
anyio = pytest.importorskip("anyio")

from mcp import ClientSession, StdioServerParameters  # noqa: E402
from mcp.client.stdio import stdio_client  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TOOLS = {"run_command", "run_python", "check_command", "start", "list", "poll", "log", "write", "send_keys",
         "kill", "remove"}


@pytest.fixture(scope="module", autouse=True)
def _needs_sandbox(isolated) -> None:
    pass


def _field(obj: Any, *names: str) -> Any:
    """mcp 1.x uses camelCase attributes, 2.x snake_case."""
    for n in names:
        if hasattr(obj, n):
            return getattr(obj, n)
    raise AttributeError(names[0])


def is_error(res: Any) -> bool:
    return bool(_field(res, "is_error", "isError"))


def structured(res: Any) -> dict[str, Any]:
    data = _field(res, "structured_content", "structuredContent")
    if data is None:  # fall back to the JSON text block
        data = json.loads(res.content[0].text)
    return data


def text(res: Any) -> str:
    return "\n".join(getattr(c, "text", "") for c in res.content)


def with_server(workspace: Path, body: Callable[[ClientSession], Awaitable[None]], *extra: str) -> None:
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "sandbox", "mcp", "--profile", "strict", "--workspace", str(workspace), *extra],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=str(ROOT))

    async def main() -> None:
        with anyio.fail_after(120):  # a bound, not a benchmark
            async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
                await session.initialize()
                await body(session)

    anyio.run(main)


def test_tools_listed_with_schemas(tmp_path: Path) -> None:
    async def body(s: ClientSession) -> None:
        listed = (await s.list_tools()).tools
        assert {t.name for t in listed} == TOOLS
        for t in listed:
            schema = _field(t, "input_schema", "inputSchema")
            assert t.description and schema["type"] == "object"
            for name, prop in schema.get("properties", {}).items():
                assert prop.get("description"), f"{t.name}.{name} has no description"
        rc = next(t for t in listed if t.name == "run_command")
        assert _field(rc, "input_schema", "inputSchema")["required"] == ["command"]

    with_server(tmp_path, body)


def test_run_command_uses_the_workspace(tmp_path: Path) -> None:
    (tmp_path / "data.txt").write_text("from the host\n")

    async def body(s: ClientSession) -> None:
        res = await s.call_tool("run_command", {"command": "cat data.txt; pwd; echo made > out.txt"})
        assert not is_error(res), text(res)
        d = structured(res)
        assert d["status"] == "ok" and d["exit_code"] == 0 and d["profile"] == "strict"
        assert d["stdout"] == "from the host\n/work\n"
        res = await s.call_tool("run_command", {"command": "echo oops >&2; exit 3"})
        d = structured(res)
        assert not is_error(res) and d["status"] == "nonzero_exit" and d["exit_code"] == 3
        assert d["stderr"] == "oops\n"
        res = await s.call_tool("run_command", {"command": "sleep 5", "timeout": 0.5})
        assert structured(res)["status"] == "timeout"

    with_server(tmp_path, body)
    assert (tmp_path / "out.txt").read_text() == "made\n"


def test_errors_are_tool_errors_with_the_reason(tmp_path: Path) -> None:
    async def body(s: ClientSession) -> None:
        res = await s.call_tool("check_command", {"command": "rm -rf /"})
        d = structured(res)
        assert not is_error(res) and d["allowed"] is False and d["reason"]
        assert structured(await s.call_tool("check_command", {"command": "ls -la"}))["allowed"] is True
        res = await s.call_tool("check_command", {"command": "echo a\0b"})  # run_command refuses it
        assert is_error(res) and "NUL" in text(res), text(res)
        res = await s.call_tool("run_command", {"command": "rm -rf /"})
        assert is_error(res) and "blocked" in text(res)
        res = await s.call_tool("run_command", {"command": "true", "timeout": 100000})
        assert is_error(res) and "timeout" in text(res)
        res = await s.call_tool("run_python", {"script": "../../etc/passwd"})
        assert is_error(res) and "outside the workspace" in text(res)

    with_server(tmp_path, body)


def test_arguments_of_another_type_are_refused_not_coerced(tmp_path: Path) -> None:
    # pydantic's lax mode took "timeout": true as 1 s, "pty": "yes" and "eof": 1 as true,
    # and a line number 2.0 as 2: each ran something other than what was asked.
    async def body(s: ClientSession) -> None:
        for tool, args, field in (("run_command", {"command": "true", "timeout": True}, "timeout"),
                                  ("run_command", {"command": "true", "timeout": "1"}, "timeout"),
                                  ("start", {"command": "true", "pty": "yes"}, "pty"),
                                  ("write", {"session_id": "x", "data": "a", "eof": 1}, "eof"),
                                  ("log", {"session_id": "x", "offset": 2.0}, "offset"),
                                  ("run_python", {"code": "pass", "args": "ab"}, "args")):
            res = await s.call_tool(tool, args)
            assert is_error(res) and field in text(res), (tool, args, text(res))
        assert structured(await s.call_tool("list", {}))["sessions"] == []  # the "yes" pty started nothing
        res = await s.call_tool("run_command", {"command": "true", "timeout": 5})  # an int is a number
        assert not is_error(res) and structured(res)["status"] == "ok"

    with_server(tmp_path, body)


def test_run_python_code_script_function(tmp_path: Path) -> None:
    (tmp_path / "calc.py").write_text("def add(a, b):\n    print('adding')\n    return a + b\n")

    async def body(s: ClientSession) -> None:
        res = await s.call_tool("run_python", {"code": "import sys; print(sum(map(int, sys.argv[1:])))",
                                               "args": ["2", "3"]})
        assert not is_error(res), text(res)
        assert structured(res)["stdout"] == "5\n"
        res = await s.call_tool("run_python", {"script": "calc.py", "function": "add", "args": [2, 3]})
        d = structured(res)
        assert not is_error(res), text(res)
        assert d["return_value"] == 5 and d["returned"] and d["stdout"] == "adding\n"
        res = await s.call_tool("run_python", {"script": "calc.py", "statement": "add('a', 'b')"})
        assert structured(res)["return_value"] == "ab"
        res = await s.call_tool("run_python", {})
        assert is_error(res) and "exactly one" in text(res)

    with_server(tmp_path, body)


def test_bad_workspace_is_a_one_line_error(tmp_path: Path) -> None:
    import subprocess

    r = subprocess.run([sys.executable, "-m", "sandbox", "mcp", "--workspace", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and "no such directory" in r.stderr and "Traceback" not in r.stderr
    # Every call may write the workspace: never the host's root or a system tree.
    for ws in ("/", "/etc"):
        r = subprocess.run([sys.executable, "-m", "sandbox", "mcp", "--workspace", ws], capture_output=True, text=True,
                           timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.DEVNULL)
        assert r.returncode == 2 and "--workspace: " in r.stderr and "writable directory" in r.stderr, r.stderr


def test_a_start_that_cannot_be_set_up_is_a_tool_error_and_keeps_no_session(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # It answered isError false with state "exited" and no reason, and the record counted
    # against --max-sessions until removed.
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    monkeypatch.setenv("SANDBOXRUN_STATE_DIR", str(state))
    monkeypatch.setenv("SANDBOXRUN_CGROUP", "none")  # strict needs a cgroup: its set-up fails
    ws = tmp_path / "ws"
    ws.mkdir()

    async def body(s: ClientSession) -> None:
        for _ in range(2):  # the second is not refused as one too many
            res = await s.call_tool("start", {"command": "sleep 100"})
            assert is_error(res) and "nothing ran: the sandbox could not be set up: cgroup" in text(res), text(res)
        assert structured(await s.call_tool("list", {}))["sessions"] == []

    with_server(ws, body, "--max-sessions", "1")
    assert [p.name for p in state.iterdir() if not p.name.endswith(".lock")] == []


def test_background_session_tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    monkeypatch.setenv("SANDBOXRUN_STATE_DIR", str(state))
    ws = tmp_path / "ws"
    ws.mkdir()

    async def body(s: ClientSession) -> None:
        res = await s.call_tool("start", {"command": "read line; echo got $line; sleep 30"})
        assert not is_error(res), text(res)
        sid = structured(res)["id"]
        assert [x["id"] for x in structured(await s.call_tool("list", {}))["sessions"]] == [sid]
        assert structured(await s.call_tool("write", {"session_id": sid, "data": "hello\n"}))["written"] == 6
        seen = ""
        with anyio.fail_after(30):
            while "got hello" not in seen:
                seen += structured(await s.call_tool("poll", {"session_id": sid}))["stdout"]
                await anyio.sleep(0.05)
        page = structured(await s.call_tool("log", {"session_id": sid}))
        assert "got hello" in page["lines"]
        res = await s.call_tool("send_keys", {"session_id": sid, "keys": ["C-c"]})
        assert is_error(res) and "terminal" in text(res)
        d = structured(await s.call_tool("kill", {"session_id": sid}))
        assert d["result"]["status"] in ("timeout", "signaled")
        assert structured(await s.call_tool("remove", {"session_id": sid}))["removed"] is True
        res = await s.call_tool("poll", {"session_id": sid})
        assert is_error(res) and "no session" in text(res)
        res = await s.call_tool("poll", {"session_id": "deadbeef"})
        assert is_error(res) and "no session" in text(res)
        # one left running: the server kills and removes it when the client goes away
        await s.call_tool("start", {"command": "sleep 30"})

    with_server(ws, body)
    assert [p.name for p in state.iterdir()] == []


def test_a_session_started_while_the_server_closes_does_not_outlive_it(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM during a `start`: close() ran in the main thread, then the worker finished
    the start and kept an id no one would remove: the session ran on after the server."""
    from sandbox import sessions
    from sandbox.mcp_server import Tools
    from sandbox.profile import load

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    monkeypatch.setenv("SANDBOXRUN_STATE_DIR", str(state))
    tools = Tools(load("strict"), None, RuntimeError)
    tools.close()  # as the server does on its way out
    with pytest.raises(RuntimeError, match="shutting down"):
        tools.start("sleep 30")
    assert tools.started == [] and sessions.list_sessions(sweep=False) == []


def test_concurrent_removes_of_one_session_are_one_removal_and_named_errors(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Four removes at once: the others raised ValueError (list.remove) with a traceback."""
    from concurrent.futures import ThreadPoolExecutor

    from sandbox.mcp_server import Tools
    from sandbox.profile import load

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    monkeypatch.setenv("SANDBOXRUN_STATE_DIR", str(state))
    tools = Tools(load("strict"), None, RuntimeError)
    try:
        sid = tools.start("sleep 30")["id"]
        import threading

        together, get = threading.Barrier(4), tools._get

        def get_then_wait(session_id: str) -> object:  # every remove past the check before any ends
            s = get(session_id)
            together.wait(10)
            return s

        monkeypatch.setattr(tools, "_get", get_then_wait)

        def remove() -> str:
            try:
                return "removed" if tools.remove(sid)["removed"] else "?"
            except RuntimeError as e:
                return str(e)

        with ThreadPoolExecutor(4) as ex:
            outs = list(ex.map(lambda _: remove(), range(4)))
        assert outs.count("removed") >= 1 and tools.started == [], outs
        assert all(o == "removed" or sid in o for o in outs), outs  # each error names the session
    finally:
        tools.close()


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_signal_ends_the_server_though_its_client_keeps_stdin_open(tmp_path: Path, signame: str) -> None:
    # SIGINT: asyncio's runner took it over and cancelled the serving task, which waited on the
    # thread reading stdin: the server hung until the client's next line.
    import signal
    import subprocess
    import sys
    import time

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    env = dict(os.environ, PYTHONPATH=str(ROOT), SANDBOXRUN_STATE_DIR=str(state))
    p = subprocess.Popen([sys.executable, "-m", "sandbox", "mcp"], env=env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        time.sleep(2)  # serving (the SDK's import)
        p.send_signal(getattr(signal, signame))
        p.wait(timeout=15)  # stdin stays open (no communicate(), which would close it): the client did not go
        err = p.stderr.read() if p.stderr else b""
        assert p.returncode == 0 and b"Traceback" not in err, err
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()


# `sandboxrun mcp` with one more tool, which sends the server a signal from inside the serving's
# own code (where the event loop and anyio's cancel scopes run) and then goes on.
_SIGNAL_PROBE = """
import signal, sys
from sandbox import cli, mcp_server

built, marker = mcp_server.build_server, sys.argv[1]

def build(*a, **kw):
    server, tools = built(*a, **kw)

    async def probe(signame: str) -> dict:
        signal.raise_signal(getattr(signal, signame))  # its Python handler runs here, at once
        with open(marker, "w") as f:
            f.write("went on")
        return {}

    server.add_tool(probe, name="probe", description="signal the server")
    return server, tools

mcp_server.build_server = build
sys.argv[1:] = ["mcp"]
cli.entry()
"""


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT", "SIGHUP", "SIGALRM"])
def test_a_signal_is_taken_between_the_servers_steps_not_raised_inside_one(tmp_path: Path, signame: str) -> None:
    # An ending signal was raised as KeyboardInterrupt wherever the main thread was. Inside
    # anyio's cancel scopes it broke their state: 1 in ~50 SIGTERMs under load, the server
    # spun in its runner's close, or ended its serving with "internal error" then waited
    # for ever on its thread reading stdin (a client keeps stdin open).
    import time

    marker = tmp_path / "went-on"
    s = Raw(tmp_path, argv=[sys.executable, "-c", _SIGNAL_PROBE, str(marker)])
    try:
        s.call("p", "probe", signame=signame)
        started = time.monotonic()
        s.p.wait(timeout=20)
        assert time.monotonic() - started < 10
        err = s.p.stderr.read() if s.p.stderr else b""
        assert s.p.returncode == 0 and b"Traceback" not in err and b"error" not in err, err
        assert marker.read_text() == "went on"  # the handler raised nothing into the code it interrupted
    finally:
        s.close()


def test_sigterm_during_a_call_ends_its_sandbox_and_then_the_server(tmp_path: Path) -> None:
    import time

    marker = f"mcp-sigterm-{os.getpid()}"
    s = Raw(tmp_path)
    try:
        s.call("r", "run_command", command=f"sleep 60; : {marker}")
        deadline = time.monotonic() + 20
        while not _alive(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _alive(marker)
        s.p.terminate()
        s.p.wait(timeout=15)
        err = s.p.stderr.read() if s.p.stderr else b""
        assert s.p.returncode == 0 and b"Traceback" not in err, err
        assert not _alive(marker)  # the run was killed before the server ended, not left to its parent-death signal
    finally:
        s.close()


# ---------------------------------------------------------------------------- the raw protocol


class Raw:
    """`sandboxrun mcp` driven line by line, as a hostile or buggy peer would."""

    def __init__(self, tmp_path: Path, *extra: str, argv: list[str] | None = None) -> None:
        import queue
        import subprocess
        import threading

        state = tmp_path / "state"
        state.mkdir(mode=0o700, exist_ok=True)
        argv = argv or [sys.executable, "-m", "sandbox", "mcp", *extra]
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  env=dict(os.environ, PYTHONPATH=str(ROOT), SANDBOXRUN_STATE_DIR=str(state)))
        self.replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: dict[str | int | None, dict[str, Any]] = {}
        threading.Thread(target=self._read, daemon=True).start()
        self.send({"jsonrpc": "2.0", "id": "init", "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}})
        self.init_reply = self.reply("init")
        assert "result" in self.init_reply
        self.send({"jsonrpc": "2.0", "method": "notifications/initialized"})

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.replies.put(json.loads(line))

    def raw(self, data: bytes) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(data)
        self.p.stdin.flush()

    def send(self, message: dict[str, Any]) -> None:
        self.raw(json.dumps(message).encode() + b"\n")

    def call(self, rid: str | int, tool: str, **arguments: Any) -> None:
        self.send({"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": {"name": tool, "arguments": arguments}})

    def reply(self, rid: str | int | None, timeout: float = 30) -> dict[str, Any]:
        import time

        deadline = time.monotonic() + timeout
        while rid not in self.seen:
            d = self.replies.get(timeout=max(0.01, deadline - time.monotonic()))
            self.seen[d.get("id")] = d  # (another's reply is kept for its own turn)
        return self.seen.pop(rid)

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
        self.p.wait(timeout=30)


def _alive(marker: str) -> list[int]:
    """Processes whose command line holds marker (the sandboxed sh -c of a call)."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        out.append(int(pid))
            except OSError:
                pass
    return out


def test_a_line_that_is_no_json_rpc_gets_the_error_json_rpc_prescribes(tmp_path: Path) -> None:
    # The SDK dropped such lines without a word: the client waited for ever.
    s = Raw(tmp_path)
    try:
        s.raw(b"this is not json\n")
        d = s.reply(None)
        assert d["error"]["code"] == -32700 and d["jsonrpc"] == "2.0", d
        s.raw(b'{"jsonrpc": "1.0", "id": 5, "method": "ping"}\n')
        assert s.reply(5)["error"]["code"] == -32600  # (its id, which could be read)
        s.send({"jsonrpc": "2.0", "id": "p", "method": "ping"})  # and it serves on
        assert "result" in s.reply("p")
    finally:
        s.close()


def test_an_over_long_or_non_utf8_line_is_refused_by_name_with_memory_bounded(tmp_path: Path) -> None:
    # The SDK's reader held a line whole (a 100 MB line grew the server by 100 MB, twice over
    # as text) and replaced bytes that were not UTF-8.
    s = Raw(tmp_path)
    try:
        s.raw(b'{"jsonrpc": "2.0", "id": "x", "method": "ping", "pad": "' + b"a" * (150 << 20) + b'"}\n')
        d = s.reply(None, timeout=60)
        assert d["error"] == {"code": -32700, "message": "Parse error: a line longer than 64 MiB: not read"}, d
        with open(f"/proc/{s.p.pid}/status") as f:
            peak = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:"))
        assert peak < 250 << 20, peak
        s.raw(b'{"jsonrpc": "2.0", "id": "u", "method": "ping", "x": "\xff"}\n')
        d = s.reply(None)
        assert d["error"]["code"] == -32700 and "not UTF-8 (invalid start byte at byte 54)" in d["error"]["message"], d
        s.send({"jsonrpc": "2.0", "id": "p", "method": "ping"})  # and it serves on
        assert "result" in s.reply("p")
    finally:
        s.close()


def test_a_cancelled_call_kills_its_sandbox(tmp_path: Path) -> None:
    import time

    marker = f"mcp-cancel-{os.getpid()}"
    s = Raw(tmp_path)
    try:
        s.call("long", "run_command", command=f"sleep 300; : {marker}", timeout=600)
        deadline = time.monotonic() + 20
        while not _alive(marker):
            assert time.monotonic() < deadline, "the run never started"
            time.sleep(0.05)
        s.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": "long"}})
        while _alive(marker):  # it ran on to its timeout, 10 minutes, holding a thread
            assert time.monotonic() < deadline + 10, "the cancelled run still runs"
            time.sleep(0.05)
        s.send({"jsonrpc": "2.0", "id": "p", "method": "ping"})
        assert "result" in s.reply("p")
    finally:
        s.close()


def test_slow_calls_beyond_the_run_limit_wait_and_never_stall_the_server(tmp_path: Path) -> None:
    # 40 slow calls filled the thread pool the SDK reads its input with: ping, check_command and
    # cancel waited for the runs to end.
    import time

    marker = f"mcp-flood-{os.getpid()}"
    s = Raw(tmp_path, "--max-runs", "2")
    try:
        for i in range(45):
            s.call(f"slow{i}", "run_command", command=f"sleep 60; : {marker}", timeout=120)
        t0 = time.monotonic()
        s.send({"jsonrpc": "2.0", "id": "p", "method": "ping"})
        s.call("quick", "check_command", command="ls")
        assert "result" in s.reply("p", timeout=10) and "result" in s.reply("quick", timeout=10)
        assert time.monotonic() - t0 < 10
        time.sleep(1)
        assert 1 <= len({p for p in _alive(marker)}) <= 2 * 3, _alive(marker)  # two runs' sh (and sleep)
        for i in range(45):  # every queued call can be cancelled too
            s.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": f"slow{i}"}})
        deadline = time.monotonic() + 20
        while _alive(marker):
            assert time.monotonic() < deadline, _alive(marker)
            time.sleep(0.05)
    finally:
        s.close()


def test_background_sessions_are_capped_per_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = Raw(tmp_path, "--max-sessions", "2")
    try:
        for i in range(3):
            s.call(f"s{i}", "start", command=f"sleep 60; : {i}")
        replies = [s.reply(f"s{i}") for i in range(3)]
        errors = [r for r in replies if r["result"].get("isError")]
        assert len(errors) == 1, replies
        assert "at most 2 background sessions" in errors[0]["result"]["content"][0]["text"], errors
        started = [r["result"]["structuredContent"] for r in replies if not r["result"].get("isError")]
        assert all(not ({"dir", "pid", "monitor_pid"} & set(d)) for d in started), started  # no host paths, pids
        # One removed from outside (`sandboxrun remove`, or its TTL's sweep) counts no more.
        from sandbox import sessions

        monkeypatch.setenv("SANDBOXRUN_STATE_DIR", str(tmp_path / "state"))
        sessions.get(started[0]["id"]).remove(grace=0)
        s.call("s3", "start", command="sleep 60; : 3")
        assert not s.reply("s3")["result"].get("isError")
    finally:
        s.close()


def test_at_the_end_of_input_the_calls_under_way_are_answered(tmp_path: Path) -> None:
    # mcp 2.x answered each call still running "Connection closed" once its input ended, and
    # killed its sandbox: `printf ... | sandboxrun mcp` got no result.
    s = Raw(tmp_path)
    try:
        s.call("slow", "run_command", command="sleep 1; echo done")
        s.call("quick", "run_command", command="echo two")
        assert s.p.stdin is not None
        s.p.stdin.close()
        for rid, out in (("slow", "done\n"), ("quick", "two\n")):
            d = s.reply(rid)
            assert "result" in d, d
            assert json.loads(d["result"]["content"][0]["text"])["stdout"] == out
        assert s.p.wait(timeout=30) == 0
    finally:
        s.close()


def test_an_output_that_cannot_be_written_ends_the_server_with_one_line(tmp_path: Path) -> None:
    # > /dev/full: ENOSPC from the SDK's writer was "internal error: ExceptionGroup", exit 125.
    import subprocess

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    line = json.dumps({"jsonrpc": "2.0", "id": "p0", "method": "ping"}).encode() + b"\n"
    with open("/dev/full", "wb") as full:
        p = subprocess.Popen([sys.executable, "-m", "sandbox", "mcp"], stdin=subprocess.PIPE, stdout=full,
                             stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(ROOT), SANDBOXRUN_STATE_DIR=str(state)))
    assert p.stdin is not None and p.stderr is not None
    try:
        p.stdin.write(line)
        p.stdin.flush()  # (stdin stays open: the write error alone ends it)
        assert p.wait(timeout=30) == 1
        assert p.stderr.read().decode().strip().splitlines() == [
            "sandboxrun: mcp: error: the server's output cannot be written: No space left on device; ending"]
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_a_client_that_closed_the_output_ends_the_server_quietly(tmp_path: Path) -> None:
    # The SDK's writer took EPIPE: "internal error: ExceptionGroup", exit 125, and only once
    # another line came (till then the server hung on in the thread reading stdin).
    import subprocess

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    p = subprocess.Popen([sys.executable, "-m", "sandbox", "mcp"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(ROOT), SANDBOXRUN_STATE_DIR=str(state)))
    assert p.stdin is not None and p.stdout is not None and p.stderr is not None
    try:
        p.stdin.write(json.dumps({"jsonrpc": "2.0", "id": "p0", "method": "ping"}).encode() + b"\n")
        p.stdin.flush()
        assert json.loads(p.stdout.readline())["id"] == "p0"  # serving
        p.stdout.close()
        p.stdin.write(json.dumps({"jsonrpc": "2.0", "id": "p1", "method": "ping"}).encode() + b"\n")
        p.stdin.flush()  # (stdin stays open)
        assert p.wait(timeout=15) == 0
        err = p.stderr.read()
        assert b"client closed" in err and b"internal error" not in err, err
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_requests_the_sdk_would_drop_or_misread_get_the_error_with_their_id(tmp_path: Path) -> None:
    # An id MCP does not allow (null, 1.5, true, an object) made the SDK take the request for a
    # notification: no reply, the client waited for ever. A lone surrogate escape, valid JSON,
    # was answered -32700 without the id. Messages ended with pydantic's URL, not the reason.
    s = Raw(tmp_path)
    try:
        for rid in (None, 1.5, True, {"a": 1}, [1]):
            s.send({"jsonrpc": "2.0", "id": rid, "method": "ping"})
            d = s.reply(None)
            assert d["error"]["code"] == -32600 and "must be a string or an integer" in d["error"]["message"], d
        s.raw(b'{"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "check_command", '
              b'"arguments": {"command": "\\ud800"}}}\n')
        d = s.reply(7)
        assert d["error"]["code"] == -32602 and "lone surrogate" in d["error"]["message"], d
        s.send({"jsonrpc": "2.0", "id": "pa", "method": "tools/list", "params": [1]})
        d = s.reply("pa")
        assert d["error"]["code"] == -32600 and "params" in d["error"]["message"], d
        s.raw(b"nojson\n")
        d = s.reply(None)
        assert d["error"]["code"] == -32700 and "https://" not in d["error"]["message"], d
        s.send({"jsonrpc": "2.0", "id": "😀", "method": "ping"})  # a pair's escapes are text
        assert "result" in s.reply("😀")
    finally:
        s.close()


def test_a_name_on_disk_that_is_not_utf8_is_a_tool_error_not_the_servers_end(tmp_path: Path) -> None:
    # The refusal named "\\udcff.py", which the SDK could not write: the server ended with
    # "internal error: ExceptionGroup" and every later call got a broken pipe.
    ws = tmp_path / "ws"
    ws.mkdir()
    os.mkfifo(os.fsencode(ws) + b"/\xff.py")
    (ws / "s.py").symlink_to(os.fsdecode(b"\xff.py"))
    s = Raw(tmp_path, "--workspace", str(ws))
    try:
        s.call("r", "run_python", script="s.py")
        d = s.reply("r")
        assert d["result"]["isError"] is True and "\\udcff" in d["result"]["content"][0]["text"], d
        s.send({"jsonrpc": "2.0", "id": "p", "method": "ping"})
        assert "result" in s.reply("p")
    finally:
        s.close()


def test_at_the_end_of_input_a_cancel_counts_by_the_id_the_sdk_matches(tmp_path: Path) -> None:
    # The SDK takes "7" for 7 (and never answers a call it cancelled), where the count of calls
    # to wait for did not: the server waited for ever. And true, equal to 1 as a key, took call
    # 1 off the count though the SDK cancels nothing for it: 1 was answered "Connection closed".
    import time

    s = Raw(tmp_path)
    try:
        s.call(7, "run_command", command="sleep 3")
        s.call(1, "run_command", command="sleep 1; echo done")
        time.sleep(0.5)
        s.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": "7"}})
        s.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": True}})
        assert s.p.stdin is not None
        s.p.stdin.close()
        d = s.reply(1)
        assert "result" in d and json.loads(d["result"]["content"][0]["text"])["stdout"] == "done\n", d
        assert s.p.wait(timeout=20) == 0  # (before: for ever)
        assert 7 not in s.seen
    finally:
        s.close()


def test_the_server_names_itself_and_its_version(tmp_path: Path) -> None:
    # serverInfo.version was empty (mcp 2.x reports what the server gives, "" by default).
    from sandbox import __version__

    s = Raw(tmp_path)
    try:
        info = s.init_reply["result"]["serverInfo"]
        assert info["name"] == "sandboxrun" and info["version"] == __version__, info
    finally:
        s.close()


_NO_THREAD_AT_FIRST = """
import _thread, asyncio
from sandbox import mcp_server

real, refused = _thread.start_new_thread, [0]

def start(*a):
    if refused[0] < 3:  # as under RLIMIT_NPROC
        refused[0] += 1
        raise RuntimeError("can't start new thread")
    return real(*a)

_thread.start_new_thread = start

async def main():
    return [line async for line in mcp_server._StdinLines()]

print(asyncio.run(main()), refused[0])
"""


def test_a_line_read_waits_for_a_thread_when_none_can_be_started() -> None:
    # Each line is read in a thread of its own: a refused start ended the server with a traceback.
    import subprocess

    p = subprocess.run([sys.executable, "-c", _NO_THREAD_AT_FIRST], input=b"one\ntwo\n", capture_output=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=30)
    assert (p.returncode, p.stdout, p.stderr) == (0, b"['one\\n', 'two\\n'] 3\n", b"")
