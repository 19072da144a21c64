"""LangChain: `SandboxTool`, a BaseTool that runs shell commands through the sandbox.

Needs the optional extra (`pip install 'sandboxrun[langchain]'`).

    from sandbox.integrations.langchain import SandboxTool
    tool = SandboxTool(profile="strict", workspace="/srv/agent-work")
    tool.invoke({"command": "ls -la"})                  # -> compact text for the model
    msg = tool.invoke({"name": "run_command", "args": {"command": "ls"},
                       "id": "call_1", "type": "tool_call"})   # -> ToolMessage
    msg.artifact                                        # -> the full Result as a dict

The text the model reads leads with what an agent needs to decide its next step:
the exit code and why the run ended, then stdout and stderr (each cut to
`max_output_chars`, the cut said out loud). Bad input (a timeout above the
profile's maximum, say) comes back as an error message the model can correct,
not as an exception in the agent loop. A bad tool configuration (profile,
workspace, run_options) is the programmer's to fix: the constructor raises
ProfileError / InputError, as `sandboxrun mcp` fails at start-up.
"""

from __future__ import annotations

from typing import Any

try:
    from langchain_core.tools import BaseTool, ToolException
    from pydantic import BaseModel, Field, ValidationError
except ImportError as e:  # as `sandboxrun mcp` without the mcp package: say what to install
    raise ImportError(f"sandbox.integrations.langchain needs langchain-core ({e.name} is missing): "
                      "pip install 'sandboxrun[langchain]'") from e

from ..errors import InputError, SandboxError

# Keywords of sandbox.run that the tool sets itself, or the model per call: not run_options.
_SET_BY_THE_TOOL = {"command": "the model passes it", "shell": "the tool always uses /bin/sh -c",
                    "profile": "use SandboxTool(profile=...)", "cwd": "use SandboxTool(workspace=...)",
                    "timeout": "the model passes it per call; the profile's applies otherwise",
                    "yield_after": "the tool answers when the command has ended: the model has no way to "
                                   "reach a background session",
                    "stdin_fd": "not a sandbox.run option"}
# Keywords of sandbox.run that are not profile settings: passed through unchecked.
_RUN_KEYWORDS = ("stdin", "stdin_from", "trace", "on_stdout", "on_stderr")


def _invalid_arguments(e: ValidationError) -> str:
    """Arguments the model got wrong (missing, of the wrong type): a message it can correct."""
    parts = [f"{'.'.join(map(str, err.get('loc', ()))) or 'arguments'}: {err.get('msg', 'invalid')}"
             for err in e.errors()]
    return "error: invalid arguments: " + "; ".join(parts)


class SandboxInput(BaseModel):
    # Strict: no coercion ("7" is not 7 s, True is not 1 s): a wrong type is an invalid
    # argument the model can correct (an int is still a number of seconds).
    command: str = Field(strict=True, description="Shell command line to run with /bin/sh -c inside the sandbox, "
                                     "e.g. 'python3 -c \"print(1+1)\"' or 'ls -la | head'")
    timeout: float | None = Field(default=None, strict=True, description="Wall-clock limit in seconds (default: the "
                                                            "profile's, 30 in strict); the whole process tree is "
                                                            "killed when it runs out")


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[... {len(text) - limit} more characters not shown]"


def format_result(res: Any, max_chars: int = 20000) -> str:
    """A Result as the short text an agent reads."""
    if res.status == "blocked":
        return f"blocked: nothing ran. {res.block_reason}"
    if res.status == "setup_error":
        return f"sandbox error: nothing ran. {res.error}"
    code = res.exit_code if res.exit_code >= 0 else "none (it did not exit on its own)"
    head = f"exit code: {code}\nstatus: {res.status}"
    if res.status not in ("ok", "nonzero_exit") and res.error:
        head += f" ({res.error})"
    elif res.signal:
        head += f" ({res.signal})"
    parts = [head]
    for name, body, truncated, total in (("stdout", res.stdout, res.stdout_truncated, res.stdout_bytes),
                                         ("stderr", res.stderr, res.stderr_truncated, res.stderr_bytes)):
        if not body and not truncated:
            continue
        note = f" (truncated by the sandbox: {total} bytes produced)" if truncated else ""
        parts.append(f"{name}{note}:\n{_cut(body, max_chars).rstrip(chr(10))}")
    if len(parts) == 1:
        parts.append("(no output)")
    return "\n".join(parts)


class SandboxTool(BaseTool):
    """Run shell commands in a hardened sandbox (see sandboxrun's profiles)."""

    name: str = "run_command"
    description: str = (
        "Run a shell command in an isolated Linux sandbox and get its exit code, status and output. "
        "No network, read-only system files, a private writable working directory, limits on time and "
        "memory. Python 3 (standard library) and the usual command-line tools are available.")
    args_schema: type[BaseModel] = SandboxInput
    response_format: str = "content_and_artifact"  # the model reads text; the Result rides as artifact
    handle_tool_error: bool = True  # bad input becomes a message the model can fix
    handle_validation_error: Any = _invalid_arguments  # arguments missing or of the wrong type too

    profile: Any = "strict"  # profile name, TOML path, or sandbox.Profile
    workspace: str | None = None  # host directory bound read-write as the workdir (None: fresh per run)
    max_output_chars: int = 20000
    run_options: dict[str, Any] = Field(default_factory=dict)  # more sandbox.run overrides (memory, env, ...)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # After pydantic's validation: a ProfileError/InputError (ValueErrors) raised inside a
        # validator would come out as a pydantic ValidationError instead.
        self._check_config()

    def _check_config(self) -> None:
        """The checks `sandboxrun mcp` makes at start-up, and sandbox.run's on every call."""
        from ..mcp_server import _workspace
        from ..profile import Profile, load, with_overrides
        from ..supervisor import build_env

        if isinstance(self.max_output_chars, bool) or not isinstance(self.max_output_chars, int) \
                or self.max_output_chars < 1:
            raise InputError(f"max_output_chars: expected a whole number >= 1, got {self.max_output_chars!r}")
        prof = self.profile if isinstance(self.profile, Profile) else load(self.profile)
        _workspace(self.workspace, "workspace")
        opts = dict(self.run_options)
        for key, why in _SET_BY_THE_TOOL.items():
            if key in opts:
                raise InputError(f"run_options: {key!r} is not a run option here: {why}")
        build_env(prof, opts.pop("env", None))
        with_overrides(prof, **{k: v for k, v in opts.items() if k not in _RUN_KEYWORDS})

    def _options(self, timeout: float | None) -> dict[str, Any]:
        return {"shell": True, "profile": self.profile, "cwd": self.workspace, "timeout": timeout,
                **self.run_options}

    def _run(self, command: str, timeout: float | None = None, run_manager: Any = None,
             **_: Any) -> tuple[str, dict[str, Any]]:
        from .. import run

        try:
            res = run(command, **self._options(timeout))
        except SandboxError as e:
            raise ToolException(f"error: {e}") from None
        return format_result(res, self.max_output_chars), res.to_dict()

    async def _arun(self, command: str, timeout: float | None = None, run_manager: Any = None,
                    **_: Any) -> tuple[str, dict[str, Any]]:
        from .. import run_async

        try:  # (not a thread running _run: cancelling the task kills the sandbox, as run_async does)
            res = await run_async(command, **self._options(timeout))
        except SandboxError as e:
            raise ToolException(f"error: {e}") from None
        return format_result(res, self.max_output_chars), res.to_dict()


__all__ = ["SandboxTool", "SandboxInput", "format_result"]
