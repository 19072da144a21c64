"""cgroups: the v2 file protocol against a fake tree, v1 and v2 for real where the host has them
(v2 without controllers, as a hybrid host's `unified` mount has, still runs join, kill,
freeze, cgroup namespace and removal against the kernel itself).

The fake tree stands in for cgroupfs: creating a directory under it makes the kernel's
interface files appear (as mkdir in cgroupfs does), removing one takes them away.
"""

from __future__ import annotations

import errno
import glob
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import end_marked, inherited_at

import sandbox
from sandbox.isolation import cgroups
from sandbox.isolation.cgroups import CgroupLimits, CgroupUnavailable, V1Backend, V2Backend

ROOT = Path(__file__).resolve().parent.parent

INTERFACE = {
    "memory.max": "max\n", "memory.swap.max": "max\n", "pids.max": "max\n", "cpu.max": "max 100000\n",
    "memory.peak": "0\n", "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n",
    "pids.events": "max 0\n", "cpu.stat": "usage_usec 0\nuser_usec 0\nsystem_usec 0\n",
    "cgroup.kill": "", "cgroup.freeze": "0\n", "cgroup.procs": "",
    "cgroup.controllers": "cpuset cpu io memory hugetlb pids\n", "cgroup.subtree_control": "\n",
}


def _populate(d: Path, omit: tuple[str, ...] = ()) -> None:
    for name, text in INTERFACE.items():
        if name not in omit:
            (d / name).write_text(text)


class FakeRoot(type(Path())):  # type: ignore[misc]
    """The tree's root path, plus the interface files new cgroups lack (a controller that is off)."""

    omit: list[str]


