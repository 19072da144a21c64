"""Every status is reachable, and nothing outlives a run."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import psutil
import pytest
from conftest import STUBBORN, end_marked, marker, py

import sandbox
from sandbox import leaks


def test_ok_and_nonzero(isolated) -> None:
    r = sandbox.run(py("print(6*7)"))
    assert (r.status, r.success, r.exit_code, r.stdout) == ("ok", True, 0, "42\n")
    r = sandbox.run(["sh", "-c", "echo err >&2; exit 3"])
    assert (r.status, r.success, r.exit_code, r.stderr) == ("nonzero_exit", False, 3, "err\n")


def test_signaled(isolated) -> None:
    r = sandbox.run(["sh", "-c", "kill -SEGV $$"])
    assert (r.status, r.signal, r.exit_code) == ("signaled", "SIGSEGV", -1), r


XFSZ_WHY = "SIGXFSZ, the signal a write past the file size limit of 1MiB gets (limits.file_size)"


def test_a_write_past_the_file_size_limit_names_the_limit(isolated) -> None:
    r = sandbox.run(["dd", "if=/dev/zero", "of=/tmp/big", "bs=64k", "count=32"], file_size="1MiB")
    assert (r.status, r.signal) == ("signaled", "SIGXFSZ"), r
    assert r.error == XFSZ_WHY, r


def test_a_sigxfsz_the_command_sent_itself_is_not_said_to_be_a_write(isolated) -> None:
    """The exit status does not tell the kernel's SIGXFSZ from a `kill -XFSZ`: the error
    names the limit whose signal it is, and claims no write that may never have been."""
    r = sandbox.run(["sh", "-c", "kill -XFSZ $$"], file_size="1MiB")
    assert (r.status, r.signal, r.success) == ("signaled", "SIGXFSZ", False), r
    assert r.error == XFSZ_WHY, r


def test_exec_failures_are_127_and_126(isolated) -> None:
    r = sandbox.run(["no-such-command-xyz"])
    assert (r.status, r.exit_code) == ("nonzero_exit", 127) and "command not found" in r.stderr
    r = sandbox.run(["/etc"])
    assert r.exit_code == 126, r
    r = sandbox.run(["/etc/passwd"])
    assert r.exit_code == 126, r


def test_timeout_kills_everything_including_setsid_daemons(contained) -> None:
    mark = marker()
    t0 = time.monotonic()
    alive_inside = f"sleep 0.3; grep -l {mark} /proc/[0-9]*/cmdline | wc -l"
    r = sandbox.run(["bash", "-c", f"setsid bash -c 'trap \"\" TERM; exec -a {mark} sleep 1000' & "
                                   f"(sleep 1000 &) ; {alive_inside}; trap '' TERM; sleep 1000"], timeout=1.5)
    assert r.status == "timeout" and r.timed_out and r.exit_code == -1, r
    assert int(r.stdout.split()[0]) >= 1, r.stdout  # the daemon really ran (the test is not vacuous)
    assert time.monotonic() - t0 < 6
    assert leaks.marked(mark) == []


def test_daemon_dies_when_main_command_exits(contained) -> None:
    mark = marker()
    r = sandbox.run(["bash", "-c", f"setsid bash -c 'exec -a {mark} sleep 1000' > /dev/null 2>&1 & "
                                   f"sleep 0.3; grep -l {mark} /proc/[0-9]*/cmdline | wc -l"])
    assert r.status == "ok" and int(r.stdout) >= 1, r  # it was running when the main command ended
    assert leaks.marked(mark) == []


def test_memory_bomb_is_memory_limit(contained) -> None:
    r = sandbox.run(py("x = []\nwhile True:\n    x.append(bytearray(16 << 20))"), memory="64MiB", timeout=20)
    assert r.status == "memory_limit", r
    assert r.usage.oom_kills >= 1
    # the cgroup's peak, which the limit judges: an RSS, which counts shared file pages, passed it
    assert 32 * 2**20 <= r.usage.peak_memory_bytes <= 64 * 2**20, r.usage


def test_fork_bomb_is_contained(contained) -> None:
    r = sandbox.run(py("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"),
                    processes=32, timeout=2)
    assert r.status == "timeout", r
    assert r.usage.pids_limit_hit, r.usage  # the cgroup's limit fires before RLIMIT_NPROC
    # A command that stops at its first refused fork says so too.
    r = sandbox.run(py("import os, time\ntry:\n    while True:\n        if os.fork() == 0:\n"
                       "            time.sleep(2); os._exit(0)\nexcept OSError as e:\n    print(e.errno)"),
                    processes=16, timeout=20)
    assert (r.status, r.stdout, r.usage.pids_limit_hit) == ("ok", "11\n", True), r


def test_cpu_limit(contained, child) -> None:
    r = sandbox.run(py("while True: pass"), cpu_time="1s", timeout=20)
    assert (r.status, r.success, r.error) == ("cpu_limit", False, "CPU time limit of 1s"), r


def test_cpu_limit_judges_the_commands_own_cpu_time_not_the_trees(contained, child) -> None:
    """RLIMIT_CPU is per process: two children of 1.1 s each (2.2 s together, past 95% of
    the 2 s limit) and then the command's own `kill -XCPU` is no CPU limit."""
    burn = "import time\nwhile time.process_time() < 1.1: pass"
    r = sandbox.run(["sh", "-c", f"python3 -c '{burn}' & python3 -c '{burn}' & wait; kill -XCPU $$"],
                    cpu_time="2s", cpus=2, timeout=30)
    assert r.usage.cpu_user_s + r.usage.cpu_sys_s >= 2.0, r.usage  # the tree's total did pass 95% of 2 s
    assert (r.status, r.signal, r.success) == ("signaled", "SIGXCPU", False), r


