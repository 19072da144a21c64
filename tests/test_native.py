"""The native stage (sandbox/native): same layers as the Python child, in the same order.

Root runs go through the stage; these tests also run the Python child (SANDBOXRUN_NATIVE=0)
on the same probes, so neither path can drift from the other unnoticed.
"""

from __future__ import annotations

import os
import shutil
import stat
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import inherited_at

import sandbox
from sandbox import native
from sandbox.native import ops

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or native.unavailable() is not None,
                                reason="the native stage runs for root callers, once built")

PROBE = ("grep -E '^(CapEff|CapBnd|NoNewPrivs|Seccomp):' /proc/self/status; id -u; hostname; "
         "tr '\\0' ' ' < /proc/1/cmdline; echo; set -- /proc/[0-9]*; echo $#; "
         "test -e /etc/shadow && echo shadow || echo no-shadow; cat /proc/net/dev | tail -n +3 | cut -d: -f1")


def _probe(monkeypatch: pytest.MonkeyPatch, path: str) -> list[str]:
    monkeypatch.setenv("SANDBOXRUN_NATIVE", "1" if path == "native" else "0")
    r = sandbox.run(["sh", "-c", PROBE])
    assert r.status == "ok", r
    lines = r.stdout.split()
    uid = lines.index(str(r.isolation.uid))
    return [*lines[:uid], "<uid>", *lines[uid + 1:]]


def test_native_and_python_child_apply_the_same_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    native_view, python_view = _probe(monkeypatch, "native"), _probe(monkeypatch, "python")
    assert native_view == python_view
    joined = " ".join(native_view)
    assert "CapEff: 0000000000000000" in joined and "CapBnd: 0000000000000000" in joined
    assert "NoNewPrivs: 1" in joined and "Seccomp: 2" in joined
    assert "sandboxrun-init" in joined and "no-shadow" in joined and native_view[-1] == "lo"


