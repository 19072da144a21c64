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

    errno: int | None = None  # a path the kernel refused: why (EMFILE is no bad path)


class ProfileError(SandboxError, ValueError):
    """A profile that cannot be loaded or validated; names file, key and value."""

    def __init__(self, message: str, *, source: str = "", key: str = "", value: object = None) -> None:
        where = source or "profile"
        if key == where == "profile":  # the profile argument itself: not "profile: profile = 'x'"
            where += "" if value is None else f" {value!r}"
        elif key:
            where += f": {key}"
            if value is not None:
                where += f" = {value!r}"
        super().__init__(f"{where}: {message}")
        self.source, self.key, self.value, self.reason = source, key, value, message


def os_bytes(text: str, what: str) -> bytes:
    """`text` as the bytes the kernel gets: UTF-8, and the bytes that were not UTF-8 on a
    command line given back as they came (Python's surrogateescape, as os.fsencode). A lone
    surrogate of other text (JSON's "\\ud800") stands for no bytes: an InputError naming `what`."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError as e:
        raise InputError(f"{what}: {text[e.start]!r} at offset {e.start} is a lone surrogate, which stands "
                         "for no bytes (not valid UTF-8 text)") from None


def write_failure(err: OSError) -> str:
    """Why a write of sandboxrun's own (state, a script copy) failed, in words: EFBIG names
    the caller's file size limit, which its processes inherit (`ulimit -f`)."""
    import errno

    why = err.strerror or str(err)
    if err.errno == errno.EFBIG:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if soft != resource.RLIM_INFINITY:
            why += f": this process's file size limit (RLIMIT_FSIZE, `ulimit -f`) is {soft} bytes"
    return why
