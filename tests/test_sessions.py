"""Background sessions: start, find from another process, drive, kill, lose the monitor."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import end_marked, marker

import sandbox
from sandbox import leaks, sessions
from sandbox.errors import InputError, ProfileError, SandboxError

ROOT = Path(sandbox.__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def state(private_state_dir: Path, isolated) -> Path:
    """A private state directory per test (conftest); what a test left running is removed."""
    return private_state_dir


def cli(*args: str, stdin: bytes | None = None, timeout: float = 60) -> subprocess.CompletedProcess[bytes]:
    """A fresh `sandboxrun` process (the caller that exits)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "sandbox", *args], input=stdin, capture_output=True,
                          timeout=timeout, env=env)


def until(cond: Callable[[], object], timeout: float = 10.0, what: str = "condition") -> object:
    """Poll `cond` until it is truthy; a bounded wait, never a timing assertion."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def gone(pid: int | None) -> bool:
    return pid is None or sessions.proc_starttime(pid) is None


def output_until(s: sessions.Session, text: str, timeout: float = 10.0) -> str:
    seen = []

    def check() -> bool:
        p = s.poll()
        seen.append(p.stdout + p.stderr)
        return text in "".join(seen)

    until(check, timeout, f"{text!r} in the output of {s.id}")
    return "".join(seen)


# ---------------------------------------------------------------------------- library


def test_start_write_poll_wait() -> None:
    s = sandbox.start(["sh", "-c", 'echo ready; while read -r l; do echo "got $l"; done; echo bye >&2; exit 3'])
    assert sessions.ID_RE.match(s.id) and s.state == "running" and s.pid and not gone(s.pid)
    assert output_until(s, "ready") == "ready\n"
    assert s.write("one\n") == 4
    assert "got one" in output_until(s, "got one")
    assert s.poll().stdout == ""  # nothing new since the last poll
    s.write("two\n", eof=True)
    res = s.wait(20)
    assert res is not None and (res.status, res.exit_code) == ("nonzero_exit", 3), res
    assert res.stdout == "ready\ngot one\ngot two\n" and res.stderr == "bye\n" and res.session_id == s.id
    assert res.isolation.filesystem == "private" and "pid" in res.isolation.namespaces
    last = s.poll()
    assert last.ended and last.stdout == "got two\n" and last.stderr == "bye\n" and last.result.exit_code == 3
    until(lambda: gone(s.meta["monitor_pid"]), what="the monitor to exit")
    with pytest.raises(InputError, match="ended"):
        s.write("late\n")
    s.clear()
    assert sessions.list_sessions() == []


def test_a_session_with_output_overflow_kill_ends_when_a_stream_passes_the_output_limit() -> None:
    """Its logs keep every byte (up to log_size), so `limits.output` counts what a stream wrote."""
    s = sandbox.start(["sh", "-c", "echo start; yes"], output_overflow="kill", output="64KiB")
    res = s.wait(20)
    assert res is not None and (res.status, res.signal) == ("output_limit", "SIGKILL"), res
    assert "stdout passed the output limit of 64KiB" in res.error, res
    quiet = sandbox.start(["sh", "-c", "head -c 100000 /dev/zero >&2"], output="64KiB")  # drain: logged, no kill
    res = quiet.wait(20)
    assert res is not None and res.status == "ok" and res.stderr_bytes == 100000, res


@pytest.mark.parametrize("name", ["\ud800x", "a\udcff", "x" * 5000])
def test_a_name_that_is_no_text_or_too_long_is_refused_in_one_short_line(name: str) -> None:
    """A lone surrogate (`start --name $'\\xff'`) was taken as a name; a 5000-character one
    was echoed whole in the error."""
    with pytest.raises(InputError, match="1-64 printable characters") as e:
        sandbox.start(["true"], name=name)
    assert len(str(e.value)) < 200, str(e.value)
    assert sessions.list_sessions() == []


def test_concurrent_starts_of_one_name_start_it_once() -> None:
    import threading

    go = threading.Barrier(4)
    started: list[sessions.Session] = []
    refused: list[str] = []

    def one() -> None:
        go.wait()
        try:
            started.append(sandbox.start(["sleep", "30"], name="once"))
        except InputError as e:
            refused.append(str(e))

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert len(started) == 1 and len(refused) == 3, (started, refused)
        assert all("still running" in e for e in refused), refused
    finally:
        for s in started:
            s.kill(grace=0)
            s.wait(20)
            s.clear()


def test_state_files_are_private(state: Path) -> None:
    s = sandbox.start(["sleep", "30"], name="perm")
    assert (state.stat().st_mode & 0o777) == 0o700
    assert (os.stat(s.dir).st_mode & 0o777) == 0o700
    for name in ("meta.json", "request.json", "output.log", "stdout.log", "ctl.sock"):
        st = os.lstat(os.path.join(s.dir, name))
        assert (st.st_mode & 0o777) == 0o600 and st.st_uid == os.geteuid(), name
    assert sessions.get("perm").id == s.id and sessions.get(s.id[:5]).id == s.id


def test_stdin_data_and_file_inputs(tmp_path: Path) -> None:
    s = sandbox.start(["cat"], stdin="from data\n")
    assert s.wait(20).stdout == "from data\n"
    with pytest.raises(InputError):
        s.write("x")
    f = tmp_path / "in.txt"
    f.write_text("from file\n")
    s2 = sandbox.start(["cat"], stdin_file=str(f))
    assert s2.wait(20).stdout == "from file\n"
    s3 = sandbox.start(["wc", "-c"], stdin_file=os.devnull)
    assert s3.wait(20).stdout.strip() == "0"


def test_a_fifo_or_a_device_as_stdin_file_is_refused_by_name(tmp_path: Path) -> None:
    # A FIFO was opened without waiting for a writer: the command read an empty stdin while
    # the writer, still blocked, gave its data to whatever opened the FIFO next. A device
    # (/dev/zero, a disk) was handed to the command whole.
    fifo = tmp_path / "ff"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "a FIFO"), ("/dev/zero", "a device")):
        with pytest.raises(InputError, match=f"stdin_file: {path}: {kind}, not a regular file"):
            sandbox.start(["cat"], stdin_file=str(path))


def test_kill_stops_the_whole_sandbox(contained) -> None:
    mark = marker()
    s = sandbox.start(["bash", "-c", f"setsid bash -c 'trap \"\" TERM; exec -a {mark} sleep 1000' & "
                                   f"trap '' TERM; echo up; exec -a {mark}b sleep 1000"])
    output_until(s, "up")
    until(lambda: len(leaks.marked(mark)) == 2, what="both sleepers")
    monitor = s.meta["monitor_pid"]
    res = s.kill(grace=0.3)
    assert res is not None and res.status == "signaled" and res.error.startswith("killed on request"), res
    assert json.loads(Path(s.dir, "result.json").read_text())["killed"] is True
    assert leaks.marked(mark) == [] and gone(s.pid)
    until(lambda: gone(monitor), what="the monitor to exit")
    assert s.kill() is not None  # killing an ended session is a no-op answer



def test_a_second_kill_with_a_shorter_grace_ends_the_sandbox_at_its_own_time(contained) -> None:
    """The monitor waited out a first kill's grace under its lock: `kill --grace 0` behind a
    `kill --grace 60` waited 30 s for an answer and the sandbox ran on."""
    import threading

    s = sandbox.start(["sh", "-c", "trap '' TERM; echo up; while :; do sleep 1; done"])
    output_until(s, "up")
    first = threading.Thread(target=lambda: s.kill(grace=60), daemon=True)
    first.start()
    time.sleep(0.5)
    t = time.monotonic()
    res = s.kill(grace=0)
    assert res is not None and res.status == "signaled" and time.monotonic() - t < 10, res
    first.join(20)
    assert not first.is_alive()


def test_a_write_too_large_for_a_session_is_refused_before_it_is_sent(state: Path) -> None:
    from sandbox.sessions import MAX_WRITE

    s = sandbox.start(["cat"])
    try:
        t = time.monotonic()
        with pytest.raises(InputError, match="at most 32 MiB per write"):
            s.write(b"x" * (MAX_WRITE + 1))
        assert time.monotonic() - t < 5
        assert s.write(b"ok\n", eof=True) == 3
        assert s.wait(20).stdout == "ok\n"
    finally:
        s.remove(grace=0)


def test_a_session_folder_made_again_by_a_poll_during_removal_is_removed_all_the_same(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A poll of another process re-created poll.offset (O_CREAT) in a folder being removed:
    `remove` said done and left a ghost session (no monitor, listed as starting, then lost)."""
    from sandbox import hostpaths

    folder = tmp_path / "0000abcd"
    folder.mkdir()
    (folder / "meta.json").write_text("{}")
    real = hostpaths.remove_tree
    calls: list[str] = []

    def racing(path: str) -> None:
        real(path)
        calls.append(path)
        if len(calls) == 1:  # the other process's poll, just before the last rmdir
            os.mkdir(path)
            (Path(path) / "poll.offset").write_text("{}")

    monkeypatch.setattr(hostpaths, "remove_tree", racing)
    sessions._rmtree(str(folder))
    assert not folder.exists() and len(calls) == 2
    gone = sessions.Session("0000abcd", str(tmp_path))
    for ask in (gone.poll, gone.log, lambda: gone.resize(80, 24), lambda: gone.send_keys("Enter"), gone.wait):
        with pytest.raises(InputError, match="no longer exists|removed"):  # not an empty log, nor "no terminal"
            ask()
    assert repr(sessions.Session("0000abcd", str(tmp_path))).endswith(" removed>")  # a repr never raises


