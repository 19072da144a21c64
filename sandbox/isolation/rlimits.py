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
}


def apply(limits: tuple[tuple[str, int], ...]) -> None:
    for name, value in limits:
        resource.setrlimit(NAMES[name], (value, value))
