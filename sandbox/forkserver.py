"""Entry point of the fork server process (see sandbox.forker)."""

from __future__ import annotations

import os


def main() -> None:
    import signal

    # In its caller's process group, a terminal's Ctrl-C reaches us too: the caller decides
    # what an interrupt ends (its runs, through their own teardown); we die with it. (Each
    # child sets SIGINT back to its default before anything of a run starts.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # (ignored by our caller: kept across exec) we reap
    fd = int(os.environ.pop("SANDBOXRUN_FORKSERVER_FD"))
    from .child import preload

    preload()
    from .forker import serve

    serve(fd)


if __name__ == "__main__":
    main()