def test_kill_of_a_nested_owner_session_without_a_cgroup_ends_its_daemons(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # No pid namespace, no cgroup, and the directory owner's uid: the monitor kills the
    # init's descendants (its subreaper's) before the init, or they would be orphaned away.
    if os.geteuid() != 0:
        pytest.skip("runs as a directory's owner for root callers")
    monkeypatch.setenv("SANDBOXRUN_CGROUP", "none")
    work = tmp_path / "owned"
    work.mkdir()
    tmp_path.chmod(0o755)
    os.chown(work, 4247, 4247)
    mark = marker()
    s = sandbox.start(["bash", "-c", f"(setsid bash -c 'trap \"\" TERM; exec -a {mark} sleep 1000' &); "
                                   f"trap '' TERM; echo up; exec -a {mark}b sleep 1000"], profile="nested", cwd=work)
    try:
        output_until(s, "up")
        until(lambda: len(leaks.marked(mark)) == 2, what="both sleepers")
        res = s.kill(grace=0.3)
        assert res is not None and res.status == "signaled" and res.isolation.cgroup == "none", res
        assert leaks.marked(mark) == []
    finally:
        end_marked(mark)
        s.clear()

def test_sigterm_to_the_monitor_ends_the_run_in_order(contained) -> None:
    mark = marker()
    s = sandbox.start(["bash", "-c", f"echo up; exec -a {mark} sleep 1000"])
    output_until(s, "up")
    os.kill(s.meta["monitor_pid"], signal.SIGTERM)
    res = s.wait(20)
    assert res is not None and res.status == "signaled" and res.error.startswith("killed on request"), res
    assert leaks.marked(mark) == []


def test_killed_monitor_takes_the_sandbox_and_reads_lost(contained) -> None:
    mark = marker()
    s = sandbox.start(["bash", "-c", f"echo logged; exec -a {mark} sleep 1000"], name="victim")
    output_until(s, "logged")
    until(lambda: leaks.marked(mark), what="the sandboxed sleeper")
    monitor = s.meta["monitor_pid"]
    os.kill(monitor, signal.SIGKILL)
    until(lambda: not leaks.marked(mark), timeout=5, what="the sandbox to die with its monitor")
    until(lambda: gone(monitor) and gone(s.pid), timeout=5, what="monitor and init to be gone")
    assert s.state == "lost"
    res = s.wait(5)
    assert res is not None and res.status == "lost" and "logged" in res.stdout and "monitor" in res.error
    assert res.isolation is None  # unknown: its monitor died before it could say

    def swept() -> bool:  # a listing that meets a lost session sweeps the dead monitor's cgroup
        sessions.list_sessions()  # (once the monitor is reaped: a zombie still counts as its owner)
        return not list(Path("/sys/fs/cgroup").glob(f"*/sandboxrun-{monitor}-*"))

    until(swept, timeout=10, what="the dead monitor's cgroup to be swept")
    with pytest.raises(InputError, match="lost"):
        s.write("x")
    # The CLI: no exit code to give, for `wait` and `kill` alike (`kill` said 0)
    assert [cli(verb, s.id).returncode for verb in ("wait", "kill")] == [1, 1]
    s.clear()


def test_pty_program_driven_by_keys() -> None:
    s = sandbox.start(["sh"], pty=True, cols=100, rows=30)
    assert s.pty
    # Each check looks for text only the command's output has, never the echo of what was typed.
    s.send_keys("stty size; test -t 0 && echo tty-$((6*7))", "Enter")
    out = output_until(s, "tty-42\r\n")
    assert "30 100\r\n" in out
    s.resize(132, 43)
    s.send_keys("stty size", "Enter")
    output_until(s, "43 132\r\n")
    s.send_keys("read -r line; echo \"got:$line\"", "Enter")
    s.write("hello\r")
    output_until(s, "got:hello\r\n")
    # ^C must reach the foreground job, not the shell: it is sent only once the job has said it
    # runs, since the shell makes a job the terminal's foreground before exec (a ^C typed ahead
    # of that goes to the shell, and the job would then sleep on).
    s.send_keys("sh -c 'echo fg-$((2+3)); exec sleep 100'", "Enter")
    output_until(s, "fg-5\r\n")
    s.send_keys("C-c")
    s.send_keys("echo after-$((1+1))", "Enter")
    output_until(s, "after-2\r\n")
    s.send_keys("C-d")
    res = s.wait(20)
    assert res is not None and res.status == "ok", res
    assert "got:hello" in res.stdout and res.stderr == ""
    page = s.log()
    assert any(line.startswith("got:hello") for line in page.lines)


@pytest.mark.parametrize("child", ["native", "python"])
def test_pty_has_a_name_in_the_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, child: str) -> None:
    """The terminal is the host's devpts, which the run's own devpts instance does not show:
    it is bound at /dev/console, so ttyname() (`tty`, tmux, GPG_TTY=$(tty)) finds it there."""
    if child == "python":
        monkeypatch.setenv("SANDBOXRUN_NATIVE", "0")
    code = ("import os; print('name:' + os.ttyname(0), os.stat(os.ttyname(0)).st_rdev == os.fstat(0).st_rdev); "
            "open(os.ttyname(0), 'w').write('by-name\\n')")  # its own: it may open it by that name
    s = sandbox.start(["sh", "-c", f"tty; python3 -c \"{code}\"; tty </dev/null"], pty=True)
    res = s.wait(20)
    assert res is not None and res.status == "nonzero_exit", res  # the last `tty` has no terminal
    assert "/dev/console\r\n" in res.stdout and "name:/dev/console True\r\n" in res.stdout, res.stdout
    assert "by-name\r\n" in res.stdout and "not a tty" in res.stdout
    # A view built in full (a caller's directory at its own path: no template) names it too.
    work = tmp_path / "w"
    work.mkdir()
    os.chown(work, 65534, 65534)
    full = sandbox.start(["sh", "-c", "tty; pwd"], pty=True, profile="ci", cwd=str(work)).wait(20)
    assert full is not None and full.stdout == f"/dev/console\r\n{work}\r\n", full
    # Without a terminal there is none to name, and no /dev/console.
    plain = sandbox.run(["sh", "-c", "tty; ls /dev"])
    assert plain.stdout.splitlines()[0] == "not a tty" and "console" not in plain.stdout.split(), plain.stdout


