"""`sandboxrun doctor`: real probes per layer, named causes, exit 0 only when strict can run."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import sandbox
from sandbox import doctor
from sandbox.isolation import cgroups

LAYERS = ("user namespace", "process", "pid namespace", "ipc namespace", "uts namespace", "cgroup namespace",
          "net namespace", "loopback", "mount namespace", "filesystem view", "/proc", "pivot_root", "seccomp",
          "landlock", "cgroup", "cgroup v2", "cgroup v1", "rlimits")


@pytest.fixture(scope="module")
def report() -> dict:
    return doctor.diagnose()


def test_report_shape(report: dict) -> None:
    assert [r["layer"] for r in report["layers"]] == list(LAYERS)
    for r in report["layers"]:
        assert r["works"] in (True, False, None) and isinstance(r["detail"], str)
        if r["works"] is False and r["step"]:
            assert r["cause"], r  # every failure found by a probe says why
    assert {p["profile"] for p in report["profiles"]} == set(__import__("sandbox.profile").profile.builtin_names())
    json.dumps(report, default=str)  # what --json prints


def test_strict_verdict_matches_a_real_strict_run(report: dict, probe: sandbox.Result) -> None:
    """doctor and the core agree: both decide by running."""
    assert report["strict"] is (probe.status == "ok")
    strict = next(p for p in report["profiles"] if p["profile"] == "strict")
    assert strict["runs"] is report["strict"]


def test_layers_work_where_strict_runs(report: dict, isolated: sandbox.Result) -> None:
    layers = {r["layer"]: r for r in report["layers"]}
    for name in ("process", "pid namespace", "ipc namespace", "uts namespace", "cgroup namespace", "net namespace",
                 "loopback", "mount namespace", "filesystem view", "/proc", "pivot_root", "seccomp", "cgroup",
                 "rlimits"):
        assert layers[name]["works"] is True, layers[name]
    assert layers["cgroup"]["detail"].startswith(isolated.isolation.cgroup)


def test_unusable_cgroup2_mount_is_named(report: dict) -> None:
    v2 = report["cgroup"]["v2"]
    if v2 is None or v2["usable"]:
        pytest.skip("no cgroup2 mount without memory/pids here")
    row = next(r for r in report["layers"] if r["layer"] == "cgroup v2")
    assert row["works"] is False and "no memory/pids" in row["detail"]


def test_text_table_and_exit_code(capsys: pytest.CaptureFixture[str], report: dict) -> None:
    code = doctor.main([])
    out = capsys.readouterr().out
    assert code == (0 if report["strict"] else 1)
    assert "LAYER" in out and "PROFILE" in out
    for name in LAYERS:
        assert f"\n{name} " in out, name


def test_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    code = doctor.main(["--json"])
    rep = json.loads(capsys.readouterr().out)
    assert code == (0 if rep["strict"] else 1) and rep["layers"] and rep["profiles"]


def test_cli_doctor() -> None:
    exe = Path(sys.executable).with_name("sandboxrun")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "sandbox"]
    cp = subprocess.run([*cmd, "doctor", "--json"], capture_output=True, text=True, timeout=120)
    assert cp.returncode in (0, 1) and "Traceback" not in cp.stderr, cp.stderr
    assert cp.returncode == (0 if json.loads(cp.stdout)["strict"] else 1)


def test_missing_cgroup_fails_strict_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    def unavailable() -> cgroups.Backend:
        raise cgroups.CgroupUnavailable(errno.EACCES, "cgroup v1 hierarchies are not writable by uid 1000")

    monkeypatch.setattr(cgroups, "detect", unavailable)
    rep = doctor.diagnose(profiles=["strict", "rootless"])
    assert rep["strict"] is False
    strict = rep["profiles"][0]
    assert strict["runs"] is False and strict["step"] == "cgroup" and strict["errno"] == errno.EACCES
    row = next(r for r in rep["layers"] if r["layer"] == "cgroup")
    assert row["works"] is False and row["errno_name"] == "EACCES" and row["cause"]


# ---------------------------------------------------------------------------- causes

BASE_FACTS = {"kernel": "6.8", "machine": "x86_64", "uid": 1000, "rootless": True, "cap_sys_admin": False,
              "seccomp_mode": 0, "no_new_privs": False, "container": None, "lsm": ["landlock", "apparmor"],
              "apparmor": True, "sysctls": {}}


def facts(**kw: object) -> dict:
    return {**BASE_FACTS, **kw}


@pytest.mark.parametrize(("sysctls", "extra", "err", "expect"), [
    ({"kernel.unprivileged_userns_clone": "0"}, {}, errno.EPERM, "kernel.unprivileged_userns_clone=0"),
    ({"user.max_user_namespaces": "0"}, {}, errno.ENOSPC, "user.max_user_namespaces"),
    ({"kernel.apparmor_restrict_unprivileged_userns": "1"}, {}, errno.EACCES, "apparmor_restrict_unprivileged_userns"),
    ({}, {"seccomp_mode": 2, "container": "docker"}, errno.EPERM, "seccomp filter"),
    ({}, {"container": "lxc"}, errno.EPERM, "nested"),
    ({}, {}, errno.EPERM, "EPERM"),
])
def test_user_namespace_causes(sysctls: dict, extra: dict, err: int, expect: str) -> None:
    cause = doctor.likely_cause("user_namespace", err, facts(sysctls=sysctls, **extra))
    assert expect in cause, cause


def test_other_causes() -> None:
    root = facts(rootless=False, uid=0, cap_sys_admin=True)
    assert "seccomp" in doctor.likely_cause("pid_namespace", errno.EPERM, {**root, "seccomp_mode": 2})
    assert "CAP_SYS_ADMIN" in doctor.likely_cause("namespaces", errno.EPERM, {**root, "cap_sys_admin": False})
    assert "Delegate=yes" in doctor.likely_cause("cgroup", errno.EACCES, facts())
    assert "rootless" in doctor.likely_cause("cgroup", errno.EACCES, facts())
    assert "lsm=" in doctor.likely_cause("landlock", errno.EOPNOTSUPP, facts(lsm=["apparmor"]))
    assert "/proc" in doctor.likely_cause("filesystem:mount:proc", errno.EPERM, root)
    assert "AppArmor" in doctor.likely_cause(
        "filesystem:mount:private", errno.EACCES,
        facts(sysctls={"kernel.apparmor_restrict_unprivileged_userns": "1"}))


@pytest.mark.parametrize("step", ["filesystem:mount:open-sources", "cgroup", "exec", "namespaces"])
def test_too_many_open_files_is_named_whatever_step_met_it(step: str) -> None:
    # Under `ulimit -n 16` the open-sources step's EMFILE said "a bind source was removed or replaced".
    root = facts(rootless=False, uid=0, cap_sys_admin=True)
    assert "RLIMIT_NOFILE" in doctor.likely_cause(step, errno.EMFILE, root)
    assert "fs.file-max" in doctor.likely_cause(step, errno.ENFILE, root)


def test_causes_that_are_no_kernel_feature_missing() -> None:
    # EAGAIN making the pid namespace's first process is a process limit, not CONFIG_PID_NS;
    # a workdir the run may not enter is no container forbidding mounts.
    root = facts(rootless=False, uid=0, cap_sys_admin=True, container="docker")
    eagain = doctor.likely_cause("pid_namespace", errno.EAGAIN, root)
    assert "RLIMIT_NPROC" in eagain and "CONFIG" not in eagain, eagain
    assert "max_" in doctor.likely_cause("namespaces", errno.ENOSPC, root)
    # a bind source removed or swapped for a link since its checks: no mount was refused
    assert "after it was checked" in doctor.likely_cause("filesystem:mount:open-sources", errno.ELOOP, root)
    assert doctor.likely_cause("sandboxrun", 0, root) == ""  # a probe's InputError: it was "sandboxrun failed (0)"
    shut = doctor.likely_cause("filesystem:chdir:workdir", errno.EACCES, root)
    assert "cannot enter its working directory" in shut and "container" not in shut, shut


def test_host_facts_of_this_process() -> None:
    f = doctor.host_facts()
    assert f["uid"] == os.geteuid() and f["rootless"] is (os.geteuid() != 0)
    assert f["seccomp_mode"] in (0, 1, 2)


def test_a_probe_refused_before_any_sandbox_says_why_and_no_empty_cause() -> None:
    # As `nobody` (state dir under /tmp) landlock said only "the probe failed earlier, at
    # sandboxrun", and a refused profile printed an empty "likely cause:".
    ok = {"status": "ok", "step": None, "errno": 0, "error": None, "isolation": None}
    refused = {"status": "error", "step": "sandboxrun", "errno": 0, "error": "InputError: /tmp holds the state"}
    keys = ("base", "pid", "ipc", "uts", "cgroupns", "net", "mount", "seccomp", "landlock", "cgroup")
    res = {k: dict(ok) for k in keys}
    res["landlock"] = refused
    res["cgroup"] = {"status": "setup_error", "step": "cgroup", "errno": errno.EACCES, "error": "no", "isolation": None}
    root = facts(rootless=False, uid=0, cap_sys_admin=True)
    rows = doctor._layer_rows(res, root, {"v1": {}, "v2": None, "backend": "v1", "error": None})
    landlock = next(r for r in rows if r["layer"] == "landlock")
    assert "InputError: /tmp holds the state" in landlock["detail"], landlock
    assert doctor.likely_cause("sandboxrun", 0, root) == ""
    host = {"rootless": False, "uid": 0, "kernel": "6", "machine": "x86_64", "container": None, "seccomp_mode": 0}
    rep = {"version": "0", "host": host, "layers": rows, "native_stage": {}, "strict": False,
           "profiles": [{"profile": "nested", "runs": False, "error": refused["error"], "cause": ""}]}
    assert "likely cause: \n" not in doctor.format_report(rep) + "\n"