def test_a_self_kill_short_of_the_cpu_limit_is_signaled(contained, child) -> None:
    """1.92 s of a 2 s limit, then its own SIGKILL: it was called cpu_limit (any kill past 95%
    of the limit was the kernel's), a limit it never reached. The kernel's comes at the limit."""
    burn = "import os, time\nwhile time.process_time() < 1.92: pass\nos.kill(os.getpid(), 9)"
    r = sandbox.run(["python3", "-c", burn], cpu_time="2s", timeout=30)
    assert (r.status, r.signal) == ("signaled", "SIGKILL"), r


def test_a_self_kill_after_an_oom_kill_is_not_called_the_oom_killers(contained) -> None:
    """The OOM killer ended a child; the command then killed itself: its SIGKILL was stated
    as the OOM killer's. The run did reach its memory limit; who sent the kill is not known."""
    r = sandbox.run("python3 -c 'x = bytearray(1 << 30)' 2>/dev/null; kill -9 $$", shell=True,
                    memory="64MiB", timeout=30)
    assert (r.status, r.signal) == ("memory_limit", "SIGKILL") and r.usage.oom_kills >= 1, r
    assert r.error == ("SIGKILL after the OOM killer ended a process of the run (memory limit 64MiB): "
                       "likely its kill"), r.error


def test_the_child_reports_the_commands_own_cpu_time(isolated, child, monkeypatch) -> None:
    """Both children (the native stage and the Python one) report the command's own CPU
    time apart from its reaped children's, which RLIMIT_CPU does not count."""
    from sandbox import supervisor

    seen = []
    real = supervisor._classify
    # (by command: a run another thread of this process still has under way is classified too)
    monkeypatch.setattr(supervisor, "_classify",
                        lambda res, report, lim: (seen.append((res.command, report)), real(res, report, lim)))
    burn = "import time\nwhile time.process_time() < {}: pass"
    r = sandbox.run(["python3", "-c", f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {burn.format(0.5)!r}])\n"
                                      f"{burn.format(0.3)}"], timeout=30)
    assert r.status == "ok" and r.usage.cpu_user_s + r.usage.cpu_sys_s >= 0.8, r
    ours = [report for command, report in seen if command == r.command]
    assert len(ours) == 1 and ours[0].own_cpu is not None and 0.3 <= ours[0].own_cpu < 0.7, (ours, seen)