def test_submit_and_paste() -> None:
    s = sandbox.start(["cat"])
    s.paste("pasted")
    s.submit()
    s.write(b"", eof=True)
    assert s.wait(20).stdout == "pasted\n"
    # Bracketed only once the program asks for it, as a terminal emulator does.
    t = sandbox.start(["sh", "-c", "stty -echo; read -r a; printf '\\033[?2004h'; cat -v"], pty=True)
    t.paste("plain")
    t.submit()
    output_until(t, "\x1b[?2004h")
    t.paste("xy")
    t.submit()
    assert "^[[200~xy^[[201~" in output_until(t, "201~")
    # Its own end mark in the text ended the paste early: what followed came as typed keys.
    t.paste("a\x1b[201~b\x1b[20\x1b[201~1~c")
    t.submit()
    assert "^[[200~abc^[[201~" in output_until(t, "abc^[[201~"), t.log().lines
    with pytest.raises(InputError, match="an empty key"):  # as write and paste refuse empty text
        t.send_keys("Enter", "")
    with pytest.raises(InputError, match="no terminal"):
        sandbox.start(["cat"]).send_keys("Enter")


def test_eof_on_a_terminal_after_text_on_the_line_ends_the_input() -> None:
    """One ^D after "abc" only hands "abc" over (the line discipline's VEOF): cat ran on."""
    s = sandbox.start(["cat"], pty=True)
    s.write("abc", eof=True)
    res = s.wait(20)
    assert res is not None and res.status == "ok" and res.stdout.endswith("abcabc"), res


@pytest.mark.parametrize("size", [1_000_000, 8 << 20])  # 8 MiB: a large one, that waits its turn to be read
def test_a_write_queued_behind_a_stuck_one_fails_whole_and_never_lands_later(size: int) -> None:
    """It waited for the lock, then its own 10 s: its client gave up at 15 s ("did not answer"),
    yet its data went in later, so a retry would have sent it twice."""
    import threading

    s = sandbox.start(["sh", "-c", "sleep 11; wc -c"])  # reads nothing for 11 s
    outcomes: list[str] = []

    def write() -> None:
        try:
            outcomes.append(f"wrote {s.write(b'x' * size)}")
        except SandboxError as e:
            outcomes.append(str(e))

    threads = [threading.Thread(target=write) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.2)
    for t in threads:
        t.join(30)
    s.write(b"", eof=True)
    res = s.wait(30)
    assert res is not None and res.status == "ok", res
    partial = [o for o in outcomes if f"of {size} bytes written" in o and "(0 of" not in o]
    queued = [o for o in outcomes if "not reading its input" in o and f"(0 of {size} bytes written)" in o]
    assert len(partial) == 1 and len(queued) == 1, outcomes
    landed = int(partial[0].split("(")[1].split(" of")[0])
    assert int(res.stdout) == landed, (res.stdout, outcomes)  # the queued write put nothing in
    s.remove()


def test_log_paging() -> None:
    s = sandbox.start(["seq", "1", "500"])
    s.wait(20)
    page = s.log()
    assert (page.offset, page.total_lines, len(page.lines)) == (300, 500, 200)
    assert page.lines[0] == "301" and page.lines[-1] == "500" and "--offset 100 --limit 200" in page.hint()
    page = s.log(offset=0, limit=10)
    assert page.lines == [str(i) for i in range(1, 11)] and "--offset 10 --limit 10" in page.hint()
    assert s.log(limit=3).lines == ["498", "499", "500"]
    assert s.log(offset=499).lines == ["500"] and s.log(offset=900).lines == []
    with pytest.raises(InputError):
        s.log(offset=-1)


