"""Each isolation layer has a test that fails if the layer is removed."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest
from conftest import py

import sandbox

pytestmark = pytest.mark.usefixtures("isolated")


def test_pid_namespace_hides_host_processes() -> None:
    host = subprocess.Popen(["sleep", "30"])
    try:
        r = sandbox.run(py(f"import os; print(os.path.exists('/proc/{host.pid}')); "
                           "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))"))
        assert r.status == "ok", r
        visible, pids = r.stdout.splitlines()
        assert visible == "False"
        assert max(eval(pids)) < 10  # only the sandbox's own few processes
    finally:
        host.kill()
        host.wait()


def test_network_namespace_blocks_host_loopback(host_listener: int) -> None:
    # Control: the listener answers on the host.
    with socket.create_connection(("127.0.0.1", host_listener), timeout=2) as c:
        assert c.recv(64) == b"host-secret\n"
    r = sandbox.run(py(
        "import socket\n"
        "try:\n"
        f"    s = socket.create_connection(('127.0.0.1', {host_listener}), timeout=2); print('reached', s.recv(64))\n"
        "except OSError as e:\n"
        "    print('refused', e.errno)\n"
    ))
    assert r.status == "ok", r
    assert r.stdout.startswith("refused"), r.stdout


def test_own_loopback_works_inside() -> None:
    r = sandbox.run(py(
        "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(1)\n"
        "c = socket.create_connection(s.getsockname()); a, _ = s.accept(); a.sendall(b'ok'); print(c.recv(2).decode())"
    ))
    assert r.stdout.strip() == "ok", r


def test_interfaces_listed_inside_are_the_sandboxs_own() -> None:
    # Listing interfaces works (netlink's NETLINK_ROUTE, as getifaddrs and `ip addr` use it) and
    # shows the sandbox's loopback alone; control: the host has more than that.
    host = sorted(name for _i, name in socket.if_nameindex())
    assert len(host) > 1, host
    r = sandbox.run(py("import socket; print(sorted(name for _i, name in socket.if_nameindex()))"))
    assert r.status == "ok", r
    assert r.stdout.strip() == "['lo']", r


def _outward_address() -> str | None:
    """The host's own address on its default route (no packet is sent), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
        except OSError:
            return None
        addr = s.getsockname()[0]
    return None if addr.startswith("127.") else addr


def test_no_route_outside(host_listener_everywhere: int) -> None:
    # Control: the host's own outward address answers on the host. In the sandbox there is
    # no route at all (only lo): not the host's address, nor anything beyond it.
    addr = _outward_address()
    if addr is None:
        pytest.skip("this host has no outward address")
    with socket.create_connection((addr, host_listener_everywhere), timeout=2) as c:
        assert c.recv(64) == b"host-secret\n"
    r = sandbox.run(py(
        "import socket\n"
        "print(len(open('/proc/net/route').readlines()) - 1, 'routes')\n"
        "try:\n"
        f"    s = socket.create_connection(('{addr}', {host_listener_everywhere}), timeout=2); print('reached', s.recv(64))\n"
        "except OSError as e:\n"
        "    print('unreachable', e.errno)\n"
    ))
    assert r.status == "ok", r
    assert r.stdout.split() == ["0", "routes", "unreachable", str(errno.ENETUNREACH)], r


def test_secrets_of_the_host_filesystem_absent() -> None:
    # Control: those of them this host has (each one probed must exist here).
    paths = [p for p in ("/etc/shadow", "/root", "/home", "/dev/mem", "/dev/kmsg", "/dev/sda", "/dev/vda", "/sys",
                         "/boot") if os.path.exists(p)]
    assert "/etc/shadow" in paths and len(paths) >= 5, paths
    r = sandbox.run(py(f"import os; print([p for p in {paths!r} if os.path.exists(p)])"))
    assert r.status == "ok" and r.stdout.strip() == "[]", r


def test_no_host_device_but_the_harmless_few() -> None:
    # Control: the host's /dev has its disks (vda, loop*, ... whatever this host has).
    disks = [d for d in os.listdir("/sys/block") if os.path.exists(f"/dev/{d}")]
    assert disks, "no block device on the host to look for"
    r = sandbox.run(["ls", "-A", "/dev"])
    assert r.status == "ok", r
    assert set(r.stdout.split()) == {"null", "zero", "full", "random", "urandom", "tty", "ptmx", "pts", "shm",
                                     "fd", "stdin", "stdout", "stderr"}, r.stdout


