"""A Ctrl-C (or the CLI's SIGTERM) is raised by Python between any two bytecodes of the main
thread. Steps that must not be cut in two hold it for their end (signals.held); the teardown
ends what a cut left half made. Each test puts the signal where a run's state was lost."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import end_marked, marker

import sandbox
from sandbox import leaks, signals

ROOT = Path(__file__).resolve().parent.parent


def _interrupt_here(sig: int = signal.SIGINT) -> None:
    """`sig` to ourselves, then some bytecodes, where Python runs its handler."""
    os.kill(os.getpid(), sig)
    for _ in range(1000):
        pass


class CallersAlarm(Exception):
    """What a calling program's own alarm handler raises (not a KeyboardInterrupt)."""


Interrupted = (KeyboardInterrupt, CallersAlarm)


@pytest.fixture(params=["SIGINT", "a caller's own SIGALRM handler", "a caller's SIGALRM raising its own exception"])
def interrupt(request: pytest.FixtureRequest) -> Iterator[Callable[[], None]]:
    """Ctrl-C, or a signal whose handler the calling program set to raise."""
    if request.param == "SIGINT":
        yield _interrupt_here
        return
    own = request.param.endswith("its own exception")

    def raising(_sig: int, _frame: object) -> None:
        raise CallersAlarm if own else KeyboardInterrupt

    before = signal.signal(signal.SIGALRM, raising)
    try:
        yield lambda: _interrupt_here(signal.SIGALRM)
    finally:
        signal.signal(signal.SIGALRM, before)


def _zombies() -> set[int]:
    """Our children that have exited and that no one reaped."""
    me = os.getpid()
    out = set()
    for task in os.listdir(f"/proc/{me}/task"):
        try:
            with open(f"/proc/{me}/task/{task}/children") as f:
                kids = [int(p) for p in f.read().split()]
        except OSError:
            continue
        for pid in kids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        out.add(pid)
            except OSError:
                pass
    return out


def _pidfds() -> set[int]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]":
                out.add(int(fd))
        except OSError:
            pass
    return out