@pytest.fixture
def fake_v2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A cgroup2-like tree: mkdir/rmdir below it behave like cgroupfs."""
    root = FakeRoot(tmp_path / "cgroup2")
    root.mkdir()
    _populate(root)
    omit: list[str] = []
    root.omit = omit
    real_mkdir, real_rmdir = os.mkdir, os.rmdir

    def mkdir(path: str | os.PathLike[str], mode: int = 0o777, *a: object, **kw: object) -> None:
        real_mkdir(path, mode)
        if str(path).startswith(str(root)):
            _populate(Path(path), tuple(omit))

    def rmdir(path: str | os.PathLike[str], *a: object, **kw: object) -> None:
        p = Path(path)
        if str(p).startswith(str(root)) and p.is_dir():
            procs = p / "cgroup.procs"
            if procs.exists() and procs.read_text().strip():
                raise OSError(errno.EBUSY, "Device or resource busy", str(p))  # populated
            for f in p.iterdir():
                if f.is_file():
                    f.unlink()
        real_rmdir(path)

    def kernel_write(path: str, value: str) -> None:
        """cgroupfs writes replace the value; subtree_control applies +/- and reads back names."""
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        if p.name == "cgroup.subtree_control":
            on = p.read_text().split()
            for tok in value.split():
                name = tok[1:]
                on = [c for c in on if c != name] + ([name] if tok[0] == "+" else [])
            p.write_text(" ".join(on) + "\n")
        elif p.name == "cgroup.kill" and value == "1":
            (p.parent / "cgroup.procs").write_text("")  # everyone in it is gone
        else:
            p.write_text(value)

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "rmdir", rmdir)
    monkeypatch.setattr(cgroups, "_write", kernel_write)
    yield root


def _only_child(root: Path) -> Path:
    kids = [p for p in root.iterdir() if p.is_dir()]
    assert len(kids) == 1, kids
    return kids[0]


# ---------------------------------------------------------------------------- v2, fake tree


def test_v2_create_writes_every_limit(fake_v2: Path) -> None:
    cg = V2Backend(str(fake_v2)).create(CgroupLimits(memory=256 * 2**20, processes=32, cpus=0.5))
    d = _only_child(fake_v2)
    assert d.name.startswith(f"sandboxrun-{os.getpid()}-")
    assert cg.version == "v2" and cg.dirs == [str(d)] and cg.procs_files == [str(d / "cgroup.procs")]
    assert (d / "memory.max").read_text() == str(256 * 2**20)
    assert (d / "memory.swap.max").read_text() == "0"  # no swapping around the memory limit
    assert (d / "pids.max").read_text() == "32"
    assert (d / "cpu.max").read_text() == "50000 100000"
    cg.remove()
    assert not d.exists()


def test_v2_create_leaves_unset_limits_alone(fake_v2: Path) -> None:
    cg = V2Backend(str(fake_v2)).create(CgroupLimits(memory=None, processes=None, cpus=None))
    d = _only_child(fake_v2)
    for name in ("memory.max", "memory.swap.max", "pids.max", "cpu.max"):
        assert (d / name).read_text() == INTERFACE[name], name
    cg.remove()


def test_v2_missing_controller_fails_closed_and_names_it(fake_v2: Path) -> None:
    fake_v2.omit.append("cpu.max")  # cpu not enabled for children
    with pytest.raises(OSError) as ei:
        V2Backend(str(fake_v2)).create(CgroupLimits(memory=64 * 2**20, processes=8, cpus=1.0))
    assert ei.value.errno == errno.ENOTSUP
    assert "'cpu' is not enabled" in str(ei.value) and "cpu.max" in str(ei.value)
    assert not [p for p in fake_v2.iterdir() if p.is_dir()], "the half-made cgroup must be removed"


def test_v2_stats_read_peak_oom_pids_cpu(fake_v2: Path) -> None:
    cg = V2Backend(str(fake_v2)).create(CgroupLimits(None, None, None))
    d = _only_child(fake_v2)
    (d / "memory.peak").write_text("12345678\n")
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 2\noom_kill 2\noom_group_kill 0\n")
    (d / "pids.events").write_text("max 3\n")
    (d / "cpu.stat").write_text("usage_usec 3500000\nuser_usec 2500000\nsystem_usec 1000000\nnr_periods 4\n")
    s = cg.stats()
    assert (s.peak_memory, s.oom_kills, s.pids_max_hit) == (12345678, 2, True)
    assert (s.cpu_user_s, s.cpu_sys_s) == (2.5, 1.0)
    cg.remove()


def test_v2_stats_survive_missing_files(fake_v2: Path) -> None:
    fake_v2.omit.extend(["memory.peak", "pids.events"])  # pre-5.19 kernel
    cg = V2Backend(str(fake_v2)).create(CgroupLimits(None, None, None))
    d = _only_child(fake_v2)
    (d / "memory.events").write_text("oom_kill 1\n")
    (d / "cpu.stat").write_text("user_usec 1000000\nsystem_usec 0\n")
    s = cg.stats()
    assert (s.peak_memory, s.oom_kills, s.pids_max_hit, s.cpu_user_s) == (0, 1, False, 1.0)
    cg.remove()


def test_v2_remove_kills_through_cgroup_kill_not_signals(fake_v2: Path) -> None:
    cg = V2Backend(str(fake_v2)).create(CgroupLimits(None, None, None))
    d = _only_child(fake_v2)
    bystander = subprocess.Popen(["sleep", "30"])  # listed in the fake cgroup, but really ours
    try:
        (d / "cgroup.procs").write_text(f"{bystander.pid}\n")
        assert cg.pids() == [bystander.pid]
        written: list[tuple[str, str]] = []
        real_write = cgroups._write

        def spy(path: str, value: str) -> None:
            written.append((os.path.basename(path), value))
            real_write(path, value)

        cgroups._write = spy  # type: ignore[assignment]
        try:
            cg.remove()
        finally:
            cgroups._write = real_write  # type: ignore[assignment]
        assert ("cgroup.kill", "1") in written
        assert bystander.poll() is None, "v2 with cgroup.kill must not fall back to signalling pids"
        assert not d.exists()
    finally:
        bystander.kill()
        bystander.wait()


def test_v2_without_cgroup_kill_freezes_then_signals(fake_v2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_v2.omit.append("cgroup.kill")  # kernel < 5.14
    cg = V2Backend(str(fake_v2)).create(CgroupLimits(None, None, None))
    monkeypatch.setattr(cg, "_holds", lambda pid: True)  # /proc cannot place it in a fake tree
    d = _only_child(fake_v2)
    victim = subprocess.Popen(["sleep", "30"])
    try:
        (d / "cgroup.procs").write_text(f"{victim.pid}\n")
        written: list[tuple[str, str]] = []
        real_write = cgroups._write

        def spy(path: str, value: str) -> None:
            written.append((os.path.basename(path), value))
            real_write(path, value)
            if os.path.basename(path) == "cgroup.freeze" and value == "0":
                (d / "cgroup.procs").write_text("")  # the kernel drops dead tasks from the list

        cgroups._write = spy  # type: ignore[assignment]
        try:
            cg.kill_all()
        finally:
            cgroups._write = real_write  # type: ignore[assignment]
        assert victim.wait(timeout=10) == -9
        assert written[0] == ("cgroup.freeze", "1") and ("cgroup.freeze", "0") in written
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
    cg.remove()


def test_v2_sweep_removes_only_dead_owners(fake_v2: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = fake_v2 / f"sandboxrun-{dead.pid}-0"
    live = fake_v2 / f"sandboxrun-{os.getppid()}-0"
    leaf = fake_v2 / "sandboxrun-supervisor"
    for d in (stale, live, leaf):
        os.mkdir(d)
    assert V2Backend(str(fake_v2)).sweep_stale() == 1
    assert not stale.exists() and live.exists() and leaf.exists()


# ---------------------------------------------------------------------------- v2 controllers


def test_enable_controllers_writes_the_missing_ones(fake_v2: Path) -> None:
    (fake_v2 / "cgroup.subtree_control").write_text("cpuset memory\n")
    cgroups._enable_controllers(str(fake_v2))
    assert (fake_v2 / "cgroup.subtree_control").read_text() == "cpuset memory pids cpu\n"


def test_enable_controllers_noop_when_enabled(fake_v2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (fake_v2 / "cgroup.subtree_control").write_text("cpu memory pids\n")
    monkeypatch.setattr(cgroups, "_write", lambda p, v: pytest.fail(f"unexpected write {p} {v}"))
    cgroups._enable_controllers(str(fake_v2))


def test_enable_controllers_moves_processes_into_a_leaf_on_ebusy(fake_v2: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The "no internal processes" rule: the kernel answers EBUSY while cg_dir holds processes."""
    (fake_v2 / "cgroup.procs").write_text("101\n202\n")
    log: list[tuple[str, str]] = []

    def kernel_write(path: str, value: str) -> None:
        rel = os.path.relpath(path, fake_v2)
        log.append((rel, value))
        procs = fake_v2 / "cgroup.procs"
        if rel == "cgroup.subtree_control":
            if procs.read_text().split():
                raise OSError(errno.EBUSY, "Device or resource busy")
            Path(path).write_text(" ".join(tok[1:] for tok in value.split()))
        elif rel.endswith("cgroup.procs"):  # a move: out of the parent, into the leaf
            procs.write_text("".join(f"{p}\n" for p in procs.read_text().split() if p != value))
            with open(path, "a") as f:
                f.write(value + "\n")

    monkeypatch.setattr(cgroups, "_write", kernel_write)
    cgroups._enable_controllers(str(fake_v2))
    leaf = "sandboxrun-supervisor"
    assert log == [("cgroup.subtree_control", "+memory +pids +cpu"),
                   (f"{leaf}/cgroup.procs", "101"), (f"{leaf}/cgroup.procs", "202"),
                   ("cgroup.subtree_control", "+memory +pids +cpu")]
    assert (fake_v2 / leaf / "cgroup.procs").read_text().split() == ["101", "202"]
    assert (fake_v2 / "cgroup.subtree_control").read_text().split() == ["memory", "pids", "cpu"]