def test_open_files_are_capped() -> None:
    # The host allows far more (a Python process here: thousands); the profile's open_files.
    r = sandbox.run(py("import os\nn = 3\ntry:\n    while True:\n        os.open('/dev/null', os.O_RDONLY)\n"
                       "        n += 1\nexcept OSError as e:\n    print(n, e.errno)"), open_files=64)
    assert r.status == "ok" and r.stdout.split()[1:] == [str(errno.EMFILE)] and 32 < int(r.stdout.split()[0]) <= 64, r


def test_system_is_read_only_and_workdir_writable() -> None:
    r = sandbox.run(["sh", "-c", "touch /usr/x 2>&1; touch /x 2>&1; touch /etc/x 2>&1; "
                                 "echo data > /work/f && cat /work/f; echo t > /tmp/t && cat /tmp/t"])
    out = r.stdout + r.stderr
    assert out.count("Read-only file system") == 3, out
    assert "data\nt\n" in r.stdout


def test_tmp_is_private() -> None:
    with tempfile.NamedTemporaryFile(dir="/tmp", prefix="hostonly-") as f:
        r = sandbox.run(["sh", "-c", f"ls {f.name} 2>&1; ls -A /tmp | wc -l"])
        assert "No such file" in r.stdout and r.stdout.strip().endswith("0"), r


def test_caller_cwd_is_the_writable_workdir(tmp_path) -> None:
    (tmp_path / "in.txt").write_text("hello")
    r = sandbox.run(["sh", "-c", "cat in.txt; pwd; echo out > out.txt"], cwd=tmp_path)
    assert r.stdout == "hello/work\n", r
    assert (tmp_path / "out.txt").read_text() == "out\n"


def test_planted_symlink_cannot_redirect_a_write_to_the_host() -> None:
    # The victim is writable by anyone, on a path any uid can reach (pytest's tmp_path is
    # under a 0700 directory): only the private view, which has not the host's /tmp, keeps
    # the run from writing it through a link.
    top = Path(tempfile.mkdtemp(prefix="victim-"))
    try:
        top.chmod(0o755)
        victim = top / "victim.txt"
        victim.write_text("original")
        victim.chmod(0o666)
        work = top / "work"
        work.mkdir()
        os.symlink(victim, work / "link")  # as if a previous run had planted it
        r = sandbox.run(["sh", "-c", f"ln -s {victim} planted; echo pwned > link; echo pwned > planted; echo done"],
                        cwd=work)
        assert "done" in r.stdout
        assert victim.read_text() == "original"
    finally:
        shutil.rmtree(top)


def test_a_fresh_host_workdirs_cleanup_does_not_follow_planted_links(tmp_path) -> None:
    # `nested` (no mount namespace) runs in a fresh workdir on the host, which the
    # supervisor removes afterwards: as root, through the run's links it would empty
    # tmp_path.
    tmp_path.chmod(0o755)
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    r = sandbox.run(["sh", "-c", f"ln -s {tmp_path} escape; ln -s {victim} file; pwd"], profile="nested")
    if r.status != "ok":
        pytest.skip(f"the nested profile does not run here: {r.error}")
    work = r.stdout.strip()
    assert work.startswith("/") and not os.path.lexists(work), r  # removed
    assert victim.read_text() == "original"


def test_capabilities_dropped_no_new_privs_seccomp() -> None:
    r = sandbox.run(["sh", "-c", "grep -E '^(CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs|Seccomp):' /proc/self/status"])
    fields = dict(line.split(":\t") for line in r.stdout.splitlines())
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert fields[cap] == "0000000000000000", (cap, fields)
    assert fields["NoNewPrivs"] == "1"
    assert fields["Seccomp"] == "2"


def test_unprivileged_uid() -> None:
    r = sandbox.run(["id", "-u"])
    assert r.status == "ok" and int(r.stdout) != 0, r
    assert r.isolation.uid == int(r.stdout)


def test_concurrent_runs_have_distinct_host_uids() -> None:
    if os.geteuid() != 0:
        pytest.skip("per-run host uids are allocated for root callers")
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        results = list(ex.map(lambda _: sandbox.run(["sh", "-c", "id -u; sleep 0.3"]), range(4)))
    uids = {r.isolation.host_uid for r in results}
    assert len(uids) == 4, uids
    # As the processes themselves have them (no user namespace: the host's uid is the uid).
    assert {int(r.stdout) for r in results} == uids, [(r.stdout, r.isolation.host_uid) for r in results]