def test_log_limit_drops_oldest_bytes_with_a_marker(tmp_path: Path) -> None:
    prof = tmp_path / "small.toml"
    # output (the Result's cap) far below what is printed: the log must still get every byte.
    prof.write_text('extends = "strict"\nname = "small"\n[limits]\nlog_size = "4KiB"\noutput = "1KiB"\n')
    s = sandbox.start(["sh", "-c", "i=0; while [ $i -lt 2000 ]; do i=$((i+1)); echo line$i; done"],
                      profile=str(prof))
    res = s.wait(30)
    assert res is not None and res.status == "ok"
    for name in ("stdout.log", "output.log"):
        data = Path(s.dir, name).read_bytes()
        assert len(data) <= 4096, name
        assert data.startswith(b"[sandboxrun:") and b"earlier bytes dropped]\n" in data
        assert data.endswith(b"line2000\n") and b"\nline1\n" not in data
    dropped, kept = sessions.read_log(os.path.join(s.dir, "stdout.log"), s.meta["log_token"])
    total = sum(len(f"line{i}\n") for i in range(1, 2001))
    assert dropped + len(kept) == total == res.stdout_bytes and res.stdout_truncated
    assert len(res.stdout) == 1024 and res.stdout.endswith("line2000\n")
    assert kept.startswith(b"line")  # cut at a line start
    page = s.log(limit=5000)
    assert page.lines[0] == f"[sandboxrun: {dropped} earlier bytes dropped (limits.log_size)]"
    assert page.dropped_bytes == dropped and page.lines[-1] == "line2000"
    p = s.poll()
    assert p.dropped == dropped and p.stdout.endswith("line2000\n")


def test_capped_log_invariants(tmp_path: Path) -> None:
    log = sessions.CappedLog(str(tmp_path / "x.log"), 2048, "tok")
    chunks = [f"{i:05d} {'x' * (i % 97)}\n".encode() for i in range(800)] + [b"y" * 5000, b"tail\n"]
    for c in chunks:
        log.append(c)
        assert os.path.getsize(log.path) <= 2048
    dropped, kept = sessions.read_log(log.path, "tok")
    everything = b"".join(chunks)
    assert dropped + len(kept) == len(everything) == log.total and everything.endswith(kept)
    assert sessions.read_log(log.path, "other-token")[0] == 0  # a marker needs the session's token
    log.close()


def test_yield_after_becomes_a_session_or_returns_the_result(state: Path) -> None:
    res = sessions.run_or_yield(["sh", "-c", "echo first; sleep 30"], yield_after=0.5)
    assert res.status == "running" and res.session_id and res.pid and res.stdout == "first\n", res
    s = sessions.get(res.session_id)
    assert s.state == "running" and s.poll().stdout == ""  # the tail shown counts as read
    s.remove(grace=0)
    quick = sessions.run_or_yield(["sh", "-c", "echo quick; exit 4"], yield_after=20)
    assert (quick.status, quick.exit_code, quick.stdout, quick.session_id) == ("nonzero_exit", 4, "quick\n", None)
    assert list(state.iterdir()) == []  # a run that ended is not kept as a session
    blocked = sessions.run_or_yield(["rm", "-rf", "/"], yield_after=1)
    assert blocked.status == "blocked" and blocked.blocked
    with pytest.raises(InputError):
        sessions.run_or_yield(["true"], yield_after=-1)


