"""A caller's directory given to a run read-write (`cwd`): what it may be, and whose it is.

The directory is bound read-write and idmapped onto the run's uid, so the run owns what
its owner owns there. These tests hold the lines that keep that from reaching the host:
no system tree, no symbolic link in the path (planted by an earlier run), the child binds
the very directory that was checked, and the command never runs as host uid 0.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT

import sandbox
from sandbox import hostpaths, workdir
from sandbox.errors import InputError, SandboxError
from sandbox.isolation.syscalls import umount2

pytestmark = pytest.mark.usefixtures("isolated")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sandbox", *args], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_a_link_planted_by_one_run_cannot_become_the_next_runs_workdir(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "secret").write_text("host-secret\n")
    ws = tmp_path / "ws"
    ws.mkdir()
    r = sandbox.run(["sh", "-c", f"ln -s {victim} build && ln -s / rootfs && echo planted"], cwd=ws)
    assert r.stdout == "planted\n", r
    for name in ("build", "rootfs"):
        with pytest.raises(InputError, match=f"{ws / name} is a symbolic link"):
            sandbox.run(["cat", "secret"], cwd=ws / name)
        p = _cli("--cwd", str(ws / name), "--", "cat", "secret")
        assert p.returncode == 2 and "symbolic link" in p.stderr and "host-secret" not in p.stdout, p
    with pytest.raises(InputError, match="symbolic link"):  # a link higher up the path too
        sandbox.run(["true"], cwd=ws / "build" / ".")
    # The real directory, named as such, is the caller's choice.
    assert sandbox.run(["cat", "secret"], cwd=victim).stdout == "host-secret\n"


@pytest.mark.parametrize("path, why", [
    ("/", "host's root"), ("/var", "contains /var/lib"), ("/etc", "system directory"),
    ("/usr/share", "system directory"), ("/root", "root's home"), ("/home", "every user's home"),
    ("/tmp", "shared by the whole host"), ("/var/tmp", "shared by the whole host")])
def test_host_root_and_system_trees_are_never_a_writable_workdir(path: str, why: str) -> None:
    if not os.path.isdir(path) or os.path.islink(path):
        pytest.skip(f"no directory {path} here")
    with pytest.raises(InputError, match=why):
        sandbox.run(["true"], cwd=path)
    p = _cli("--cwd", path, "--", "true")
    assert p.returncode == 2 and why in p.stderr, p
    [line] = list(sandbox.run_many([{"command": ["true"], "cwd": path}], trusted=True))  # even then
    assert line.status == "invalid_request" and why in line.error, line


def test_batch_refuses_a_system_tree_as_cwd(tmp_path: Path) -> None:
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(json.dumps({"id": 1, "command": ["true"], "cwd": "/"}) + "\n")
    p = _cli("batch", "--trusted", str(jobs))
    [out] = [json.loads(line) for line in p.stdout.splitlines()]
    assert out["id"] == 1 and "host's root" in json.dumps(out), out


def _check_finds_another_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if a component of the path were swapped for a link between the supervisor's check
    and the child's open: the directory the child reaches is not the one checked."""
    real = hostpaths.check_writable_dir

    def swapped(given: object, what: str) -> hostpaths.CheckedDir:
        checked = real(given, what)
        checked.ino += 1
        return checked

    monkeypatch.setattr(workdir, "check_writable_dir", swapped)


def test_child_refuses_a_workdir_replaced_after_the_check(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                          child: str) -> None:
    # As if a component of the path had been swapped for a link between the supervisor's
    # check and the child's open_tree: the tree the child holds is not the checked directory.
    _check_finds_another_directory(monkeypatch)
    r = sandbox.run(["sh", "-c", "echo ran"], cwd=tmp_path)
    assert r.status == "setup_error" and "no longer the directory that was checked" in (r.error or ""), r
    assert r.stdout == ""


