"""sandboxrun: run untrusted commands with real OS isolation, get a structured result.

    >>> import sandbox
    >>> r = sandbox.run(["python3", "-c", "print(6*7)"])
    >>> r.status, r.stdout
    ('ok', '42\\n')
"""

from __future__ import annotations

import resource as _resource
import sys as _sys

# Under a finite `ulimit -f` CPython can rename a cut .pyc into place (its short write goes
# unchecked), and every later import of it fails ("marshal data too short"): write none then.
try:
    if _resource.getrlimit(_resource.RLIMIT_FSIZE)[0] != _resource.RLIM_INFINITY:
        _sys.dont_write_bytecode = True
except OSError:  # prlimit64 denied (a seccomp profile): not known, so none; the run names the step
    _sys.dont_write_bytecode = True

from .errors import InputError, ProfileError, SandboxError

__version__ = "0.1.0"
__all__ = ["run", "run_async", "run_many", "start", "Result", "Profile", "load_profile",
           "SandboxError", "InputError", "ProfileError"]

TYPE_CHECKING = False  # typing costs ~5 ms to import; annotations here are strings anyway
if TYPE_CHECKING:
    from typing import Any

    from .profile import Profile
    from .result import Result


def run(command: Any, **kwargs: Any) -> Result:
    """Run a command in a sandbox. See sandbox.supervisor.run."""
    from .supervisor import run as _run

    return _run(command, **kwargs)


async def run_async(command: Any, **kwargs: Any) -> Result:
    """asyncio variant: the run is supervised in a thread of its own; the loop never blocks.
    Cancelling the task kills the sandbox (and waits for that) before the CancelledError
    goes on."""
    from .asyncrun import in_thread

    if "cancel" in kwargs:  # (else a TypeError: run() got multiple values for 'cancel')
        raise InputError("cancel: run_async makes its own; cancel the task instead")
    return await in_thread(lambda cancel: run(command, cancel=cancel, **kwargs))


def run_many(requests: Any, concurrency: int | None = None, **kwargs: Any) -> Any:
    from .batch import run_many as _run_many

    return _run_many(requests, concurrency, **kwargs)


def start(command: Any, **kwargs: Any) -> Any:
    from .sessions import start as _start

    return _start(command, **kwargs)


def load_profile(ref: str = "strict") -> Profile:
    from .profile import load

    return load(ref)


_SUBMODULES = ("doctor", "payload", "batch", "sessions", "coderunner")


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:  # `sandbox.doctor.diagnose()` after a plain `import sandbox`, imported on first use
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    if name == "Result":
        from .result import Result

        return Result
    if name == "Profile":
        from .profile import Profile

        return Profile
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
