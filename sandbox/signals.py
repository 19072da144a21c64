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
# The handler each stand-in stands for. An entry outlives its section: a stand-in left in place
# (a second signal's exception cut _leave short; a caller who saved getsignal() within a section
# and set it back after) finds its handler here and calls it, outside a section, as if in place.
_originals: dict[int, object] = {}
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
    if not holding(sig):  # outside a section: what it stands for, as if in place
        handler = _originals.get(sig)
        if callable(handler):
            handler(sig, frame)


class held:
    """A step that a signal's exception must not cut in two: the signal is taken at its end.
    Only the main thread's steps need it (no Python handler runs in another). Each Python
    handler stands aside meanwhile, but those that call holding() themselves (the CLI's).

    Python runs a handler only at some points (a call's return, a loop's back edge, a function's
    start): the state below is changed between them, so that wherever a handler raises (two
    signals at once: one is taken inside a step of ours, the next at the step's end) a stand-in
    left in place still calls its handler and the next section starts clean."""

    __slots__ = ("_outer",)

    def __enter__(self) -> None:
        self._outer = False
        if _thread.get_ident() != _main_ident():
            return
        if _depth[0]:
            _depth[0] += 1
            return
        self._outer = True
        del _pending[:]  # (one left by a signal that cut the last _leave short was raised then)
        _depth[0] = 1  # first: from here a stand-in keeps what it is handed
        try:
            for sig in _CATCHABLE:
                handler = getsignal(sig)
                if callable(handler) and handler is not _stand_in and not getattr(handler, "holds", False):
                    _originals[sig] = handler  # (before the stand-in: never one without its handler)
                    signal(sig, _stand_in)
        except BaseException:  # a handler not yet stood in for raised: no step began
            _depth[0] = 0  # (no call before it: another such handler cannot cut in)
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
    """The outer section's end: each held signal taken (every handler runs, the first exception
    is raised), each stand-in replaced by its handler."""
    _depth[0] = 0  # (a stand-in calls its handler from here on)
    taken = _pending[:]
    del _pending[:]
    raised: BaseException | None = None
    for sig in taken:
        handler = getsignal(sig)
        if callable(handler):
            try:
                handler(sig, None)
            except BaseException as e:  # noqa: BLE001 - raised once every held signal is taken
                raised = raised or e
    while True:
        try:
            for sig in list(_originals):
                if getsignal(sig) is _stand_in:  # (not one the step itself set)
                    signal(sig, _originals[sig])  # type: ignore[arg-type]
            break
        except BaseException as e:  # noqa: BLE001 - one put back raised: the rest are put back first
            raised = raised or e
    if raised is not None:
        raise raised