def _gone(mark: str, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while leaks.marked(mark):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# ---------------------------------------------------------------------------- signals.held


def test_a_sigint_within_held_is_raised_at_its_end_and_the_handler_is_put_back() -> None:
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with signals.held():
            _interrupt_here()
            reached.append("the step's end")
    assert reached == ["the step's end"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_held_sections_nest_and_a_held_signal_is_taken_once() -> None:
    seen = []
    with pytest.raises(KeyboardInterrupt):
        with signals.held():
            with signals.held():
                _interrupt_here()
                _interrupt_here()
            seen.append("inner end")  # still held: the outer step goes on
    assert seen == ["inner end"]
    for _ in range(1000):  # nothing more pending
        pass


@pytest.mark.parametrize("phase", ["enter", "exit"])
def test_a_signal_between_handler_swaps_is_taken_once_and_none_is_lost(phase: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGINT fired right after each of held()'s handler swaps: one KeyboardInterrupt, every
    handler back in its place, and the next section holds SIGINT again (a stand-in once taken
    for an original dropped every later signal)."""
    def quiet(sig: int, frame: object) -> None:  # more Python handlers: more swaps to land between
        pass

    monkeypatch.setattr(signals, "_CATCHABLE", (signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2))
    real_signal = signals.signal
    signal.signal(signal.SIGUSR1, quiet)
    signal.signal(signal.SIGUSR2, quiet)
    try:
        for at in range(1, 4):  # after the 1st, 2nd, 3rd swap of the phase
            swaps = [0]
            counting = [phase == "enter"]

            def swap(sig: int, handler: object, at: int = at, swaps: list[int] = swaps,
                     counting: list[bool] = counting) -> object:
                old = real_signal(sig, handler)
                if counting[0]:
                    swaps[0] += 1
                    if swaps[0] == at:
                        os.kill(os.getpid(), signal.SIGINT)
                return old

            monkeypatch.setattr(signals, "signal", swap)
            interrupts = 0
            try:
                with signals.held():
                    counting[0] = phase == "exit"
            except KeyboardInterrupt:
                interrupts += 1
            for _ in range(1000):  # a signal left pending would raise here
                pass
            monkeypatch.setattr(signals, "signal", real_signal)
            assert (interrupts, swaps[0] >= at) == (1, True), at
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
            assert signal.getsignal(signal.SIGUSR1) is quiet and signal.getsignal(signal.SIGUSR2) is quiet
            assert (signals._depth, signals._pending) == ([0], [])
            test_a_sigint_within_held_is_raised_at_its_end_and_the_handler_is_put_back()
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)


class _Alarm(Exception):
    pass


def _raise_alarm(sig: int, frame: object) -> None:
    raise _Alarm


def _two_at_once() -> None:
    """SIGINT and SIGALRM pending together: CPython runs SIGINT's handler, and SIGALRM's at
    its next check, wherever that is."""
    pair = {signal.SIGINT, signal.SIGALRM}
    signal.pthread_sigmask(signal.SIG_BLOCK, pair)
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGALRM)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, pair)


@pytest.mark.parametrize("phase", ["enter", "exit"])
def test_two_signals_at_once_in_held_s_own_steps_leave_every_handler_working(phase: str,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The second exception escaped from where no try was: the depth stayed 1 and a stand-in
    stayed in place with nothing to stand for, every later signal of it dropped."""
    got: list[int] = []
    monkeypatch.setattr(signals, "_CATCHABLE", (signal.SIGINT, signal.SIGALRM, signal.SIGTERM))
    signal.signal(signal.SIGALRM, _raise_alarm)
    signal.signal(signal.SIGTERM, lambda sig, frame: got.append(sig))
    real_signal = signals.signal

    def swap(sig: int, handler: object) -> object:
        old = real_signal(sig, handler)
        if (phase == "exit" and handler is _raise_alarm) or (phase == "enter" and sig == signal.SIGINT):
            _two_at_once()
        return old

    try:
        monkeypatch.setattr(signals, "signal", swap)
        with pytest.raises((KeyboardInterrupt, _Alarm)):
            with signals.held():
                pass
        monkeypatch.setattr(signals, "signal", real_signal)
        assert signals._depth == [0]
        os.kill(os.getpid(), signal.SIGTERM)  # its handler runs, stood in for or not
        for _ in range(1000):
            pass
        assert got == [signal.SIGTERM]
        with pytest.raises(KeyboardInterrupt):  # the next section holds, and puts every handler back
            with signals.held():
                _interrupt_here()
                got.append(0)
        assert got == [signal.SIGTERM, 0]
        assert signal.getsignal(signal.SIGALRM) is _raise_alarm and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_a_quiet_handlers_held_signal_runs_though_a_raising_one_came_first() -> None:
    got: list[int] = []
    signal.signal(signal.SIGUSR1, lambda sig, frame: got.append(sig))
    try:
        with pytest.raises(KeyboardInterrupt):
            with signals.held():
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGUSR1)
        assert got == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)


def test_a_handler_set_within_a_section_stays_and_a_saved_stand_in_still_calls_its_own() -> None:
    got: list[str] = []
    signal.signal(signal.SIGUSR1, lambda sig, frame: got.append("usr1"))
    signal.signal(signal.SIGUSR2, lambda sig, frame: got.append("usr2"))
    try:
        def mine(sig: int, frame: object) -> None:
            got.append("mine")

        with signals.held():
            signal.signal(signal.SIGUSR2, mine)  # the step's own: not put "back" to the one it replaced
            saved = signal.getsignal(signal.SIGUSR1)  # what a library saves to set back later
        assert signal.getsignal(signal.SIGUSR2) is mine
        signal.signal(signal.SIGUSR1, saved)
        os.kill(os.getpid(), signal.SIGUSR1)
        for _ in range(1000):
            pass
        os.kill(os.getpid(), signal.SIGUSR2)
        for _ in range(1000):
            pass
        assert got == ["usr1", "mine"]
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)


