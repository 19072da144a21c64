"""sandbox.signals: the signal module's numbers and names, without its enums."""

from __future__ import annotations

import signal

from sandbox import signals


def test_names_and_numbers_are_the_signal_modules() -> None:
    for number in range(1, signal.NSIG):
        try:
            expected = signal.Signals(number).name
        except ValueError:
            expected = f"SIG{number}"  # 32, 33, 35-63: no name in Python
        assert signals.name(number) == expected
        assert signals.number(expected) == number
    for name, member in signal.Signals.__members__.items():  # aliases too (SIGIOT, SIGPOLL)
        assert signals.number(name) == int(member)
    assert signals.number("SIGNOPE") is None and signals.number("KILL") is None


def test_constants_and_calls_are_the_signal_modules() -> None:
    for name in ("SIGKILL", "SIGTERM", "SIGHUP", "SIGINT", "SIGCHLD", "SIGPIPE", "SIGXCPU", "SIG_BLOCK",
                 "SIG_SETMASK", "SIG_UNBLOCK", "SIG_DFL", "SIG_IGN"):
        assert getattr(signals, name) == getattr(signal, name)
    old = signals.pthread_sigmask(signals.SIG_BLOCK, {signals.SIGPIPE})
    try:
        assert signals.SIGPIPE in signal.pthread_sigmask(signal.SIG_BLOCK, set())
    finally:
        signals.pthread_sigmask(signals.SIG_SETMASK, old)
