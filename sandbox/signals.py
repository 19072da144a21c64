"""Signal numbers, names and calls for the CLI's path, without the `signal` module.

`signal` turns every constant into an enum member, and importing `enum` (with `re`, which also
needs it) costs ~3 ms of each CLI call. `_signal` is the C module that `signal` re-exports: the
same calls, taking and giving plain ints.
"""

from __future__ import annotations

import _signal
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