@pytest.fixture
def ramfs(tmp_path: Path) -> Iterator[Path]:
    """A filesystem without idmapped mounts, owned by root."""
    if os.geteuid() != 0:
        pytest.skip("mounting a ramfs needs root")
    d = tmp_path / "ramfs"
    d.mkdir()
    if subprocess.run(["mount", "-t", "ramfs", "-o", "mode=0755", "none", str(d)]).returncode != 0:
        pytest.skip("cannot mount a ramfs here")
    try:
        yield d
    finally:
        umount2(str(d), 2)  # MNT_DETACH


def test_root_owned_workdir_without_idmap_never_runs_as_root(ramfs: Path, child: str) -> None:
    r = sandbox.run(["sh", "-c", "id -u; touch made"], cwd=ramfs)
    assert r.status == "setup_error" and "host uid 0" in (r.error or ""), r
    assert r.error_step == "filesystem:mount:idmap-workdir", r  # the same step through either child
    assert r.stdout == "" and not (ramfs / "made").exists()
    # Owned by an unprivileged user, it runs as that user (and says so), as before.
    os.chown(ramfs, 4242, 4242)
    r = sandbox.run(["sh", "-c", "id -u; touch made"], cwd=ramfs)
    assert r.status == "ok" and r.stdout == "4242\n" and r.isolation.uid == 4242, r
    assert (ramfs / "made").stat().st_uid == 4242
    # Nor as a per-run uid (the directory is an earlier run's).
    from sandbox.isolation import uids

    base, count = uids.uid_range()
    os.chown(ramfs, base + count - 5, base + count - 5)
    r = sandbox.run(["true"], cwd=ramfs)
    assert r.status == "setup_error" and "per-run uid" in (r.error or ""), r
    assert r.error_step == "filesystem:mount:idmap-workdir", r
    os.chown(ramfs, 4242, 4242)
    # As the owner, never in the directory's group (shadow, disk, docker...): nogroup.
    os.chown(ramfs, 4242, 42)
    r = sandbox.run(["sh", "-c", "id -u; id -g; id -G"], cwd=ramfs)
    assert r.status == "ok" and r.stdout.split() == ["4242", "65534", "65534"], r