@pytest.mark.parametrize("how", ["run --yield-ms", "start", "a yielded run that handed over"])
def test_a_caller_sigkilled_before_it_holds_the_id_takes_the_session_with_it(state: Path, how: str) -> None:
    """`run --yield-ms` SIGKILLed while it waited left its session running, under an id no one
    was told (as did `start` killed before it printed the id): until the session's timeout."""
    import signal

    marker = f"orphan-{os.getpid()}-{how.split()[0]}"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    argv = {"run --yield-ms": ["run", "--yield-ms", "60000"], "start": ["start"],
            "a yielded run that handed over": ["run", "--yield-ms", "300"]}[how]
    slow_start = how == "start"
    if slow_start:  # held between the session's start and the printing of its id
        code = ("import os, signal, sandbox.sessions as s; real = s.Session._detach\n"
                "def held(self): os.kill(os.getpid(), signal.SIGSTOP); real(self)\n"
                "s.Session._detach = held\nfrom sandbox.cli import main; raise SystemExit(main())")
        cmd = [sys.executable, "-c", code, *argv]
    else:
        cmd = [sys.executable, "-m", "sandbox", *argv]
    p = subprocess.Popen([*cmd, "--", "sh", "-c", f"sleep 300; : {marker}"], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    try:
        def running() -> list[sessions.Session]:
            return [x for x in sessions.list_sessions() if marker in " ".join(x.meta.get("command", []))
                    and x.state == "running"]
        (sess,) = until(running, 30, "the session")  # type: ignore[misc]
        if how == "a yielded run that handed over":
            p.wait(timeout=30)  # it printed the id: from now on the session is the caller's to end
        else:
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
        p.communicate()
    if how == "a yielded run that handed over":
        time.sleep(1)
        assert sess.state == "running" and not gone(sess.meta.get("pid")), sess.info()
        sess.remove(grace=0)
    else:
        until(lambda: gone(sess.meta.get("pid")) and sess.state in ("exited", "lost"), 15, "the orphaned session's end")
        sess.remove(grace=0)


def test_yielded_result_does_not_report_the_no_isolation_defaults(state: Path) -> None:
    # Not known while it runs: null, never Isolation()'s "host network, seccomp off".
    res = sessions.run_or_yield(["sleep", "30"], yield_after=0.2)
    assert res.status == "running" and res.isolation is None, res
    d = res.to_dict()
    assert d["isolation"] is None
    validator = pytest.importorskip("jsonschema").Draft202012Validator(
        json.loads((ROOT / "sandbox" / "result.schema.json").read_text()))
    validator.validate(d)
    assert sandbox.Result.from_dict(d).isolation is None
    final = sessions.get(res.session_id).remove(grace=0)
    assert final is not None and final.isolation is not None and final.isolation.network == "none", final
    validator.validate(final.to_dict())


def test_bad_input_is_a_clear_error() -> None:
    with pytest.raises(sessions.SessionBlocked, match="blocked"):
        sandbox.start(["rm", "-rf", "/"])
    with pytest.raises(ProfileError, match="timeout"):
        sandbox.start(["true"], timeout=0)  # strict does not allow running without a wall timeout
    with pytest.raises(InputError, match="no session"):
        sessions.get("nosuchsession")
    with pytest.raises(InputError, match="cols"):
        sandbox.start(["true"], pty=True, cols=0)
    with pytest.raises(InputError, match="name"):
        sandbox.start(["true"], name="a/b")
    s = sandbox.start(["sleep", "30"], name="busy")
    with pytest.raises(InputError, match="still running"):
        sandbox.start(["true"], name="busy")
    with pytest.raises(InputError, match="still running"):
        s.clear()
    with pytest.raises(InputError, match="no terminal"):
        s.resize(10, 10)
    with pytest.raises(InputError, match="grace: expected 0 to 60 seconds"):  # as a profile's kill_grace
        s.kill(grace=61)
    assert s.state == "running"  # nothing was sent


def test_ttl_sweeps_finished_sessions(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw, want in (("1", 60), ("99999", 10800), ("", 1800)):
        monkeypatch.setenv("SANDBOXRUN_SESSION_TTL", raw)
        assert sessions.session_ttl() == want
    monkeypatch.setenv("SANDBOXRUN_SESSION_TTL", "60")
    old, fresh = sandbox.start(["true"]), sandbox.start(["true"])
    old.wait(20), fresh.wait(20)
    meta = old.meta
    meta["ended_at"] -= 120
    sessions.write_json(os.path.join(old.dir, "meta.json"), meta)
    assert [s.id for s in sessions.list_sessions()] == [fresh.id]
    assert not os.path.exists(old.dir)


def test_state_dir_must_be_ours(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "real"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    monkeypatch.setenv("SANDBOXRUN_STATE_DIR", str(tmp_path / "link"))
    with pytest.raises(SandboxError, match="not a directory"):
        sessions.state_dir()


def test_key_names() -> None:
    kb = sessions.key_bytes
    assert [kb(k) for k in ("Enter", "enter", "C-c", "C-d", "C-[", "Up", "F5", "M-x", "Tab")] == [
        b"\r", b"\r", b"\x03", b"\x04", b"\x1b", b"\x1b[A", b"\x1b[15~", b"\x1bx", b"\t"]
    assert kb("hello world") == b"hello world" and kb("Enter", literal=True) == b"Enter"
    assert kb("M-C-c") == b"\x1b\x03" and kb("M-Up") == b"\x1b\x1b[A" and kb("ls -l") == b"ls -l"
    for chord in ("C-nonsense", "C-enter", "C-1", "M-enterr", "M-hello", "C-", "M-"):  # were typed as text
        with pytest.raises(InputError, match=f"unknown key '{chord}'"):
            kb(chord)
        assert kb(chord, literal=True) == chord.encode()


# ---------------------------------------------------------------------------- CLI, fresh processes


def test_cli_server_found_again_from_fresh_processes(contained) -> None:
    mark = marker()
    r = cli("start", "--name", "web", "--timeout", "2m", "--", "bash", "-c",
            f"exec -a {mark} python3 -u -m http.server 8123")
    assert r.returncode == 0, r.stderr
    sid = r.stdout.decode().strip()
    assert sessions.ID_RE.match(sid) and b"started" in r.stderr
    rows = json.loads(cli("list", "--json").stdout)
    assert [(x["id"], x["name"], x["state"]) for x in rows] == [(sid, "web", "running")]
    until(lambda: b"Serving HTTP" in cli("log", "web").stdout, what="the server's banner")
    assert b"RESULT" in cli("list").stdout
    page = json.loads(cli("log", sid, "--json", "--offset", "0", "--limit", "1").stdout)
    assert page["lines"][0].startswith("Serving HTTP on") and page["offset"] == 0
    r = cli("poll", "web", "--json")
    assert json.loads(r.stdout)["ended"] is False
    assert json.loads(cli("write", "web", "x", "--json").stdout) == {"id": sid, "ok": True, "written": 1}  # not "web"
    r = cli("kill", "web")
    assert r.returncode == 0 and b"ended: signaled" in r.stderr, r.stderr
    assert leaks.marked(mark) == []
    assert json.loads(cli("poll", "web", "--json").stdout)["ended"] is True
    r = cli("wait", "web", "--json")
    assert r.returncode == 128 + 15 and json.loads(r.stdout)["signal"] == "SIGTERM"
    assert cli("clear", "web").returncode == 0
    assert json.loads(cli("list", "--json").stdout) == []


def test_cli_stdin_keys_and_wait() -> None:
    sid = cli("start", "--", "sh", "-c", "read -r a; echo \"a=$a\"; read -r m; echo \"m=$m\"; read -r b; "
              "echo \"b=$b\"").stdout.decode().strip()
    assert cli("write", sid, "first", "--newline").returncode == 0
    assert cli("write", sid, "--newline", "between").returncode == 0  # an option between ID and DATA
    assert cli("write", sid, "--stdin", "--eof", stdin=b"second\n").returncode == 0
    r = cli("wait", sid, "--timeout", "20")
    assert r.returncode == 0 and b"ended: ok" in r.stderr
    assert cli("log", sid).stdout == b"a=first\nm=between\nb=second\n"
    r = cli("send-keys", sid, "Enter")
    assert r.returncode == 2 and r.stderr.count(b"\n") == 1 and b"no terminal" in r.stderr

    pty = cli("start", "--pty", "--name", "term", "--", "sh").stdout.decode().strip()
    assert cli("send-keys", "term", "echo $((6*7))", "Enter").returncode == 0
    until(lambda: b"42" in cli("log", "term", "--stream", "stdout").stdout, what="42 on the terminal")
    r = cli("wait", "term", "--timeout", "0.2")
    assert r.returncode == 124 and b"still running" in r.stderr
    cli("paste", "term", "exit 5")
    cli("submit", "term")
    r = cli("wait", pty, "--timeout", "20", "--json")
    assert r.returncode == 5 and json.loads(r.stdout)["exit_code"] == 5
    assert cli("remove", "term").returncode == 0


def test_cli_run_yield_and_errors() -> None:
    r = cli("run", "--yield-ms", "300", "--", "sh", "-c", "echo early; sleep 30")
    d = json.loads(r.stdout)
    assert r.returncode == 0 and d["status"] == "running" and d["stdout"] == "early\n"
    assert d["isolation"] is None  # not known until it ends; never the "host network, no seccomp" defaults
    r = cli("remove", d["session_id"], "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["result"]["status"] == "signaled"
    r = cli("run", "--yield-ms", "20000", "--", "echo", "fast")
    assert r.returncode == 0 and json.loads(r.stdout)["stdout"] == "fast\n"
    # several words after --shell are one script, as without --yield-ms (each was quoted: "echo a: not found")
    r = cli("run", "--shell", "--yield-ms", "20000", "--", "echo a", "$HOME")
    assert r.returncode == 0 and json.loads(r.stdout)["stdout"] == "a /tmp\n", r
    r = cli("start", "--", "rm", "-rf", "/")
    assert r.returncode == 125 and b"blocked" in r.stderr
    r = cli("start", "--", "no-such-command-xyz")  # the starter hears of it before it returns
    assert r.returncode == 127 and b"did not start" in r.stderr and b"command not found" in r.stderr, r.stderr
    assert r.stdout == b"", "an id on stdout says the session started: ID=$(sandboxrun start ...) must get none"
    for args in (["poll", "zzz"], ["kill", "zzz"], ["start", "--timeout", "0", "--", "true"], ["log", "x", "--limit", "q"]):
        r = cli(*args)
        assert r.returncode == 2 and b"Traceback" not in r.stderr, (args, r)
        assert r.stderr.strip().splitlines()[-1].startswith(b"sandboxrun: error: "), (args, r)


def test_state_dir_variable_is_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for value, needle in ((str(tmp_path / "no" / "such"), "No such file"), ("relative", "absolute path")):
        monkeypatch.setenv("SANDBOXRUN_STATE_DIR", value)
        with pytest.raises(SandboxError, match=needle):
            sessions.state_dir()
    assert not (tmp_path / "no").exists()


def test_a_process_without_a_recorded_start_time_is_never_taken_for_alive() -> None:
    # A number /proc does not show now may show an unrelated process later: judged alive
    # by a missing start time, a dead monitor read "running" for ever, and its pid was killed.
    assert not sessions._alive(os.getpid(), None)
    assert sessions._alive(os.getpid(), sessions.proc_starttime(os.getpid()))


def _start_in_pid_namespace(*, own_proc: bool) -> tuple[subprocess.Popen[str], str]:
    """`sandboxrun start -- sleep 60` from a pid namespace of its own (with a /proc of its own
    or the host's), which stays until the process returned is killed; and the session id."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    ns = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", *(["--mount-proc"] if own_proc else []),
                           "sh", "-c", '"$@" start -- sleep 60 && exec sleep 60', "sh", sys.executable, "-m",
                           "sandbox"], env=env, stdout=subprocess.PIPE, text=True)
    assert ns.stdout is not None
    return ns, ns.stdout.readline().strip()


def test_a_session_started_in_a_pid_namespace_records_pids_as_proc_numbers_them() -> None:
    # Started where /proc belongs to an ancestor pid namespace, it recorded its own numbers:
    # read on the host they named other processes (a kernel thread's start time; a host
    # `list` SIGKILLed an unrelated process that happened to have the sandbox's number).
    if os.geteuid() != 0:
        pytest.skip("root: a pid namespace of the starter's own")
    ns, sid = _start_in_pid_namespace(own_proc=False)
    try:
        try:
            until(lambda: sessions.Session(sid).meta.get("pid"), what="the sandbox's pid")
        except AssertionError:
            raise AssertionError((sid, sessions.Session(sid).meta, sessions.Session(sid).state)) from None
        m = sessions.Session(sid).meta
        with open(f"/proc/{m['pid']}/comm") as f:
            assert f.read().strip() == "sandboxrun-init", m
        assert sessions.proc_starttime(m["monitor_pid"]) == m["monitor_start"], m
        assert sessions.Session(sid).state == "running"
    finally:
        ns.kill()
        ns.wait()  # its SIGKILLed monitor left its run's cgroup: a dead namespace's, swept
        from sandbox.isolation import cgroups

        ours = f"-n{cgroups.own_pid_namespace():x}-"
        deadline = time.monotonic() + 10
        while any(ours not in c for c in leaks.runner_cgroups()) and time.monotonic() < deadline:
            cgroups.detect().sweep_stale()
            time.sleep(0.05)


def test_a_reader_with_its_own_proc_leaves_a_live_session_alone(contained) -> None:
    # A reader in a pid namespace with a /proc of its own sees other numbers: it marked a
    # live session lost for good, and `kill` then ended nothing.
    if os.geteuid() != 0:
        pytest.skip("root: a pid namespace of the reader's own")
    sid = cli("start", "--", "sleep", "60").stdout.decode().strip()
    until(lambda: sessions.Session(sid).state == "running", what="the session to run")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run(["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", sys.executable, "-m", "sandbox",
                        "list", "--json"], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert sessions.Session(sid).state == "running"
    pid = sessions.Session(sid).pid
    assert cli("kill", sid).returncode == 0
    until(lambda: gone(pid), what="the killed sandbox to go")


def test_a_session_whose_pid_namespace_died_reads_lost_where_its_pids_mean_nothing(contained) -> None:
    # Started with a /proc of its own (unshare --pid --mount-proc), its pids cannot be judged
    # from the host; once no process is in its monitor's namespace, all of it is gone: it
    # stayed "running" for good, and wait, kill, clear and remove could not end it.
    from sandbox.isolation import cgroups

    if os.geteuid() != 0 or cgroups.live_pid_namespaces() is None:
        pytest.skip("root in the initial pid namespace, able to see every process's")
    ns, sid = _start_in_pid_namespace(own_proc=True)
    try:
        until(lambda: sessions.Session(sid).meta.get("pid"), what="the sandbox's pid")
        assert sessions.Session(sid).state == "running"
    finally:
        ns.kill()
        ns.wait()
    until(lambda: sessions.Session(sid).state == "lost", what="the session to read lost")
    sessions.Session(sid).remove(grace=0)
    deadline = time.monotonic() + 10
    while any(f"-n{cgroups.own_pid_namespace():x}-" not in c for c in leaks.runner_cgroups()):
        assert time.monotonic() < deadline, leaks.runner_cgroups()
        cgroups.detect().sweep_stale()
        time.sleep(0.05)


def _cutting_monitor(folder: Path, states: list[str], end_first: bool) -> None:
    """A stand-in monitor on `folder`/ctl.sock: it reads one request and closes with it unread
    (RST), as a real one does when its command has just exited; `end_first`: the session
    is recorded as exited before the cut."""
    import socket
    import struct
    import threading

    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(folder / "ctl.sock"))
    srv.listen(4)

    def serve() -> None:
        with srv:
            conn, _ = srv.accept()
            conn.recv(10)  # part of the request: the rest stays unread, so close() sends a reset
            if end_first:
                states[0] = "exited"
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    threading.Thread(target=serve, daemon=True).start()


@pytest.mark.parametrize("op", ["eof", "write"])
def test_a_request_cut_because_the_session_ended_is_answered_not_an_internal_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, op: str) -> None:
    """`write --stdin --eof` as the command exits on the data written: the monitor exits
    with the eof request unread, and the caller saw ECONNRESET as an internal error."""
    states = ["running"]
    monkeypatch.setattr(sessions.Session, "state", property(lambda self: states[0]))
    (tmp_path / "0123abcd").mkdir()
    _cutting_monitor(tmp_path / "0123abcd", states, end_first=True)
    s = sessions.Session("0123abcd", root=str(tmp_path))
    if op == "eof":  # its stdin went with it: done, not an error
        assert s.write(b"", eof=True) == 0
    else:
        with pytest.raises(InputError, match="has ended"):
            s.write(b"x" * 100)


def test_eof_to_an_ended_session_is_done_however_late(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As when the request is cut (above): an ended command's stdin is closed already. Data
    for it is refused: it would be lost."""
    monkeypatch.setattr(sessions.Session, "state", property(lambda self: "exited"))
    (tmp_path / "0123abcd").mkdir()
    s = sessions.Session("0123abcd", root=str(tmp_path))
    assert s.write(b"", eof=True) == 0
    with pytest.raises(InputError, match="has ended"):
        s.write(b"x", eof=True)


def test_a_request_cut_while_the_session_still_runs_is_a_named_error(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    states = ["running"]
    monkeypatch.setattr(sessions.Session, "state", property(lambda self: states[0]))
    monkeypatch.setattr(sessions, "ANSWER_GRACE_S", 0.1)
    (tmp_path / "0123abcd").mkdir()
    _cutting_monitor(tmp_path / "0123abcd", states, end_first=False)
    with pytest.raises(SandboxError, match="closed the connection without an answer") as e:
        sessions.Session("0123abcd", root=str(tmp_path)).write(b"x" * 100)
    assert not isinstance(e.value, InputError)


def test_ctrl_c_on_wait_says_interrupted_and_the_session_runs_on() -> None:
    """`sandboxrun wait` only waits: it said "sandbox torn down" while the session ran on."""
    sid = cli("start", "--", "sleep", "30").stdout.decode().strip()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-m", "sandbox", "wait", sid], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        until(lambda: sessions.get(sid).state == "running", what="the session running")
        time.sleep(0.5)  # into its wait; a signal before that is answered the same way
        p.send_signal(signal.SIGINT)
        _out, err = p.communicate(timeout=20)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 130 and err == b"sandboxrun: interrupted\n", (p.returncode, err)
    assert sessions.get(sid).state == "running"


def test_cli_terminal_size_without_a_terminal_is_refused() -> None:
    r = cli("start", "--cols", "120", "--", "true")
    assert r.returncode == 2 and b"add --pty" in r.stderr, r.stderr
    r = cli("start", "--pty", "--cols", "0", "--", "true")
    assert r.returncode == 2 and b"cols" in r.stderr, r.stderr  # 0 is refused, not taken for the default


def test_a_yield_takes_input_a_session_can_take_and_names_what_it_cannot(tmp_path: Path) -> None:
    """stdin_from (an fd of the caller's) cannot reach a session's monitor: refused by name,
    not taken for an unknown profile setting; a file by name is read, through the CLI too."""
    r, w = os.pipe()
    try:
        with pytest.raises(InputError, match="stdin_from cannot be combined with yield_after"):
            sandbox.run(["cat"], yield_after=5, stdin_from=r)
    finally:
        os.close(r)
        os.close(w)
    assert sessions.list_sessions(sweep=False) == []
    src = tmp_path / "in.txt"
    src.write_text("from the file\n")
    res = sessions.run_or_yield(["cat"], yield_after=20, stdin_file=str(src))
    assert (res.status, res.stdout) == ("ok", "from the file\n"), res
    p = cli("run", "--yield-ms", "20000", "--stdin-file", str(src), "--", "cat")
    assert p.returncode == 0 and json.loads(p.stdout)["stdout"] == "from the file\n", p


def test_a_failed_monitor_records_that_nothing_was_applied(tmp_path: Path) -> None:
    """Its setup_error said "host network, no seccomp, no filesystem view" (Isolation()'s
    defaults) where nothing is known; and result.json lacked the "killed" key others have."""
    from sandbox import monitor

    (tmp_path / "request.json").write_text(json.dumps({"argv": ["true"]}))
    (tmp_path / "meta.json").write_text(json.dumps({"profile": "strict", "state": "starting"}))
    r, w = os.pipe()
    try:
        monitor.Monitor(str(tmp_path), w).fail("boom")
        assert os.read(r, 1) == b"E"
    finally:
        os.close(r)
    d = json.loads((tmp_path / "result.json").read_text())
    assert (d["status"], d["error"], d["isolation"], d["killed"]) == ("setup_error", "monitor: boom", None, False), d
    pytest.importorskip("jsonschema").Draft202012Validator(
        json.loads((ROOT / "sandbox" / "result.schema.json").read_text())).validate(d)


def test_a_yield_too_long_is_refused_before_any_session_starts() -> None:
    """wait() refused it after start(): the call failed and left a session running unseen."""
    with pytest.raises(InputError, match="yield_after"):
        sessions.run_or_yield(["sleep", "30"], yield_after=1e12)
    assert sessions.list_sessions(sweep=False) == []


def test_an_interrupted_yield_leaves_no_session_running(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while `run --yield-ms` waited: the caller never got the id, and the session ran on."""
    real_wait = sessions.Session.wait
    calls = []

    def interrupted_once(self: sessions.Session, timeout: float | None = None) -> Any:
        calls.append(timeout)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real_wait(self, timeout)

    monkeypatch.setattr(sessions.Session, "wait", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        sessions.run_or_yield(["sleep", "30"], yield_after=5)
    assert [s.state for s in sessions.list_sessions(sweep=False)] in ([], ["exited"])
    for s in sessions.list_sessions(sweep=False):
        assert gone(s.pid)


@pytest.mark.parametrize("starter", ["library", "mcp"])
def test_a_session_that_ends_with_its_caller_goes_when_the_caller_is_sigkilled(state: Path, starter: str) -> None:
    """An MCP server kills its sessions on its way out, but a SIGKILLed one cannot: they ran on.
    start(ends_with_caller=True) (the server's) has the session's monitor watch its starter."""
    mark = marker()
    cmd = f"sleep 300 # {mark}"
    code = {
        "library": f"import sandbox; s = sandbox.start({cmd!r}, shell=True, ends_with_caller=True)",
        "mcp": "from sandbox.mcp_server import Tools; from sandbox.profile import load\n"
               f"s = Tools(load('strict'), None, RuntimeError).start({cmd!r})",
    }[starter]
    env = dict(os.environ, PYTHONPATH=str(ROOT), SANDBOXRUN_STATE_DIR=str(state))
    p = subprocess.Popen([sys.executable, "-c", f"{code}\nprint('started', flush=True)\nimport time; time.sleep(300)"],
                         env=env, stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stdout.readline() == b"started\n"
        (s,) = sessions.list_sessions()
        assert s.state == "running" and leaks.marked(mark)
        p.kill()
        p.wait()
        until(lambda: s.poll().state == "exited", 15, "the session to end with its caller")
        until(lambda: not leaks.marked(mark), 5, "its processes to be gone")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        end_marked(mark)


def test_a_session_outlives_its_caller_by_default(state: Path) -> None:
    mark = marker()
    code = f"import sandbox; s = sandbox.start('sleep 300 # {mark}', shell=True); print(s.id, flush=True)"
    env = dict(os.environ, PYTHONPATH=str(ROOT), SANDBOXRUN_STATE_DIR=str(state))
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=60)
        s = sessions.get(out.stdout.decode().strip())
        time.sleep(0.5)  # what the watcher of a session that ends with its caller would have needed
        assert s.poll().state == "running" and leaks.marked(mark)
        s.kill()
    finally:
        end_marked(mark)


# ---------------------------------------------------------------------------- sessions audit


@pytest.mark.parametrize("verb", ["kill", "remove"])
def test_kill_or_remove_while_the_session_starts_ends_it(state: Path, verb: str, contained) -> None:
    """Asked before the monitor had bound ctl.sock (meta.json says "starting"), both failed
    with "cannot reach its monitor: No such file or directory" and the command ran on."""
    mark = marker()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    starter = subprocess.Popen([sys.executable, "-m", "sandbox", "start", "--name", "rs", "--", "bash", "-c",
                                f"exec -a {mark} sleep 100"], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    try:
        metas = until(lambda: list(state.glob("*/meta.json")) if state.exists() else [], 30, "meta.json")
        s = sessions.Session(metas[0].parent.name)  # type: ignore[index]
        early = s.state == "starting" and not Path(s.dir, "ctl.sock").exists()
        res = s.kill(grace=0) if verb == "kill" else s.remove(grace=0)
        assert res is not None and res.status in ("signaled", "killed", "setup_error"), res
        assert verb == "kill" or not os.path.lexists(s.dir)
        starter.communicate(timeout=60)
        until(lambda: not leaks.marked(mark), 5, "the command to be gone")
        assert early  # the case the audit found (4 of 4): asked before ctl.sock was there
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait()
        end_marked(mark)


def test_a_half_created_session_folder_can_be_cleared_at_once(state: Path) -> None:
    """A start SIGKILLed after request.json, before meta.json: listed `starting` for 60 s,
    and neither clear nor remove could take it."""
    sessions.state_dir()
    folder = state / "0badf00d"
    folder.mkdir(mode=0o700)
    (folder / "request.json").write_text("{}")
    s = sessions.get("0badf00d")
    assert s.state == "lost"
    s.clear()
    assert not folder.exists()
    folder.mkdir(mode=0o700)
    (folder / "request.json").write_text("{}")
    assert sessions.get("0badf00d").remove() is not None and not folder.exists()


def test_a_folder_its_starter_still_writes_reads_starting(state: Path) -> None:
    import fcntl

    sessions.state_dir()
    folder = state / "0badf00d"
    folder.mkdir(mode=0o700)
    (folder / "request.json").write_text("{}")
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as the starter holds it until meta.json is written
        assert sessions.get("0badf00d").state == "starting"
    finally:
        os.close(fd)
    assert sessions.get("0badf00d").state == "lost"


ESCAPE_NAME = "sleep 100 # \x1b]0;PWNED\x07\u202eevil\x9b31m"


def test_a_derived_name_carries_no_control_characters() -> None:
    for argv in (["sh", "-c", ESCAPE_NAME], ["echo", "\x1b[2J", "\u2066x\u2069", "\u200f\u061c"]):
        name = sessions.derive_name(argv)
        assert not any(ord(c) < 32 or 0x7F <= ord(c) <= 0x9F or c in "\u202a\u202b\u202c\u202d\u202e\u2066"
                       "\u2067\u2068\u2069\u200e\u200f\u061c" for c in name), repr(name)
    assert sessions.derive_name(["sh", "-c", "a\x1bb"]) == "a?b"


@pytest.mark.parametrize("char", ["\x85", "\x9b", "\u202e", "\u2066", "\u200f", "\u061c", "\x1b", "\x7f"])
def test_a_name_with_a_control_character_is_refused_by_name(char: str) -> None:
    with pytest.raises(InputError, match=f"U\\+{ord(char):04X}") as e:
        sandbox.start(["true"], name=f"a{char}b")
    assert char not in str(e.value)
    assert sessions.list_sessions() == []


def test_list_and_start_print_no_raw_control_characters(state: Path) -> None:
    r = cli("start", "--", "sh", "-c", ESCAPE_NAME)
    assert r.returncode == 0, r.stderr
    sid = r.stdout.decode().strip()
    try:
        # An older meta.json (or one edited by hand) may carry them still: escaped on output.
        meta = Path(state, sid, "meta.json")
        meta.write_text(json.dumps(dict(json.loads(meta.read_text()), name="x\x1b]0;PWNED\x07\u202ey\x9b")))
        listed = cli("list")
        assert listed.returncode == 0 and sid.encode() in listed.stdout, listed
        for out in (r.stderr, listed.stdout):
            text = out.decode()
            assert not any(ord(c) < 32 and c != "\n" or 0x7F <= ord(c) <= 0x9F or c in "\u202e" for c in text), out
        assert b"\\x1b" in listed.stdout and b"\\u202e" in listed.stdout
    finally:
        sessions.get(sid).remove(grace=0)


def _vm_hwm(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmHWM")


def test_many_concurrent_writers_under_the_big_size_keep_the_monitor_small() -> None:
    """Only requests over 4 MiB waited their turn: 32 writers of 3 MiB each held theirs at once
    (the monitor from ~17 to ~141 MB)."""
    import threading

    s = sandbox.start(["sh", "-c", "cat > /dev/null"])
    monitor = s.meta["monitor_pid"]
    base = _vm_hwm(monitor)
    data = b"x" * (2 << 20)
    results: list[object] = []
    threads = [threading.Thread(target=lambda: results.append(s.write(data))) for _ in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    grown = _vm_hwm(monitor) - base
    s.write(b"", eof=True)
    assert s.wait(20) is not None
    assert results == [len(data)] * 24, results
    assert grown < 24 << 20, f"the monitor grew by {grown >> 20} MiB"  # (was 54 MiB here)


def test_concurrent_large_writes_keep_the_monitor_small() -> None:
    """Each connection buffered up to 44 MiB plus JSON and base64 copies, all at once: one
    32 MiB write took the monitor from ~17 to ~180 MB, six concurrent ones to 784 MB."""
    import threading

    s = sandbox.start(["sh", "-c", "cat > /dev/null"])
    monitor = s.meta["monitor_pid"]
    base = _vm_hwm(monitor)
    data = b"x" * (24 << 20)
    results: list[object] = []

    def write() -> None:
        try:
            results.append(s.write(data))
        except SandboxError as e:
            results.append(str(e))

    threads = [threading.Thread(target=write) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    grown = _vm_hwm(monitor) - base
    s.write(b"", eof=True)
    assert s.wait(20) is not None
    assert results == [len(data)] * 3, results
    # One at a time: its line (4/3 of the data, as base64) and the data decoded; was 213 MiB here
    assert grown < 4 * len(data), f"the monitor grew by {grown >> 20} MiB"
