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


def integer(text: str) -> int:
    """A whole number as written in ASCII digits: int() also takes "1_0" (10) and other
    scripts' digits ("١")."""
    digits = text.strip().removeprefix("-")
    if not (digits.isascii() and digits.isdigit()):
        raise ValueError(text)
    return int(text)


integer.__name__ = "int"  # argparse names the type in its error: "invalid int value: '1_0'"


class _Formatter(argparse.HelpFormatter):
    def __init__(self, prog: str) -> None:
        # A fixed width: argparse otherwise imports shutil (~4 ms) to ask the terminal.
        cols = os.environ.get("COLUMNS", "")
        # (at most 5 digits: int() refuses over 4,300, and no terminal is wider)
        super().__init__(prog, width=int(cols) if cols.isascii() and cols.isdigit() and len(cols) <= 5 else 100)


DEBUG_HELP = "show the traceback of an error too (same message, same exit code)"


class Parser(argparse.ArgumentParser):
    """Every subcommand's parser: sandboxrun's usage errors (exit 2), and --debug, which
    cli.main reads (before `--`) for whichever subcommand runs."""

    def __init__(self, *args: Any, debug_help: str = DEBUG_HELP, **kw: Any) -> None:
        kw.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kw)
        self.add_argument("--debug", action="store_true", help=debug_help)

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        print(f"sandboxrun: error: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def add_run_options(p: argparse.ArgumentParser, without: tuple[str, ...] = ()) -> None:
    """The options of `sandboxrun run`, but those named in `without`."""
    from .cli import RUN_DEFAULTS, RUN_OPTIONS, option_attribute

    actions = {"value": "store", "list": "append", "flag": "store_true"}
    for names, kind, choices, metavar, help_text in RUN_OPTIONS:
        if set(names) & {*without, "--debug"}:  # (--debug: every Parser has it)
            continue
        kw: dict[str, Any] = {"action": actions[kind], "help": help_text}
        if choices is not None:
            kw["choices"] = choices
        if metavar is not None:
            kw["metavar"] = metavar
        default = RUN_DEFAULTS.get(option_attribute(names))
        if default is not None:
            kw["default"] = default
        p.add_argument(*names, **kw)


def command_of(p: argparse.ArgumentParser, ns: Any, usage: str) -> list[str]:
    """The CMD ARGS after `--` (argparse.REMAINDER keeps the `--`); a usage error if none."""
    cmd = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not cmd:
        p.error(f"no command given (usage: {usage})")
    return list(cmd)
