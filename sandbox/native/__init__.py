"""The native stage: the child's setup steps in a small C program (stage.c).

Forking a Python process to build the sandbox costs a copy of its page tables and
hundreds of copy-on-write faults per run, and a Python child spends milliseconds
interpreting the steps. The stage is posix_spawn'ed (vfork + exec: free even from
a large, multi-threaded caller), reads a program of ordered steps compiled from the
RunPlan (ops.py), applies them with the same syscalls as the Python child, and
stays as PID 1. Rootless callers' forkers (in a user namespace of their own) spawn it
too. The Python child remains for what the stage does not do (a view with more fds than
its slots, ops.supports) and where no C compiler was there to build the stage.

The binary is built once per source version into the trusted cache directory (the
seccomp cache's: root-owned /var/cache/sandboxrun for root); `scripts/setup.sh` builds
it ahead of the first run. It is linked statically against musl where `musl-gcc` is
there (Debian's musl-tools), else against glibc: glibc's start-up asks the CPU for its
features and cache sizes with some 75 `cpuid` instructions, each a VM exit on a guest
(5.6 us measured here), about 0.2-0.4 ms of every run; musl's start-up asks nothing.
"""

from __future__ import annotations

import os
import stat

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stage.c")

_path: str | None = None
_error: str | None = None


BUILD_RECIPE = b"musl-static|cc-static|cc"  # in the key: a change of recipe rebuilds


def _source_key() -> str:
    from ..isolation.seccomp import _sha256_hex

    with open(SOURCE, "rb") as f:
        return _sha256_hex(f.read() + os.uname().machine.encode() + BUILD_RECIPE)[:16]


def _trusted(fd: int, name: str) -> bool:
    try:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
    except OSError:
        return False
    return (stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and bool(st.st_mode & stat.S_IXUSR))


def _kernel_headers(into: str) -> list[str]:
    """musl-gcc searches musl's headers only; the stage also needs the kernel's (linux/, asm/,
    asm-generic/ from linux-libc-dev). Links to those three alone, so no glibc header mixes in.
    [] when they are not where Debian and Ubuntu put them."""
    arch = os.uname().machine
    multiarch = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}.get(arch, "")
    found = {"linux": "/usr/include/linux", "asm-generic": "/usr/include/asm-generic",
             "asm": next((d for d in (f"/usr/include/{multiarch}/asm", "/usr/include/asm") if os.path.isdir(d)), "")}
    if not all(os.path.isdir(d) for d in found.values()):
        return []
    for name, target in found.items():
        os.symlink(target, os.path.join(into, name))
    return ["-isystem", into]


def _recipes(headers: str) -> list[list[str]]:
    """Compiler command lines to try in order (without -o and the source)."""
    cc = os.environ.get("CC")
    if cc:  # the caller chose the compiler
        return [[cc, "-static"], [cc]]
    import shutil

    out: list[list[str]] = []

    if shutil.which("musl-gcc"):
        extra = _kernel_headers(headers)
        if extra:
            out.append(["musl-gcc", "-static", *extra])
    return [*out, ["cc", "-static"], ["cc"]]  # static: no dynamic loader on each exec


def _compile(dfd: int, name: str, cache: str) -> None:
    import shutil
    import subprocess

    from ..workdir import mkdtemp

    tmp = f".{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    out = os.path.join(cache, tmp)
    errors = ""
    # (named as a run's fresh workdir, our pid in it: a later start removes it if we are SIGKILLed)
    headers = mkdtemp()[0]
    try:
        recipes = _recipes(headers)
        for recipe in recipes:
            try:
                r = subprocess.run([recipe[0], "-O2", "-std=gnu11", *recipe[1:], "-o", out, SOURCE],
                                   capture_output=True, text=True, timeout=120,
                                   env={**os.environ, "LC_ALL": "C"})  # (_FORK_FAILED is the C locale's text)
            except (OSError, subprocess.SubprocessError) as e:
                errors = str(e)
                continue
            if r.returncode == 0:
                os.chmod(out, 0o700)
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                prune_builds(dfd, name)
                return
            lines = r.stderr.strip().splitlines()
            errors = lines[-1] if lines else f"exit {r.returncode}"
            if _FORK_FAILED in r.stderr:  # (RLIMIT_NPROC) the compiler retried for ~15 s: so would the next
                break
    finally:
        try:
            os.unlink(tmp, dir_fd=dfd)
        except OSError:
            pass
        shutil.rmtree(headers, ignore_errors=True)
    tried = ", ".join(dict.fromkeys(r[0] for r in recipes))
    raise OSError(0, f"cannot build the native stage (tried {tried}): {errors}")


_FORK_FAILED = "Resource temporarily unavailable"  # gcc's "cannot fork" (EAGAIN), after its own retries
STALE_TEMP_S = 3600.0  # a build's or cache write's temp file this old is a SIGKILLed process's


KEEP_BUILDS = 4  # of other sources: a process of another installed version may still spawn its own


def prune_builds(dfd: int, current: str, keep: int = KEEP_BUILDS) -> None:
    """Remove builds of other sources but the `keep` newest: deleting every other build would
    make a long-running process of another version fail its next run."""
    import time

    from ..isolation.seccomp import prune_cache

    prune_cache(dfd, keep, lambda e: e.startswith("stage-") and e != current)
    now = time.time()
    for e in os.listdir(dfd):  # what a SIGKILLed build or cache write left
        if e.startswith(".") and e.endswith(".tmp"):
            try:
                if now - os.stat(e, dir_fd=dfd, follow_symlinks=False).st_mtime > STALE_TEMP_S:
                    os.unlink(e, dir_fd=dfd)
            except OSError:
                pass


def stage_path() -> str | None:
    """The built stage binary, building it on first use; None (see `unavailable()`) when it
    cannot be built or is switched off (SANDBOXRUN_NATIVE=0)."""
    global _path, _error
    if os.environ.get("SANDBOXRUN_NATIVE", "1") == "0":
        return None
    if _path or _error:
        return _path
    from ..isolation.seccomp import _open_cache_dir, default_cache_dir

    cache = default_cache_dir()
    dfd = _open_cache_dir(cache)
    if dfd is None:
        _error = f"no trusted cache directory at {cache}"
        return None
    try:
        name = f"stage-{_source_key()}"
        if not _trusted(dfd, name):
            _compile(dfd, name, cache)
        _path = os.path.join(cache, name)
    except OSError as e:
        _error = e.strerror or str(e)
    finally:
        os.close(dfd)
    return _path


def unavailable() -> str | None:
    """Why the native stage is not used, or None when it is."""
    if os.environ.get("SANDBOXRUN_NATIVE", "1") == "0":
        return "switched off (SANDBOXRUN_NATIVE=0)"
    stage_path()
    return _error
