"""Landlock via raw syscalls. Every restriction happens in a forked child (it is irreversible);
the child reports errno codes to the parent over a pipe."""

from __future__ import annotations

import ast
import errno
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from sandbox.isolation import landlock

ABI = landlock.abi_version()
pytestmark = pytest.mark.skipif(ABI == 0, reason="landlock is not available on this kernel")

SYSTEM_RO = ["/usr", "/etc", "/lib", "/lib64", "/bin"]
READABLE_SYSTEM_FILE = "/etc/hostname" if os.path.exists("/etc/hostname") else "/etc/passwd"


def attempt(action: Callable[[], object]) -> int:
    """0 if the action succeeds, else its errno."""
    try:
        action()
    except OSError as e:
        return e.errno or -1
    return 0


def write(path: str) -> None:
    with open(path, "w") as f:
        f.write("x")


def read(path: str) -> None:
    with open(path) as f:
        f.read()


def spawn(path: str) -> int:
    pid = os.posix_spawn(path, [path], {})
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def in_child(body: Callable[[], dict[str, object]]) -> dict[str, object]:
    """Run body() in a forked child with no_new_privs set; return its dict (or {"error": ...})."""
    import prctl

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 1
        try:
            os.close(r)
            prctl.set_no_new_privs(1)
            try:
                out: dict[str, object] = body()
            except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the test
                out = {"error": f"{type(e).__name__}: {e}"}
            os.write(w, repr(out).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    result = ast.literal_eval(b"".join(chunks).decode())
    assert isinstance(result, dict)
    return result


@pytest.fixture
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = {name: tmp_path_factory.mktemp(name) for name in ("rw", "rw2", "ro", "outside")}
    (d["ro"] / "file").write_text("read-only data")
    (d["outside"] / "secret").write_text("secret")
    return d


def test_abi_version_and_handled_rights() -> None:
    assert isinstance(ABI, int) and ABI >= 1
    assert bin(landlock.handled_access(1)).count("1") == 13
    assert landlock.handled_access(2) == landlock.handled_access(1) | landlock.FS_REFER
    assert landlock.handled_access(3) == landlock.handled_access(2) | landlock.FS_TRUNCATE
    assert landlock.handled_access(4) == landlock.handled_access(3)  # ABI 4 added network rights only
    assert landlock.handled_access(5) == landlock.handled_access(4) | landlock.FS_IOCTL_DEV
    assert landlock.handled_access(7) == landlock.handled_access(5)
    assert landlock.handled_access(0) == 0


def test_restrict_confines_filesystem(dirs: dict[str, Path]) -> None:
    rw, outside = str(dirs["rw"]), str(dirs["outside"])

    def body() -> dict[str, object]:
        used = landlock.restrict(read_only=SYSTEM_RO, read_write=[rw])
        return {
            "abi": used,
            "write_rw": attempt(lambda: write(f"{rw}/new")),
            "mkdir_rw": attempt(lambda: os.mkdir(f"{rw}/sub")),
            "unlink_rw": attempt(lambda: os.unlink(f"{rw}/new")),
            "read_etc": attempt(lambda: read(READABLE_SYSTEM_FILE)),
            "write_outside": attempt(lambda: write(f"{outside}/new")),
            "read_outside": attempt(lambda: read(f"{outside}/secret")),
            "list_outside": attempt(lambda: os.listdir(outside)),
            "write_etc": attempt(lambda: write("/etc/landlock-test-must-not-exist")),
            "exec_true": spawn("/usr/bin/true"),
        }

    res = in_child(body)
    assert res == {
        "abi": ABI,
        "write_rw": 0,
        "mkdir_rw": 0,
        "unlink_rw": 0,
        "read_etc": 0,
        "write_outside": errno.EACCES,
        "read_outside": errno.EACCES,
        "list_outside": errno.EACCES,
        "write_etc": errno.EACCES,
        "exec_true": 0,
    }
    assert not os.path.exists("/etc/landlock-test-must-not-exist")
    assert not (dirs["outside"] / "new").exists()


def test_subprocess_still_works_under_restriction(dirs: dict[str, Path]) -> None:
    rw = str(dirs["rw"])

    def body() -> dict[str, object]:
        landlock.restrict(read_only=SYSTEM_RO, read_write=[rw])
        # close_fds=False: listing /proc/self/fd is outside the rules; exercise plain fork+exec.
        p = subprocess.run(["/usr/bin/true"], close_fds=False, check=False)
        return {"rc": p.returncode}

    assert in_child(body) == {"rc": 0}


def test_read_only_dir_is_read_and_execute_only(dirs: dict[str, Path]) -> None:
    ro, rw = str(dirs["ro"]), str(dirs["rw"])
    shutil.copy("/usr/bin/true", dirs["ro"] / "true")
    shutil.copy("/usr/bin/true", dirs["outside"] / "true")
    outside_true = str(dirs["outside"] / "true")

    def body() -> dict[str, object]:
        landlock.restrict(read_only=[*SYSTEM_RO, ro], read_write=[rw])
        return {
            "read": attempt(lambda: read(f"{ro}/file")),
            "list": attempt(lambda: os.listdir(ro)),
            "exec": spawn(f"{ro}/true"),
            "exec_outside": attempt(lambda: spawn(outside_true)),
            "overwrite": attempt(lambda: write(f"{ro}/file")),
            "create": attempt(lambda: write(f"{ro}/new")),
            "unlink": attempt(lambda: os.unlink(f"{ro}/file")),
            "mkdir": attempt(lambda: os.mkdir(f"{ro}/sub")),
            "symlink": attempt(lambda: os.symlink("/", f"{ro}/link")),
            "truncate": attempt(lambda: os.truncate(f"{ro}/file", 0)),
        }

    res = in_child(body)
    assert res["read"] == res["list"] == res["exec"] == 0
    for key in ("exec_outside", "overwrite", "create", "unlink", "mkdir", "symlink"):
        assert res[key] == errno.EACCES, (key, res)
    # truncate(2) is only mediated from ABI 3 on
    assert res["truncate"] == (errno.EACCES if ABI >= 3 else 0)
    assert (dirs["ro"] / "file").read_text() == "read-only data"


def test_rules_on_single_files_use_file_rights_only(dirs: dict[str, Path]) -> None:
    ro_file = dirs["ro"] / "file"
    rw_file = dirs["rw"] / "log"
    rw_file.write_text("old")
    (dirs["rw"] / "sibling").write_text("sibling")

    def body() -> dict[str, object]:
        # Directory-only rights on a file would be EINVAL from the kernel; restrict() masks them.
        landlock.restrict(read_only=[*SYSTEM_RO, str(ro_file)], read_write=[str(rw_file)])
        return {
            "read_ro_file": attempt(lambda: read(str(ro_file))),
            "write_ro_file": attempt(lambda: write(str(ro_file))),
            "write_rw_file": attempt(lambda: write(str(rw_file))),  # O_TRUNC: needs TRUNCATE on ABI 3+
            "read_sibling": attempt(lambda: read(str(dirs["rw"] / "sibling"))),
            "create_sibling": attempt(lambda: write(str(dirs["rw"] / "other"))),
            "list_parent": attempt(lambda: os.listdir(dirs["rw"])),
        }

    assert in_child(body) == {
        "read_ro_file": 0,
        "write_ro_file": errno.EACCES,
        "write_rw_file": 0,
        "read_sibling": errno.EACCES,
        "create_sibling": errno.EACCES,
        "list_parent": errno.EACCES,
    }
    assert rw_file.read_text() == "x"


def test_missing_paths_are_skipped(dirs: dict[str, Path]) -> None:
    rw = str(dirs["rw"])
    missing = ["/nonexistent/landlock/path", f"{READABLE_SYSTEM_FILE}/not-a-dir", str(dirs["rw"] / "gone")]

    def body() -> dict[str, object]:
        used = landlock.restrict(read_only=[*SYSTEM_RO, *missing], read_write=[rw, *missing])
        return {"abi": used, "write_rw": attempt(lambda: write(f"{rw}/x")),
                "write_rw2": attempt(lambda: write(f"{dirs['rw2']}/x"))}  # and the rules still hold

    assert in_child(body) == {"abi": ABI, "write_rw": 0, "write_rw2": errno.EACCES}


def test_symlinked_rule_path_applies_to_target(dirs: dict[str, Path]) -> None:
    link = dirs["rw2"] / "link-to-rw"
    link.symlink_to(dirs["rw"])
    rw = str(dirs["rw"])

    def body() -> dict[str, object]:
        landlock.restrict(read_only=SYSTEM_RO, read_write=[str(link)])
        return {"write_target": attempt(lambda: write(f"{rw}/via-link")),
                "write_links_dir": attempt(lambda: write(f"{dirs['rw2']}/beside-the-link"))}

    # The rule is the link's target's: not the directory that holds the link.
    assert in_child(body) == {"write_target": 0, "write_links_dir": errno.EACCES}


@pytest.mark.skipif(ABI < 2, reason="REFER needs landlock ABI 2")
def test_refer_right_allows_cross_directory_rename_only_when_handled(dirs: dict[str, Path]) -> None:
    rw, rw2 = str(dirs["rw"]), str(dirs["rw2"])
    (dirs["rw"] / "a").write_text("a")
    (dirs["rw"] / "b").write_text("b")

    def body_for(abi: int | None) -> Callable[[], dict[str, object]]:
        def body() -> dict[str, object]:
            used = landlock.restrict(read_only=SYSTEM_RO, read_write=[rw, rw2], abi=abi)
            name = "a" if abi is None else "b"
            return {"abi": used, "rename": attempt(lambda: os.rename(f"{rw}/{name}", f"{rw2}/{name}"))}

        return body

    # ABI 1 cannot grant REFER, so cross-directory renames are always refused (EXDEV).
    assert in_child(body_for(1)) == {"abi": 1, "rename": errno.EXDEV}
    assert in_child(body_for(None)) == {"abi": ABI, "rename": 0}


def test_abi_argument_is_capped_by_the_kernel(dirs: dict[str, Path]) -> None:
    rw = str(dirs["rw"])

    def body() -> dict[str, object]:
        return {"abi": landlock.restrict(read_only=SYSTEM_RO, read_write=[rw], abi=ABI + 10)}

    assert in_child(body) == {"abi": ABI}


def test_invalid_abi_argument() -> None:
    def body() -> dict[str, object]:
        try:
            landlock.restrict(read_only=SYSTEM_RO, read_write=[], abi=0)
        except ValueError:
            return {"raised": "ValueError"}
        return {"raised": None}

    assert in_child(body) == {"raised": "ValueError"}


def test_import_is_cheap_and_defers_ctypes() -> None:
    """What importing the module pulls in, not how long it takes (timings are the benchmark's
    job): none of the costly modules (ctypes ~3 ms, typing ~5 ms, re, enum) until first use."""
    code = ("import sys; import sandbox.isolation; before = set(sys.modules); "
            "import sandbox.isolation.landlock; print(' '.join(sorted(set(sys.modules) - before)))")
    new = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split())
    assert "sandbox.isolation.landlock" in new
    assert not new & {"ctypes", "_ctypes", "typing", "re", "enum", "pathlib", "socket", "subprocess"}, new


@pytest.mark.skipif(ABI < 6, reason="scopes need landlock ABI 6")
def test_scope_keeps_signals_and_abstract_sockets_to_the_domain() -> None:
    """landlock.scope(): the command's own domain may not signal, nor reach abstract unix
    sockets of, processes outside it (without a pid namespace: every process of its uid)."""
    import socket

    name = f"\0sandboxrun-test-{os.getpid()}"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(name)
    srv.listen(1)
    parent = os.getpid()

    def probe() -> dict[str, object]:
        def connect() -> None:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
                c.connect(name)

        return {"signal": attempt(lambda: os.kill(parent, 0)), "abstract": attempt(connect)}

    try:
        assert in_child(probe) == {"signal": 0, "abstract": 0}  # the control

        def body() -> dict[str, object]:
            assert landlock.scope(ABI)
            return probe()

        assert in_child(body) == {"signal": errno.EPERM, "abstract": errno.EPERM}
    finally:
        srv.close()
