"""The isolation checks again, as an unprivileged user; and hosts that refuse user namespaces.

Set-up (once per session, as root): a system user `sandboxrun-test` (created if missing,
removed afterwards only if we created it), and a 0755 temp tree holding a copy of the
`sandbox` package and the site-packages it needs, because the venv's interpreter lives
under /root where that user cannot go. The user runs the system /usr/bin/python3 (same
minor version, same ABI) through `setpriv --reuid --regid --clear-groups --reset-env`.

A refused user namespace is simulated with a seccomp filter (installed by a wrapper
before dropping to the user) that answers EPERM to unshare/clone with CLONE_NEWUSER, as
a container runtime's profile does: the run must end in a named setup_error, never run
with less isolation.
"""

from __future__ import annotations

import glob
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sandbox.isolation import cgroups

ROOT = Path(__file__).resolve().parent.parent
USER = "sandboxrun-test"
SYS_PYTHON = "/usr/bin/python3"
CLONE_NEWUSER = 0x10000000

pytestmark = pytest.mark.rootless

# Tests of tests/test_isolation.py that need what rootless gives up by definition.
ROOTLESS_DESELECT = {
    "test_cgroup_namespace_and_limits_applied": "asserts a cgroup v1/v2 backend; rootless has none on v1 hosts",
}