@pytest.mark.parametrize(("line", "own"), [("X 9 1.5 0.5 100 0.250000", 0.25), ("X 9 1.5 0.5 100", None),
                                           ("X 9 1.5 0.5 100 -1", None)])
def test_the_report_line_carries_the_commands_own_cpu_time_when_known(line: str, own: float | None) -> None:
    from sandbox import supervisor

    report = supervisor._Report()
    report.feed(line.encode() + b"\n")
    assert (report.status, report.utime, report.stime, report.maxrss_kb, report.own_cpu) == (9, 1.5, 0.5, 100, own)


def test_cpu_quota_caps_the_whole_run(contained) -> None:
    # Two processes spin for 1 s of wall time: ~2 s of CPU on two free CPUs, one at most
    # on one; the run's quota (half a CPU) lets them have ~0.5 s together.
    r = sandbox.run(py("import os, time\nchild = os.fork()\nend = time.time() + 1.0\nwhile time.time() < end: pass\n"
                       "if child: os.waitpid(child, 0)"), cpus=0.5, timeout=20)
    cpu = r.usage.cpu_user_s + r.usage.cpu_sys_s
    assert r.status == "ok" and 0.2 < cpu < 0.75, (cpu, r)


def test_thread_bomb_is_contained(contained) -> None:
    r = sandbox.run(py("import threading, time\nn = 0\ntry:\n    while True:\n"
                       "        threading.Thread(target=time.sleep, args=(3,), daemon=True).start()\n        n += 1\n"
                       "except RuntimeError:\n    print(n)"), processes=16, timeout=20)
    assert r.status == "ok" and 0 < int(r.stdout) < 16 and r.usage.pids_limit_hit, r


def test_a_command_cannot_pass_its_own_signal_off_as_a_limit(isolated) -> None:
    for sig in ("XCPU", "KILL"):
        r = sandbox.run(["sh", "-c", f"kill -{sig} $$"])
        assert (r.status, r.signal) == ("signaled", f"SIG{sig}"), r


def test_an_end_at_the_deadline_is_no_timeout(isolated, monkeypatch) -> None:
    """The supervisor wakes at the deadline to find the command already ended, its exit not
    yet read (a `sleep 30` under a 30 s timeout): that is its own end, not a timeout."""
    from sandbox import supervisor

    real = supervisor._Poller.poll
    first = [True]

    def late(self, timeout):  # the first wait oversleeps: the command ends meanwhile, unread
        if first[0] and timeout:
            first[0] = False
            time.sleep(timeout + 1.0)
            return []
        return real(self, timeout)

    monkeypatch.setattr(supervisor._Poller, "poll", late)
    r = sandbox.run(["sh", "-c", "echo done; exit 3"], timeout=0.5)
    assert not first[0]
    assert (r.status, r.timed_out, r.exit_code, r.stdout) == ("nonzero_exit", False, 3, "done\n"), r


def test_timeout_past_the_grace_says_sigkill(contained) -> None:
    r = sandbox.run(["sh", "-c", "trap '' TERM; sleep 30"], timeout=0.5, kill_grace=0.3)  # sleep ignores TERM too
    assert (r.status, r.signal) == ("timeout", "SIGKILL"), r
    r = sandbox.run(["sleep", "30"], timeout=0.5)
    assert (r.status, r.signal) == ("timeout", "SIGTERM"), r