def test_enable_controllers_gives_up_on_persistent_ebusy(fake_v2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def busy(path: str, value: str) -> None:
        if path.endswith("subtree_control"):
            raise OSError(errno.EBUSY, "Device or resource busy")

    monkeypatch.setattr(cgroups, "_write", busy)
    with pytest.raises(OSError) as ei:
        cgroups._enable_controllers(str(fake_v2))
    assert ei.value.errno == errno.EBUSY


def test_enable_controllers_other_errors_propagate(fake_v2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def denied(path: str, value: str) -> None:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(cgroups, "_write", denied)
    with pytest.raises(PermissionError):
        cgroups._enable_controllers(str(fake_v2))
    assert not (fake_v2 / "sandboxrun-supervisor").exists()


# ---------------------------------------------------------------------------- detection


def _fake_mounts(monkeypatch: pytest.MonkeyPatch, mounts: list[tuple[str, str, str]], uid: int = 0) -> None:
    monkeypatch.setattr(cgroups, "_mountinfo", lambda: mounts)
    monkeypatch.setattr(cgroups, "_own_v2_cgroup", lambda: "/")
    cgroups._caller_uid.clear()
    monkeypatch.setattr(cgroups.os, "geteuid", lambda: uid)
    monkeypatch.delenv("SANDBOXRUN_CGROUP", raising=False)


def test_detect_v2_enables_controllers(fake_v2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_mounts(monkeypatch, [(str(fake_v2), "cgroup2", "rw")])
    b = cgroups._detect()
    assert isinstance(b, V2Backend) and b.parent == str(fake_v2)
    assert (fake_v2 / "cgroup.subtree_control").read_text().split() == ["memory", "pids", "cpu"]


def test_detect_v2_without_memory_pids_says_so(fake_v2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (fake_v2 / "cgroup.controllers").write_text("hugetlb\n")  # like /sys/fs/cgroup/unified here
    _fake_mounts(monkeypatch, [(str(fake_v2), "cgroup2", "rw")])
    with pytest.raises(CgroupUnavailable) as ei:
        cgroups._detect()
    assert "lacks the memory/pids controllers" in str(ei.value) and not str(ei.value).startswith("[Errno")


def test_detect_v2_not_delegated_names_delegation(fake_v2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_mounts(monkeypatch, [(str(fake_v2), "cgroup2", "rw")], uid=1000)

    def denied(path: str, value: str) -> None:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(cgroups, "_write", denied)
    with pytest.raises(CgroupUnavailable) as ei:
        cgroups._detect()
    assert ei.value.errno == errno.EACCES and "Delegate=yes" in str(ei.value)


def test_detect_v1_unwritable_names_delegation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mem = tmp_path / "memory"
    mem.mkdir()
    _fake_mounts(monkeypatch, [(str(mem), "cgroup", "rw,memory")], uid=1000)
    monkeypatch.setattr(cgroups.os, "access", lambda p, m: False)
    with pytest.raises(CgroupUnavailable) as ei:
        cgroups._detect()
    assert "no delegation" in str(ei.value)
    # What to do is the run's error's to say, once: a rootless run (cgroup optional) keeps this
    # message in limits.cgroup_unavailable, where "use the rootless profile" was advice to itself.
    assert "rootless" not in str(ei.value)
    from sandbox import supervisor

    assert "rootless" in supervisor._likely_cause("cgroup", errno.EACCES)


@pytest.mark.parametrize(("asked", "needs"), [({"memory": "64MiB"}, "the memory limit asked for needs"),
                                              ({"cpus": 0.5}, "the cpus limit asked for needs"),
                                              ({"memory": "64MiB", "cpus": 0.5},
                                               "the memory and cpus limits asked for need")])
def test_a_limit_asked_of_an_optional_cgroup_that_cannot_be_had_fails_closed(
        monkeypatch: pytest.MonkeyPatch, isolated, asked: dict[str, object], needs: str) -> None:
    """rootless ran `--memory 64MiB` without any memory limit, and said so only in the JSON."""
    monkeypatch.setenv("SANDBOXRUN_CGROUP", "none")
    monkeypatch.setattr(cgroups, "_backend", None)
    monkeypatch.setattr(cgroups, "_backend_error", None)
    r = sandbox.run(["true"], profile="rootless", **asked)  # type: ignore[arg-type]
    assert (r.status, r.error_step, r.isolation) == ("setup_error", "cgroup", None), r
    assert needs in (r.error or "") and "profile 'rootless' runs without one" in (r.error or ""), r.error
    plain = sandbox.run(["true"], profile="rootless", processes=10)  # an rlimit too: no cgroup needed
    # No limit asked for is no limit a cgroup must enforce: it ran nowhere (the cgroup required).
    for none_asked in ({"memory": "unlimited"}, {"cpus": 0}, {"memory": "unlimited", "cpus": 0}):
        free = sandbox.run(["true"], profile="rootless", **none_asked)  # type: ignore[arg-type]
        assert free.status == "ok" and free.isolation is not None and free.isolation.cgroup == "none", free
    assert plain.status == "ok" and plain.isolation is not None and plain.isolation.cgroup == "none", plain
    # Nothing a cgroup counts could be counted: unknown, not "no OOM kill, no pids limit hit".
    assert (plain.usage.oom_kills, plain.usage.pids_limit_hit) == (None, None)
    assert sandbox.Result.from_stored(plain.to_json().encode()).usage.oom_kills is None  # (the schema allows it)


def test_a_limit_asked_of_a_profile_without_cgroups_is_refused(tmp_path: Path) -> None:
    prof = tmp_path / "nocg.toml"
    prof.write_text('extends = "rootless"\n[security]\ncgroup = "off"\n')
    # the file's own memory (inherited from strict) was shown by `profiles show` and not applied
    with pytest.raises(sandbox.ProfileError, match=r"nocg.toml: security.cgroup = 'off': limits.memory = '512MiB' "
                                                   "is enforced only by a cgroup"):
        sandbox.load_profile(str(prof))
    prof.write_text('extends = "rootless"\n[security]\ncgroup = "off"\n[limits]\nmemory = "unlimited"\ncpus = 0.5\n')
    with pytest.raises(sandbox.ProfileError, match=r"limits.cpus = 0.5 is enforced only by a cgroup"):
        sandbox.load_profile(str(prof))
    prof.write_text('extends = "rootless"\n[security]\ncgroup = "off"\n[limits]\nmemory = "unlimited"\ncpus = 0\n')
    with pytest.raises(sandbox.ProfileError, match="cgroup = 'off', and only a cgroup enforces this limit"):
        sandbox.run(["true"], profile=str(prof), memory="64MiB")
    assert sandbox.run(["true"], profile=str(prof), memory="unlimited", cpus=0).status == "ok"  # no limit: no cgroup
    twice = sandbox.profile.with_overrides(sandbox.profile.load("rootless"), memory="64MiB")
    assert sandbox.profile.with_overrides(twice, memory="32MiB").cgroup_needed_by == ("memory",)


def test_a_run_with_a_cgroup_counts_its_oom_kills_and_pids_hits(isolated) -> None:
    r = sandbox.run(["true"])
    assert r.isolation is not None and r.isolation.cgroup != "none"
    assert (r.usage.oom_kills, r.usage.pids_limit_hit) == (0, False)


def test_detect_forced_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDBOXRUN_CGROUP", "none")
    with pytest.raises(CgroupUnavailable, match="SANDBOXRUN_CGROUP=none"):
        cgroups._detect()


def test_a_cgroup_turned_off_by_the_caller_is_named_without_a_guessed_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDBOXRUN_CGROUP", "none")
    monkeypatch.setattr(cgroups, "_backend", None)  # detected anew, and both restored after
    monkeypatch.setattr(cgroups, "_backend_error", None)
    r = sandbox.run(["true"], profile="standard")
    assert (r.status, r.error_step) == ("setup_error", "cgroup"), r
    assert r.error == "cgroup: cgroups disabled by SANDBOXRUN_CGROUP=none", r.error


# ---------------------------------------------------------------------------- real hierarchies

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="creating cgroups on this host needs root")


def _real_v1() -> dict[str, str]:
    v1: dict[str, str] = {}
    for point, fstype, opts in cgroups._mountinfo():
        if fstype == "cgroup":
            for c in cgroups.V1_CONTROLLERS:
                if c in opts.split(","):
                    v1.setdefault(c, point)
    return v1


def _real_v2() -> str | None:
    return next((p for p, fstype, _ in cgroups._mountinfo() if fstype == "cgroup2"), None)


@needs_root
def test_v1_real_limits_stats_kill_remove() -> None:
    v1 = _real_v1()
    if "memory" not in v1 or "pids" not in v1:
        pytest.skip("no cgroup v1 memory+pids hierarchies on this host")
    cg = V1Backend(v1).create(CgroupLimits(memory=64 * 2**20, processes=16, cpus=0.5))
    victim = None
    try:
        assert all(os.path.isdir(d) for d in cg.dirs)
        assert int(Path(cg._file("memory.limit_in_bytes") or "").read_text()) == 64 * 2**20
        assert Path(cg._file("pids.max") or "").read_text().strip() == "16"
        if cg._file("cpu.cfs_quota_us"):
            assert Path(cg._file("cpu.cfs_quota_us") or "").read_text().strip() == "50000"
        # A process that joined every hierarchy (as the child does through the passed fds).
        victim = subprocess.Popen(
            [sys.executable, "-c", "import sys, time; sys.stdin.read(1); b = b'x' * (8 << 20); print(len(b), "
             "flush=True); time.sleep(60)"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        for f in cg.procs_files:
            cgroups._write(f, str(victim.pid))
        assert victim.stdin and victim.stdout
        victim.stdin.write(b"x")
        victim.stdin.flush()
        assert victim.stdout.readline()  # allocated after joining: charged to the cgroup
        assert cg.pids() == [victim.pid]
        s = cg.stats()
        assert s.peak_memory > 0 and s.cpu_user_s is not None
        cg.kill_all()
        assert victim.wait(timeout=10) == -9
        assert cg.pids() == []
    finally:
        if victim is not None and victim.poll() is None:
            victim.kill()
            victim.wait()
        cg.remove()
    assert not any(os.path.exists(d) for d in cg.dirs)


@needs_root
def test_kill_all_spares_a_pid_no_longer_in_the_cgroup(monkeypatch: pytest.MonkeyPatch) -> None:
    # Unfrozen, a pid read from cgroup.procs may exit and its number go to another process
    # before the kill: here the list names a process of the host's that never was inside.
    v1 = _real_v1()
    if "pids" not in v1:
        pytest.skip("no cgroup v1 pids hierarchy on this host")
    cg = V1Backend({"pids": v1["pids"]}).create(CgroupLimits(memory=None, processes=16, cpus=None, freezer=False))
    inside = bystander = None
    try:
        inside = subprocess.Popen(["sleep", "60"])
        cgroups._write(cg.procs_files[0], str(inside.pid))
        bystander = subprocess.Popen(["sleep", "60"])
        listed_once = iter([[inside.pid, bystander.pid], []])
        monkeypatch.setattr(cg, "pids", lambda: next(listed_once))
        cg.kill_all()
        assert inside.wait(timeout=10) == -9
        time.sleep(0.1)
        assert bystander.poll() is None, "a process outside the cgroup was killed"
    finally:
        for p in (inside, bystander):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        cg.remove()


@needs_root
def test_v1_sweep_removes_stale_cgroups() -> None:
    v1 = _real_v1()
    if "memory" not in v1:
        pytest.skip("no cgroup v1 memory hierarchy on this host")
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"sandboxrun-{dead.pid}-99"
    made = [os.path.join(base, name) for base in dict.fromkeys(v1.values())]
    for d in made:
        os.mkdir(d)
    try:
        assert V1Backend(v1).sweep_stale() >= 1
        assert not any(os.path.exists(d) for d in made)
    finally:
        for d in made:
            if os.path.exists(d):
                os.rmdir(d)


@needs_root
def test_v2_real_mount() -> None:
    """v2 for real when a cgroup2 mount with memory and pids is there; otherwise say why not."""
    base = _real_v2()
    if base is None:
        pytest.skip("no cgroup2 mount on this host")
    ctl = Path(base, "cgroup.controllers").read_text().split()
    if "memory" not in ctl or "pids" not in ctl:
        pytest.skip(f"cgroup2 at {base} has controllers [{' '.join(ctl) or 'none'}]: "
                    "not usable for memory/pids limits (v2 without controllers is run for real by the tests above; "
                    "the limit files by the fake tree)")
    code = ("import json, sandbox; r = sandbox.run(['sh', '-c', 'cat /sys/fs/cgroup/memory.max 2>/dev/null; echo'],"
            " memory='64MiB'); print(json.dumps([r.status, r.isolation.cgroup, r.usage.peak_memory_bytes]))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "SANDBOXRUN_CGROUP": "v2"},
                         capture_output=True, text=True, timeout=60)
    status, version, peak = __import__("json").loads(out.stdout.splitlines()[-1])
    assert (status, version) == ("ok", "v2") and peak > 0, out
    assert not glob.glob(os.path.join(base, "**", "sandboxrun-[0-9]*"), recursive=True)


@pytest.fixture
def real_v2_parent() -> Iterator[str]:
    """A directory of our own in the host's real cgroup2 hierarchy, controllers or not (a
    hybrid host's `unified` mount has none): the v2 protocol the fake tree stands in for
    (cgroup.procs, cgroup.kill, cgroup.freeze, cpu.stat, rmdir) against the kernel itself."""
    base = _real_v2()
    if base is None or os.geteuid() != 0 or not os.access(base, os.W_OK):
        pytest.skip("no writable cgroup2 mount on this host")
    parent = os.path.join(base, f"sandboxrun-test-{os.getpid()}")
    os.mkdir(parent)
    try:
        yield parent
    finally:
        for d in glob.glob(os.path.join(parent, "*/")):
            cgroups.RunCgroup("v2", [d.rstrip("/")]).remove()
        os.rmdir(parent)


def _tree_in(cg: cgroups.RunCgroup, mark: str) -> subprocess.Popen[bytes]:
    """A shell with a setsid'd daemon, moved into `cg`, started outside any sandbox: plain
    sleeps, named `mark` (end_marked ends them if the test fails)."""
    r, w = os.pipe()
    proc = subprocess.Popen(["bash", "-c", f"read _; (setsid bash -c 'exec -a {mark} sleep 1000' &); echo started; "
                             f"exec -a {mark} sleep 1000"],
                            stdin=r, stdout=subprocess.PIPE)
    os.close(r)
    cg.add(proc.pid)
    os.write(w, b"go\n")
    os.close(w)
    assert proc.stdout is not None and proc.stdout.readline() == b"started\n"
    return proc


@pytest.mark.parametrize("how", ["cgroup.kill", "freeze"])
def test_v2_real_kill_all_ends_a_setsid_tree_and_remove_leaves_nothing(real_v2_parent: str, how: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cg = V2Backend(real_v2_parent).create(CgroupLimits(None, None, None))
    mark = f"sandboxrun-v2-kill-{os.getpid()}-{how}"
    proc = _tree_in(cg, mark)
    try:
        deadline = time.monotonic() + 5
        while len(cg.pids()) < 2 and time.monotonic() < deadline:  # the daemon is there too
            time.sleep(0.01)
        members = cg.pids()
        assert proc.pid in members and len(members) == 2, members
        if how == "freeze":  # a kernel before 5.14: no cgroup.kill, so freeze, signal, thaw
            real_exists = os.path.exists
            monkeypatch.setattr(cgroups.os.path, "exists", lambda p: not p.endswith("cgroup.kill") and real_exists(p))
        cg.kill_all()
        assert proc.wait(timeout=5) == -9
        deadline = time.monotonic() + 5
        while cg.pids() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cg.pids() == []
        for pid in members:
            assert not os.path.exists(f"/proc/{pid}") or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
        cg.remove()
        assert not os.path.exists(cg.dirs[0])
    finally:
        end_marked(mark)
        proc.wait()


def test_v2_real_run_is_in_its_cgroup_sees_its_own_root_and_leaves_nothing(real_v2_parent: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole strict run on the real v2 hierarchy: the child joins through cgroup.procs, its
    cgroup namespace is rooted there, CPU comes from cpu.stat, and the cgroup goes with it."""
    import threading

    import sandbox
    from sandbox import record as records
    from sandbox.profile import load

    monkeypatch.setattr(cgroups, "_backend", V2Backend(real_v2_parent))
    prof = load("strict")  # no limit that needs a controller: a hybrid host's v2 mount may have none
    prof = records.replace(prof, limits=records.replace(prof.limits, memory=None, processes=None, cpus=None))
    seen: list[list[str]] = []

    def watch() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not seen:
            for d in glob.glob(os.path.join(real_v2_parent, "sandboxrun-*/")):
                procs = Path(d, "cgroup.procs").read_text().split()
                if procs:
                    seen.append(procs)
            time.sleep(0.005)

    t = threading.Thread(target=watch)
    t.start()
    r = sandbox.run(["sh", "-c", "grep '^0::' /proc/self/cgroup; i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done; "
                     "(setsid sleep 1000 &); sleep 0.5"], profile=prof)
    t.join()
    assert r.status == "ok" and r.isolation.cgroup == "v2", r
    assert r.stdout == "0::/\n"  # its own cgroup is the root of its cgroup namespace
    assert seen and len(seen[0]) >= 1  # its processes were in the run's cgroup while it ran
    assert r.usage.cpu_user_s + r.usage.cpu_sys_s > 0.005  # the loop's CPU is reported
    assert glob.glob(os.path.join(real_v2_parent, "*/")) == []


def _v2_strict_without_controllers(real_v2_parent: str, monkeypatch: pytest.MonkeyPatch) -> object:
    from sandbox import record as records
    from sandbox.profile import load

    monkeypatch.setattr(cgroups, "_backend", V2Backend(real_v2_parent))
    prof = load("strict")  # no limit that needs a controller: a hybrid host's v2 mount may have none
    return records.replace(prof, limits=records.replace(prof.limits, memory=None, processes=None, cpus=None))


@pytest.mark.parametrize("clone_into, one_shot", [(True, False), (True, True), (False, False)])
def test_v2_pid1_is_born_in_its_cgroup_or_else_moved_there(real_v2_parent: str, monkeypatch: pytest.MonkeyPatch,
                                                           clone_into: bool, one_shot: bool) -> None:
    """The native stage clones PID 1 into the run's v2 cgroup (CLONE_INTO_CGROUP): moving it
    through cgroup.procs takes the global threadgroup lock, whose writer waits for an RCU grace
    period when the lock was idle (a run 5 ms -> 15 ms here). Where the clone cannot (here: the
    fd given is no cgroup, as a kernel without clone3 would refuse too), it is moved as before."""
    import sandbox
    from sandbox.native import stage_path

    if stage_path() is None or os.environ.get("SANDBOXRUN_NATIVE") == "0":
        pytest.skip("the native stage is not used here")
    prof = _v2_strict_without_controllers(real_v2_parent, monkeypatch)
    if one_shot:  # the CLI's forker: its stage makes the pid namespace anyway (no ctypes for unshare)
        from sandbox import supervisor
        from sandbox.native.launch import NativeForker

        monkeypatch.setattr(supervisor, "_native", NativeForker(templates=False, stage_clones=True))
    moves: list[int] = []
    real_add = cgroups.RunCgroup.add
    monkeypatch.setattr(cgroups.RunCgroup, "add", lambda self, pid: (moves.append(pid), real_add(self, pid))[1])
    if not clone_into:
        real_open = os.open

        def not_a_cgroup(path: str, flags: int, *a: object) -> int:
            if str(path).startswith(real_v2_parent) and flags & os.O_DIRECTORY:
                return real_open("/", flags)
            return real_open(path, flags, *a)

        monkeypatch.setattr(os, "open", not_a_cgroup)
    r = sandbox.run(["sh", "-c", "grep '^0::' /proc/self/cgroup /proc/1/cgroup"], profile=prof)
    assert r.status == "ok" and r.isolation.cgroup == "v2", r
    assert r.stdout == "/proc/self/cgroup:0::/\n/proc/1/cgroup:0::/\n", r  # both at the root of their namespace
    assert moves == ([] if clone_into else [r.pid]), moves
    assert glob.glob(os.path.join(real_v2_parent, "*/")) == []


def test_an_inherited_fd_17_does_not_choose_pid1s_cgroup(real_v2_parent: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """fd 17 open in a cloning stage names the cgroup PID 1 is born in (stage.c): a caller's own
    fd 17, inheritable, must not reach it."""
    import sandbox
    from sandbox import supervisor
    from sandbox.native import launch, stage_path

    if stage_path() is None or os.environ.get("SANDBOXRUN_NATIVE") == "0":
        pytest.skip("the native stage is not used here")
    elsewhere = os.path.join(real_v2_parent, "not-the-runs")
    os.mkdir(elsewhere)
    born: list[bool] = []
    real_cloning = launch._spawn_cloning
    monkeypatch.setattr(launch, "_spawn_cloning", lambda *a: (lambda r: (born.append(r[1]), r)[1])(real_cloning(*a)))
    forker = launch.NativeForker(templates=False, stage_clones=True)
    monkeypatch.setattr(supervisor, "_native", forker)
    fd = os.open(elsewhere, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with inherited_at(17, fd):
            r = sandbox.run(["true"])  # this host's default backend: the run's cgroup is not `elsewhere`
    finally:
        forker.close()
        os.close(fd)
    assert r.status == "ok" and born == [False], (r, born)
    assert Path(elsewhere, "cgroup.procs").read_text() == ""
    os.rmdir(elsewhere)


@needs_root
def test_runs_leave_no_cgroups(isolated: object) -> None:
    import sandbox

    r = sandbox.run(["sh", "-c", "sleep 30 & sleep 30 & setsid sleep 30 & wait"], timeout=0.5)
    assert r.status == "timeout" and r.isolation.cgroup in ("v1", "v2"), r
    assert not glob.glob(f"/sys/fs/cgroup/*/sandboxrun-{os.getpid()}-*")
    assert not glob.glob(f"/sys/fs/cgroup/sandboxrun-{os.getpid()}-*")


SOCKET_FLOOD = """
import socket, sys
conns, cap = int(sys.argv[1]), int(sys.argv[2]) << 20
ls = socket.socket(); ls.bind(("127.0.0.1", 0)); ls.listen(conns)
pairs, queued, buf = [], 0, b"x" * 65536
for _ in range(conns):  # a receiver that never reads: what is sent stays in kernel buffers
    c = socket.socket(); c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 30)
    c.connect(ls.getsockname()); s, _ = ls.accept()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 30); c.setblocking(False)
    pairs.append((c, s))
for c, _ in pairs:
    try:
        while queued < cap:
            queued += c.send(buf)
    except BlockingIOError:
        pass
print(queued >> 20)
"""


@needs_root
def test_socket_buffers_count_against_the_memory_limit(contained: object) -> None:
    """Unread loopback traffic is kernel memory the run holds: bounded by its memory limit
    (v1: the tcp limit set beside it; v2: memory.max charges sockets), not by the host's
    global tcp_mem. 256 MiB offered, 64 MiB allowed."""
    import sandbox

    r = sandbox.run(["python3", "-c", SOCKET_FLOOD, "48", "256"], memory="64MiB", timeout=60)
    assert r.status == "ok", r
    assert int(r.stdout) <= 80, f"{r.stdout.strip()} MiB held in socket buffers under a 64 MiB limit"


# ---------------------------------------------------------------------------- fail closed


def test_required_cgroup_unavailable_is_a_setup_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import sandbox
    from sandbox import record as records
    from sandbox.profile import load

    def unavailable() -> cgroups.Backend:
        raise CgroupUnavailable(errno.EACCES, "cgroup v1 hierarchies are not writable by uid 1000: no delegation")

    monkeypatch.setattr(cgroups, "detect", unavailable)
    r = sandbox.run(["/bin/true"], profile="strict")
    assert r.status == "setup_error" and r.error_step == "cgroup" and r.error_errno == errno.EACCES, r
    assert "delegation" in (r.error or "") and "[Errno" not in (r.error or "")
    assert r.pid is None  # nothing ran
    # An explicitly weaker profile runs, and says the cgroup is missing and why.
    weaker = records.replace(load("strict"), cgroup="optional")
    r = sandbox.run(["/bin/true"], profile=weaker)
    if r.status == "setup_error" and r.error_step != "cgroup":
        pytest.skip(f"sandbox unavailable here: {r.error}")
    assert r.status == "ok" and r.isolation.cgroup == "none", r
    assert "delegation" in r.isolation.limits["cgroup_unavailable"]
    assert r.isolation.limits["memory_bytes"] is None


def test_caller_uid_sees_through_our_own_user_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's DirectForker makes the process root of a user namespace: still not host root."""
    cgroups._caller_uid.clear()
    monkeypatch.setattr(cgroups.os, "geteuid", lambda: 0)
    monkeypatch.setattr(cgroups, "_read", lambda p: "         0        999          1\n")
    assert cgroups.caller_uid() == 999
    cgroups._caller_uid.clear()
    monkeypatch.setattr(cgroups, "_read", lambda p: "         0          0 4294967295\n")
    assert cgroups.caller_uid() == 0


@pytest.fixture(autouse=True)
def _clear_uid_cache():
    cgroups._caller_uid.clear()
    yield
    cgroups._caller_uid.clear()


def test_run_names_carry_the_pid_namespace_and_only_our_own_are_judged() -> None:
    # Cgroup hierarchies and /tmp are shared with callers in other pid namespaces, where the
    # same pid is another process: judged by a pid alone, a live run of a caller elsewhere
    # was taken for a dead supervisor's, and its processes were killed.
    from sandbox.isolation import cgroups

    ours = f"{cgroups.own_pid_namespace():x}"
    dead = 4_194_303  # above any pid_max default: no process has it
    assert cgroups._name().startswith(f"sandboxrun-{os.getpid()}-n{ours}-")
    assert cgroups.owner_is_gone(f"{dead}-n{ours}-0")
    assert not cgroups.owner_is_gone(f"{dead}-n{int(ours, 16) + 1:x}-0")  # another namespace's
    assert not cgroups.owner_is_gone(f"{os.getpid()}-n{ours}-0")
    assert cgroups.owner_is_gone(f"{dead}-0")  # an older name: the pid alone, as before
    # Our pid with another token: the process that had our pid (in a namespace whose inode
    # ours reuses) before us. Another namespace that no process is in any more: gone.
    assert cgroups.owner_is_gone(f"{os.getpid()}-n{ours}-tffffffff-0")
    other = int(ours, 16) + 1
    assert cgroups.owner_is_gone(f"{dead}-n{other:x}-t0-0", live=set())
    assert not cgroups.owner_is_gone(f"{dead}-n{other:x}-t0-0", live={other})
    assert not cgroups.owner_is_gone(f"{dead}")  # /tmp/sandboxrun-<uid>: a user's session state, no run's


def test_a_name_with_other_digits_than_ascii_is_nobodys_run(tmp_path: Path, isolated) -> None:
    # "²".isdigit() but int("²") fails: anyone who could write /tmp (a `nested` run among
    # them) stopped every later run with "internal error: ValueError" from the first run's sweep.
    import subprocess
    import sys

    from sandbox.isolation import cgroups
    from sandbox.leaks import cgroup_owner

    assert not cgroups.owner_is_gone("²-x") and not cgroups.owner_is_gone("١٢-n1-t2-3")
    assert cgroup_owner("/sys/fs/cgroup/pids/sandboxrun-²-1") is None
    from sandbox import signals

    assert signals.number("SIG²") is None and signals.number("SIG9") == 9
    r = subprocess.run([sys.executable, "-m", "sandbox", "--help"], capture_output=True, timeout=60,
                       env=dict(os.environ, COLUMNS="²", PYTHONPATH=str(ROOT)))  # every --help: internal error
    assert r.returncode == 0 and b"internal error" not in r.stderr, r.stderr
    (tmp_path / "sandboxrun-²-x").mkdir()
    r = subprocess.run([sys.executable, "-m", "sandbox", "--", "true"], capture_output=True, timeout=60,
                       env=dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=str(ROOT)))
    assert r.returncode == 0 and (tmp_path / "sandboxrun-²-x").is_dir(), r.stderr


def test_namespaces_we_cannot_see_are_never_taken_for_dead(monkeypatch: pytest.MonkeyPatch) -> None:
    # Root without CAP_SYS_PTRACE cannot read other users' /proc/<pid>/ns/pid: every other
    # namespace looked empty, and a sweep killed the live runs of callers there.
    from sandbox.isolation import cgroups

    if cgroups.own_pid_namespace() != cgroups.INIT_PID_NAMESPACE:
        pytest.skip("only a supervisor in the initial pid namespace judges other namespaces")
    real = os.readlink

    def denied(path: str, *a: object, **k: object) -> str:
        if path.startswith("/proc/") and path.endswith("/ns/pid") and path != "/proc/self/ns/pid":
            raise PermissionError(13, "Permission denied", path)
        return real(path, *a, **k)

    monkeypatch.setattr(os, "readlink", denied)
    assert cgroups.live_pid_namespaces() is None


NS_CALLER = """
import sandbox
r = sandbox.run(["sh", "-c", "sleep 3; echo done"])
print(r.status, r.stdout.strip())
"""
# PID 1 of its namespace sets the next pid there, so that the caller has one no host process has.
NS_INIT = 'echo $(($1 - 1)) > /proc/sys/kernel/ns_last_pid && shift && "$@"'


def test_a_supervisor_leaves_a_live_run_of_a_caller_in_another_pid_namespace_alone() -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("root and util-linux unshare: a caller in a pid namespace of its own")
    from sandbox import leaks

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    pid = next(p for p in range(20000, 300, -1) if not os.path.exists(f"/proc/{p}"))  # dead on the host
    ns = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "sh", "-c", NS_INIT, "sh",
                           str(pid), sys.executable, "-c", NS_CALLER], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                          text=True)
    try:
        deadline = time.monotonic() + 20
        while not any(leaks.cgroup_owner(c) == pid for c in leaks.runner_cgroups()):
            assert time.monotonic() < deadline, "the caller's run never started"
            time.sleep(0.05)
        host = subprocess.run([sys.executable, "-m", "sandbox", "--", "true"], env=env, cwd=ROOT, timeout=60)
        assert host.returncode == 0
        out, _ = ns.communicate(timeout=30)
        assert out.split() == ["ok", "done"], out
    finally:
        ns.kill()
        ns.wait()


# ---------------------------------------------------------------------------- a batch's slots


def test_v2_slot_carries_pids_and_cpu_and_each_run_nests_below_it(fake_v2: Path) -> None:
    backend = V2Backend(str(fake_v2))
    slots = cgroups.Slots()
    slot = slots.take(backend)
    assert slot is not None and slot.version == "v2"
    caps = Path(slot.dirs[""])
    assert caps.parent == fake_v2 and caps.name.endswith("-slot")
    assert "memory" in (caps / "cgroup.subtree_control").read_text().split()  # the run's own below it
    (caps / "pids.events").write_text("max 3\n")  # the pids limit was hit before this run...
    cg = backend.create(CgroupLimits(memory=64 * 2**20, processes=16, cpus=0.5), slot)
    run = Path(cg.dirs[0])
    assert run.parent == caps and cg.shared == []
    assert (run / "memory.max").read_text() == str(64 * 2**20)
    assert (caps / "pids.max").read_text() == "16" and (caps / "cpu.max").read_text() == "50000 100000"
    assert cg.stats().pids_max_hit is False  # ...not by it: the counter never resets, so it counts from its start
    cg.remove()
    assert not run.exists() and caps.exists()
    slots.give_back(slot)
    # The next run of the batch gets the same slot, with its own limits written (none: unlimited).
    again = slots.take(backend)
    assert again is slot
    cg2 = backend.create(CgroupLimits(memory=None, processes=None, cpus=None), again)
    assert (caps / "pids.max").read_text() == "max" and (caps / "cpu.max").read_text() == "max 100000"
    assert cg2.pids_max_base == 3
    (caps / "pids.events").write_text("max 4\n")
    assert cg2.stats().pids_max_hit is True
    cg2.remove()
    slots.give_back(again)
    slots.close()
    assert [p for p in fake_v2.iterdir() if p.is_dir()] == []


def test_a_slot_given_back_with_a_run_left_in_it_is_never_lent_again(fake_v2: Path) -> None:
    backend = V2Backend(str(fake_v2))
    slots = cgroups.Slots()
    slot = slots.take(backend)
    assert slot is not None
    cg = backend.create(CgroupLimits(memory=None, processes=8, cpus=None), slot)
    Path(cg.procs_files[0]).write_text(f"{os.getpid() + 10**7}\n")  # a process of the run still there
    slots.give_back(slot)  # (as if its removal had failed)
    assert not Path(slot.dirs[""]).exists(), "emptied (cgroup.kill) and removed, run cgroup and all"
    fresh = slots.take(backend)
    assert fresh is not None and fresh is not slot
    slots.close()
    assert [p for p in fake_v2.iterdir() if p.is_dir()] == []


def test_slots_fall_back_to_per_run_cgroups_when_none_can_be_made(fake_v2: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    backend = V2Backend(str(fake_v2))
    tries: list[int] = []

    def refuse() -> None:
        tries.append(1)
        raise OSError(errno.EINVAL, "memory not available for children")

    monkeypatch.setattr(backend, "make_slot", refuse)
    slots = cgroups.Slots()
    assert slots.take(backend) is None and slots.take(backend) is None
    assert tries == [1], "one failed try per batch, not one per run"


def test_v2_stale_slot_sweep_removes_the_run_below_it(fake_v2: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    slot = fake_v2 / f"sandboxrun-{dead.pid}-n{cgroups.own_pid_namespace():x}-tdead-3-slot"
    os.mkdir(slot)
    os.mkdir(slot / f"sandboxrun-{dead.pid}-n{cgroups.own_pid_namespace():x}-tdead-4")
    assert V2Backend(str(fake_v2)).sweep_stale() == 1
    assert not slot.exists()


FORK_PAST_LIMIT = """
import os, sys, time
sys.stdin.readline()
for _ in range(6):
    try:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
    except OSError:  # EAGAIN: the cgroup's pids.max
        break
print(flush=True)
time.sleep(30)
"""


@needs_root
def test_v1_real_slot_is_reused_with_fresh_limits_and_leaves_nothing() -> None:
    v1 = _real_v1()
    if not {"memory", "pids", "cpu"} <= set(v1):
        pytest.skip("no cgroup v1 memory+pids+cpu hierarchies on this host")
    backend = V1Backend(v1)
    slots = cgroups.Slots()
    victim = None
    made: list[cgroups.RunCgroup] = []  # removed however the test ends
    try:
        slot = slots.take(backend)
        assert slot is not None and set(slot.dirs) == {"cpu", "pids"}
        limits = CgroupLimits(memory=64 * 2**20, processes=4, cpus=0.5, freezer=False, cpu_usage=False)
        cg = backend.create(limits, slot)
        made.append(cg)
        assert set(cg.shared) == set(slot.dirs.values()) and set(cg.shared) <= set(cg.dirs)
        assert cg._file("pids.max") == os.path.join(slot.dirs["pids"], "pids.max")
        assert Path(slot.dirs["cpu"], "cpu.cfs_quota_us").read_text().strip() == "50000"
        own = [d for d in cg.dirs if d not in cg.shared]
        assert len(own) == 1 and own[0].startswith(v1["memory"])  # the memory cgroup stays the run's own
        # A process of the run, in every one of its cgroups, forking past its pids limit.
        victim = subprocess.Popen([sys.executable, "-c", FORK_PAST_LIMIT], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        for f in cg.procs_files:
            cgroups._write(f, str(victim.pid))
        assert victim.stdin and victim.stdout
        victim.stdin.write(b"\n")
        victim.stdin.flush()
        victim.stdout.readline()
        assert cg.stats().pids_max_hit is True
        cg.kill_all()
        victim.wait(timeout=10)
        cg.remove()
        assert not os.path.exists(own[0]) and all(os.path.isdir(d) for d in slot.dirs.values())
        slots.give_back(slot)
        # The next run: the same slot, its own quota, and the earlier run's pids hit is not its own.
        again = slots.take(backend)
        assert again is slot
        cg2 = backend.create(CgroupLimits(memory=None, processes=64, cpus=1.0, freezer=False, cpu_usage=False), again)
        made.append(cg2)
        assert Path(slot.dirs["cpu"], "cpu.cfs_quota_us").read_text().strip() == "100000"
        assert Path(slot.dirs["pids"], "pids.max").read_text().strip() == "64"
        assert cg2.stats().pids_max_hit is False
        cg2.remove()
        slots.give_back(again)
    finally:
        if victim is not None and victim.poll() is None:
            victim.kill()
            victim.wait()
        for c in made:
            c.remove()
        slots.close()
    assert not glob.glob(f"/sys/fs/cgroup/*/sandboxrun-{os.getpid()}-*")


@needs_root
def test_v1_slot_is_not_used_for_a_hierarchy_the_run_needs_to_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """cpu and cpuacct mounted together (systemd's layout): a run that needs its own cpuacct
    (no pid namespace) gets its own cgroup there, not the slot's."""
    backend = V1Backend({"memory": "/m", "pids": "/p", "cpu": "/c", "cpuacct": "/c"})
    slot = cgroups.Slot("v1", {"cpu": "/c/s", "pids": "/p/s"})
    limits = CgroupLimits(memory=None, processes=8, cpus=1.0, freezer=False, cpu_usage=True)
    assert backend._from_slot(limits, slot) == {"pids": "/p/s"}
    limits = CgroupLimits(memory=None, processes=8, cpus=1.0, freezer=False, cpu_usage=False)
    assert backend._from_slot(limits, slot) == {"cpu": "/c/s", "pids": "/p/s"}
    limits = CgroupLimits(memory=None, processes=None, cpus=None, freezer=False, cpu_usage=False)
    assert backend._from_slot(limits, slot) == {}  # no cap asked for: nothing joined


def _cgroups_of(pid: int) -> list[str]:
    return glob.glob(f"/sys/fs/cgroup/*/{cgroups.PREFIX}{pid}-*")


def _until(cond, seconds: float = 20.0) -> bool:
    end = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.parametrize("start", [
    "for _ in range(2):\n    threading.Thread(target=sandbox.run, args=(['sleep', '60'],), daemon=True).start()\n",
    # run_async's thread passes its own Cancel; a loop left open (no asyncio.run) never cancels the tasks
    "import asyncio\nloop = asyncio.new_event_loop()\n"
    "for _ in range(2):\n    loop.create_task(sandbox.run_async(['sleep', '60']))\n"
    "loop.run_until_complete(asyncio.sleep(0.2))\n",
], ids=["thread", "run_async"])
def test_runs_of_daemon_threads_are_ended_and_cleaned_up_at_interpreter_exit(contained, start: str) -> None:
    """A caller that exits while daemon threads (run_async's, its own) supervise runs froze
    them mid-run: their cgroups stayed until a later sandboxrun's sweep."""
    code = (f"import glob, os, sys, threading, time; sys.path.insert(0, {str(ROOT)!r}); import sandbox\n"
            "print(os.getpid(), flush=True)\n"
            f"{start}"
            "end = time.monotonic() + 20\n"
            "while len(glob.glob(f'/sys/fs/cgroup/*/sandboxrun-{os.getpid()}-*')) < 2 and time.monotonic() < end:\n"
            "    time.sleep(0.02)\n"
            "print(len(glob.glob(f'/sys/fs/cgroup/*/sandboxrun-{os.getpid()}-*')) >= 2, flush=True)\n")
    t = time.monotonic()
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    pid, started = p.stdout.split()
    assert (p.returncode, started) == (0, "True") and "Traceback" not in p.stderr, p  # (asyncio: "Task was destroyed")
    assert _cgroups_of(int(pid)) == [] and time.monotonic() - t < 30


def test_a_zombie_supervisor_is_gone_for_the_sweep(contained) -> None:
    """A SIGKILLed supervisor that its parent has not reaped kept its cgroups from the sweep."""
    root = str(Path(__file__).resolve().parent.parent)
    p = subprocess.Popen([sys.executable, "-c", f"import sys; sys.path.insert(0, {root!r}); import sandbox; "
                          "sandbox.run(['sleep', '60'])"])
    try:
        assert _until(lambda: len(_cgroups_of(p.pid)) > 0), "the run never started"
        os.kill(p.pid, 9)
        assert _until(lambda: open(f"/proc/{p.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z")
        backend = cgroups.detect()
        assert _until(lambda: (backend.sweep_stale(), not _cgroups_of(p.pid))[1], 10), _cgroups_of(p.pid)
    finally:
        p.kill()
        p.wait()
