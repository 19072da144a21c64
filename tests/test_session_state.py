"""Session state on disk that is not as sandboxrun wrote it: a file edited by hand, a directory
in a file's place, a read-only state directory. Each command still answers, and says what is
wrong: none reports an ended session as running, none fails with an internal error."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import sandbox
from sandbox import sessions
from sandbox.errors import SandboxError

ROOT = Path(sandbox.__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def state(private_state_dir: Path, isolated) -> Path:
    return private_state_dir


def cli(*args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([*prefix, sys.executable, "-m", "sandbox", *args], capture_output=True, text=True,
                          timeout=60, env=env)


def ended(name: str | None = None) -> sessions.Session:
    s = sandbox.start(["sh", "-c", "echo hi"], name=name)
    res = s.wait(30)
    assert res is not None and res.status == "ok", res
    return s


def _replace_field(field: str, value: object) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        d = json.loads(path.read_text())
        d[field] = value
        path.write_text(json.dumps(d))
    return damage


def _directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


RESULT_DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "not JSON": (lambda p: p.write_text("garbage"), "Expecting value"),
    "empty": (lambda p: p.write_text(""), "Expecting value"),
    "not a Result": (lambda p: p.write_text('{"x": 1}'), "command is missing"),
    "a field of another type": (_replace_field("exit_code", "x"), "exit_code: expected integer, got 'x'"),
    "an unknown status": (_replace_field("status", "fine"), "'fine' is not one of ok,"),
    "usage unknown": (_replace_field("usage", {"bogus": 1}), "bogus"),
    "a directory": (_directory, "Is a directory"),
}


@pytest.mark.parametrize("damage", RESULT_DAMAGE)
def test_an_unreadable_result_is_lost_and_says_why(damage: str) -> None:
    s = ended()
    make, why = RESULT_DAMAGE[damage]
    make(Path(s.dir, "result.json"))
    for res in (s.wait(5), s.kill(timeout=5), s.poll().result, s.result):
        assert res is not None and res.status == "lost", res
        assert "result.json cannot be read back" in res.error and why in res.error, res.error
    assert [x.info()["status"] for x in sessions.list_sessions()] == ["lost"]
    for args in (("wait", s.id), ("list",)):
        r = cli(*args)
        assert r.returncode in (0, 1) and "internal error" not in r.stderr, (args, r.stderr)
    assert "cannot be read back" in cli("wait", s.id).stderr
    s.clear()
    assert not os.path.lexists(s.dir)


META_DAMAGE: dict[str, Callable[[Path], None]] = {
    "a directory": _directory,
    "a list": lambda p: p.write_text("[1]"),
    "fields of other types": lambda p: p.write_text(json.dumps(
        {"created": "x", "name": 5, "command": 7, "pid": "z", "pty": "yes", "log_token": 3, "ended_at": [1]})),
    "a command of numbers": _replace_field("command", [1, 2]),
}


@pytest.mark.parametrize("damage", META_DAMAGE)
def test_damaged_meta_reads_as_not_written(damage: str) -> None:
    s, other = ended("damaged"), ended("intact")
    META_DAMAGE[damage](Path(s.dir, "meta.json"))
    assert s.command == [] and s.pty is False  # never 7, [1, 2] or "yes": left out, as if unwritten
    assert isinstance(s.name, str) and (s.pid is None or isinstance(s.pid, int))
    assert all(isinstance(v, int | float) and not isinstance(v, bool)
               for k, v in s.meta.items() if k in ("created", "pid", "ended_at"))
    res = s.wait(5)
    assert res is not None and res.status == "ok"
    assert s.poll().stdout == "hi\n" and s.info()["state"] == "exited"
    assert {x.id for x in sessions.list_sessions()} == {s.id, other.id}  # sorted beside a sound one
    r = cli("list")
    assert r.returncode == 0 and "internal error" not in r.stderr and other.id in r.stdout, r.stderr
    s.clear()


@pytest.mark.parametrize("stored", ['"s"', "[1]", "null", '{"stdout": 1e400}', '{"stdout": -100}',
                                    '{"stdout": "x"}', '{"stdout": 1.5}', '{"stdout": true}', "{"])
def test_a_damaged_poll_position_starts_over(stored: str) -> None:
    s = ended()
    Path(s.dir, "poll.offset").write_text(stored)
    p = s.poll()
    assert (p.stdout, p.dropped, p.ended) == ("hi\n", 0, True)  # from the start, no false "dropped"
    assert s.poll().stdout == ""  # and on from there


def test_a_read_only_state_directory_is_named(state: Path) -> None:
    if not shutil.which("unshare"):
        pytest.skip("needs unshare(1) for a private read-only bind")
    s = ended()
    own = () if os.geteuid() == 0 else ("-r",)  # rootless: a user namespace of our own for the mount
    ro = ("unshare", *own, "-m", "--propagation", "private", "sh", "-c",
          f'mount --bind -o ro "{state}" "{state}" && exec "$@"', "sh")
    probe = subprocess.run([*ro, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no private mount here: {probe.stderr.strip()}")
    for args, why in ((("poll", s.id), "cannot keep the poll position"),
                      (("clear", s.id), "cannot remove the session folder"),
                      (("remove", s.id), "cannot remove the session folder")):
        r = cli(*args, prefix=ro)
        assert r.returncode == SandboxError.exit_code and why in r.stderr, (args, r.stderr)
        assert "Read-only file system" in r.stderr and "internal error" not in r.stderr, r.stderr
    assert cli("log", s.id, prefix=ro).stdout == "hi\n"  # what needs no writing still works
    s.clear()


def test_the_monitor_imports_nothing_from_its_session_folder(tmp_path: Path) -> None:
    # `python -m` put its working directory, the session folder, first on the import path: a
    # `secrets.py` there (written by whoever can write the state directory) ran as the caller.
    sdir = tmp_path / "planted"
    sdir.mkdir()
    marker = tmp_path / "imported"
    for name in ("secrets", "json", "socket", "selectors", "signal", "base64"):
        (sdir / f"{name}.py").write_text(f"open({str(marker)!r}, 'a').write({name!r})\n")
    with contextlib.suppress(SandboxError):  # no request.json: the monitor fails, after its imports
        sessions._spawn_monitor(str(sdir))
    assert not marker.exists(), marker.read_text()


@pytest.mark.parametrize("detached", [False, True])
def test_a_session_whose_starter_ended_before_it_was_watched_ends_unless_handed_over(tmp_path: Path,
                                                                                       detached: bool) -> None:
    # The starter gone before the monitor could take its pidfd (-1): the session must end at
    # once, as with a starter that exits later, unless the starter had handed it over.
    from sandbox.monitor import Monitor

    mon = Monitor(str(tmp_path), -1)
    killed: list[bool] = []
    mon._kill = lambda grace=None: killed.append(True)  # type: ignore[method-assign]
    mon.caller_fd = -1
    if detached:
        os.write(mon._detach_w, b"x")
    import threading

    t = threading.Thread(target=mon._end_with_caller, daemon=True)
    t.start()
    t.join(10)  # at once either way: it had waited for ever for a detach that never came
    assert not t.is_alive() and killed == ([] if detached else [True]), (t.is_alive(), killed)


def test_a_runtime_directory_that_is_a_file_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # makedirs(exist_ok=True) takes an existing file for the parent; lstat then raised
    # NotADirectoryError: "internal error" for a user whose XDG_RUNTIME_DIR names a file.
    from sandbox import hostpaths

    afile = tmp_path / "runtime"
    afile.write_text("")
    monkeypatch.delenv("SANDBOXRUN_STATE_DIR", raising=False)
    monkeypatch.setattr(hostpaths, "default_state_dir", lambda: str(afile / "sandboxrun"))
    with pytest.raises(SandboxError, match=r"runtime/sandboxrun: Not a directory \(set SANDBOXRUN_STATE_DIR\)"):
        sessions.state_dir()


@pytest.mark.parametrize("where", ["meta.json", "result.json", "request.json", "stdout.log", "poll.offset"])
def test_a_fifo_in_place_of_a_state_file_hangs_no_command(state: Path, where: str) -> None:
    """read_bytes opened it blocking: `start`, `poll` (the sweep) and `list` hung for ever."""
    s = ended("sound")
    folder = state / "deadbeef"
    folder.mkdir(mode=0o700)
    (folder / "meta.json").write_text(json.dumps({"id": "deadbeef", "state": "running", "created": 1.0}))
    (folder / where).unlink(missing_ok=True)
    os.mkfifo(folder / where, 0o600)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for args in (("start", "--", "true"), ("list",), ("poll", s.id), ("wait", "deadbeef"), ("log", "deadbeef"),
                 ("log", "deadbeef", "--stream", "stdout"), ("poll", "deadbeef")):
        r = subprocess.run([sys.executable, "-m", "sandbox", *args], capture_output=True, text=True,
                           timeout=20, env=env)
        assert "internal error" not in r.stderr, (args, r.stderr)
    if where == "result.json":
        res = sessions.get("deadbeef").result
        assert res is not None and res.status == "lost" and "not a regular file" in res.error, res
    assert sessions.read_json(str(folder / where)) is None
    sessions.get("deadbeef").remove()
    assert not folder.exists()


def test_an_edited_meta_never_gets_a_host_process_killed(state: Path) -> None:
    """meta.json naming any host process (pid, pid_start) with a dead monitor: the next
    `list` SIGKILLed it, taking it for a surviving sandbox init."""
    s = ended("sound")
    bystander = subprocess.Popen(["sleep", "300"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        folder = state / "deadbeef"
        folder.mkdir(mode=0o700)
        (folder / "meta.json").write_text(json.dumps({
            "id": "deadbeef", "name": "forged", "state": "running", "created": 1.0, "command": ["x"],
            "monitor_pid": dead.pid, "monitor_start": 1, "pid": bystander.pid,
            "pid_start": sessions.proc_starttime(bystander.pid)}))
        assert sessions.get("deadbeef").state == "lost"
        assert cli("list").returncode == 0
        assert bystander.poll() is None, "a host process was killed"
        sessions.get("deadbeef").clear()
        s.clear()
    finally:
        bystander.kill()
        bystander.wait()


def test_a_surviving_sandbox_init_of_a_lost_session_is_still_killed(state: Path, tmp_path: Path) -> None:
    """What the check lets through: a process named as a sandbox's init names itself."""
    init = tmp_path / "sandboxrun-init"  # comm is the name it was executed by
    init.symlink_to(shutil.which("sleep") or "/bin/sleep")
    survivor = subprocess.Popen([str(init), "300"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        sessions.state_dir()
        folder = state / "deadbeef"
        folder.mkdir(mode=0o700)
        (folder / "meta.json").write_text(json.dumps({
            "id": "deadbeef", "state": "running", "created": 1.0, "monitor_pid": dead.pid, "monitor_start": 1,
            "pid": survivor.pid, "pid_start": sessions.proc_starttime(survivor.pid)}))
        assert sessions.get("deadbeef").state == "lost"
        assert survivor.wait(5) == -9
    finally:
        survivor.kill()
        survivor.wait()