def test_held_is_a_no_op_in_another_thread() -> None:
    errors: list[BaseException] = []

    def step() -> None:
        try:
            with signals.held():
                pass
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=step)
    t.start()
    t.join()
    assert errors == [] and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_clis_sigterm_is_held_too() -> None:
    code = ("import os, signal, sys\nfrom sandbox import cli, signals\n"
            "def probe(argv):\n"
            "    with signals.held():\n"
            "        os.kill(os.getpid(), signal.SIGTERM)\n"
            "        for _ in range(1000): pass\n"
            "        print('step ended', flush=True)\n"
            "    print('not reached', flush=True)\n"
            "    return 0\n"
            "cli._dispatch = lambda name: probe\n"
            "sys.argv[1:] = ['check', 'x']\n"
            "cli.entry()\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.stdout == "step ended\n" and p.returncode == 143, (p.stdout, p.stderr)


# ---------------------------------------------------------------------------- the library's runs


@pytest.fixture
def mark(isolated) -> str:
    m = marker()
    yield m
    end_marked(m)


def test_an_interrupt_right_after_the_spawn_does_not_lose_the_child(mark: str, monkeypatch: pytest.MonkeyPatch,
                                                                     child: str, interrupt: Callable[[], None]) -> None:
    # Before: the stage's pid (or the fork server's reply) was lost with the KeyboardInterrupt:
    # its command ran on unsupervised, a zombie stayed, and (native) this thread was left in
    # the pid namespace it had unshared, so that every later run failed.
    from sandbox import forker
    from sandbox.native import launch

    before = _zombies()
    for cls in (launch.NativeForker, forker.ServerForker, forker.DirectForker):
        real = cls.spawn

        def spawn(self, plan, fds, _real=real):  # type: ignore[no-untyped-def]
            launched = _real(self, plan, fds)
            interrupt()
            return launched

        monkeypatch.setattr(cls, "spawn", spawn)
    with pytest.raises(Interrupted):
        sandbox.run(["sh", "-c", f"sleep 30; : {mark}"], timeout=60)
    monkeypatch.undo()
    assert _gone(mark)
    assert _zombies() - before == set()  # reaped
    r = sandbox.run(["echo", "next"])  # and this thread is not stuck anywhere
    assert r.status == "ok" and r.stdout == "next\n", r


def test_an_interrupt_before_the_supervision_began_ends_the_run(mark: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from sandbox import supervisor

    pidfds_before = _pidfds()
    before = _zombies()

    def interrupted(*_a, **_k):  # type: ignore[no-untyped-def]
        raise KeyboardInterrupt

    monkeypatch.setattr(supervisor, "_supervise", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sandbox.run(["sh", "-c", f"sleep 30; : {mark}"], timeout=60)
    monkeypatch.undo()
    assert _gone(mark)
    assert _zombies() - before == set()
    assert _pidfds() <= pidfds_before  # its pidfd closed too


def test_a_teardown_rerun_closes_no_fd_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    # A Ctrl-C between a step's close and its "closed" mark made the rerun close the same
    # number again: EBADF, "internal error", exit 125 (or, threaded, another's fd closed).
    from sandbox.isolation import uids
    from sandbox.supervisor import Cancel, _Uninterrupted

    real_close = os.close
    cut = []

    def close_then_interrupt(fd: int) -> None:
        real_close(fd)
        if not cut:
            cut.append(fd)
            raise KeyboardInterrupt

    c = Cancel()
    lease = uids.Lease(-1, os.open("/dev/null", os.O_RDONLY))
    for step in (c.close, lease.release):
        cut.clear()
        steady = _Uninterrupted()
        monkeypatch.setattr(os, "close", close_then_interrupt)
        try:
            steady.do(step)
        finally:
            monkeypatch.setattr(os, "close", real_close)
        assert cut and steady.pending is not None  # cut once, then rerun to its end without an error


@pytest.mark.parametrize("step", ["_close_all", "_remove_quietly"])
def test_a_callers_own_exception_inside_a_teardown_step_leaves_nothing(isolated, mark: str, step: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # _Uninterrupted reran a step cut by a KeyboardInterrupt only: a calling program's alarm
    # handler raising its own exception ended the teardown there, and the run's cgroups, pipes
    # and network namespace stayed (300 runs under a raising timer: 8 cgroups, 6 fds).
    from sandbox import supervisor

    real = getattr(supervisor, step)
    cut: list[str] = []

    def cut_once(*args):  # type: ignore[no-untyped-def]
        if not cut:
            cut.append(step)
            raise CallersAlarm
        return real(*args)

    made: list[str] = []
    real_create = supervisor.cgroups.RunCgroup.__init__

    def remember(self, *a, **k):  # type: ignore[no-untyped-def]
        real_create(self, *a, **k)
        made.extend(self.dirs)

    monkeypatch.setattr(supervisor.cgroups.RunCgroup, "__init__", remember)
    monkeypatch.setattr(supervisor, step, cut_once)
    fds_before = _fds()
    with pytest.raises(CallersAlarm):
        sandbox.run(["sh", "-c", f": {mark}"], timeout=60)
    monkeypatch.undo()
    assert cut == [step]
    assert made and not [d for d in made if os.path.exists(d)]
    assert _fds() <= fds_before
    assert _gone(mark)


def _fds() -> set[str]:
    """Our open fds but the network namespaces made ahead for the next runs (a run takes one)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if not target.startswith("net:"):
            out.add(f"{fd} {target}")
    return out


# ---------------------------------------------------------------------------- batch and sessions


def test_an_interrupt_inside_the_pools_submit_leaves_no_slot(isolated, monkeypatch: pytest.MonkeyPatch) -> None:
    # Cut inside Thread.start, the pool's worker ran but was neither the pool's nor waited for:
    # it made or returned a slot cgroup after the batch had removed its slots.
    from sandbox.batch import run_many

    real_start = threading.Thread.start
    started = []

    def start(self: threading.Thread) -> None:
        real_start(self)
        if self.name.startswith("sandboxrun-batch") and not started:
            started.append(self)
            _interrupt_here()

    monkeypatch.setattr(threading.Thread, "start", start)
    tag = f"sandboxrun-{os.getpid()}-"
    with pytest.raises(KeyboardInterrupt):
        list(run_many([["sh", "-c", "sleep 0.3"]] * 4, concurrency=2))
    monkeypatch.undo()
    for t in started:
        t.join(10)
    left = [d for root in ("/sys/fs/cgroup", *(f"/sys/fs/cgroup/{c}" for c in os.listdir("/sys/fs/cgroup")))
            if os.path.isdir(root) for d in os.listdir(root) if d.startswith(tag)]
    assert left == []


def test_slots_closed_lend_none_and_remove_what_comes_back() -> None:
    from sandbox.isolation.cgroups import Slots

    class FakeSlot:
        removed = False

        def is_empty(self) -> bool:
            return True

        def remove(self) -> None:
            self.removed = True

    class Backend:
        def make_slot(self) -> FakeSlot:
            return FakeSlot()

    slots = Slots()
    lent = slots.take(Backend())  # type: ignore[arg-type]
    slots.close()
    assert slots.take(Backend()) is None  # type: ignore[arg-type]
    slots.give_back(lent)  # type: ignore[arg-type]
    assert lent.removed  # type: ignore[union-attr]


def test_an_interrupt_before_starts_id_is_printed_removes_the_session(private_state_dir: Path) -> None:
    code = ("import sys\nfrom sandbox import cli, sessions\n"
            "real = sessions.Session.info\n"
            "def info(self):\n"
            "    raise KeyboardInterrupt\n"
            "sessions.Session.info = info\n"
            "sys.argv[1:] = ['start', '--', 'sleep', '60']\n"
            "cli.entry()\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 130 and p.stdout == "", (p.stdout, p.stderr)
    from sandbox import sessions

    assert [s.id for s in sessions.list_sessions()] == []  # not left running with an id no one has


def test_an_interrupt_as_the_runs_cgroup_is_made_leaves_none(isolated, monkeypatch: pytest.MonkeyPatch,
                                                             interrupt: Callable[[], None]) -> None:
    # Cut between the cgroup's mkdir and its keeping in `cg`, the run's cgroup stayed on the
    # host until a later start's sweep.
    from sandbox.isolation import cgroups

    backend = cgroups.detect()
    made: list[cgroups.RunCgroup] = []
    real = type(backend).create

    def create(self, limits, slot=None):  # type: ignore[no-untyped-def]
        cg = real(self, limits, slot)
        made.append(cg)
        interrupt()
        return cg

    monkeypatch.setattr(type(backend), "create", create)
    with pytest.raises(Interrupted):
        sandbox.run(["true"])
    monkeypatch.undo()
    assert made and not any(os.path.exists(d) for cg in made for d in cg.dirs)