def test_a_run_killed_after_its_grace_still_reports_the_cpu_time_of_its_processes(contained) -> None:
    """Its PID 1, SIGKILLed, reaps nothing into its own counts (the kernel reaps the rest of
    the pid namespace without adding their CPU time anywhere): read from /proc before the kill."""
    burn = ("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "end = time.process_time() + 0.6\nwhile time.process_time() < end: pass\ntime.sleep(60)")
    r = sandbox.run(["sh", "-c", f"trap '' TERM; python3 -c '{burn}' & python3 -c '{burn}'; wait"], timeout=2.5, kill_grace=0.3,
                    cpus=2)
    assert (r.status, r.signal) == ("timeout", "SIGKILL"), r
    assert r.usage.cpu_user_s + r.usage.cpu_sys_s >= 1.0, r.usage  # two processes of 0.6 s each


def test_output_flood_is_capped_and_counted(contained) -> None:
    me = psutil.Process()
    before = me.memory_info().rss
    r = sandbox.run(["sh", "-c", "head -c 200000000 /dev/zero; head -c 3000000 /dev/zero >&2"], timeout=60)
    grown = me.memory_info().rss - before
    assert r.status == "ok", r
    assert r.stdout_truncated and r.stdout_bytes == 200_000_000 and len(r.stdout_raw) == 2**20
    assert r.stderr_truncated and r.stderr_bytes == 3_000_000
    assert grown < 32 * 2**20, grown


def test_output_overflow_kill_ends_a_flood_at_once_and_says_which_stream(contained) -> None:
    mark = marker()
    t0 = time.monotonic()
    r = sandbox.run(["bash", "-c", f"(exec -a {mark} sleep 1000) & yes"], output_overflow="kill", timeout=30)
    assert time.monotonic() - t0 < 10, r  # not the 30 s timeout
    assert (r.status, r.success, r.signal, r.exit_code, r.timed_out) == ("output_limit", False, "SIGKILL", -1, False), r
    assert r.stdout_truncated and len(r.stdout_raw) == 2**20, r
    assert r.error == "stdout passed the output limit of 1MiB: the sandbox was killed", r
    assert r.isolation.limits["output_overflow"] == "kill"
    assert leaks.marked(mark) == []
    r = sandbox.run(["sh", "-c", "yes >&2"], output_overflow="kill", output="64KiB")
    assert (r.status, r.stderr_truncated, len(r.stderr_raw)) == ("output_limit", True, 65536), r
    assert "stderr passed the output limit of 64KiB" in r.error, r


def test_output_overflow_kill_judges_the_bytes_not_the_timing(isolated) -> None:
    """One byte past the cap is output_limit even when the command ended before the read;
    exactly the cap is not."""
    over = sandbox.run(["sh", "-c", "head -c 65537 /dev/zero; exit 3"], output="64KiB", output_overflow="kill")
    assert (over.status, over.stdout_bytes, over.stdout_truncated) == ("output_limit", 65537, True), over
    at = sandbox.run(["sh", "-c", "head -c 65536 /dev/zero; exit 3"], output="64KiB", output_overflow="kill")
    assert (at.status, at.exit_code, at.stdout_truncated) == ("nonzero_exit", 3, False), at
    drained = sandbox.run(["sh", "-c", "head -c 65537 /dev/zero; exit 3"], output="64KiB")
    assert (drained.status, drained.exit_code, drained.stdout_truncated) == ("nonzero_exit", 3, True), drained


def test_an_output_limit_is_no_success_and_says_the_kill_only_when_there_was_one(isolated, monkeypatch) -> None:
    """The command wrote one byte past the cap and exited 0 before the supervisor read it,
    the byte's read handled before the exit: output_limit, never with success true, and the
    error does not say the sandbox was killed (the kill came after the command's own end)."""
    from sandbox import supervisor

    real = supervisor._Poller.poll

    def late(self, timeout):  # each wait oversleeps: the command ends meanwhile; its output is read first
        time.sleep(0.2)
        return sorted(real(self, 0), key=lambda what: what != "out")

    monkeypatch.setattr(supervisor._Poller, "poll", late)
    r = sandbox.run("head -c 65537 /dev/zero; exit 0", shell=True, output="64KiB", output_overflow="kill")
    assert (r.status, r.success, r.exit_code, r.signal) == ("output_limit", False, 0, None), r
    assert (r.stdout_bytes, r.stdout_truncated, len(r.stdout_raw)) == (65537, True, 65536), r
    assert r.error == "stdout passed the output limit of 64KiB: the output was cut there (the command had ended)", r


def test_an_output_limit_is_never_a_success(isolated) -> None:
    """However the reads fall (the kill before or after the command's own exit 0)."""
    for _ in range(6):
        r = sandbox.run("head -c 65537 /dev/zero; exit 0", shell=True, output="64KiB", output_overflow="kill")
        assert (r.status, r.success) == ("output_limit", False), r
        assert r.error.endswith("the sandbox was killed") == (r.signal == "SIGKILL"), r


def test_small_output_not_truncated(isolated) -> None:
    r = sandbox.run(["sh", "-c", "head -c 1000 /dev/zero"])
    assert not r.stdout_truncated and r.stdout_bytes == 1000


def test_stdin_is_fed_without_deadlock(isolated) -> None:
    data = os.urandom(3 * 2**20)
    r = sandbox.run(["wc", "-c"], stdin=data)
    assert r.stdout.strip() == str(len(data)), r
    r = sandbox.run(["true"], stdin=data)  # a command that never reads stdin
    assert r.status == "ok"


def test_blocked_runs_nothing() -> None:
    r = sandbox.run("rm -rf /")
    assert (r.status, r.blocked, r.exit_code, r.pid) == ("blocked", True, -1, None)
    assert "rm" in r.block_reason


def test_setup_error_names_the_step(tmp_path, isolated) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    prof = sandbox.load_profile("strict")
    from sandbox.profile import with_overrides

    prof = with_overrides(prof, ro_bind=[f"{gone}:/data"])  # not under /tmp: the private /tmp hides it
    gone.rmdir()
    r = sandbox.run(["true"], profile=prof)
    assert r.status == "setup_error" and r.error_step.startswith("filesystem"), r
    assert r.error_errno == 2
    # Nothing was applied to a command that never ran: isolation is null, never the
    # "host network, no seccomp" defaults a reader would take for an unsandboxed run.
    assert r.isolation is None and '"isolation": null' in r.to_json(), r
    b = sandbox.run("rm -rf /")
    assert b.status == "blocked" and b.isolation is None, b


def test_string_command_and_shell(isolated) -> None:
    assert sandbox.run("echo 'a b'").stdout == "a b\n"
    assert sandbox.run("echo $((6*7)) | tr 4 X", shell=True).stdout == "X2\n"
    with pytest.raises(sandbox.InputError, match="unbalanced|quotation"):
        sandbox.run("echo 'oops")


def test_many_threads_no_crosstalk(isolated) -> None:
    errors: list[str] = []

    def worker(n: int) -> None:
        for i in range(25):
            tag = f"{n}-{i}"
            r = sandbox.run(["echo", tag])
            if r.stdout != tag + "\n":
                errors.append(f"{tag}: {r.status} {r.stdout!r} {r.error}")

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert errors == []


def test_asyncio(isolated) -> None:
    async def main() -> list[sandbox.Result]:
        return await asyncio.gather(*(sandbox.run_async(["echo", str(i)]) for i in range(20)))

    results = asyncio.run(main())
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(20)]


