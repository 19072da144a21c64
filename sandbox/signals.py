"""Signal numbers, names and calls for the CLI's path, without the `signal` module.

`signal` turns every constant into an enum member, and importing `enum` (with `re`, which also
needs it) costs ~3 ms of each CLI call. `_signal` is the C module that `signal` re-exports: the
same calls, taking and giving plain ints.
"""

from __future__ import annotations

import _signal
import _thread
import sys
from _signal import (  # noqa: F401 - re-exported
    SIG_BLOCK,
    SIG_DFL,
    SIG_IGN,
    SIG_SETMASK,
    SIG_UNBLOCK,
    SIGALRM,
    SIGCHLD,
    SIGHUP,
    SIGINT,
    SIGKILL,
    SIGPIPE,
    SIGPROF,
    SIGTERM,
    SIGUSR1,
    SIGUSR2,
    SIGVTALRM,
    SIGXCPU,
    SIGXFSZ,
    getsignal,
    pidfd_send_signal,
    pthread_sigmask,
    signal,
    sigtimedwait,
)

_NUMBERS = {k: v for k, v in vars(_signal).items()
            if k.startswith("SIG") and not k.startswith("SIG_") and k.isupper() and isinstance(v, int)}
_NAMES: dict[int, str] = {}
# What the CLI ends on, as on Ctrl-C (its sandbox torn down). The timers' signals and SIGXCPU
# too: an interval timer, alarm() or a CPU limit a parent set survives its exec of us (`alarm
# 5; exec sandboxrun ...`, a timeout idiom), and their default action ended the CLI at once.
TIMERS = (SIGALRM, SIGVTALRM, SIGPROF, SIGXCPU)
ENDING = (SIGTERM, SIGHUP, SIGUSR1, SIGUSR2, *TIMERS)

for _value, _key in sorted((v, k) for k, v in _NUMBERS.items()):
    # As signal.Signals names a number with several names (SIGABRT, SIGIOT): the first in order.
    _NAMES.setdefault(_value, _key)


def name(number: int) -> str:
    """"SIGKILL" for 9; "SIG<N>" for the numbers with no name (32, 33, 35-63)."""
    return _NAMES.get(number) or f"SIG{number}"


def number(name: str) -> int | None:
    """9 for "SIGKILL" (and for "SIG9"); None for what names no signal."""
    found = _NUMBERS.get(name)
    if found is not None:
        return found
    digits = name[3:] if name.startswith("SIG") else ""
    return int(digits) if digits.isascii() and digits.isdigit() else None


# ---------------------------------------------------------------------------- held signals
# Python runs a signal's handler in the main thread, between any two bytecodes; one that raises
# (KeyboardInterrupt, the CLI's SIGTERM, a caller's own alarm handler) could cut a step that
# must not be cut: a child spawned whose pid is lost, a thread left in the pid namespace it
# unshared, a pool's worker started but not yet counted. Within `held()` such a signal waits
# for the step's end.

_depth = [0]  # the main thread's depth of held() sections
_pending: list[int] = []  # the signals held, in order, each once
_originals: dict[int, object] = {}  # the handlers held() stood in for
_CATCHABLE = tuple(n for n in range(1, _signal.NSIG) if n not in (_signal.SIGKILL, _signal.SIGSTOP))


def holding(sig: int) -> bool:
    """For a handler that raises: whether the main thread is in a held() section, `sig` then
    kept for its end instead. (A handler that asks is left in place by held().)"""
    if not _depth[0] or _thread.get_ident() != _main_ident():
        return False
    if sig not in _pending:
        _pending.append(sig)
    return True


def _main_ident() -> int:
    threading = sys.modules.get("threading")
    return threading.main_thread().ident if threading is not None else _MAIN  # type: ignore[return-value]


_MAIN = _thread.get_ident()  # (with no `threading` imported yet, only a _thread-started thread could be another)


def _stand_in(sig: int, frame: object) -> None:
    """Every Python handler's stand-in within held()."""
    if not holding(sig):  # (between the section's end and the handler's return to its place)
        handler = _originals.get(sig)
        if callable(handler):
            handler(sig, frame)


class held:
    """A step that a signal's exception must not cut in two: the signal is taken at its end.
    Only the main thread's steps need it (no Python handler runs in another). Each Python
    handler stands aside meanwhile, but those that call holding() themselves (the CLI's)."""

    __slots__ = ("_outer",)

    def __enter__(self) -> None:
        self._outer = False
        if _thread.get_ident() != _main_ident():
            return
        if _depth[0]:
            _depth[0] += 1
            return
        self._outer = True
        _pending.clear()  # (any left by a signal that raised in _leave's last steps was taken then)
        _depth[0] = 1  # first: from here a stand-in keeps what it is handed
        try:
            for sig in _CATCHABLE:
                handler = getsignal(sig)
                if callable(handler) and handler is not _stand_in and not getattr(handler, "holds", False):
                    _originals[sig] = handler
                    signal(sig, _stand_in)
        except BaseException:  # a handler not yet stood in for raised: no step began, put all back
            _leave()
            raise

    def __exit__(self, *exc: object) -> None:
        if _thread.get_ident() != _main_ident():
            return
        if self._outer:
            _leave()
        else:
            _depth[0] -= 1


def _leave() -> None:
    """The outer section's end: each handler back in its place, then each held signal taken."""
    raised: BaseException | None = None
    while _originals:  # still held meanwhile: a stand-in keeps its signal
        try:
            for sig, handler in list(_originals.items()):
                signal(sig, handler)  # type: ignore[arg-type]
                del _originals[sig]
        except BaseException as e:  # noqa: BLE001 - one put back already raised: taken once all are back
            raised = raised or e
    _depth[0] = 0
    taken = _pending[:]
    _pending.clear()
    if raised is not None:
        raise raised
    for sig in taken:
        handler = getsignal(sig)
        if callable(handler):
            handler(sig, None)  # raises now, between steps (any after it are then dropped)