def test_a_pid_namespace_the_stage_makes_is_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-shot CLI has the stage clone PID 1 (no ctypes to unshare with on Python 3.11):
    the run sees what a run whose pid namespace our thread made sees, and the stage is reaped."""
    from sandbox import supervisor
    from sandbox.native import launch

    thread_made = _probe(monkeypatch, "native")
    spawned: list[int] = []
    real_spawn = os.posix_spawn
    monkeypatch.setattr(launch.os, "posix_spawn", lambda *a, **k: spawned.append(real_spawn(*a, **k)) or spawned[-1])
    cloned: list[tuple[int, bool]] = []  # (PID 1's pid, born in its cgroup)
    real_cloning = launch._spawn_cloning
    monkeypatch.setattr(launch, "_spawn_cloning", lambda *a: cloned.append(real_cloning(*a)) or cloned[-1])
    forker = launch.NativeForker(templates=False, stage_clones=True)
    monkeypatch.setattr(supervisor, "_native", forker)
    try:
        stage_made = _probe(monkeypatch, "native")
    finally:
        forker.close()
    assert stage_made == thread_made
    assert len(spawned) == 1 and len(cloned) == 1 and cloned[0][0] != spawned[0]  # PID 1 is not the stage
    with pytest.raises(ChildProcessError):
        os.waitpid(spawned[0], os.WNOHANG)  # the stage that cloned PID 1: reaped, no zombie


@pytest.mark.parametrize(("says", "step", "err"), [("-28", "pid_namespace", 28), ("", "stage", 0)])
def test_a_stage_that_could_not_clone_fails_the_run_closed(tmp_path, says: str, step: str, err: int) -> None:
    """The stage's answer on fd 5 is PID 1's pid, or -errno when the clone was refused (ENOSPC:
    user.max_pid_namespaces reached), or nothing if it died: no pid, no run, the step named."""
    from sandbox.forker import ForkError
    from sandbox.native import launch

    fake = tmp_path / "stage"
    fake.write_text(f"#!/bin/sh\n{'echo ' + says + ' >&5' if says else 'exit 0'}\n")
    fake.chmod(0o755)
    null = os.open(os.devnull, os.O_RDONLY)  # a stdin for it, as a run's: copied for the spawn, then closed
    try:
        with pytest.raises(ForkError) as caught:
            launch._spawn_cloning(str(fake), "sandboxrun-init", {0: null})
    finally:
        os.close(null)
    assert (caught.value.step, caught.value.errno or 0) == (step, err), caught.value


def test_an_inherited_fd_5_does_not_make_the_stage_clone(monkeypatch: pytest.MonkeyPatch) -> None:
    """fd 5 open in the stage means "make the pid namespace" (stage.c): a caller's own fd 5,
    inheritable, must not reach it when our thread made the namespace already."""
    from sandbox import supervisor
    from sandbox.native import launch

    null = os.open(os.devnull, os.O_WRONLY)
    forker = launch.NativeForker(templates=False, stage_clones=False)
    monkeypatch.setattr(supervisor, "_native", forker)
    try:
        with inherited_at(5, null):
            r = sandbox.run(["sh", "-c", "echo $$; tr '\\0' ' ' < /proc/1/cmdline"])
    finally:
        forker.close()
        os.close(null)
    assert r.status == "ok" and r.stdout.split() == ["2", "sandboxrun-init"], r


def test_native_stage_is_what_root_runs_use(monkeypatch: pytest.MonkeyPatch) -> None:
    from sandbox.native.launch import NativeForker

    spawned: list[int] = []
    real = NativeForker.spawn
    monkeypatch.setattr(NativeForker, "spawn", lambda self, plan, fds: spawned.append(1) or real(self, plan, fds))
    monkeypatch.setenv("SANDBOXRUN_NATIVE", "1")
    r = sandbox.run(["/bin/true"])
    assert r.status == "ok" and spawned == [1]
    st = os.stat(native.stage_path() or "")
    assert st.st_uid == 0 and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _records(program: bytes) -> list[tuple[str, list[bytes]]]:
    out, pos = [], 0
    while pos < len(program):
        code, n = chr(program[pos]), program[pos + 1]
        pos += 2
        args = []
        for _ in range(n):
            (size,) = struct.unpack_from("<I", program, pos)
            args.append(program[pos + 4:pos + 4 + size])
            pos += 4 + size + 1
        out.append((code, args))
    return out


def test_stage_program_keeps_the_python_childs_step_order(monkeypatch: pytest.MonkeyPatch) -> None:
    from sandbox.child import __doc__ as child_doc
    from sandbox.profile import load
    from sandbox.supervisor import Request, make_plan
    from sandbox.workdir import Workdir

    req = Request(["/bin/true"], load("strict"))
    plan = make_plan(req, Workdir(None, in_memory=True), 1234, 1234)
    steps = [a[0].decode() for c, a in _records(ops.compile_plan(plan, template=False, cgroup=True)) if c == "T"]
    documented = [line.split()[0] for line in (child_doc or "").split("Order")[1].splitlines()[1:]
                  if line.startswith("  ") and not line.startswith("   ")]
    assert [s for s in steps if s in documented] == [s for s in documented if s in steps]
    assert steps.index("no_new_privs") < steps.index("landlock_enforce") < steps.index("seccomp") < steps.index("exec")
    assert steps.index("identity") < steps.index("capabilities")
    # And the order the Python child really takes (its trace), not only its docstring's. The
    # cgroup wait is the one step that differs: the stage joins v1 cgroups itself, first.
    monkeypatch.setenv("SANDBOXRUN_NATIVE", "0")
    r = sandbox.run(["/bin/true"], trace=True)
    assert r.status == "ok" and r.trace, r
    taken = [s for s in r.trace if s != "cgroup"]
    assert [s for s in steps if s in taken] == [s for s in taken if s in steps], (steps, list(r.trace))


def test_stage_is_born_pid_1_as_our_child_and_our_thread_keeps_its_namespace() -> None:
    """The calling thread unshares CLONE_NEWPID so the stage starts as PID 1 (no first
    process, no CLONE_PARENT hop); afterwards the thread must be back in its own namespace."""
    from sandbox.profile import load
    from sandbox.supervisor import Request, build_env, execute

    seen: list[str] = []

    def on_started(pid: int) -> None:
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f)
        seen.extend([status["PPid"].strip(), status["NSpid"].split()[-1]])

    prof = load("strict")
    r = execute(Request(["sh", "-c", "echo $PPID"], prof, env=build_env(prof, None), on_started=on_started))
    assert r.status == "ok" and r.stdout.strip() == "1", r
    assert seen == [str(os.getpid()), "1"]  # our child, PID 1 in its namespace
    assert os.readlink("/proc/thread-self/ns/pid_for_children") == os.readlink("/proc/thread-self/ns/pid")
    assert sandbox.run(["/bin/true"]).status == "ok"  # a second unshare works: the first was undone


def test_a_thread_stuck_in_the_new_pid_namespace_leaves_no_child(monkeypatch: pytest.MonkeyPatch) -> None:
    """If the thread cannot return to its own pid namespace, the stage it started is killed
    and reaped, and the caller gets an error (never a run from a thread in the wrong place)."""
    import threading

    from sandbox.native import launch

    spawned: list[int] = []
    real_spawn = os.posix_spawn
    monkeypatch.setattr(launch.os, "posix_spawn", lambda *a, **k: spawned.append(real_spawn(*a, **k)) or spawned[-1])
    monkeypatch.setattr(launch, "setns", lambda fd, nstype: (_ for _ in ()).throw(OSError(1, "refused (test)")))
    raised: list[BaseException] = []

    def body() -> None:  # its own thread: it ends, and its pid namespace for children with it
        try:
            launch._spawn_stage(native.stage_path() or "", "sandboxrun-init", ops.Program().bytes(),
                                {}, pid1=True)
        except BaseException as e:  # noqa: BLE001
            raised.append(e)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert len(raised) == 1 and isinstance(raised[0], RuntimeError) and len(spawned) == 1
    with pytest.raises(ChildProcessError):
        os.waitpid(spawned[0], os.WNOHANG)  # killed and reaped already


def test_a_ready_network_namespace_serves_one_run_only() -> None:
    seen = [sandbox.run(["readlink", "/proc/self/ns/net"]).stdout.strip() for _ in range(6)]
    assert len(set(seen)) == 6, seen
    with open("/proc/self/ns/net"):
        assert os.readlink("/proc/self/ns/net") not in seen  # and never the host's


def test_ready_network_namespaces_are_dropped_in_a_forked_caller() -> None:
    sandbox.run(["/bin/true"])
    from sandbox import supervisor

    ready = supervisor._native.netns
    assert ready is not None
    for _ in range(50):  # ready ones: a run still ending in another thread may have taken the last
        ready.refill()
        assert ready.wait_ready() and not ready.broken, ready.broken
        if ready.fds():
            break
    assert ready.fds()
    pid = os.fork()
    if pid == 0:  # the child must not hand out namespaces its parent also holds
        try:
            os._exit(0 if ready.take() == -1 else 1)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_stage_joined_by_the_supervisor_is_limited_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """cgroup v2's protocol (the supervisor moves PID 1, the stage waits for its word),
    exercised here on v1: the memory limit must still hold."""
    from sandbox.isolation import cgroups
    from sandbox.native.launch import NativeForker

    if cgroups.detect().version == "none":
        pytest.skip("no cgroup backend")
    monkeypatch.setattr(NativeForker, "joins_v1_cgroups", False)
    r = sandbox.run(["python3", "-c", "x = []\nwhile True:\n    x.append(bytearray(16 << 20))"],
                    memory="64MiB", timeout=20)
    assert r.status == "memory_limit" and r.usage.oom_kills >= 1, r


def test_views_with_more_binds_than_the_stage_holds_still_run(tmp_path) -> None:
    binds = []
    for i in range(ops.MAX_SLOTS + 5):
        (tmp_path / f"d{i}").mkdir()
        binds.append(f"{tmp_path}/d{i}:/mnt/d{i}")
    r = sandbox.run(["sh", "-c", "ls /mnt | wc -l"], ro_bind=binds)
    assert r.status == "ok" and int(r.stdout) == len(binds), r


def test_a_new_build_keeps_a_few_builds_of_other_versions(tmp_path) -> None:
    """Another installed version may be running: its stage must not vanish under it."""
    for i in range(7):
        f = tmp_path / f"stage-old{i}"
        f.write_bytes(b"")
        os.utime(f, ns=(i * 10**9, i * 10**9))
    (tmp_path / "stage-new").write_bytes(b"")
    (tmp_path / "seccomp-default-x.bpf").write_bytes(b"")
    dfd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        native.prune_builds(dfd, "stage-new", keep=4)
    finally:
        os.close(dfd)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "seccomp-default-x.bpf", "stage-new", "stage-old3", "stage-old4", "stage-old5", "stage-old6"]


def test_cpu_usage_counts_processes_killed_at_the_end(child: str) -> None:
    # A background spinner outlives the command and is killed with the sandbox: its CPU time
    # is the run's too. The stage, PID 1, kills and reaps it before it reports (the kernel
    # would reap it without adding it to PID 1's children); the Python child leaves it to
    # the kernel, and its run's CPU time comes from the cgroup's cpuacct.
    r = sandbox.run(["sh", "-c", "python3 -c 'while 1: pass' & sleep 0.6"])
    assert r.status == "ok", r
    assert r.usage.cpu_user_s + r.usage.cpu_sys_s >= 0.3, r.usage


def test_peak_memory_is_the_runs_not_the_supervisors() -> None:
    # The stage is born by vfork from this process: at exec the kernel carries our own peak
    # RSS into its ru_maxrss, so that figure must not reach the Result.
    ballast = bytearray(160 << 20)
    ballast[::4096] = b"x" * len(ballast[::4096])  # touched: resident
    r = sandbox.run(["true"])
    assert r.status == "ok", r
    assert r.usage.peak_memory_bytes < 64 << 20, r.usage
    del ballast


def test_ready_network_namespaces_own_small_socket_tables_and_leave_the_host_alone() -> None:
    """Made from a parent with small child hash tables: tearing one down purges its own few
    buckets, not the host's TCP table; the host's settings stay as they were."""
    host = "/proc/sys/net/ipv4/tcp_child_ehash_entries"
    if not os.path.exists(host):
        pytest.skip("kernel before 6.1: no per-namespace socket tables")
    with open(host) as f:
        before = f.read()
    from sandbox import supervisor
    from sandbox.isolation.network import CHILD_HASH_BUCKETS

    sandbox.run(["/bin/true"])
    ready = supervisor._native.netns
    assert ready is not None and ready.wait_ready()
    r = sandbox.run(["cat", "/proc/sys/net/ipv4/tcp_ehash_entries", "/proc/sys/net/ipv4/udp_hash_entries"])
    assert r.status == "ok" and r.stdout.split() == [str(CHILD_HASH_BUCKETS)] * 2, r
    with open(host) as f:
        assert f.read() == before


def test_a_batch_makes_each_runs_network_namespace_from_the_parent_never_in_it() -> None:
    """In a batch the stage makes the run's namespace from the parent (network.parent_namespace)
    instead of taking one made ahead: the pool is left alone, and no run is ever in the parent
    or in another run's namespace."""
    from sandbox import supervisor
    from sandbox.isolation.network import parent_namespace

    sandbox.run(["/bin/true"])
    ready = supervisor._native.netns
    assert ready is not None and ready.wait_ready()
    parent = parent_namespace()
    if parent < 0:
        pytest.skip("no parent namespace on this kernel (before 6.1)")

    def pool() -> set[str]:
        return {os.readlink(f"/proc/self/fd/{fd}") for fd in ready.fds()}

    before = pool()
    cmd = ["sh", "-c", "readlink /proc/self/ns/net; cat /proc/sys/net/ipv4/tcp_ehash_entries"]
    rs = list(sandbox.run_many([{"command": cmd}] * 6, concurrency=2))
    assert all(r.status == "ok" for r in rs), rs
    seen = [r.stdout.split()[0] for r in rs]
    assert len(set(seen)) == 6, seen  # one each
    assert os.readlink(f"/proc/self/fd/{parent}") not in seen
    assert not set(seen) & before and pool() == before  # none of the pool's, which stays as it was
    assert {r.stdout.split()[1] for r in rs} == {"256"}  # the parent's small socket tables
    r = next(sandbox.run_many([{"command": ["python3", "-c", "import socket; s = socket.create_server(('127.0.0.1', 0)); "
                                                         "socket.create_connection(s.getsockname()); print('up')"]}]))
    assert r.status == "ok" and r.stdout == "up\n", r  # loopback up