def test_cancelling_run_async_kills_the_sandbox(isolated) -> None:
    """asyncio.to_thread could not stop the run: a cancelled task's sandbox ran on, holding a
    worker of the loop's executor (and asyncio.run's exit) until its timeout."""
    mark = marker()

    async def main() -> None:
        task = asyncio.ensure_future(sandbox.run_async(["sh", "-c", f"sleep 300 # {mark}"], timeout=20))
        with_deadline = time.monotonic() + 30  # a bound, not a benchmark
        while not leaks.marked(mark):
            assert time.monotonic() < with_deadline, "the sandbox never started"
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 60)
        assert not leaks.marked(mark)  # gone before the cancellation reached us

    try:
        asyncio.run(main())
    finally:
        for p in leaks.marked(mark):
            os.kill(p.pid, 9)


def test_a_second_cancel_still_waits_for_the_sandbox_to_go(isolated) -> None:
    """anyio re-sends a cancellation at each turn of the loop, and a second Ctrl-C under
    asyncio.run cancels again: the second CancelledError went on at once, the sandbox alive."""
    mark = marker()

    async def main() -> None:
        task = asyncio.ensure_future(sandbox.run_async(STUBBORN.format(mark=mark), shell=True, timeout=60))
        deadline = time.monotonic() + 30  # a bound, not a benchmark
        while not leaks.marked(mark):
            assert time.monotonic() < deadline, "the sandbox never started"
            await asyncio.sleep(0.02)
        task.cancel()
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not leaks.marked(mark)

    try:
        asyncio.run(main())
    finally:
        end_marked(mark)


