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


def fixed() -> tuple[tuple[str, int], ...]:
    """FIXED, each no higher than our own hard limit: raising one takes CAP_SYS_RESOURCE,
    which a container's root often lacks (memlock 64 KiB there), and the run would fail."""
    out = []
    for name, value in FIXED:
        hard = resource.getrlimit(NAMES[name])[1]
        out.append((name, value if hard == resource.RLIM_INFINITY else min(value, hard)))
    return tuple(out)


def apply(limits: tuple[tuple[str, int], ...]) -> None:
    for name, value in limits:
        resource.setrlimit(NAMES[name], (value, value))