def test_a_batch_without_a_parent_namespace_uses_namespaces_made_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no parent namespace can be made (a kernel before 6.1), a batch's runs take the
    namespaces made ahead, each its own, as single runs do."""
    from sandbox.isolation import network

    monkeypatch.setattr(network, "parent_namespace", lambda: -1)
    taken: list[int] = []
    real_take = network.ReadyNamespaces.take

    def take(self):  # noqa: ANN001, ANN202
        fd = real_take(self)
        taken.append(fd)
        return fd

    monkeypatch.setattr(network.ReadyNamespaces, "take", take)
    from sandbox import supervisor

    sandbox.run(["/bin/true"])
    ready = supervisor._native.netns
    assert ready is not None and ready.wait_ready() and not ready.broken
    taken.clear()
    cmd = ["readlink", "/proc/self/ns/net"]
    rs = list(sandbox.run_many([{"command": cmd}] * 4, concurrency=2))
    seen = [r.stdout.strip() for r in rs]
    assert all(r.status == "ok" for r in rs) and len(set(seen)) == 4, rs
    # Made ahead, not by the stage: those ready before the batch surely (a later one may find the
    # refilling thread behind on a loaded host, and the stage then makes its own, as it should).
    assert len(taken) == 4 and all(fd >= 0 for fd in taken[:ready.size]), taken
    with open("/proc/self/ns/net"):
        assert os.readlink("/proc/self/ns/net") not in seen


@pytest.mark.skipif(shutil.which("musl-gcc") is None or "CC" in os.environ, reason="musl-gcc is not installed")
def test_stage_is_linked_against_musl_where_musl_gcc_is_there() -> None:
    """glibc's static start-up runs some 75 cpuid instructions (each a VM exit) on every run
    of the stage; musl's runs none. A glibc build carries glibc's tunables parser."""
    path = native.stage_path()
    assert path is not None
    with open(path, "rb") as f:
        assert b"GLIBC_TUNABLES" not in f.read()


def test_build_recipes_try_musl_then_the_system_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert native._recipes(str(tmp_path)) == [["cc", "-static"], ["cc"]]
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    first = native._recipes(str(tmp_path))[0]
    if first[0] == "musl-gcc":  # with the kernel's headers, and only those, beside musl's
        assert first == ["musl-gcc", "-static", "-isystem", str(tmp_path)]
        assert sorted(os.listdir(tmp_path)) == ["asm", "asm-generic", "linux"]
    monkeypatch.setenv("CC", "clang")
    assert native._recipes(str(tmp_path)) == [["clang", "-static"], ["clang"]]


def _fake_compiler(tmp_path, name: str) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / name
    fake.write_text(f"#!/bin/sh\necho '{name}: broken on purpose' >&2\nexit 1\n")
    fake.chmod(0o755)


def _build(tmp_path) -> bytes:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    dfd = os.open(cache, os.O_RDONLY | os.O_DIRECTORY)
    try:
        native._compile(dfd, "stage-test", str(cache))
    finally:
        os.close(dfd)
    return (cache / "stage-test").read_bytes()


def test_a_failing_musl_build_falls_back_to_the_system_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    _fake_compiler(tmp_path, "musl-gcc")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.delenv("CC", raising=False)
    assert b"GLIBC_TUNABLES" in _build(tmp_path)  # cc built it


def test_a_stage_no_compiler_can_build_names_what_was_tried(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    _fake_compiler(tmp_path, "broken-cc")
    monkeypatch.setenv("CC", str(tmp_path / "bin" / "broken-cc"))
    with pytest.raises(OSError, match=r"tried .*broken-cc\): broken-cc: broken on purpose"):
        _build(tmp_path)
    assert os.listdir(tmp_path / "cache") == []  # no half-written binary left


def test_a_long_lived_caller_builds_each_view_from_its_template(monkeypatch: pytest.MonkeyPatch) -> None:
    # A template that cannot be opened falls back to a full build on every run: still
    # correct, but ~1 ms a run slower, and silent (a change broke it once, unseen).
    from sandbox import supervisor

    monkeypatch.setattr(supervisor, "_native", None)  # a forker of this test's own
    monkeypatch.delenv("SANDBOXRUN_NO_TEMPLATE", raising=False)
    try:
        assert sandbox.run(["true"]).status == "ok"
        forker = supervisor._native
        assert forker is not None and len(forker.templates) == 1 and not forker._failed, forker._failed
    finally:
        if supervisor._native is not None:
            supervisor._native.close()


def test_a_run_whose_supervisor_died_before_the_parent_death_signal_never_starts(
        monkeypatch: pytest.MonkeyPatch, child: str) -> None:
    """A supervisor SIGKILLed between the child's spawn and its PR_SET_PDEATHSIG would send no
    signal, and the run would go on with no one to end it at its timeout. The child checks its
    report pipe right after arming the signal: no reader left, no run. Here the child gets a
    report pipe whose reader is already closed (Landlock off: its report line would otherwise
    end the child by SIGPIPE before the command, hiding the check)."""
    from sandbox import forker as forker_mod
    from sandbox import record as records
    from sandbox.native import launch

    cls = launch.NativeForker if child == "native" else forker_mod.ServerForker
    real = cls.spawn

    import threading

    timers: list[threading.Timer] = []

    def with_dead_reader(self, plan, fds):  # noqa: ANN001, ANN202
        r, w = os.pipe2(os.O_CLOEXEC)
        os.close(r)  # the supervisor that would read it: gone
        # The real report pipe stays open a while here, so that the supervisor does not see
        # its end and kill the sandbox itself: only the child's own check can stop the run.
        held = os.dup(fds.report)
        timers.append(threading.Timer(2.0, os.close, args=(held,)))
        timers[-1].start()
        try:
            return real(self, plan, records.replace(fds, report=w))
        finally:
            os.close(w)

    monkeypatch.setattr(cls, "spawn", with_dead_reader)
    from sandbox.profile import load

    no_landlock = records.replace(load("strict"), landlock="off")
    try:
        r = sandbox.run(["sh", "-c", "echo ran"], profile=no_landlock)
    finally:
        for t in timers:
            t.join()
    assert r.stdout == "" and r.status != "ok", r


@pytest.mark.parametrize("console", [False, True])
@pytest.mark.parametrize("workdir", [False, True])
def test_the_stage_takes_a_view_only_where_its_fds_fit_the_slots(tmp_path: Path, workdir: bool, console: bool) -> None:
    """A terminal and a caller's workdir hold a slot each: counted too, a view one slot too
    large goes to the Python child instead of failing in the stage ("bad slot")."""
    from types import SimpleNamespace

    from sandbox.isolation.filesystem import BindSpec, ViewSpec, view_ops
    from sandbox.native import ops

    st = tmp_path.stat()
    for n in range(ops.MAX_SLOTS - 12, ops.MAX_SLOTS + 1):
        spec = ViewSpec(binds=tuple(BindSpec("/usr", f"/b{i}", False, False) for i in range(n)),
                        workdir_host=str(tmp_path) if workdir else "", workdir="/work", tmp_size=1 << 20,
                        shm_size=1 << 20, hostname="h", passwd="", group="", console=console,
                        workdir_id=(st.st_dev, st.st_ino) if workdir else None)
        assert ops.supports(SimpleNamespace(view=spec)) == (view_ops(spec).slots <= ops.MAX_SLOTS), n


def test_a_kernel_with_only_the_tcp_setting_still_gets_a_parent_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    """6.1 has tcp_child_ehash_entries but not udp_child_hash_entries (6.2): the TCP table's
    saving was thrown away with the UDP one. Neither (before 6.1): no parent."""
    import threading

    from sandbox.isolation import network
    from sandbox.isolation.syscalls import CLONE_NEWNET, setns

    if not os.path.exists("/proc/sys/net/ipv4/tcp_child_ehash_entries"):
        pytest.skip("kernel before 6.1: no per-namespace socket tables")
    monkeypatch.setattr(network, "_parent", [])
    monkeypatch.setattr(network, "CHILD_HASH_TABLES", ("tcp_child_ehash_entries", "udp_child_hash_entries_of_no_kernel"))
    fd = network.parent_namespace()
    assert fd >= 0
    seen: list[str] = []

    def read() -> None:  # in a thread of its own, which ends in the parent namespace
        setns(fd, CLONE_NEWNET)
        with open("/proc/sys/net/ipv4/tcp_child_ehash_entries") as f:
            seen.append(f.read().strip())

    try:
        t = threading.Thread(target=read)
        t.start()
        t.join()
        assert seen == [str(network.CHILD_HASH_BUCKETS)]
    finally:
        os.close(fd)
    monkeypatch.setattr(network, "_parent", [])
    monkeypatch.setattr(network, "CHILD_HASH_TABLES", ("no_such_child_entries",))
    assert network.parent_namespace() == -1


def test_without_close_range_the_stage_still_closes_every_inherited_fd(tmp_path: Path) -> None:
    """A kernel before 5.9, or a container's seccomp profile that refuses close_range: the
    stage's fallback closed fds 3..1023 only, and one above (the caller's, inherited through
    posix_spawn) reached the command (CVE-2024-21626's class)."""
    import pyseccomp as sc

    from sandbox.isolation import seccomp

    filt = sc.SyscallFilter(defaction=sc.ALLOW)
    filt.add_rule(sc.ERRNO(38), "close_range")  # ENOSYS, as an old kernel
    with open(tmp_path / "f.bpf", "w+b") as f:
        filt.export_bpf(f)
        f.seek(0)
        bpf = f.read()
    p = ops.Program()
    p.op("z")
    p.op("E", 0, b"/bin/ls\0/proc/self/fd", b"PATH=/bin", "/bin")
    memfd = os.memfd_create("program")
    os.write(memfd, p.bytes())
    os.lseek(memfd, 0, 0)
    rep_r, rep_w = os.pipe()
    out_r, out_w = os.pipe()
    null = os.open("/dev/null", os.O_RDONLY)
    pid = os.fork()
    if pid == 0:  # never returns into pytest
        try:
            os.dup2(out_w, 1)
            os.dup2(memfd, 3)
            os.dup2(rep_w, 4)
            for fd in (900, 1500):
                os.dup2(null, fd)
            import prctl

            prctl.set_no_new_privs(1)
            seccomp.load_bpf(bpf)
            # "sandboxrun-stage": no pid namespace of its own, so it ends its descendants only
            # (as "sandboxrun-init" it would kill(-1) at the end; the stage refuses that mode
            # unless it is PID 1, see the test below)
            os.execv(native.stage_path() or "", ["sandboxrun-stage"])
        finally:
            os._exit(127)
    for fd in (memfd, rep_w, out_w, null):
        os.close(fd)
    with os.fdopen(out_r, "rb") as f:
        listed = f.read().split()
    os.close(rep_r)
    os.waitpid(pid, 0)
    assert b"1" in listed and b"900" not in listed and b"1500" not in listed, listed


_NOT_PID1 = """
import os, sys
stage, prog, rep = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
pid = os.fork()
if pid == 0:  # PID 2 of this namespace
    os.dup2(prog, 3)
    os.dup2(rep, 4)
    os.execv(stage, ["sandboxrun-init"])
_, status = os.waitpid(pid, 0)
print("survived", os.waitstatus_to_exitcode(status))  # we, PID 1 here, were not killed
"""


def test_the_init_mode_refuses_to_run_unless_it_is_pid_1() -> None:
    """The init mode ends a run with kill(-1), meant for its own pid namespace: started by
    mistake in a caller's namespace (as root, before any identity step) it would reach every
    process there. It refuses. Run inside a pid namespace of the test's own, so that without
    the check the kill(-1) could reach that namespace only."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1)")
    p = ops.Program()
    p.op("E", 0, b"/bin/true", b"PATH=/bin", "/bin")
    memfd = os.memfd_create("program", 0)
    os.write(memfd, p.bytes())
    os.lseek(memfd, 0, 0)
    rep_r, rep_w = os.pipe()
    try:
        cp = subprocess.run(["unshare", "--pid", "--fork", "--kill-child", "--", sys.executable, "-S", "-c", _NOT_PID1,
                             native.stage_path() or "", str(memfd), str(rep_w)],
                            pass_fds=(memfd, rep_w), capture_output=True, text=True, timeout=30)
        os.close(rep_w)
        rep_w = -1
        with os.fdopen(rep_r, "rb") as f:
            rep_r = -1
            report = f.read().decode()
    finally:
        for fd in (memfd, rep_w, rep_r):
            if fd >= 0:
                os.close(fd)
    assert cp.stdout.startswith("survived 125"), (cp.stdout, cp.stderr, report)
    assert "not PID 1" in report and "\nS " not in report, report


@pytest.mark.parametrize("program", [
    b"T\x01" + ops._LEN.pack(0xFFFFFFFF) + b"x\0",  # a length whose n + 1 wraps to 0
    b"T\x01" + ops._LEN.pack(1) + b"xy",  # an argument without its NUL
], ids=["wrapping-length", "no-nul"])
def test_a_malformed_stage_program_is_refused(program: bytes) -> None:
    memfd = os.memfd_create("program", 0)
    os.write(memfd, program)
    os.lseek(memfd, 0, 0)
    rep_r, rep_w = os.pipe()
    try:
        cp = subprocess.run([native.stage_path() or ""], executable=native.stage_path() or "",
                            preexec_fn=lambda: (os.dup2(memfd, 3), os.dup2(rep_w, 4)) and None, close_fds=False,
                            capture_output=True, timeout=30)
        os.close(rep_w)
        rep_w = -1
        report = os.read(rep_r, 4096).decode()
    finally:
        for fd in (memfd, rep_w, rep_r):
            if fd >= 0:
                os.close(fd)
    assert cp.returncode != 0 and "truncated stage program" in report, (cp, report)


@pytest.fixture
def cold_cache(tmp_path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A process whose stage is not built yet, in an empty cache of its own."""
    from sandbox import supervisor
    from sandbox.isolation import seccomp

    cache = tmp_path / "cache"
    monkeypatch.setattr(seccomp, "default_cache_dir", lambda: str(cache))
    monkeypatch.setattr(native, "_path", None)
    monkeypatch.setattr(native, "_error", None)
    monkeypatch.setattr(supervisor, "_native", None)
    return cache


def test_the_stages_build_is_no_part_of_the_first_runs_time(cold_cache: Path) -> None:
    # The build (~1 s) ran on the first run's clock: `echo` with a 0.3 s timeout timed out.
    r = sandbox.run(["echo", "hi"], timeout=0.3)
    assert r.status == "ok" and r.stdout == "hi\n" and r.usage.wall_s < 0.3, r
    assert any(p.name.startswith("stage-") for p in cold_cache.iterdir())


def test_a_build_leaves_no_folder_and_removes_stale_temp_files(cold_cache: Path, tmp_path) -> None:
    # A SIGKILLed build left its headers' folder in $TMPDIR, which no sweep knew, and its
    # output's temp file in the cache, which no prune took.
    import time

    from sandbox import workdir

    cold_cache.mkdir(mode=0o700)
    stale, fresh = cold_cache / ".stage-x.1.ab.tmp", cold_cache / ".seccomp-y.bpf.2.cd.tmp"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"x")
    old = time.time() - native.STALE_TEMP_S - 60
    os.utime(stale, (old, old))
    before = set(os.listdir(workdir.tmpdir()))
    assert native.stage_path() is not None
    assert not stale.exists() and fresh.exists()
    made = {n for n in set(os.listdir(workdir.tmpdir())) - before if "build" in n or n.startswith("sandboxrun-")}
    assert made == set()



def test_the_builds_folder_is_named_for_the_start_up_sweep(cold_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sandbox.isolation import cgroups

    seen: list[str] = []
    real = native._recipes

    def recipes(headers: str) -> list[list[str]]:
        seen.append(os.path.basename(headers))
        return real(headers)

    monkeypatch.setattr(native, "_recipes", recipes)
    assert native.stage_path() is not None
    assert seen and seen[0].startswith(f"sandboxrun-{cgroups.owner_tag()}-")  # a SIGKILLed build's: swept


def test_a_compiler_that_cannot_fork_is_not_tried_again_and_again(cold_cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path) -> None:
    # Under a low RLIMIT_NPROC gcc retried its own fork for ~15 s, and each recipe did so:
    # 45 s on every run's first call.
    cc = tmp_path / "cc"
    calls = tmp_path / "calls"
    cc.write_text(f"#!/bin/sh\necho x >> {calls}\necho 'gcc: fatal error: cannot fork: Resource temporarily unavailable' >&2\n"
                  "exit 1\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    assert native.stage_path() is None
    assert "Resource temporarily unavailable" in (native._error or "")
    assert calls.read_text().count("x") == 1