def test_run_async_takes_yield_after_and_its_cancel_ends_the_session(isolated, private_state_dir) -> None:
    # run_async passed its Cancel on to the session as if a profile setting: a ProfileError.
    mark = marker()

    async def main() -> tuple[sandbox.Result, sandbox.Result]:
        quick = await sandbox.run_async(["echo", "hi"], yield_after=30)
        task = asyncio.ensure_future(sandbox.run_async(STUBBORN.format(mark=mark), shell=True, yield_after=60))
        deadline = time.monotonic() + 30
        while not leaks.marked(mark):
            assert time.monotonic() < deadline, "the session never started"
            await asyncio.sleep(0.02)
        slow = await sandbox.run_async(["sleep", "30"], yield_after=0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not leaks.marked(mark)
        return quick, slow

    try:
        quick, slow = asyncio.run(main())
    finally:
        end_marked(mark)
    assert (quick.status, quick.stdout, quick.session_id) == ("ok", "hi\n", None), quick
    assert slow.status == "running" and slow.session_id, slow
    from sandbox import sessions

    sessions.get(slow.session_id).remove(grace=0)
    assert [s.id for s in sessions.list_sessions()] == []


def test_a_cancel_ends_a_run_waiting_to_yield_and_forgets_its_session(isolated, private_state_dir) -> None:
    from sandbox import sessions
    from sandbox.supervisor import Cancel

    mark = marker()
    cancel = Cancel()
    got: list[sandbox.Result] = []
    t = threading.Thread(target=lambda: got.append(sandbox.run(["bash", "-c", f"exec -a {mark} sleep 60"],
                                                                yield_after=60, cancel=cancel)))
    t.start()
    try:
        deadline = time.monotonic() + 30
        while not leaks.marked(mark):
            assert time.monotonic() < deadline, "the session never started"
            time.sleep(0.02)
        cancel.cancel()
        t.join(30)
    finally:
        end_marked(mark)
        cancel.close()
    assert not t.is_alive() and got and got[0].error == "cancelled by the caller: the sandbox was killed", got
    assert got[0].session_id is None and sessions.list_sessions() == [] and not leaks.marked(mark)


def test_run_async_starts_its_thread_without_waiting_on_the_loop(isolated, monkeypatch) -> None:
    # threading.Thread.start() waits for the new thread to take the GIL: up to 5 ms each, on
    # the loop, while other runs' threads are busy (50 runs at once held it ~200 ms).
    import threading

    def waits(self: threading.Thread) -> None:
        raise AssertionError("Thread.start() on the event loop")

    monkeypatch.setattr(threading.Thread, "start", waits)

    async def main() -> list[sandbox.Result]:
        return await asyncio.gather(*(sandbox.run_async(["true"]) for _ in range(3)))

    assert [r.status for r in asyncio.run(main())] == ["ok"] * 3


def test_run_async_threads_leave_no_thread_objects_behind(isolated) -> None:
    # Started by _thread, each asked threading.current_thread() and left a _DummyThread, alive
    # for ever in threading.enumerate() (Python 3.11 never removes one).
    import subprocess
    import sys
    from pathlib import Path

    code = ("import asyncio, json, threading, sandbox\n"
            "async def main():\n"
            "    return await asyncio.gather(*(sandbox.run_async(['true']) for _ in range(30)))\n"
            "ok = [r.status for r in asyncio.run(main())] == ['ok'] * 30\n"
            "print(json.dumps([ok, [t.name for t in threading.enumerate()]]))\n")
    root = Path(__file__).resolve().parent.parent
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(root)})
    ok, names = json.loads(p.stdout or "null") or (False, p.stderr)
    assert ok and [n for n in names if not n.startswith("Dummy")] == names, names  # (a pool of its own may stay)


