"""The argparse side of the command line: parsers for the subcommands, help and usage errors.

Imported only where a command needs it: argparse (with re, gettext and enum) costs a CLI call
~5 ms, and the plain `sandboxrun [OPTIONS] -- CMD` is parsed without it (cli.parse_plain_run).
"""

from __future__ import annotations

import argparse
import os
import sys

from .errors import EXIT_USAGE

TYPE_CHECKING = False  # typing costs ~5 ms to import; annotations here are strings anyway
if TYPE_CHECKING:
    from typing import Any, NoReturn

# argparse has gettext translate each of its strings, and gettext searches the disk for a
# catalogue on every call (importing locale first): ~3 ms of every CLI call. No catalogue
# for argparse ships with Python, and our own messages are English too.
argparse._ = str  # type: ignore[attr-defined]
argparse.ngettext = lambda singular, plural, n: singular if n == 1 else plural  # type: ignore[attr-defined]

class _Formatter(argparse.HelpFormatter):
    def __init__(self, prog: str) -> None:
        # A fixed width: argparse otherwise imports shutil (~4 ms) to ask the terminal.
        cols = os.environ.get("COLUMNS", "")
        super().__init__(prog, width=int(cols) if cols.isdigit() else 100)


class Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kw: Any) -> None:
        kw.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kw)

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        print(f"sandboxrun: error: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", "-p", default="strict", help="built-in profile name or a TOML file (default: strict)")
    p.add_argument("--timeout", "-t", help="wall timeout, e.g. 30, 30s, 2m (0 = none, if the profile allows)")
    p.add_argument("--memory", help="memory limit, e.g. 256MiB")
    p.add_argument("--cwd", help="workdir to mount read-write (default: a fresh, size-capped, empty tmpfs)")
    p.add_argument("--env", "-e", action="append", metavar="K=V", help="set a variable inside (repeatable)")
    p.add_argument("--ro-bind", action="append", metavar="SRC[:DST]", help="bind a host path read-only")
    p.add_argument("--bind", action="append", metavar="SRC[:DST]", help="bind a host path read-write")
    p.add_argument("--network", choices=("none", "loopback", "host"), help="network mode")
    p.add_argument("--stdin-file", metavar="FILE", help="feed this file to the command's stdin")
    p.add_argument("--shell", action="store_true", help="run CMD with /bin/sh -c inside the sandbox")
    p.add_argument("--json", action="store_true", help="print the Result as JSON instead of streaming output")
    p.add_argument("--trace", action="store_true", help="record the cost of each child setup step")
    p.add_argument("--debug", action="store_true", help="show tracebacks for internal errors")


def command_of(p: argparse.ArgumentParser, ns: Any, usage: str) -> list[str]:
    """The CMD ARGS after `--` (argparse.REMAINDER keeps the `--`); a usage error if none."""
    cmd = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not cmd:
        p.error(f"no command given (usage: {usage})")
    return list(cmd)