def test_nested_profile_never_runs_as_the_root_owner_of_its_workdir(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("a root-owned directory needs a root caller")
    work = tmp_path / "w"
    work.mkdir()
    with pytest.raises(InputError, match="belongs to root"):
        sandbox.run(["id", "-u"], profile="nested", cwd=work)
    os.chown(work, 4243, 42)  # a group such as shadow: not the run's
    r = sandbox.run(["sh", "-c", "id -u; id -G"], profile="nested", cwd=work)
    assert r.status == "ok" and r.stdout.split() == ["4243", "65534"], r


def test_the_path_walk_cannot_be_redirected_by_a_link_swapped_in_midway(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path) -> None:
    # A concurrent run can exchange a component of the path for a link, in its own workdir,
    # while the supervisor checks it: the walk holds each directory it passed by fd, so it
    # ends where the real directories lead, never where the link points.
    (tmp_path / "ws" / "build" / "sub").mkdir(parents=True)
    (tmp_path / "victim" / "sub").mkdir(parents=True)
    real_open = os.open
    swapped: list[bool] = []

    def open_then_swap(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        fd = real_open(path, flags, mode, dir_fd=dir_fd)
        if path == "build" and not swapped:
            os.rename(tmp_path / "ws" / "build", tmp_path / "ws" / "build.real")
            os.symlink(tmp_path / "victim", tmp_path / "ws" / "build")
            swapped.append(True)
        return fd

    monkeypatch.setattr(os, "open", open_then_swap)
    checked = hostpaths.check_writable_dir(tmp_path / "ws" / "build" / "sub", "cwd")
    monkeypatch.undo()
    assert swapped
    real = os.stat(tmp_path / "ws" / "build.real" / "sub")
    assert (checked.dev, checked.ino) == (real.st_dev, real.st_ino)  # not the victim's
    # (The child clones by path, which now leads to the victim: the identity check refuses
    # that, test_child_refuses_a_workdir_replaced_after_the_check.)


def test_a_system_tree_mounted_elsewhere_is_still_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("bind-mounting needs root")
    d = tmp_path / "etc-again"
    d.mkdir()
    if subprocess.run(["mount", "--bind", "/etc", str(d)]).returncode != 0:
        pytest.skip("cannot bind-mount here")
    try:
        with pytest.raises(InputError, match="is /etc, mounted there"):
            sandbox.run(["true"], cwd=d)
    finally:
        umount2(str(d), 2)
    # The host's root mounted elsewhere (a container's `-v /:/host`): what is under it is
    # under the system trees too.
    if subprocess.run(["mount", "--bind", "/", str(d)]).returncode != 0:
        pytest.skip("cannot bind-mount / here")
    try:
        with pytest.raises(InputError, match="is /, mounted there"):
            sandbox.run(["true"], cwd=d)
        for inside, tree in (("etc/default", "/etc"), ("usr/share", "/usr")):
            if (d / inside).is_dir():
                with pytest.raises(InputError, match=f"is in {tree}, mounted there"):
                    sandbox.run(["true"], cwd=d / inside)
    finally:
        umount2(str(d), 2)
    # A part of a system tree mounted elsewhere: where it is in its filesystem says so.
    if subprocess.run(["mount", "--bind", "/usr/share", str(d)]).returncode != 0:
        pytest.skip("cannot bind-mount /usr/share here")
    try:
        sub = next(p for p in d.iterdir() if p.is_dir() and not p.is_symlink())
        for target in (d, sub):
            with pytest.raises(InputError, match="is in /usr, mounted there"):
                sandbox.run(["true"], cwd=target)
            with pytest.raises(InputError, match="is in /usr, mounted there"):
                sandbox.run(["true"], bind=f"{target}:/data")
    finally:
        umount2(str(d), 2)


def test_files_and_binds_from_the_host_are_reached_without_links(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("host-secret\n")
    secret.chmod(0o600)
    ws = tmp_path / "ws"
    ws.mkdir()
    os.symlink(secret, ws / "input.txt")  # planted by an earlier run
    os.symlink(tmp_path, ws / "build")
    p = _cli("--stdin-file", str(ws / "input.txt"), "--", "cat")
    assert p.returncode == 2 and "symbolic link" in p.stderr and "host-secret" not in p.stdout, p
    with pytest.raises(SandboxError, match="symbolic link"):
        sandbox.run(["true"], bind=f"{ws / 'build'}:/data")
    for src in ("/etc", "/"):
        with pytest.raises(InputError, match="cannot be bound read-write"):
            sandbox.run(["true"], bind=f"{src}:/data")
    with pytest.raises(InputError, match="symbolic link"):  # background runs check as foreground ones
        sandbox.start(["true"], cwd=ws / "build")
    # The real file, named as such, is the caller's choice.
    p = _cli("--stdin-file", str(secret), "--", "cat")
    assert p.returncode == 0 and p.stdout == "host-secret\n", p


def test_a_directory_of_a_per_run_uid_is_no_ones_to_run_as(tmp_path: Path) -> None:
    # A directory an earlier run made belongs to a per-run uid: a run as its owner would
    # share that uid with whichever run gets it next (its processes, its leftovers).
    if os.geteuid() != 0:
        pytest.skip("per-run uids are for root callers")
    from sandbox.isolation import uids

    base, count = uids.uid_range()
    work = tmp_path / "w"
    work.mkdir()
    os.chown(work, base + count - 4, base + count - 4)
    with pytest.raises(InputError, match="a per-run uid"):
        sandbox.run(["true"], profile="nested", cwd=work)


def test_nested_child_checks_the_directory_it_enters(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                     child: str) -> None:
    # No mount namespace: the child enters the caller's directory by path. It must be the one
    # checked (a concurrent run of the same owner could swap a component), and Landlock's
    # write rule is that directory, ".", never the path resolved a second time.
    if os.geteuid() != 0:
        pytest.skip("a directory owned by another user needs a root caller")
    work, other = tmp_path / "w", tmp_path / "other"
    for d in (work, other):
        d.mkdir()
        os.chown(d, 4245, 4245)
    os.chmod(tmp_path, 0o755)
    r = sandbox.run(["sh", "-c", f"touch made && echo in; touch {other}/x 2>/dev/null || echo denied"],
                    profile="nested", cwd=work)
    assert r.status == "ok" and (work / "made").exists(), r
    if r.isolation.landlock_abi:
        assert r.stdout == "in\ndenied\n" and not (other / "x").exists(), r
    _check_finds_another_directory(monkeypatch)
    r = sandbox.run(["sh", "-c", "echo ran"], profile="nested", cwd=work)
    assert r.status == "setup_error" and "no longer the directory that was checked" in (r.error or ""), r


def test_bind_sources_are_reached_without_links_and_verified(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                             child: str) -> None:
    # A link planted before a bind source's last component would pick what is bound; and
    # the child checks that it opened the very file the supervisor looked at.
    (tmp_path / "private").mkdir()
    (tmp_path / "private" / "data").write_text("not for the run\n")
    ws = tmp_path / "ws"
    ws.mkdir()
    os.symlink(tmp_path / "private", ws / "build")
    with pytest.raises(SandboxError, match=r"^override: ro_bind = .*/ws/build/data:/data': .*/ws/build is a symbolic link"):
        sandbox.run(["cat", "/data"], ro_bind=f"{ws / 'build' / 'data'}:/data")  # named as the CLI's --ro-bind
    assert sandbox.run(["cat", "/data"], ro_bind=f"{tmp_path / 'private' / 'data'}:/data").stdout == \
        "not for the run\n"
    # Swapped between the look and the child's open: the child's identity check refuses it.
    if child == "native":  # the stage's view is compiled here, in this process
        (tmp_path / "private" / "other").write_text("x\n")
        real = hostpaths.lstat_through_real_dirs

        def other_file(given: str, what: str) -> os.stat_result:
            st = real(given, what)
            if given.endswith("/other"):
                return os.stat_result((st.st_mode, st.st_ino + 1, *tuple(st)[2:]))
            return st

        monkeypatch.setattr(hostpaths, "lstat_through_real_dirs", other_file)
        r = sandbox.run(["cat", "/data"], ro_bind=f"{tmp_path / 'private' / 'other'}:/data")
        assert r.status == "setup_error" and "no longer the file that was checked" in (r.error or ""), r
    else:  # the Python child runs the same operations (filesystem.apply)
        from sandbox.isolation import filesystem

        st = os.stat(tmp_path / "private" / "data")
        view = filesystem.ViewOps()
        view.op("o", 0, str(tmp_path / "private" / "data"), 0)
        view.op("V", 0, str(tmp_path / "private" / "data"), st.st_dev, st.st_ino + 1)
        with pytest.raises(OSError, match="no longer the file that was checked"):
            filesystem.apply(view, [""])


def test_a_callers_bind_source_swapped_for_a_link_after_the_checks_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                                               tmp_path: Path, child: str) -> None:
    # A caller's bind source is checked to be no link where it is taken; a concurrent run whose
    # workdir holds it can swap in one afterwards (renameat2 RENAME_EXCHANGE). The view then
    # reproduced it as it does a profile's own link (/bin -> usr/bin): /data was the view's
    # /etc, and a long-lived caller's template kept it for the later runs with these binds.
    from sandbox import supervisor
    from sandbox.isolation import filesystem
    from sandbox.profile import load, with_overrides

    monkeypatch.setattr(supervisor, "_native", None)  # a forker (and templates) of this test's own
    monkeypatch.delenv("SANDBOXRUN_NO_TEMPLATE", raising=False)
    src, real = tmp_path / "data", tmp_path / "real"
    src.mkdir()
    (src / "mine").write_text("x\n")
    prof = with_overrides(load("strict"), ro_bind=f"{src}:/data")  # checked: no link
    src.rename(real)
    os.symlink("/etc", src)  # swapped after the checks
    try:
        r = sandbox.run(["ls", "/data/"], profile=prof)
        assert (r.status, r.error_step) == ("setup_error", "filesystem:mount:open-sources"), r
        assert f"bind source {src} is a symbolic link: it changed after the checks" in (r.error or ""), r
        if child == "native":
            assert not supervisor._native.templates, "a template was kept with the link"
        src.unlink()
        real.rename(src)
        r = sandbox.run(["ls", "/data/"], profile=prof)
        assert (r.status, r.stdout) == ("ok", "mine\n"), r
    finally:
        if supervisor._native is not None:
            supervisor._native.close()
    # A profile's own link is still reproduced (test_a_link_in_the_view_is_made_after_every_bind).
    os.symlink("usr/bin", tmp_path / "bin")
    spec = filesystem.ViewSpec(binds=(filesystem.BindSpec(str(tmp_path / "bin"), "/bin", False, False),),
                               workdir_host="", workdir="/work", tmp_size=1 << 20, shm_size=1 << 20,
                               hostname="h", passwd="", group="")
    assert ("l", "usr/bin", "/tmp/bin", 1) in filesystem.template_ops(spec).ops


def test_a_link_in_the_view_is_made_after_every_bind(tmp_path: Path, child: str) -> None:
    # A profile's bind source that is a link is reproduced as a link in the view; until
    # pivot_root it resolves on the host, so a bind target below it would make its mount
    # point there. Links come last: the host directory it points at is never written.
    host_dir = tmp_path / "host-dir"
    host_dir.mkdir()
    os.symlink(host_dir, tmp_path / "tools")
    (tmp_path / "l2").write_text("bound\n")
    prof = tmp_path / "p.toml"
    prof.write_text(f'extends = "strict"\n[filesystem]\nro_bind_try = ["{tmp_path}/tools:/opt/tools", '
                    f'"{tmp_path}/l2:/opt/tools/x"]\n')
    r = sandbox.run(["cat", "/opt/tools/x"], profile=str(prof))
    assert r.status == "ok" and r.stdout == "bound\n", r
    assert list(host_dir.iterdir()) == [], "a mount point was made on the host"
    # A caller's bind source may not be a link at all: it could be one a run planted.
    with pytest.raises(SandboxError, match="is a symbolic link"):
        sandbox.run(["true"], ro_bind=f"{tmp_path / 'tools'}:/opt/tools")


def test_no_mount_point_is_made_through_a_link_inside_a_bound_directory(tmp_path: Path, child: str) -> None:
    # A run plants a link in a directory that a later run binds; a bind target below that
    # link would make its mount point on the host before pivot_root. It is refused instead.
    host_dir = tmp_path / "host-dir"
    host_dir.mkdir()
    ws = tmp_path / "ws"
    (ws / "src").mkdir(parents=True)
    (ws / "cfg").write_text("x\n")
    r = sandbox.run(["ln", "-s", str(host_dir), "src/cache"], cwd=ws)  # the planting run
    assert r.status == "ok", r
    # (A caller's nested binds are refused up front; a profile may nest its own.)
    prof = tmp_path / "p.toml"
    prof.write_text(f'extends = "strict"\n[filesystem]\nro_bind_try = ["{ws / "src"}:/src", '
                    f'"{ws / "cfg"}:/src/cache/sub/cfg"]\n')
    r = sandbox.run(["true"], profile=str(prof))
    assert r.status == "setup_error" and "is a link in the way" in (r.error or ""), r
    assert list(host_dir.iterdir()) == [], "a mount point was made on the host"


def test_a_callers_binds_are_not_nested(tmp_path: Path) -> None:
    # A nested bind's mount point is made through the outer bind's host directory, which a
    # run may be changing (a link swapped in while the view is built would put it on the
    # host): refused up front, as is a "same" workdir inside a bind.
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with pytest.raises(SandboxError, match="is inside the bind at /src"):
        sandbox.run(["true"], ro_bind=[f"{tmp_path / 'a'}:/src", f"{tmp_path / 'b'}:/src/b"])
    with pytest.raises(SandboxError, match="holds the bind at /src/b"):
        sandbox.run(["true"], ro_bind=[f"{tmp_path / 'b'}:/src/b", f"{tmp_path / 'a'}:/src"])
    with pytest.raises(SandboxError, match="is inside the bind at /usr"):
        sandbox.run(["true"], ro_bind=f"{tmp_path / 'a'}:/usr/local/x")
    if os.geteuid() != 0:
        return
    top = Path(f"/srv/sbxtest{os.urandom(3).hex()}")  # (binds under /tmp are refused anyway)
    (top / "jobs" / "ws").mkdir(parents=True)
    try:
        with pytest.raises(InputError, match="cannot be made inside a bind"):
            sandbox.run(["true"], profile="ci", cwd=top / "jobs" / "ws", ro_bind=f"{top / 'jobs'}:{top / 'jobs'}")
    finally:
        shutil.rmtree(top)


HOME_PROBE = ("echo \"$HOME\"; python3 -c 'import os, pwd; print(pwd.getpwuid(os.getuid()).pw_dir)'; "
              "git config --global user.name probe && mkdir -p ~/.cache/tool && touch ~/.dotfile && echo wrote")


@pytest.mark.parametrize("profile", ["strict", "ci"])
def test_home_is_the_runs_own_tmp_never_the_callers_directory(profile: str, tmp_path: Path) -> None:
    # Tools write dotfiles and caches to $HOME (git config --global, pip --user, npm, matplotlib):
    # with HOME in a caller's --cwd they landed in the caller's project and outlived the run.
    ws = tmp_path / "proj"
    ws.mkdir()
    r = sandbox.run(["sh", "-c", HOME_PROBE], profile=profile, cwd=ws)
    assert r.stdout.split() == ["/tmp", "/tmp", "wrote"], r
    assert sorted(os.listdir(ws)) == [], "the run's dotfiles landed in the caller's directory"
    fresh = sandbox.run(["sh", "-c", HOME_PROBE], profile=profile)  # a fresh workdir: the same home
    assert fresh.stdout.split() == ["/tmp", "/tmp", "wrote"], fresh


def test_without_a_private_tmp_home_is_the_runs_workdir_not_the_hosts_tmp() -> None:
    r = sandbox.run(["sh", "-c", 'echo "$HOME"; pwd; touch ~/.dotfile && echo wrote'], profile="nested")
    home, cwd, wrote = r.stdout.split()
    assert home == cwd != "/tmp" and wrote == "wrote", r


def test_a_read_write_bind_is_the_runs_own_like_the_workdir(tmp_path: Path, child: str) -> None:
    """A root caller's read-write bind is idmapped onto each run's uid, as the workdir is: the
    run writes there as the directory's owner, so a later run (whatever its per-run uid) can
    change what an earlier one wrote; another host user's file there stays out of the run's hands."""
    if os.geteuid() != 0:
        pytest.skip("per-run uids (and idmapped binds) are a root caller's")
    out = tmp_path / "out"
    out.mkdir()  # root's, 0755: a per-run uid could not even create a file here without the idmap
    (out / "theirs").write_text("theirs\n")
    os.chown(out / "theirs", 12345, 12345)
    (tmp_path / "data.txt").write_text("data\n")
    binds = [f"{out}:/out", f"{tmp_path / 'data.txt'}:/data.txt"]  # a directory, and a file
    first = sandbox.run(["sh", "-c", "id -u; stat -c %u /out; echo one > /out/made; echo more >> /data.txt; "
                                     "echo x >> /out/theirs || echo refused"], bind=binds)
    uid, seen_owner, refused = first.stdout.split()
    assert first.status == "ok" and int(uid) == first.isolation.uid != 0 and int(seen_owner) == int(uid), first
    assert refused == "refused", first.stdout
    assert (out / "made").stat().st_uid == 0  # on the host: the owner's, not a per-run uid another run lacks
    second = sandbox.run(["sh", "-c", "echo two >> /out/made && mkdir /out/d && echo ok"], bind=binds)
    assert second.stdout == "ok\n", second
    assert (out / "made").read_text() == "one\ntwo\n"
    assert (tmp_path / "data.txt").read_text() == "data\nmore\n"
    assert {p.stat().st_uid for p in (out / "made", out / "d", tmp_path / "data.txt")} == {0}  # the owner's
    assert (out / "theirs").read_text() == "theirs\n" and (out / "theirs").stat().st_uid == 12345


def test_a_read_write_bind_is_the_source_that_was_checked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                          child: str) -> None:
    # Cloned for each run, a read-write bind's source is checked by the child against what the
    # supervisor's walk found (a directory swapped in since is refused).
    if os.geteuid() != 0:
        pytest.skip("per-run binds are a root caller's")
    from sandbox import supervisor

    real = supervisor.check_writable_bind
    swapped = {"on": False}

    def another(given: object, what: str) -> os.stat_result:
        st = real(given, what)
        return os.stat_result((st.st_mode, st.st_ino + 1, *tuple(st)[2:])) if swapped["on"] else st

    monkeypatch.setattr(supervisor, "check_writable_bind", another)
    (tmp_path / "out").mkdir()
    assert sandbox.run(["touch", "/out/made"], bind=f"{tmp_path / 'out'}:/out").status == "ok"
    swapped["on"] = True
    r = sandbox.run(["touch", "/out/again"], bind=f"{tmp_path / 'out'}:/out")
    assert r.status == "setup_error" and "no longer the directory that was checked" in (r.error or ""), r
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["made"]


def test_a_read_write_bind_without_idmapped_mounts_is_bound_as_it_is(ramfs: Path, child: str) -> None:
    # Where the filesystem cannot idmap, the bind is what it was before idmapped binds: the run
    # keeps its per-run uid and writes where the source's modes let any uid.
    (ramfs / "in").write_text("in\n")
    r = sandbox.run(["sh", "-c", "cat /r/in; touch /r/made 2>/dev/null || echo refused"], bind=f"{ramfs}:/r")
    assert r.status == "ok" and r.stdout == "in\nrefused\n", r
    os.chmod(ramfs, 0o777)
    r = sandbox.run(["touch", "/r/made"], bind=f"{ramfs}:/r")
    assert r.status == "ok" and (ramfs / "made").stat().st_uid == r.isolation.uid != 0, r
    # A run whose workdir cannot be idmapped runs as its owner: its binds are then as they are,
    # so it writes in a bind of that owner's as that owner (an idmap onto the per-run uid it
    # no longer has would lock it out).
    os.chown(ramfs, 4242, 4242)
    os.chmod(ramfs, 0o755)
    out = ramfs.parent / "out"
    out.mkdir()
    os.chown(out, 4242, 4242)
    r = sandbox.run(["sh", "-c", "id -u; touch /out/made"], cwd=ramfs, bind=f"{out}:/out")
    assert r.status == "ok" and r.stdout == "4242\n", r
    assert (out / "made").stat().st_uid == 4242


def test_a_profiles_read_write_bind_that_holds_another_is_not_cloned_per_run(tmp_path: Path) -> None:
    # A profile may nest its own binds; a per-run mount of the outer one would hide the inner
    # one, so an outer read-write bind stays in the view's shared part, as it was.
    (tmp_path / "outer").mkdir()
    (tmp_path / "outer" / "sub").mkdir()
    (tmp_path / "inner").mkdir()
    (tmp_path / "inner" / "x").write_text("inner\n")
    prof = tmp_path / "p.toml"
    prof.write_text(f'extends = "strict"\n[filesystem]\nbind = ["{tmp_path / "outer"}:/data"]\n'
                    f'ro_bind_try = ["{tmp_path / "inner"}:/data/sub"]\n')
    r = sandbox.run(["cat", "/data/sub/x"], profile=str(prof))
    assert r.status == "ok" and r.stdout == "inner\n", r
    from sandbox.isolation.filesystem import view_binds
    from sandbox.profile import load

    binds = view_binds(load(str(prof)).mounts, per_run=True, workdir="/work")
    assert [b.per_run for b in binds if b.target.startswith("/data")] == [False, False]
    assert not any(b.per_run for b in view_binds(load(str(prof)).mounts, per_run=False, workdir="/work"))


# ---------------------------------------------------------------------------- sandboxrun's own files


def test_no_run_may_write_sandboxruns_own_code_cache_or_state(tmp_path: Path) -> None:
    """What starts later runs (the native stage in the cache, this code, its virtual environment)
    and the sessions' state: a run given write access to any of them, or to a directory above
    or below one, could rewrite the next sandbox's set-up and run outside it."""
    own = dict((what, d) for what, d in hostpaths.own_dirs())
    assert {"cache", "session state directory", "code"} <= set(own), own
    cache = Path(own["cache"])
    cache.mkdir(parents=True, exist_ok=True)
    for cwd in (ROOT, ROOT / "sandbox", ROOT / "sandbox" / "native", cache):
        with pytest.raises(InputError, match="sandboxrun's own"):
            sandbox.run(["true"], cwd=str(cwd))
    with pytest.raises(InputError, match="sandboxrun's own cache"):
        sandbox.run(["true"], bind=f"{cache}:/mnt/c")
    with pytest.raises(InputError, match="sandboxrun's own code"):
        sandbox.run(["true"], bind=f"{ROOT / 'sandbox'}:/mnt/c")
    r = _cli("--cwd", str(ROOT), "--", "true")
    assert r.returncode == 2 and "holds sandboxrun's own" in r.stderr and "Traceback" not in r.stderr, r.stderr
    (tmp_path / "beside").mkdir()
    assert sandbox.run(["true"], cwd=str(tmp_path / "beside")).status == "ok"  # elsewhere: as before


def test_the_usual_cache_and_state_places_stay_protected_whatever_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Only this call's cache and state directory were known: with SANDBOXRUN_STATE_DIR (or HOME,
    # XDG_*) set elsewhere, a run could be given the ones every other invocation uses.
    monkeypatch.setenv("SANDBOXRUN_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    own = hostpaths.own_dirs()
    assert ("session state directory", str(tmp_path / "state")) in own, own
    if os.geteuid() == 0:
        assert ("session state directory", "/run/sandboxrun") in own and ("cache", "/var/cache/sandboxrun") in own
        for d in ("/run/sandboxrun", "/var/cache/sandboxrun"):
            if os.path.isdir(d):
                with pytest.raises(InputError, match="sandboxrun's own|a system directory"):
                    sandbox.run(["true"], bind=f"{d}:/mnt/s")
    # A user's: those below the home their passwd entry names, whatever HOME says now.
    import pwd
    from types import SimpleNamespace

    from sandbox.isolation import cgroups

    monkeypatch.setattr(cgroups, "caller_uid", lambda: 4321)
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: SimpleNamespace(pw_dir=f"/home/u{uid}"))
    assert set(hostpaths._usual_places()) == {
        ("session state directory", "/run/user/4321/sandboxrun"), ("cache", "/home/u4321/.cache/sandboxrun"),
        ("session state directory", "/home/u4321/.local/state/sandboxrun")}
