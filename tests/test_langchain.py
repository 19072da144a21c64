"""SandboxTool as a LangChain agent calls it: plain arguments and tool calls."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("langchain_core")

from langchain_core.messages import ToolMessage  # noqa: E402

from sandbox.errors import InputError, ProfileError, SandboxError  # noqa: E402
from sandbox.integrations.langchain import SandboxTool  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _needs_sandbox(isolated) -> None:
    pass


def test_plain_invoke_returns_compact_text() -> None:
    tool = SandboxTool()
    out = tool.invoke({"command": "echo hi; echo oops >&2; exit 3"})
    assert out == "exit code: 3\nstatus: nonzero_exit\nstdout:\nhi\nstderr:\noops"
    assert tool.invoke({"command": "true"}) == "exit code: 0\nstatus: ok\n(no output)"


def test_tool_call_returns_tool_message_with_result_artifact() -> None:
    tool = SandboxTool()
    msg = tool.invoke({"name": tool.name, "args": {"command": "echo hi"}, "id": "call-1", "type": "tool_call"})
    assert isinstance(msg, ToolMessage) and msg.tool_call_id == "call-1" and msg.status == "success"
    assert msg.content == "exit code: 0\nstatus: ok\nstdout:\nhi"
    assert msg.artifact["status"] == "ok" and msg.artifact["stdout"] == "hi\n" and msg.artifact["profile"] == "strict"


def test_why_it_ended() -> None:
    tool = SandboxTool()
    out = tool.invoke({"command": "sleep 5", "timeout": 0.5})
    assert "status: timeout (wall timeout of 0.5s)" in out and "exit code: none" in out
    out = tool.invoke({"command": "rm -rf /"})
    assert out.startswith("blocked: nothing ran.")


def test_bad_input_is_an_error_message_not_an_exception() -> None:
    tool = SandboxTool()
    msg = tool.invoke({"name": tool.name, "args": {"command": "true", "timeout": 100000}, "id": "2",
                       "type": "tool_call"})
    assert msg.status == "error" and "max_timeout" in msg.content


@pytest.mark.parametrize("args, needle", [
    ({"command": "true", "timeout": "abc"}, "timeout: Input should be a valid number"),
    ({}, "command: Field required"),
    ({"command": 5}, "command: Input should be a valid string"),
])
def test_arguments_of_the_wrong_shape_are_an_error_message_too(args: dict, needle: str) -> None:
    """pydantic's ValidationError came out of invoke, into the agent loop."""
    msg = SandboxTool().invoke({"name": "run_command", "args": args, "id": "v", "type": "tool_call"})
    assert isinstance(msg, ToolMessage) and msg.status == "error", msg
    assert msg.content.startswith("error: invalid arguments: ") and needle in msg.content, msg.content


def test_cancelling_ainvoke_kills_the_sandbox() -> None:
    """It ran _run in a thread: the task was cancelled, the sandbox ran on to its end."""
    import time

    async def main() -> float:
        task = asyncio.ensure_future(SandboxTool().ainvoke({"command": "sleep 20"}))
        await asyncio.sleep(1.0)
        task.cancel()
        start = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.monotonic() - start

    start = time.monotonic()
    assert asyncio.run(main()) < 10 and time.monotonic() - start < 12  # not the 20 s of the sleep


def test_schema_workspace_and_async(tmp_path: Path) -> None:
    (tmp_path / "f.txt").write_text("from host\n")
    tool = SandboxTool(workspace=str(tmp_path), max_output_chars=4)
    schema = tool.tool_call_schema.model_json_schema()
    assert schema["required"] == ["command"] and set(schema["properties"]) == {"command", "timeout"}
    out = asyncio.run(tool.ainvoke({"command": "cat f.txt"}))
    assert out.endswith("stdout:\nfrom\n[... 6 more characters not shown]")


@pytest.mark.parametrize("kwargs, error, needle", [
    ({"profile": "nosuch"}, ProfileError, "unknown profile"),
    ({"workspace": "/nonexistent_ws_sbx"}, InputError, "no such directory"),
    ({"run_options": {"memroy": "1GiB"}}, ProfileError, "memroy"),
    ({"run_options": {"memory": "lots"}}, ProfileError, "memory"),
    ({"run_options": {"env": {"A": 1}}}, SandboxError, "env"),
    ({"run_options": {"timeout": 5}}, InputError, "timeout"),
    ({"run_options": {"yield_after": 0.2}}, InputError, "background session"),
    ({"run_options": {"stdin_fd": 0}}, InputError, "stdin_fd"),
    ({"max_output_chars": -5}, InputError, "max_output_chars"),
], ids=["profile", "workspace", "unknown-option", "bad-option-value", "bad-env", "reserved-option", "yield-after",
        "stdin-fd", "max-output-chars"])
def test_bad_configuration_raises_at_construction(kwargs, error, needle) -> None:
    """A mistake of the programmer who builds the tool fails there, not as an error the model
    reads on every call and cannot fix (as `sandboxrun mcp --profile nosuch` fails at start-up)."""
    with pytest.raises(error, match=needle):
        SandboxTool(**kwargs)


def test_good_configuration_is_kept(tmp_path: Path) -> None:
    tool = SandboxTool(profile="standard", workspace=str(tmp_path), run_options={"memory": "256MiB", "env": {"A": "1"}})
    assert (tool.profile, tool.workspace) == ("standard", str(tmp_path))
    assert tool.invoke({"command": "echo $A"}) == "exit code: 0\nstatus: ok\nstdout:\n1"
    msg = tool.invoke({"name": tool.name, "args": {"command": "true"}, "id": "call-2", "type": "tool_call"})
    assert msg.artifact["isolation"]["limits"]["memory_bytes"] == 256 * 2**20, msg.artifact  # the run_options too


@pytest.mark.parametrize("timeout", [True, False, "7", "0.5"])
def test_timeout_of_the_wrong_type_is_not_coerced(timeout) -> None:
    """pydantic's lax mode made True 1 s, "7" 7 s and False 0 (an error about a timeout of 0)."""
    msg = SandboxTool().invoke({"name": "run_command", "args": {"command": "true", "timeout": timeout},
                                "id": "t", "type": "tool_call"})
    assert msg.status == "error" and msg.content.startswith("error: invalid arguments: timeout"), msg.content


def test_whole_seconds_are_still_a_timeout() -> None:
    assert SandboxTool().invoke({"command": "true", "timeout": 5}) == "exit code: 0\nstatus: ok\n(no output)"