def test_run_async_leaks_no_fd_when_its_thread_cannot_start(isolated, monkeypatch) -> None:
    import _thread

    def refuse(*_: object) -> None:
        raise RuntimeError("can't start new thread")

    async def main() -> None:
        for _ in range(5):
            with pytest.raises(RuntimeError, match="can't start new thread"):
                await sandbox.run_async(["true"])

    before = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(_thread, "start_new_thread", refuse)
    asyncio.run(main())
    monkeypatch.undo()
    assert len(os.listdir("/proc/self/fd")) <= before


@pytest.mark.parametrize("kwargs", [{"cancel": 1}, {"cancel": None}])
def test_run_async_refuses_a_cancel_of_the_callers_by_name(isolated, kwargs) -> None:
    with pytest.raises(sandbox.InputError, match="^cancel: run_async makes its own"):
        asyncio.run(sandbox.run_async(["true"], **kwargs))


@pytest.mark.parametrize("fd, why", [("x", "expected an open file descriptor"), (-1, "expected an open file"),
                                     (True, "expected an open file"), (987, "987 is not an open file descriptor")])
def test_a_bad_stdin_fd_is_named(isolated, fd, why) -> None:
    with pytest.raises(sandbox.InputError, match=f"^stdin_fd: .*{why}"):
        sandbox.run(["cat"], stdin_fd=fd)


def test_run_async_runs_are_not_held_to_the_loops_executor(isolated, tmp_path) -> None:
    """Each waits for the other's file: with one worker (the default executor's few, here
    one) the second never starts."""
    from concurrent.futures import ThreadPoolExecutor

    def waits_for(name: str, then: str) -> list[str]:
        return ["sh", "-c", f"touch {then}; i=0; while [ ! -e {name} ] && [ $i -lt 500 ]; do sleep 0.02; i=$((i+1)); "
                f"done; [ -e {name} ]"]

    async def main() -> list[sandbox.Result]:
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(1))
        return await asyncio.gather(sandbox.run_async(waits_for("b", "a"), cwd=str(tmp_path)),
                                    sandbox.run_async(waits_for("a", "b"), cwd=str(tmp_path)))

    assert [r.status for r in asyncio.run(main())] == ["ok", "ok"]


def test_result_json_matches_schema_fields(isolated) -> None:
    import json
    from pathlib import Path

    schema = json.loads((Path(sandbox.__file__).parent / "result.schema.json").read_text())
    d = sandbox.run(["true"]).to_dict()
    assert set(schema["required"]) <= set(d)
    assert set(d) <= set(schema["properties"])