SECCOMP_PROBE = """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
def call(nr, *args):
    r = libc.syscall(nr, *[ctypes.c_long(a) for a in args])
    return 'ok' if r >= 0 else errno.errorcode[ctypes.get_errno()]
print('unshare_user', call(272, 0x10000000))
print('ptrace_traceme', call(101, 0, 0, 0, 0))
print('keyctl', call(250, 0, 0, 0, 0))
print('bpf', call(321, 0, 0, 0))
print('userfaultfd', call(323, 1))  # UFFD_USER_MODE_ONLY: allowed unprivileged
print('perf_event_open', call(298, 0, 0, -1, -1, 0))
print('io_uring_setup', call(425, 1, 0))
ctx = ctypes.c_ulong(0)
print('io_setup', call(206, 1, ctypes.addressof(ctx)))
buf = ctypes.create_string_buffer(16)
print('modify_ldt', call(154, 0, ctypes.addressof(buf), 16))
open('f', 'w').close()
try:
    os.setxattr('f', 'user.x', b'1'); print('setxattr ok')
except OSError as e:
    print('setxattr', errno.errorcode[e.errno])
import shutil
import socket
for fam, proto in ((16, 9), (17, 0), (40, 0), (38, 0), (16, 0)):  # netlink audit, packet, vsock, alg; route
    try:
        socket.socket(fam, socket.SOCK_RAW if fam in (16, 17) else socket.SOCK_STREAM, proto)
        print('socket', f'{fam}.{proto}', 'ok')
    except OSError as e:
        print('socket', f'{fam}.{proto}', errno.errorcode[e.errno])
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="syscall numbers are x86_64")
def test_seccomp_denies_kernel_surface_with_eperm() -> None:
    r = sandbox.run(["python3", "-c", SECCOMP_PROBE])
    lines = dict(line.rsplit(" ", 1) for line in r.stdout.splitlines())
    for name in ("unshare_user", "ptrace_traceme", "keyctl", "bpf", "userfaultfd", "perf_event_open",
                 "io_uring_setup", "modify_ldt", "socket 16.9", "socket 17.0", "socket 40.0", "socket 38.0"):
        assert lines[name] == "EPERM", (name, r.stdout, r.stderr)
    assert lines["socket 16.0"] == "ok", r.stdout  # NETLINK_ROUTE: what lists interfaces
    assert lines["io_setup"] == "ENOSYS" and lines["setxattr"] == "ENOTSUP", r.stdout


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x32 is an x86_64 ABI")
def test_seccomp_kills_x32_abi() -> None:
    r = sandbox.run(py("import ctypes; ctypes.CDLL(None).syscall(0x40000000 | 39); print('survived')"))
    assert r.status == "signaled" and r.signal == "SIGSYS", r


def test_only_std_fds_inherited() -> None:
    leaked = os.open("/etc/hostname", os.O_RDONLY)  # inheritable on purpose
    os.set_inheritable(leaked, True)
    try:
        r = sandbox.run(py("import os\nopen_fds = []\nfor fd in range(3, 4096):\n"
                           "    try:\n        os.fstat(fd); open_fds.append(fd)\n    except OSError:\n        pass\n"
                           "print(open_fds)"))
        assert r.stdout.strip() == "[]", r
    finally:
        os.close(leaked)


def test_callers_environment_does_not_leak(monkeypatch) -> None:
    monkeypatch.setenv("SANDBOXRUN_TEST_SECRET", "hunter2")
    r = sandbox.run(["env"])
    assert "hunter2" not in r.stdout and "SANDBOXRUN_TEST_SECRET" not in r.stdout
    r = sandbox.run(["env"], env={"GIVEN": "yes"})
    assert "GIVEN=yes" in r.stdout


def test_hostname_is_private() -> None:
    before = socket.gethostname()
    r = sandbox.run(["sh", "-c", "hostname; hostname evil 2>&1; hostname"])
    assert r.stdout.splitlines()[0] == "sandbox"
    assert socket.gethostname() == before


def test_ipc_namespace_hides_host_sysv_shm() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    shmid = libc.shmget(0x5B0C5, 4096, 0o1666)  # IPC_CREAT | 0666
    assert shmid >= 0
    try:
        r = sandbox.run(["cat", "/proc/sysvipc/shm"])
        assert "5b0c5" not in r.stdout.lower() and str(0x5B0C5) not in r.stdout, r.stdout
    finally:
        libc.shmctl(shmid, 0, None)  # IPC_RMID


def test_proc_knobs_read_only() -> None:
    knobs = [k for k in ("/proc/sys/vm/overcommit_memory", "/proc/sys/kernel/domainname", "/proc/sysrq-trigger",
                         "/proc/pressure/memory") if os.path.exists(k)]  # pressure: triggers are written there
    code = (f"import errno\nfor k in {knobs!r}:\n    try:\n        open(k, 'w').write('0')\n        print(k, 'written')\n"
            "    except OSError as e:\n        print(k, errno.errorcode[e.errno])")
    r = sandbox.run(py(code))
    assert r.stdout.count("EROFS") == len(knobs) >= 2, r.stdout + r.stderr


def test_cgroup_namespace_and_limits_applied(isolated) -> None:
    r = sandbox.run(["cat", "/proc/self/cgroup"])
    # Inside a cgroup namespace every hierarchy shows the run's cgroup as its root.
    lines = r.stdout.splitlines()
    assert r.status == "ok" and lines and all(line.endswith(":/") for line in lines), r
    assert isolated.isolation.cgroup in ("v1", "v2")
    # And its limits hold: a process that touches more than the memory limit is stopped.
    r = sandbox.run(["python3", "-c", "b = bytearray(256 << 20); print('allocated')"], memory="64MiB")
    assert r.status == "memory_limit" and "allocated" not in r.stdout, r


def test_setuid_binaries_gain_nothing(tmp_path: Path) -> None:
    # A setuid-root `id` prints euid 0 for any user on the host (the control); in the sandbox
    # (no_new_privs, and binds mounted nosuid) it runs with the run's own uid.
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("making a setuid-root binary needs root (and setpriv, for the control)")
    suid = tmp_path / "suid"
    suid.mkdir(mode=0o755)
    os.chmod(tmp_path, 0o755)
    shutil.copy("/usr/bin/id", suid / "id")
    os.chmod(suid / "id", 0o4755)
    control = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(suid / "id"), "-u"],
                             capture_output=True, text=True)
    if control.stdout.strip() != "0":
        pytest.skip(f"setuid binaries do not work under {tmp_path} on this host: {control}")
    r = sandbox.run(["/suid/id", "-u"], ro_bind=f"{suid}:/suid")
    assert r.status == "ok" and r.stdout.strip() not in ("", "0"), r
    assert r.stdout.strip() == str(r.isolation.uid), r


def test_every_mount_is_nosuid_and_only_devices_allow_dev(tmp_path: Path) -> None:
    # no_new_privs alone would hide a missing nosuid from the setuid test above: read the
    # flags themselves, of the view's own mounts and of a caller's bind.
    (tmp_path / "d").mkdir()
    r = sandbox.run(["cat", "/proc/self/mountinfo"], ro_bind=f"{tmp_path / 'd'}:/data")
    assert r.status == "ok", r
    mounts = {f[4]: set(f[5].split(",")) for f in (line.split() for line in r.stdout.splitlines())}
    assert {"/", "/usr", "/tmp", "/work", "/data", "/proc"} <= set(mounts), mounts
    for point, flags in mounts.items():
        assert "nosuid" in flags, (point, flags)
        device = point == "/dev" or point.startswith("/dev/") and point != "/dev/shm" or point.startswith("/proc/")
        assert device or "nodev" in flags, (point, flags)  # device nodes, and /proc's masks (/dev/null binds)


def test_result_reports_isolation_applied(isolated) -> None:
    iso = isolated.isolation
    assert set(iso.namespaces) >= {"pid", "mount", "net", "ipc", "uts", "cgroup"}
    assert iso.filesystem == "private" and iso.network == "none" and iso.seccomp == "default"
    assert iso.no_new_privs and iso.capabilities == "none"


def test_runner_binary_unreachable_through_proc(tmp_path) -> None:
    code = ("import os\nfor p in ('/proc/1/exe', '/proc/1/mem', '/proc/1/environ'):\n"
            "    try:\n        open(p, 'rb').read(1); print(p, 'open')\n"
            "    except OSError as e:\n        print(p, e.errno)")
    for cwd in (None, tmp_path):  # the per-run uid, and uid 0 for a root-owned workdir
        r = sandbox.run(py(code), cwd=cwd)
        assert r.stdout.count(" 13") == 3 and "open" not in r.stdout, (cwd, r.stdout, r.stderr)


def test_template_and_full_build_give_the_same_view() -> None:
    """The library copies a prepared mount namespace; the CLI builds the view in full (a
    rootless caller's too: its template holds a proc, which each run swaps for its own)."""
    import subprocess
    import sys
    from pathlib import Path

    show = "cut -d' ' -f5,6 /proc/self/mountinfo | sort; stat -c '%A %U %G %n' / /* /etc/* /dev/* | sort"
    via_template = sandbox.run(["sh", "-c", show]).stdout
    root = Path(__file__).resolve().parent.parent
    rootless = ["--profile", "rootless"] if os.geteuid() != 0 else []  # (as sandbox.run gets it there)
    package_parent = str(Path(sandbox.__file__).resolve().parent.parent)
    via_cli = subprocess.run([sys.executable, "-m", "sandbox", *rootless, "--", "sh", "-c", show], capture_output=True,
                             text=True, cwd=root, env=dict(os.environ, PYTHONPATH=package_parent)).stdout
    assert via_template and via_template == via_cli


def test_init_command_line_reveals_no_host_paths() -> None:
    from pathlib import Path

    r = sandbox.run(["cat", "/proc/1/cmdline"])
    assert r.stdout.strip("\0 ") == "sandboxrun-init", r.stdout
    assert str(Path(sandbox.__file__).parent.parent) not in r.stdout


def test_no_core_dumps(tmp_path) -> None:
    r = sandbox.run(["sh", "-c", "ulimit -c unlimited 2>&1; python3 -c 'import os; os.abort()'; ls"], cwd=tmp_path)
    assert "core" not in r.stdout and not list(tmp_path.glob("core*")), r.stdout


def test_callers_workdir_is_idmapped_to_the_unprivileged_run_uid(tmp_path) -> None:
    """A root caller's root-owned directory: the command still runs unprivileged, sees the
    directory as its own, and what it creates belongs to the directory's owner on the host."""
    if os.geteuid() != 0:
        pytest.skip("idmapped workdirs are made for root callers")
    (tmp_path / "in.txt").write_text("hi")
    r = sandbox.run(["sh", "-c", "id -u; stat -c %u in.txt; echo out > out.txt; chmod 4755 out.txt || echo refused"],
                    cwd=tmp_path)
    uid, seen_owner, refused = r.stdout.split()
    assert int(uid) != 0 and int(seen_owner) == int(uid) == r.isolation.uid, r.stdout
    assert refused == "refused"  # no setuid file for the host (seccomp)
    assert (tmp_path / "out.txt").stat().st_uid == tmp_path.stat().st_uid == 0


def test_proc_entries_that_describe_the_host_are_masked(child: str) -> None:
    # The host's boot arguments (a VM's may name its control ports), keys, timers: empty inside.
    names = [n for n in ("cmdline", "keys", "key-users", "timer_list", "sched_debug", "locks")
             if os.path.exists(f"/proc/{n}")]
    with open("/proc/key-users", "rb") as f:
        assert f.read().strip(), "the control: the host's counts keys per uid"
    with open("/proc/cmdline", "rb") as f:
        assert f.read().strip(), "the control: the host's own is not empty"
    held = open("/proc/self/exe", "rb")  # noqa: SIM115 - a lock of ours the host's /proc/locks lists
    fcntl.flock(held, fcntl.LOCK_SH)
    with open("/proc/locks", "rb") as f:
        assert f.read().strip(), "the control: the host's lists our lock"
    r = sandbox.run(["sh", "-c", "for n in " + " ".join(names) + "; do printf '%s=' $n; wc -c < /proc/$n; done"])
    held.close()
    assert r.status == "ok", r
    assert r.stdout.split() == [f"{n}=0" for n in names], r.stdout


def test_a_run_holds_at_most_max_ptys_terminals(child: str) -> None:
    """Its own devpts instance is capped: the kernel's shared pty pool is not the run's to use up."""
    from sandbox.isolation.filesystem import MAX_PTYS

    code = ("import os\nn = 0\ntry:\n    while True:\n        os.openpty(); n += 1\n"
            "except OSError as e:\n    print(n, e.strerror)")
    r = sandbox.run(py(code), open_files=4 * MAX_PTYS)  # fds enough for twice as many
    assert r.status == "ok", r
    assert r.stdout.split(None, 1)[0] == str(MAX_PTYS), r.stdout


def test_the_run_can_reopen_its_own_stdio(child: str) -> None:
    # `echo x > /dev/stderr` is in every other shell script: /dev/std* reopen the run's pipes,
    # which must be its own (and stdin, when none is given, an empty pipe, not the host's /dev/null).
    script = "echo out > /dev/stdout; echo err > /dev/stderr; cat /dev/stdin; echo end"
    r = sandbox.run(["sh", "-c", script], stdin="in\n")
    assert (r.status, r.stdout, r.stderr) == ("ok", "out\nin\nend\n", "err\n"), r
    r = sandbox.run(["sh", "-c", script])
    assert (r.status, r.stdout, r.stderr) == ("ok", "out\nend\n", "err\n"), r


def test_dev_is_sealed(child: str) -> None:
    # Templates share the /dev tmpfs between runs, and its nodes are the host's inodes: both
    # are mounted read-only (a device is still written through), so no run can add to /dev
    # for the next one, nor chmod or touch a host device even as its owner.
    r = sandbox.run(["sh", "-c", "echo x > /dev/null && echo written; touch /dev/planted 2>&1; "
                     "awk '$5 ~ \"^/dev(/null|/zero|/tty)?$\" {print $5, $6}' /proc/self/mountinfo"])
    assert r.stdout.startswith("written\n") and "Read-only file system" in r.stdout, r
    mounts = dict(line.split() for line in r.stdout.splitlines()[2:])
    assert {"/dev", "/dev/null", "/dev/zero"} <= set(mounts), mounts
    assert all(opts.split(",")[0] == "ro" for opts in mounts.values()), mounts


def test_files_move_and_link_across_directories_of_the_run(child: str) -> None:
    """Every Landlock layer refuses REFER unless it grants it: the command's scoped layer must,
    or each rename into another directory (an sdist build, an atomic replace) fails EXDEV."""
    code = ("import os\nfor d in ('/work', '/tmp'):\n    os.makedirs(f'{d}/x/y')\n"
            "    open(f'{d}/x/y/f', 'w').close()\n    os.rename(f'{d}/x/y/f', f'{d}/x/f')\n"
            "    os.link(f'{d}/x/f', f'{d}/x/y/g')\n    os.rename(f'{d}/x/y', f'{d}/z')\n"
            "try:\n    os.rename('/work/x/f', '/usr/f')\nexcept OSError as e:\n    print(e.errno != 0)\n")
    r = sandbox.run(py(code))
    assert (r.status, r.stdout) == ("ok", "True\n"), r


def test_service_and_protocol_names_resolve() -> None:
    """getaddrinfo(host, "http") and getservbyname read /etc/services: static, not secret."""
    if not os.path.exists("/etc/services"):
        pytest.skip("the host has no /etc/services")
    r = sandbox.run(py("import socket; print(socket.getservbyname('http', 'tcp'), socket.getprotobyname('tcp'))"))
    assert (r.status, r.stdout) == ("ok", "80 6\n"), r


def _debian_java_conf() -> str | None:
    """The /etc directory a Debian/Ubuntu OpenJDK keeps its conf/ in (conf/* link there)."""
    import shutil

    java = shutil.which("java")
    conf = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(java))), "conf") if java else ""
    for root, _dirs, files in os.walk(conf):
        for f in files:
            target = os.path.realpath(os.path.join(root, f))
            if target.startswith("/etc/java-"):
                return "/".join(target.split("/")[:3])
    return None


def test_java_finds_its_configuration() -> None:
    """Debian's OpenJDK links its conf/ (java.security: no Java program starts without it) into
    /etc/java-N-openjdk, which the view must carry like the other static /etc entries."""
    etc = _debian_java_conf()
    if etc is None:
        pytest.skip("no Debian/Ubuntu OpenJDK with its configuration in /etc")
    r = sandbox.run(["sh", "-c", 'test -r "$1/security/java.security" && echo readable', "sh", etc])
    assert (r.status, r.stdout) == ("ok", "readable\n"), r
    address_space = (r.isolation.limits if r.isolation else {}).get("address_space_bytes")
    if address_space is not None and address_space < 2**31:
        return  # (rootless: 512 MiB per process) a JVM reserves more than that before its first class
    src = "public class A { public static void main(String[] a) { System.out.println(6 * 7); } }"
    r = sandbox.run(["sh", "-c", 'printf %s "$1" > A.java && java A.java', "sh", src], timeout=120)
    assert (r.status, r.stdout) == ("ok", "42\n"), (etc, r.stderr[-2000:])