def _sys_python_ok() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create the unprivileged test user"
    if shutil.which("setpriv") is None:
        return "setpriv (util-linux) is not installed"
    if not os.access(SYS_PYTHON, os.X_OK):
        return f"{SYS_PYTHON} is missing"
    ver = subprocess.run([SYS_PYTHON, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                         text=True).stdout.strip()
    if ver != str(tuple(sys.version_info[:2])):
        return f"{SYS_PYTHON} is {ver}, not {tuple(sys.version_info[:2])}: the C extensions would not load"
    return None


@dataclass
class Tree:
    path: Path
    uid: int
    gid: int

    @property
    def home(self) -> Path:
        return self.path / "home"

    def env(self) -> list[str]:
        return ["env", f"PYTHONPATH={self.path / 'lib'}", f"HOME={self.home}",
                f"XDG_CACHE_HOME={self.home / '.cache'}", "PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8"]

    def as_user(self, args: list[str], *, prefix: list[str] | None = None, timeout: float = 120,
                cwd: str | None = None, input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run args as the test user; prefix (e.g. a seccomp wrapper) runs first, as root."""
        cmd = [*(prefix or []), "setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups",
               "--reset-env", *self.env(), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd or str(self.home),
                              input=input)


def _module_path(name: str) -> Path:
    mod = __import__(name)
    f = Path(mod.__file__)
    return f.parent if f.name == "__init__.py" else f


@pytest.fixture(scope="session")
def test_user() -> Iterator[tuple[int, int]]:
    why = _sys_python_ok()
    if why:
        pytest.skip(why)
    created = False
    try:
        pw = pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", USER],
                       check=True, capture_output=True)
        created = True
        pw = pwd.getpwnam(USER)
    yield pw.pw_uid, pw.pw_gid
    if created:
        subprocess.run(["userdel", USER], capture_output=True)
        # What its sessions kept (sandbox.start), which no user would own now
        shutil.rmtree(f"/tmp/sandboxrun-{pw.pw_uid}", ignore_errors=True)


@pytest.fixture(scope="session")
def tree(test_user: tuple[int, int]) -> Iterator[Tree]:
    path = Path(tempfile.mkdtemp(prefix="sandboxrun-rootless-", dir="/var/tmp"))  # not /tmp: nested runs write it
    try:
        path.chmod(0o755)
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
        lib = path / "lib"
        lib.mkdir()
        # Beside its dependencies: the fork server gets sandbox's parent dir on sys.path, not PYTHONPATH.
        shutil.copytree(ROOT / "sandbox", lib / "sandbox", ignore=ignore)  # profiles symlink -> real copy
        for name in ("prctl", "_prctl", "pyseccomp", "pytest", "_pytest", "pluggy", "iniconfig", "packaging",
                     "pygments", "psutil", "py"):
            try:
                src = _module_path(name)
            except ImportError:
                continue
            if src.is_dir():
                shutil.copytree(src, lib / src.name, ignore=ignore)
            else:
                shutil.copy2(src, lib / src.name)
        (lib / "sandboxrun_rootless_defaults.py").write_text(
            '"""pytest plugin: sandbox.run() defaults to the rootless profile."""\n'
            "import sandbox.supervisor as _s\n\n_orig = _s.run\n\n\n"
            "def run(command, **kw):\n    kw.setdefault('profile', 'rootless')\n    return _orig(command, **kw)\n\n\n"
            "_s.run = run\n")
        (path / "tests").mkdir()
        for name in ("conftest.py", "test_isolation.py"):
            shutil.copy2(ROOT / "tests" / name, path / "tests" / name)
        (path / "scripts").mkdir()
        shutil.copy2(ROOT / "scripts" / "bench.py", path / "scripts" / "bench.py")
        (path / "scripts" / "probe.py").write_text(PROBE)
        (path / "scripts" / "deny.py").write_text(DENY)
        for p in [path, *path.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        (path / "home").mkdir(mode=0o700)
        os.chown(path / "home", *test_user)
        yield Tree(path, *test_user)
    finally:
        shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------- probe script

# Runs in the sandbox: everything it can find out about its confinement, as JSON.
INSIDE = r"""
import json, os, socket, sys
hostpid, port, hostfile = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
st = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
out = {k: st[k].strip() for k in ("CapEff", "CapPrm", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp")}
out["uid"], out["gid"] = os.getuid(), os.getgid()
out["shadow"] = os.path.exists("/etc/shadow")
out["hostpid_visible"] = os.path.exists("/proc/%d" % hostpid)
try:
    socket.create_connection(("127.0.0.1", port), timeout=2).close()
    out["listener"] = "reached"
except OSError as e:
    out["listener"] = e.errno
out["writes"] = {}
for p in ("/usr/sandboxrun-x", "/sandboxrun-x", "/etc/sandboxrun-x", hostfile):
    try:
        with open(p, "w") as f:
            f.write("pwned")
        out["writes"][p] = "written"
    except OSError as e:
        out["writes"][p] = e.errno
with open("in-workdir", "w") as f:
    out["workdir_write"] = f.write("ok") == 2
print(json.dumps(out))
"""

# Runs as the caller (the unprivileged user): the runs, as Result JSON.
PROBE = r"""
import json, sys
import sandbox
mode = sys.argv[1]
out = {}
if mode == "isolation":
    out["rootless"] = sandbox.run(["python3", "-c", INSIDE, *sys.argv[2:5]], profile="rootless").to_dict()
for name in (sys.argv[5:] if mode == "isolation" else sys.argv[2:]):
    out[name] = sandbox.run(["sh", "-c", "id -u; id -g"], profile=name).to_dict()
print(json.dumps(out))
""".replace("INSIDE", repr(INSIDE))

# Installs the seccomp filter a container runtime would, then execs the rest of argv.
DENY = r"""
import errno, os, sys
import pyseccomp as sc
f = sc.SyscallFilter(sc.ALLOW)
if sys.argv[1] == "userns":  # unshare/clone with CLONE_NEWUSER: EPERM; clone3 cannot be inspected
    for name in ("unshare", "clone"):
        f.add_rule(sc.ERRNO(errno.EPERM), name, sc.Arg(0, sc.MASKED_EQ, 0x10000000, 0x10000000))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
else:  # no namespaces at all (Docker's default profile without CAP_SYS_ADMIN)
    f.add_rule(sc.ERRNO(errno.EPERM), "unshare")
    f.add_rule(sc.ERRNO(errno.EPERM), "setns")
f.load()
os.execvp(sys.argv[2], sys.argv[2:])
"""


def _json_out(cp: subprocess.CompletedProcess[str]) -> dict:
    assert cp.returncode == 0 and cp.stdout.strip(), (cp.returncode, cp.stdout[-2000:], cp.stderr[-2000:])
    return json.loads(cp.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def host_bait(tree: Tree) -> Iterator[tuple[int, int, Path]]:
    """A host process, a host 127.0.0.1 listener and a host file the user could write: (pid, port, file)."""
    sleeper = subprocess.Popen(["sleep", "120"])
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    victim = tree.home / "victim.txt"
    victim.write_text("original")
    os.chown(victim, tree.uid, tree.gid)
    try:
        yield sleeper.pid, srv.getsockname()[1], victim
    finally:
        srv.close()
        sleeper.kill()
        sleeper.wait()


@pytest.fixture(scope="module")
def rootless_probe(tree: Tree, host_bait: tuple[int, int, Path]) -> dict:
    pid, port, victim = host_bait
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        pass  # control: the listener is reachable from the host
    cp = tree.as_user([SYS_PYTHON, str(tree.path / "scripts" / "probe.py"), "isolation", str(pid), str(port),
                       str(victim), "strict", "nested"])
    out = _json_out(cp)
    assert victim.read_text() == "original"
    return out


@pytest.fixture(scope="module")
def inside(rootless_probe: dict) -> dict:
    r = rootless_probe["rootless"]
    assert r["status"] == "ok", (r["status"], r["error"], r["stderr"])
    return json.loads(r["stdout"])


# ---------------------------------------------------------------------------- rootless isolation


def test_rootless_run_is_ok_and_reports_a_user_namespace(rootless_probe: dict) -> None:
    r = rootless_probe["rootless"]
    assert r["status"] == "ok", r
    iso = r["isolation"]
    assert iso["user_namespace"] is True and "user" in iso["namespaces"]
    assert set(iso["namespaces"]) >= {"pid", "mount", "net", "ipc", "uts", "cgroup"}
    assert iso["filesystem"] == "private" and iso["network"] == "none" and iso["seccomp"] == "default"
    assert iso["host_uid"] == pwd.getpwnam(USER).pw_uid
    assert iso["cgroup"] == "none" and "cgroup_unavailable" in iso["limits"]  # said, not hidden


def test_rootless_uid_inside_is_not_root(inside: dict, rootless_probe: dict) -> None:
    assert inside["uid"] != 0 and inside["gid"] != 0
    assert inside["uid"] == rootless_probe["rootless"]["isolation"]["uid"] == 1000


def test_rootless_host_secrets_and_processes_invisible(inside: dict) -> None:
    assert inside["shadow"] is False
    assert inside["hostpid_visible"] is False


def test_rootless_host_loopback_unreachable(inside: dict) -> None:
    assert inside["listener"] != "reached"


def test_rootless_no_capabilities_nnp_seccomp(inside: dict) -> None:
    assert (inside["CapEff"], inside["CapPrm"], inside["CapAmb"]) == ("0" * 16,) * 3
    assert inside["CapBnd"] == "0" * 16, "bounding set must be empty (refilled by entering a user namespace?)"
    assert inside["NoNewPrivs"] == "1" and inside["Seccomp"] == "2"


def test_rootless_writes_outside_the_workdir_fail(inside: dict) -> None:
    assert inside["workdir_write"] is True
    for path, outcome in inside["writes"].items():
        assert outcome != "written", path


def test_strict_fails_closed_without_cgroup_delegation(rootless_probe: dict) -> None:
    """On this host (cgroup v1: no delegation) strict must refuse, saying why, not run weaker."""
    r = rootless_probe["strict"]
    if r["status"] == "ok":
        assert r["isolation"]["cgroup"] in ("v1", "v2")  # a host that delegates a cgroup to the user
        return
    assert r["status"] == "setup_error" and r["error_step"] == "cgroup", r
    assert "delegat" in r["error"], r["error"]
    assert r["pid"] is None and r["exit_code"] == -1


def test_nested_profile_runs_rootless(rootless_probe: dict) -> None:
    # No namespace of the profile's; but the fork side's user namespace (where the caller is
    # uid 0) would make it root inside: it gets one more, where it is uid 1000, and says so.
    r = rootless_probe["nested"]
    assert r["status"] == "ok", (r["error_step"], r["error"])
    iso = r["isolation"]
    assert iso["filesystem"] in ("host", "none")
    assert iso["namespaces"] == ["user"] and iso["user_namespace"] is True and iso["capabilities"] == "none"
    assert r["stdout"].split() == ["1000", "1000"] and iso["uid"] == 1000, r["stdout"]
    assert iso["host_uid"] == pwd.getpwnam(USER).pw_uid


# Two library runs of one process (the rootless fork server keeps a template of the view).
_TEMPLATE_RUNS = r"""
import json, sandbox
inside = "import json, os; print(json.dumps([os.stat('/').st_dev, [l.split()[2] for l in open('/proc/self/mountinfo') if ' - proc ' in l], os.getpid() == int(os.readlink('/proc/self')), os.path.lexists('/run/.proc')]))"
runs = [sandbox.run(["python3", "-c", inside], profile="rootless", trace=True) for _ in range(2)]
print(json.dumps([[json.loads(r.stdout), sorted(r.trace or {})] for r in runs]))
"""

# Which child the library's fork server starts for a rootless run: the native stage, or the
# Python child (where no stage could be built, or SANDBOXRUN_NATIVE=0).
CHILDREN = {"native": [], "python": ["env", "SANDBOXRUN_NATIVE=0"]}


@pytest.mark.parametrize("child", CHILDREN)
def test_rootless_library_runs_copy_a_template_and_keep_no_proc_of_it(tree: Tree, child: str) -> None:
    cp = tree.as_user([*CHILDREN[child], SYS_PYTHON, "-c", _TEMPLATE_RUNS])
    assert cp.returncode == 0, cp.stderr
    runs = json.loads(cp.stdout)
    (root_a, *_), (root_b, *_) = (inside for inside, _steps in runs)
    # One root filesystem for both: a template's, copied (a view built in full mounts a fresh one)
    assert root_a == root_b
    for (_root, procs, own, staged), steps in runs:
        # The run's own proc only (its read-only and masked parts are binds of it): the
        # template's, of the fork server's pid namespace, is neither stacked below nor aside
        assert len(set(procs)) == 1, procs
        assert own  # /proc/self is the run's own pid: the proc of the run's pid namespace
        assert not staged
        # The stage's program names the pid namespace its caller made; the Python child starts later
        assert ("pid_namespace" in steps) == (child == "native"), steps


@pytest.mark.parametrize("child", CHILDREN)
def test_isolation_suite_passes_rootless(tree: Tree, child: str) -> None:
    """tests/test_isolation.py, unchanged, as the unprivileged user with the rootless profile,
    through the native stage and through the Python child."""
    tests = tree.path / "tests" / "test_isolation.py"
    args = [*CHILDREN[child], SYS_PYTHON, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "-p",
            "sandboxrun_rootless_defaults", f"--rootdir={tree.path}", f"--basetemp={tree.home / 'pytest'}", str(tests)]
    for name in ROOTLESS_DESELECT:
        args.append(f"--deselect=tests/test_isolation.py::{name}")
    cp = tree.as_user(args, timeout=300)
    tail = cp.stdout[-4000:]
    assert cp.returncode == 0, tail + cp.stderr[-2000:]
    assert "sandbox unavailable" not in cp.stdout, tail  # every test skipped would be a vacuous pass
    summary = cp.stdout.strip().splitlines()[-1]
    assert " passed" in summary and int(summary.split(" passed")[0].split()[-1]) >= 10, tail


# A rootless caller in a cgroup v2 delegated to it (as `systemd-run --user -p Delegate=yes`
# gives): where does each run's PID 1 get into its cgroup?
_DELEGATED_RUN = r"""
import json, sys, sandbox
from sandbox.isolation import cgroups
cgroups._backend = cgroups.V2Backend(sys.argv[2])  # detection wants memory and pids, which this mount may lack
moves = []
real_add = cgroups.RunCgroup.add
cgroups.RunCgroup.add = lambda self, pid: (moves.append(pid), real_add(self, pid))[1]
r = sandbox.run(["sh", "-c", "grep '^0::' /proc/self/cgroup /proc/1/cgroup"], profile=sys.argv[1])
print(json.dumps({"status": r.status, "error": r.error, "cgroup": r.isolation and r.isolation.cgroup,
                  "stdout": r.stdout, "moved": len(moves)}))
"""


@pytest.mark.parametrize("child", CHILDREN)
def test_rootless_pid1_is_born_in_its_delegated_v2_cgroup(tree: Tree, child: str) -> None:
    """The stage clones PID 1 into the run's cgroup (CLONE_INTO_CGROUP) for a rootless caller
    too: moving it through cgroup.procs waits for an RCU grace period whenever the lock was
    idle (milliseconds a run). The Python child is still moved."""
    base = next((p for p, fstype, _ in cgroups._mountinfo() if fstype == "cgroup2"), None)
    if base is None or not os.access(base, os.W_OK):
        pytest.skip("no writable cgroup2 mount on this host")
    deleg = os.path.join(base, f"sandboxrun-test-deleg-{os.getpid()}")
    os.mkdir(deleg)
    try:
        for name in ("", "cgroup.procs", "cgroup.subtree_control", "cgroup.threads"):  # what systemd hands over
            os.chown(os.path.join(deleg, name), tree.uid, tree.gid)
        prof = tree.home / "v2-no-controllers.toml"  # a hybrid host's v2 mount may have no controller
        prof.write_text('extends = "rootless"\n[limits]\nmemory = "unlimited"\nprocesses = "unlimited"\n'
                        'cpus = "unlimited"\n[security]\ncgroup = "required"\n')
        os.chmod(prof, 0o644)
        into = ["sh", "-c", f'echo $$ > {deleg}/cgroup.procs && exec "$@"', "sh"]  # as root: the user starts there
        cp = tree.as_user(["env", *CHILDREN[child][1:], SYS_PYTHON, "-c", _DELEGATED_RUN, str(prof), deleg],
                          prefix=into)
        assert cp.returncode == 0, cp.stderr
        out = json.loads(cp.stdout)
        assert out["status"] == "ok" and out["cgroup"] == "v2", out
        assert out["stdout"] == "/proc/self/cgroup:0::/\n/proc/1/cgroup:0::/\n", out  # at their namespace's root
        assert out["moved"] == (0 if child == "native" else 1), out
    finally:
        for d in sorted(glob.glob(os.path.join(deleg, "**/"), recursive=True), reverse=True):
            if d.rstrip("/") != deleg:
                os.rmdir(d)
        os.rmdir(deleg)


# The rootless fork server SIGKILLed while its stage-made sandbox runs: nothing of the run may
# outlive it (the stage's parent-death signal; its pid namespace dies with it).
_SERVER_KILLED = r"""
import json, os, signal, threading, time, sandbox
from sandbox import leaks
mark = "sandboxrun-test-orphan-%d" % os.getpid()
box = {}
cmd = ["bash", "-c", f"(setsid bash -c 'exec -a {mark} sleep 30' &); exec -a {mark} sleep 31"]
t = threading.Thread(target=lambda: box.setdefault("r", sandbox.run(cmd, profile="rootless", timeout=60)))
t.start()
deadline = time.monotonic() + 10
while len(leaks.marked(mark)) < 2 and time.monotonic() < deadline:
    time.sleep(0.01)
seen = len(leaks.marked(mark))
for pid in leaks.forkserver_pids():
    os.kill(pid, signal.SIGKILL)
deadline = time.monotonic() + 1.0
while leaks.marked(mark) and time.monotonic() < deadline:
    time.sleep(0.01)
left = [p.pid for p in leaks.marked(mark)]
for pid in left:
    os.kill(pid, signal.SIGKILL)
t.join(20)
print(json.dumps({"seen": seen, "left": left, "status": box["r"].status if "r" in box else None,
                  "after": sandbox.run(["/bin/true"], profile="rootless").status}))
"""


@pytest.mark.parametrize("child", CHILDREN)
def test_rootless_fork_server_killed_mid_run_leaves_nothing(tree: Tree, child: str) -> None:
    cp = tree.as_user([*CHILDREN[child], SYS_PYTHON, "-c", _SERVER_KILLED], timeout=60)
    assert cp.returncode == 0, cp.stderr
    out = json.loads(cp.stdout)
    assert out["seen"] == 2 and out["left"] == [], out  # both sleeps, the setsid one included, gone within 1 s
    assert out["status"] in ("signaled", "setup_error") and out["after"] == "ok", out  # and a new server serves


def test_bench_runs_rootless_with_its_profile(tree: Tree) -> None:
    """scripts/bench.py for an unprivileged user: --profile rootless (strict needs a cgroup)."""
    out = tree.home / "bench.json"
    cp = tree.as_user([SYS_PYTHON, str(tree.path / "scripts" / "bench.py"), "--smoke", "--profile", "rootless",
                       "--only", "latency,throughput", "--json", str(out)], timeout=300)
    assert cp.returncode == 0, cp.stdout[-2000:] + cp.stderr[-2000:]
    doc = json.loads(out.read_text())
    cases = {c["name"]: c for c in doc["cases"]}
    for name in ("sandbox_true", "sandbox_py", "tput_run_many", "tput_cli_batch", "tput_cli_each"):
        assert cases[name]["value"] is not None and cases[name]["error"] is None, cases[name]
    assert doc["meta"]["profile"] == "rootless" and "rootless" in cases["sandbox_true"]["command"]


# ---------------------------------------------------------------------------- CLI as the user


def test_cli_runs_rootless(tree: Tree) -> None:
    cp = tree.as_user([SYS_PYTHON, "-m", "sandbox", "--profile", "rootless", "--", "python3", "-c", "print(6*7)"])
    assert (cp.returncode, cp.stdout) == (0, "42\n"), cp.stderr


@pytest.mark.parametrize("child", CHILDREN)
def test_cli_runs_rootless_through_either_child(tree: Tree, child: str) -> None:
    probe = "import os; s = open('/proc/self/status').read(); print(os.getuid(), 'CapEff:\t0000000000000000' in s, 'NoNewPrivs:\t1' in s, 'Seccomp:\t2' in s)"
    cp = tree.as_user([*CHILDREN[child], SYS_PYTHON, "-m", "sandbox", "--json", "--trace", "--profile", "rootless", "--",
                       "python3", "-c", probe])
    r = json.loads(cp.stdout)
    assert r["status"] == "ok" and r["stdout"] == "1000 True True True\n", r
    assert r["isolation"]["user_namespace"] and r["isolation"]["host_uid"] == tree.uid
    assert ("pid_namespace" in r["trace"]) == (child == "native"), r["trace"]  # the stage's program names it


def test_cli_passes_its_stdin_on_rootless(tree: Tree) -> None:
    cp = tree.as_user([SYS_PYTHON, "-m", "sandbox", "--profile", "rootless", "--", "sh", "-c",
                       "cat; readlink /proc/self/fd/0"], input="hello\n")
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.startswith("hello\npipe:"), cp.stdout


@pytest.mark.parametrize("child", CHILDREN)
def test_cli_copies_a_stdin_file_rootless(tree: Tree, child: str) -> None:
    # A regular file is copied by a thread, which a rootless one-shot CLI forking the Python
    # child cannot start once it has unshared the run's pid namespace (clone answers EINVAL):
    # that one reads the file itself. With the stage (which makes that namespace) the thread.
    f = tree.home / "input.txt"
    f.write_text("from a file\n")
    os.chown(f, tree.uid, tree.gid)
    cp = tree.as_user(["sh", "-c", f"exec {' '.join(CHILDREN[child])} {SYS_PYTHON} -m sandbox --profile rootless -- "
                       f"sh -c 'cat; readlink /proc/self/fd/0' < {f}"])
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.startswith("from a file\npipe:"), cp.stdout


def test_cli_strict_names_the_missing_layer(tree: Tree) -> None:
    cp = tree.as_user([SYS_PYTHON, "-m", "sandbox", "--", "/bin/true"])
    if cp.returncode == 0:
        pytest.skip("this host delegates a cgroup to unprivileged users")
    assert cp.returncode == 125 and "cgroup" in cp.stderr and "delegat" in cp.stderr, cp.stderr
    assert "Traceback" not in cp.stderr


def test_doctor_as_user(tree: Tree) -> None:
    cp = tree.as_user([SYS_PYTHON, "-m", "sandbox", "doctor", "--json"])
    assert cp.returncode in (0, 1) and "Traceback" not in cp.stderr, cp.stderr
    rep = json.loads(cp.stdout)
    assert rep["host"]["rootless"] is True and rep["host"]["uid"] == tree.uid
    layers = {r["layer"]: r for r in rep["layers"]}
    assert layers["user namespace"]["works"] is True
    for name in ("pid namespace", "net namespace", "mount namespace", "/proc", "pivot_root", "seccomp"):
        assert layers[name]["works"] is True, layers[name]
    profiles = {p["profile"]: p for p in rep["profiles"]}
    assert profiles["rootless"]["runs"] is True, profiles["rootless"]
    assert rep["strict"] is profiles["strict"]["runs"] and cp.returncode == (0 if rep["strict"] else 1)
    if not rep["strict"]:
        assert profiles["strict"]["step"] == "cgroup" and "delegat" in profiles["strict"]["cause"]
        assert "likely cause" not in profiles["strict"]["error"]  # given once, as the report's own
    text = tree.as_user([SYS_PYTHON, "-m", "sandbox", "doctor"])
    assert text.returncode == cp.returncode and "rootless" in text.stdout and "LAYER" in text.stdout, text.stderr
    assert "(likely cause:" not in text.stdout  # each cause once, on its own line, not in the error too


# ---------------------------------------------------------------------------- refused namespaces


def _deny(tree: Tree, what: str, python: str = SYS_PYTHON) -> list[str]:
    """The wrapper that installs the filter (as root), then execs the rest."""
    return ["env", f"PYTHONPATH={tree.path / 'lib'}", python, str(tree.path / "scripts" / "deny.py"), what]


def test_refused_user_namespace_is_a_named_setup_error(tree: Tree) -> None:
    """As under a container's seccomp profile: never a run without namespaces."""
    cp = tree.as_user([SYS_PYTHON, str(tree.path / "scripts" / "probe.py"), "profiles", "rootless", "strict"],
                      prefix=_deny(tree, "userns"))
    out = _json_out(cp)
    r = out["rootless"]
    assert r["status"] == "setup_error" and r["error_step"] == "user_namespace", r
    assert r["error_errno"] == 1 and r["pid"] is None and "user namespace" in r["error"]
    assert out["strict"]["status"] == "setup_error"


def test_doctor_names_the_seccomp_filter_as_cause(tree: Tree) -> None:
    cp = tree.as_user([SYS_PYTHON, "-m", "sandbox", "doctor", "--json"],
                      prefix=_deny(tree, "userns"))
    assert cp.returncode == 1, cp.stderr
    rep = json.loads(cp.stdout)
    layers = {r["layer"]: r for r in rep["layers"]}
    userns = layers["user namespace"]
    assert userns["works"] is False and userns["errno_name"] == "EPERM", userns
    assert "seccomp" in userns["cause"], userns["cause"]
    assert layers["pid namespace"]["works"] is None  # untested, not claimed to work
    assert not any(p["runs"] for p in rep["profiles"] if p["profile"] in ("strict", "rootless", "standard"))


def test_root_with_unshare_denied_fails_closed(tree: Tree) -> None:
    """Root under a filter denying unshare: strict names the namespace step; nested (explicitly weaker) runs."""
    code = ("import json, sandbox; print(json.dumps({n: sandbox.run(['/bin/true'], profile=n).to_dict() "
            "for n in ('strict', 'nested')}))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cp = subprocess.run([*_deny(tree, "unshare", sys.executable), sys.executable, "-c", code],
                        capture_output=True, text=True, timeout=120, env=env)
    out = _json_out(cp)
    s = out["strict"]
    assert s["status"] == "setup_error" and s["error_step"] in ("pid_namespace", "namespaces"), s
    assert s["error_errno"] == 1 and s["exit_code"] == -1 and not s["stdout"]
    n = out["nested"]
    assert n["status"] == "ok" and n["isolation"]["namespaces"] == [], n


def test_nested_timeout_as_the_user_signals_only_the_run(tree: Tree) -> None:
    """No namespace at all: the run is the user's own uid, as are the user's shell and the
    supervisor itself. A timeout must end the run's processes (a daemon that ignores
    SIGTERM included) and nothing else of the user: kill(-1) would take them all."""
    from conftest import STUBBORN, bystander, end_marked, marker

    from sandbox import leaks

    mark = marker()
    with bystander(tree.uid, tree.gid) as own:
        try:
            cp = tree.as_user([SYS_PYTHON, "-m", "sandbox", "--json", "--profile", "nested", "--timeout", "1", "--",
                               "bash", "-c", STUBBORN.format(mark=mark)])
            assert cp.returncode == 124, (cp.returncode, cp.stderr[-2000:])  # not 130: the CLI was not signalled
            res = json.loads(cp.stdout)
            # no pid namespace (the user namespace the fork side gives it does not separate pids)
            assert res["status"] == "timeout" and "pid" not in res["isolation"]["namespaces"], res
            assert own.poll() is None, "the user's own process was signalled"
            assert leaks.marked(mark) == []
        finally:
            end_marked(mark)


_KILLED_AFTER_ITS_GRACE = """
import json, sys
import sandbox
code = ("import signal, time\\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\\nx = bytearray(100 << 20)\\n"
        "end = time.process_time() + 0.6\\nwhile time.process_time() < end: pass\\ntime.sleep(60)")
r = sandbox.run(["python3", "-c", code], profile=sys.argv[1], timeout=2, kill_grace=0.3)
print(json.dumps({"status": r.status, "signal": r.signal, "usage": r.to_dict()["usage"]}))
"""


@pytest.mark.parametrize("child", CHILDREN)
def test_rootless_run_killed_after_its_grace_still_reports_its_usage(tree: Tree, child: str) -> None:
    """No cgroup counts it and its PID 1, SIGKILLed, reports nothing: the supervisor reads the
    tree's CPU time and peak RSS from /proc just before the kill (they read 0 before)."""
    cp = tree.as_user([*CHILDREN[child], SYS_PYTHON, "-c", _KILLED_AFTER_ITS_GRACE, "rootless"])
    assert cp.returncode == 0, cp.stderr[-2000:]
    res = json.loads(cp.stdout)
    assert (res["status"], res["signal"]) == ("timeout", "SIGKILL"), res
    assert res["usage"]["cpu_user_s"] + res["usage"]["cpu_sys_s"] >= 0.5, res
    assert res["usage"]["peak_memory_bytes"] >= 100 << 20, res


_TWO_NESTED_RUNS = """
import json, sys, threading
import sandbox
out = {}
def run(name, cmd, timeout):
    out[name] = sandbox.run(["bash", "-c", cmd], profile="nested", timeout=timeout).to_dict()
a = threading.Thread(target=run, args=("a", sys.argv[1], 1))
b = threading.Thread(target=run, args=("b", "sleep 3; echo survived", 20))
b.start(); a.start(); a.join(); b.join()
print(json.dumps({k: {"status": v["status"], "stdout": v["stdout"], "signal": v["signal"]} for k, v in out.items()}))
"""


def test_nested_library_runs_signal_only_their_own_processes(tree: Tree) -> None:
    """A rootless library caller's fork server has a pid namespace of its own, which the
    host's /proc it sees does not number: the run's child still finds its descendants there
    (by the pids /proc gives them). One run's timeout must end its own processes, its
    setsid daemon that ignores SIGTERM included, and leave a concurrent run of the same
    caller alone: kill(-1) in that namespace would reach both."""
    from conftest import STUBBORN, end_marked, marker

    from sandbox import leaks

    mark = marker()
    try:
        cp = tree.as_user([SYS_PYTHON, "-c", _TWO_NESTED_RUNS, STUBBORN.format(mark=mark)], timeout=60)
        assert cp.returncode == 0, cp.stderr[-3000:]
        res = json.loads(cp.stdout)
        assert res["a"]["status"] == "timeout", res
        assert res["b"] == {"status": "ok", "stdout": "survived\n", "signal": None}, res
        assert leaks.marked(mark) == []  # the daemon died with its run, not with the caller
    finally:
        end_marked(mark)


_PTY_SESSION = r"""
import sandbox
s = sandbox.start(["sh", "-c", "tty; python3 -c \"import os; open(os.ttyname(0), 'w').write('by-name\\n')\""],
                  pty=True, profile="rootless")
r = s.wait(30)
s.clear()
print(r.status, repr(r.stdout), r.error)
"""


@pytest.mark.parametrize("child", CHILDREN)
def test_rootless_terminal_has_a_name(tree: Tree, child: str) -> None:
    """A rootless session's terminal is bound at /dev/console too (found there by ttyname)."""
    cp = tree.as_user([*CHILDREN[child], SYS_PYTHON, "-c", _PTY_SESSION], timeout=60)
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.startswith("ok ") and "/dev/console\\r\\nby-name\\r\\n" in cp.stdout, cp.stdout


@pytest.mark.parametrize("child", CHILDREN)
def test_a_limit_above_the_callers_hard_rlimit_is_a_named_setup_error(tree: Tree, child: str) -> None:
    """Without CAP_SYS_RESOURCE no hard limit can be raised: a profile's open_files above the
    caller's hard limit is named (it was `cannot start the native stage: Invalid argument`).
    A low soft limit alone is no obstacle: the run still gets the profile's limit."""
    def run(limits: str) -> subprocess.CompletedProcess[str]:
        return tree.as_user(["sh", "-c", f"{limits}; exec {' '.join(CHILDREN[child])} {SYS_PYTHON} -m sandbox "
                             "--json --profile rootless -- sh -c 'ulimit -n'"])

    cp = run("ulimit -Sn 50; ulimit -Hn 60")
    r = json.loads(cp.stdout)
    assert cp.returncode == 125 and r["status"] == "setup_error", (cp.stdout, cp.stderr)
    assert "open_files" in r["error"] and "hard limit of 60" in r["error"], r["error"]
    assert "likely cause" not in r["error"], r["error"]  # the cause is known, not guessed
    cp = run("ulimit -Sn 50")
    r = json.loads(cp.stdout)
    assert (cp.returncode, r["status"], r["stdout"]) == (0, "ok", "256\n"), (cp.stdout, cp.stderr)


def test_a_cwd_the_user_may_not_enter_is_named_before_any_sandbox(tree: Tree) -> None:
    # It failed in the sandbox at chdir, under the last mount's step, blaming the container.
    shut = tree.path / "shut"
    shut.mkdir(mode=0o700)  # root's
    try:
        cp = tree.as_user([SYS_PYTHON, "-m", "sandbox", "--profile", "rootless", "--cwd", str(shut), "--", "true"])
        assert cp.returncode == 2, (cp.returncode, cp.stderr)
        assert f"--cwd: {shut}: this user may not enter it" in cp.stderr, cp.stderr
    finally:
        shut.rmdir()


def test_nested_as_the_user_is_refused_where_its_runs_could_write_sandboxruns_cache(tree: Tree) -> None:
    """nested has no mount namespace: its runs write the host's /tmp as the caller. A cache there
    (HOME or XDG_CACHE_HOME under /tmp) let a run replace the native stage, which the next run,
    of any profile, started before any layer: a wrapper there ran with Seccomp 0, full caps."""
    cache = Path(tempfile.mkdtemp(prefix="sandboxrun-owncache-"))  # in /tmp
    try:
        os.chown(cache, tree.uid, tree.gid)
        cp = tree.as_user(["env", f"XDG_CACHE_HOME={cache}", SYS_PYTHON, "-m", "sandbox", "--profile", "nested",
                           "--", "true"])
        assert cp.returncode == 2 and "holds sandboxrun's own cache" in cp.stderr, cp.stderr
        assert "XDG_CACHE_HOME" in cp.stderr and "Traceback" not in cp.stderr, cp.stderr
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    # Its state directory is not /tmp's either when it has a home (no XDG_RUNTIME_DIR here).
    cp = tree.as_user([SYS_PYTHON, "-c", "from sandbox import hostpaths; print(hostpaths.default_state_dir())"])
    assert cp.stdout.strip() == str(tree.home / ".local" / "state" / "sandboxrun"), cp


@pytest.mark.parametrize("where", [".local/state/sandboxrun", ".local", ".cache"])
def test_the_rootless_cli_keeps_runs_off_its_real_cache_and_state(tree: Tree, where: str) -> None:
    """The CLI's process enters a user namespace, where geteuid() says 0: the state directory it
    protected was root's /run/sandboxrun, and `--cwd ~/.local/state/sandboxrun` gave a run the
    user's sessions (a request.json rewritten to a profile without seccomp ran at the next start)."""
    target = tree.home / where
    cp = tree.as_user(["mkdir", "-p", str(target)])
    assert cp.returncode == 0, cp.stderr
    for args in (["--cwd", str(target)], ["--bind", f"{target}:/mnt/x"]):
        cp = tree.as_user([SYS_PYTHON, "-m", "sandbox", "--profile", "rootless", *args, "--", "true"])
        assert cp.returncode == 2 and "sandboxrun's own" in cp.stderr, (args, cp.returncode, cp.stderr)
