"""Per-process resource limits, soft = hard so the command cannot raise them."""

from __future__ import annotations

import resource

NAMES = {
    "cpu_time": resource.RLIMIT_CPU,
    "address_space": resource.RLIMIT_AS,
    "file_size": resource.RLIMIT_FSIZE,
    "open_files": resource.RLIMIT_NOFILE,
    "processes": resource.RLIMIT_NPROC,
    "core": resource.RLIMIT_CORE,
    "stack": resource.RLIMIT_STACK,
    "locked_memory": resource.RLIMIT_MEMLOCK,
    "realtime_priority": resource.RLIMIT_RTPRIO,
    "nice": resource.RLIMIT_NICE,
    "message_queues": resource.RLIMIT_MSGQUEUE,
}

# Limits no profile names, at the kernel's usual defaults rather than the caller's: a caller
# with an unlimited stack (the legacy mmap layout: less ASLR), real-time priority allowed,
# or unlimited locked memory would hand them to the untrusted command.
FIXED = (("stack", 8 << 20), ("locked_memory", 8 << 20), ("realtime_priority", 0), ("nice", 0),
         ("message_queues", 819200))


class LimitsUnreadable(OSError):
    """Our own limits cannot be read (prlimit64 denied to sandboxrun): none could be set either."""


def _hard(name: str) -> int:
    try:
        return resource.getrlimit(NAMES[name])[1]
    except OSError as e:
        raise LimitsUnreadable(e.errno, f"cannot read this process's {name} limit: {e.strerror} "
                                        "(prlimit64 denied?): no limit could be set") from None


def fixed() -> tuple[tuple[str, int], ...]:
    """FIXED, each no higher than our own hard limit: raising one takes CAP_SYS_RESOURCE,
    which a container's root often lacks (memlock 64 KiB there), and the run would fail."""
    out = []
    for name, value in FIXED:
        hard = _hard(name)
        out.append((name, value if hard == resource.RLIM_INFINITY else min(value, hard)))
    return tuple(out)


_may_raise: list[bool] = []  # once per process: whether we hold CAP_SYS_RESOURCE


def may_raise_hard_limits() -> bool:
    """Root with CAP_SYS_RESOURCE may set a limit above its own hard one; nobody else may
    (a user namespace's root neither: the check is against the initial namespace)."""
    if not _may_raise:
        import os

        held = False
        if os.geteuid() == 0:
            try:
                with open("/proc/self/uid_map") as f:  # the initial namespace maps every uid to itself
                    initial = f.read().split() == ["0", "0", "4294967295"]
                with open("/proc/self/status") as f:
                    eff = next((line.split()[1] for line in f if line.startswith("CapEff:")), "0")
                held = initial and bool(int(eff, 16) >> 24 & 1)  # CAP_SYS_RESOURCE
            except (OSError, ValueError):
                held = True  # root, unreadable /proc: let setrlimit answer
        _may_raise.append(held)
    return _may_raise[0]


def ceiling(name: str) -> int | None:
    """The highest value of limit `name` this process can give a child, or None: any."""
    if may_raise_hard_limits():
        return None
    hard = _hard(name)
    return None if hard == resource.RLIM_INFINITY else hard


def beyond_reach(limits: tuple[tuple[str, int], ...]) -> str | None:
    """Why one of `limits` cannot be set here (above our hard limit, which only
    CAP_SYS_RESOURCE raises), or None. Checked before the run: the child would fail with EPERM."""
    for name, value in limits:
        top = ceiling(name)
        if top is not None and value > top:
            return (f"{name} = {value} is above this process's hard limit of {top}, which only "
                    f"CAP_SYS_RESOURCE may raise: lower the profile's {name}, or raise the hard limit (ulimit -H)")
    return None


def apply(limits: tuple[tuple[str, int], ...]) -> None:
    for name, value in limits:
        resource.setrlimit(NAMES[name], (value, value))


def bytecode_flags() -> list[str]:
    """["-B"] for a Python process of ours when this one writes no .pyc: the caller said so,
    or sandbox/__init__.py did under a finite `ulimit -f` (a cut .pyc would break every
    later start)."""
    import sys

    return ["-B"] if sys.dont_write_bytecode else []
