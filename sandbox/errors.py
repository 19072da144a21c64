"""Errors that reach users: each names what is wrong and maps to an exit code."""

from __future__ import annotations

# CLI exit codes for failures of sandboxrun itself (the command's own codes pass through).
EXIT_USAGE = 2  # bad argument, profile or payload: nothing was run
EXIT_SANDBOX = 125  # blocked, or the sandbox could not be set up (as docker run / podman)


class SandboxError(Exception):
    """Base class: a problem sandboxrun reports instead of running the command."""

    exit_code = EXIT_USAGE


class InputError(SandboxError, ValueError):
    """Bad input from the caller: argument, path, payload, request."""


class ProfileError(SandboxError, ValueError):
    """A profile that cannot be loaded or validated; names file, key and value."""

    def __init__(self, message: str, *, source: str = "", key: str = "", value: object = None) -> None:
        where = source or "profile"
        if key:
            where += f": {key}"
            if value is not None:
                where += f" = {value!r}"
        super().__init__(f"{where}: {message}")
        self.source, self.key, self.value = source, key, value
