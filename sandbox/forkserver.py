"""Entry point of the fork server process (see sandbox.forker)."""

from __future__ import annotations

import os


def main() -> None:
    fd = int(os.environ.pop("SANDBOXRUN_FORKSERVER_FD"))
    from .child import preload

    preload()
    from .forker import serve

    serve(fd)


if __name__ == "__main__":
    main()