def test_filling_the_fresh_workdir_hits_enospc_not_the_host_disk(isolated) -> None:
    # Bounded (at most 7 x 50 MB) even if the workdir were on the host's disk.
    r = sandbox.run(["sh", "-c", "i=0; while [ $i -lt 7 ] && head -c 50000000 /dev/zero > f$i; do i=$((i+1)); done;"
                                 " echo $i"], workdir_size="128MiB", timeout=20)
    assert r.stdout.strip() == "2" and "No space left on device" in r.stderr, (r.stdout, r.stderr)


def test_a_huge_sparse_mapping_is_allowed_and_touching_it_is_memory_limit(contained) -> None:
    # strict lets a run reserve far more address space than its memory (V8 reserves ~10 GiB per
    # WebAssembly memory, a JVM its heap): the cgroup caps what is touched, page tables included.
    with open("/proc/sys/vm/overcommit_memory") as f:
        if f.read().strip() == "2":
            pytest.skip("this host accounts every private mapping (vm.overcommit_memory = 2)")
    code = ("import mmap\n"
            "m = mmap.mmap(-1, 48 << 30, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x4000)\n"  # MAP_NORESERVE
            "print('mapped', flush=True)\nfor i in range(0, 48 << 30, 2 << 20):\n    m[i] = 1\nprint('touched')")
    r = sandbox.run(py(code), memory="64MiB", timeout=30)
    assert r.stdout == "mapped\n", r
    assert r.status == "memory_limit" and r.usage.oom_kills >= 1, r


def test_node_instantiates_webassembly_memories() -> None:
    import shutil

    if shutil.which("node") is None:
        pytest.skip("node is not installed")
    js = "const a = []; for (let i = 0; i < 4; i++) a.push(new WebAssembly.Memory({initial: 1})); console.log(a.length)"
    r = sandbox.run(["node", "-e", js], timeout=30)
    assert (r.status, r.stdout) == ("ok", "4\n"), r.stderr[-1000:]


def test_a_timeout_shorter_than_the_setup_still_ends_the_command_with_sigterm(contained) -> None:
    # The SIGTERM reached PID 1 before the stage held its signals: an init drops a signal it
    # has no handler for, so the command only ever got the SIGKILL, a whole grace later.
    for _ in range(3):  # (the first run of a process sets up slower: its SIGTERM comes in time)
        r = sandbox.run(["sleep", "5"], timeout="1ms", kill_grace="3s")
        assert (r.status, r.signal) == ("timeout", "SIGTERM"), r
        assert r.duration_ms < 2500, r


def test_a_command_that_exits_on_its_timeouts_sigterm_keeps_its_exit_code(contained) -> None:
    r = sandbox.run("trap 'exit 5' TERM; sleep 10 & wait", shell=True, timeout=0.3)
    assert (r.status, r.exit_code, r.signal, r.success) == ("timeout", 5, None, False), r  # -1 only where there is none


def test_the_schema_says_a_timeout_may_keep_the_commands_exit_code() -> None:
    """As the test above shows: the schema's -1 is for no exit code, not for every timeout."""
    with open(os.path.join(os.path.dirname(sandbox.__file__), "result.schema.json")) as f:
        described = json.load(f)["properties"]["exit_code"]["description"]
    assert "-1 when there is none" in described and "exited by itself on the timeout's SIGTERM" in described, described


def test_the_tmp_limit_is_reported_only_where_a_private_tmp_is_mounted(isolated) -> None:
    # `isolation` reports what was applied: nested's /tmp is the host's own, no 64 MiB tmpfs.
    strict = sandbox.run(["sh", "-c", "df -k /tmp | tail -1"])
    assert strict.isolation.limits["tmp_bytes"] == 64 * 2**20
    assert strict.stdout.split()[1] == str(64 * 2**10), strict.stdout
    if os.geteuid() != 0:
        pytest.skip("profile nested takes a per-run host uid: a root caller's")
    nested = sandbox.run(["true"], profile="nested")
    assert nested.status == "ok" and nested.isolation.limits["tmp_bytes"] is None, nested
