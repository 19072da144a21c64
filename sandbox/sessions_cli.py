"""`sandboxrun start|list|poll|log|write|send-keys|submit|paste|kill|wait|clear|remove`.

Each subcommand is a thin layer over sandbox.sessions; `--json` prints what the
library returns. A session is named by its id, its name, or a unique id prefix.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from . import sessions, signals
from .cli import exit_code_for, explain, run_kwargs
from .cliargs import Parser, add_run_options, command_of, integer
from .errors import InputError, SandboxError
from .result import Result

EXIT_WAIT_TIMEOUT = 124  # `wait --timeout` ran out while the session still runs (as timeout(1))


def _parser(name: str, description: str, with_id: bool = True) -> argparse.ArgumentParser:
    p = Parser(prog=f"sandboxrun {name}", description=description)
    if with_id:
        p.add_argument("id", help="session id, name, or unique id prefix")
    p.add_argument("--json", action="store_true", help="print JSON")
    return p


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2))


def _ended_line(sid: str, res: Result) -> str:
    line = explain(res)
    if res.status == "lost":
        line = f"sandboxrun: {res.error}"
    what = f" (exit {res.exit_code})" if res.exit_code >= 0 else f" ({res.signal})" if res.signal else ""
    return f"sandboxrun: session {sid} ended: {res.status}{what}" + (f"\n{line}" if line else "")


def cmd_start(argv: list[str]) -> int:
    p = Parser(prog="sandboxrun start", description="Start CMD in a background sandbox session; print its id.",
                usage="sandboxrun start [OPTIONS] [--name N] [--pty [--cols C --rows R]] -- CMD [ARGS...]")
    add_run_options(p, without=("--json",))
    p.add_argument("--json", action="store_true", help="print the session's info as JSON (state \"blocked\", "
                                                        "id null, when the filter refused the command)")
    p.add_argument("--name", "-n", help="a name to find the session by (default: derived from the command)")
    p.add_argument("--pty", action="store_true", help="give the command a terminal owned by the session")
    p.add_argument("--cols", type=integer, help="terminal width (default 80)")
    p.add_argument("--rows", type=integer, help="terminal height (default 24)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    ns = p.parse_args(argv)
    cmd = command_of(p, ns, "sandboxrun start [OPTIONS] -- CMD [ARGS...]")
    if not ns.pty and (ns.cols is not None or ns.rows is not None):
        raise InputError("--cols and --rows size the session's terminal: add --pty")
    if ns.pty and ns.stdin_file is not None:
        raise InputError("--stdin-file cannot be used with --pty: a PTY session reads its terminal")
    kw = run_kwargs(ns)
    shell_cmd: Any = " ".join(cmd) if ns.shell else cmd
    try:
        # Handed over (detached) only with its id printed: a Ctrl-C in between left a session
        # running whose id no one had, though the CLI said it was torn down.
        sess = sessions.start(shell_cmd, shell=ns.shell, name=ns.name, pty=ns.pty, cols=ns.cols, rows=ns.rows,
                              stdin_file=ns.stdin_file, ends_with_caller=True, **kw)
    except sessions.SessionBlocked as e:
        if ns.json:  # the shape of a session's info, as every other start prints
            _print_json(_blocked_info(e.result, ns.name, ns.pty))
        print(f"sandboxrun: blocked: {e.result.block_reason}", file=sys.stderr)
        return e.exit_code
    handed_over = False
    try:
        info = sess.info()
        res = sess.result if info["state"] == "exited" else None
        # It never ran: a setup failure (125) or an exec failure (127 not found, 126 not executable).
        failed = res is not None and (res.status == "setup_error" or bool(res.error and res.exit_code in (126, 127)))
        with signals.held():  # both or neither
            sess._detach()
            handed_over = True
            if ns.json:
                _print_json(info)
            elif not failed:  # an id on stdout says it started: `ID=$(sandboxrun start ...)` gets none otherwise
                print(sess.id)
    except BaseException:
        if not handed_over:
            try:
                sess.remove(grace=0)
            except SandboxError:
                pass
        raise
    if not ns.json and not failed:
        print(f"sandboxrun: session {sess.id} ({sessions.printable(info['name'])}) started, "
              f"sandbox pid {info['pid']}", file=sys.stderr)
    if res is not None and failed:
        print(f"sandboxrun: session {sess.id} did not start: {res.error}", file=sys.stderr)
        return exit_code_for(res)
    return 0


def _blocked_info(res: Result, name: str | None, pty: bool) -> dict[str, Any]:
    """Session info for a start the filter refused: no session, so no id, pid or directory."""
    return {"id": None, "name": name or sessions.derive_name(res.command), "state": "blocked", "pid": None,
            "monitor_pid": None, "pty": pty, "command": res.to_dict()["command"], "profile": res.profile,
            "created": None, "started_at": None, "ended_at": None, "dir": None, "status": "blocked",
            "exit_code": res.exit_code, "signal": None, "block_reason": res.block_reason}


def _age(ts: Any) -> str:
    if not isinstance(ts, (int, float)):
        return "-"
    s = max(0, int(time.time() - ts))
    return f"{s}s" if s < 120 else f"{s // 60}m" if s < 7200 else f"{s // 3600}h"


def cmd_list(argv: list[str]) -> int:
    p = _parser("list", "List background sessions, running and finished.", with_id=False)
    ns = p.parse_args(argv)
    rows = [s.info() for s in sessions.list_sessions()]
    if ns.json:
        _print_json(rows)
        return 0
    if not rows:
        print("no sessions", file=sys.stderr)
        return 0
    print(f"{'ID':<9} {'STATE':<8} {'PID':>7} {'AGE':>5} {'RESULT':<16} NAME")
    for r in rows:
        result = ""
        if r.get("status"):
            code = r.get("exit_code")
            result = r["status"] + (f" {code}" if isinstance(code, int) and code >= 0 else "")
        pid = r["pid"] if r["pid"] is not None else "-"
        print(sessions.printable(f"{r['id']:<9} {r['state']:<8} {pid:>7} {_age(r.get('created')):>5} {result:<16} "
                                 f"{r['name']}{'  [pty]' if r['pty'] else ''}"))  # a name edited in: escaped
    return 0


def cmd_poll(argv: list[str]) -> int:
    p = _parser("poll", "Print the output since the last poll, and say whether the session ended.")
    ns = p.parse_args(argv)
    sess = sessions.get(ns.id)
    pr = sess.poll()
    if ns.json:
        _print_json(pr.to_dict())
        return 0
    if pr.dropped:
        print(f"sandboxrun: {pr.dropped} bytes were dropped from the log before this poll", file=sys.stderr)
    sys.stdout.write(pr.stdout)
    sys.stdout.flush()
    sys.stderr.write(pr.stderr)
    if pr.ended and pr.result is not None:
        print(_ended_line(sess.id, pr.result), file=sys.stderr)
    return 0


def cmd_log(argv: list[str]) -> int:
    p = _parser("log", "Print lines of a session's log (default: the last 200).")
    p.add_argument("--offset", type=integer, help="first line to show (0-based; default: the tail)")
    p.add_argument("--limit", type=integer, help="how many lines (default 200)")
    p.add_argument("--stream", choices=("output", "stdout", "stderr"), default="output",
                   help="output (both streams as they came, default), stdout or stderr")
    ns = p.parse_args(argv)
    page = sessions.get(ns.id).log(ns.offset, ns.limit, ns.stream)
    if ns.json:
        _print_json(page.to_dict())
        return 0
    for line in page.lines:
        print(line)
    hint = page.hint()
    if hint:
        print(f"sandboxrun: {hint}", file=sys.stderr)
    return 0


def _ack(ns: argparse.Namespace, sess: sessions.Session, n: int) -> int:
    if ns.json:  # the session's id, not the name or prefix typed (as poll, log, clear say)
        _print_json({"id": sess.id, "ok": True, "written": n})
    return 0


def cmd_write(argv: list[str]) -> int:
    p = _parser("write", "Write DATA to the session's stdin (its terminal with --pty).")
    p.add_argument("data", nargs="?", default="", help="the bytes to write (exactly as given)")
    p.add_argument("--newline", "-l", action="store_true", help="append a newline")
    p.add_argument("--stdin", action="store_true", help="read the data from this command's stdin")
    p.add_argument("--eof", action="store_true", help="then close the session's stdin")
    ns = p.parse_intermixed_args(argv)  # `write ID --newline DATA`: options between the two too
    if ns.stdin and ns.data:  # before reading stdin: on a terminal that would wait for EOF first
        raise InputError("write: give DATA or --stdin, not both")
    data = sys.stdin.buffer.read() if ns.stdin else os.fsencode(ns.data)  # the bytes as given, UTF-8 or not
    if ns.newline:
        data += b"\n"
    if not data and not ns.eof:
        raise InputError("write: nothing to write (give DATA, --stdin or --eof)")
    sess = sessions.get(ns.id)
    return _ack(ns, sess, sess.write(data, eof=ns.eof))


def cmd_send_keys(argv: list[str]) -> int:
    p = _parser("send-keys", "Send keys to a PTY session: named keys (Enter, Tab, Escape, Up, Down, Left, Right, "
                             "Home, End, PageUp, PageDown, BSpace, Delete, F1-F12, C-c, M-x) and literal text.")
    p.add_argument("keys", nargs="+", metavar="KEY")
    p.add_argument("--literal", "-L", action="store_true", help="send every KEY as literal text")
    ns = p.parse_args(argv)
    sess = sessions.get(ns.id)
    return _ack(ns, sess, sess.send_keys(*ns.keys, literal=ns.literal))


def cmd_submit(argv: list[str]) -> int:
    p = _parser("submit", "Press Enter in the session (a newline on a plain stdin).")
    ns = p.parse_args(argv)
    sess = sessions.get(ns.id)
    return _ack(ns, sess, sess.submit())


def cmd_paste(argv: list[str]) -> int:
    p = _parser("paste", "Paste TEXT into the session (bracketed paste on a terminal).")
    p.add_argument("text")
    ns = p.parse_args(argv)
    if not ns.text:  # as `write ID ''`: an empty argument is more likely a mistake than a wish
        raise InputError("paste: nothing to paste (TEXT is empty)")
    sess = sessions.get(ns.id)
    return _ack(ns, sess, sess.paste(ns.text))


def _finished(ns: argparse.Namespace, sid: str, res: Result | None, verb: str) -> int:
    if res is None:
        if ns.json:
            _print_json({"id": sid, "state": "running"})
        else:
            print(f"sandboxrun: session {sid} is still running ({verb} timed out)", file=sys.stderr)
        return EXIT_WAIT_TIMEOUT
    if ns.json:
        d = res.to_dict()
        _print_json(d)
    else:
        print(_ended_line(sid, res), file=sys.stderr)
    if verb == "kill":  # it ended: 0, but for a lost one (no exit code to give, as `wait` says)
        return 1 if res.status == "lost" else 0
    return exit_code_for(res)


def _duration(option: str, text: str | None, unlimited: bool) -> float | None:
    """Seconds from an option written as run's --timeout is (5, 2.5, 500ms, 2m); None when not
    given, or, where `unlimited` allows it, "unlimited" (for ever)."""
    if text is None:
        return None
    from .units import parse_duration

    try:
        seconds = parse_duration(text)
    except ValueError as e:
        raise InputError(f"{option} {text!r}: {e}") from None
    if seconds is None and not unlimited:
        raise InputError(f"{option} {text!r}: expected a duration such as 5s or 500ms")
    return seconds


def cmd_kill(argv: list[str]) -> int:
    p = _parser("kill", "Stop the session's whole sandbox: SIGTERM, then SIGKILL after the grace.")
    p.add_argument("--grace", metavar="DURATION",
                   help="time between SIGTERM and SIGKILL, e.g. 2, 500ms (default: the profile's)")
    ns = p.parse_args(argv)
    grace = _duration("--grace", ns.grace, unlimited=False)  # before the session is looked for
    sess = sessions.get(ns.id)
    return _finished(ns, sess.id, sess.kill(grace), "kill")


def cmd_wait(argv: list[str]) -> int:
    p = _parser("wait", "Wait until the session ends; exit with its command's code (124 if --timeout ran out).")
    p.add_argument("--timeout", metavar="DURATION", help="give up after this long, e.g. 30, 30s, 2m "
                                                         "(default: wait for ever)")
    ns = p.parse_args(argv)
    timeout = _duration("--timeout", ns.timeout, unlimited=True)
    sess = sessions.get(ns.id)
    return _finished(ns, sess.id, sess.wait(timeout), "wait")


def cmd_clear(argv: list[str]) -> int:
    p = _parser("clear", "Forget a finished session (its logs and result).")
    ns = p.parse_args(argv)
    sess = sessions.get(ns.id)
    sess.clear()
    if ns.json:
        _print_json({"id": sess.id, "cleared": True})
    return 0


def cmd_remove(argv: list[str]) -> int:
    p = _parser("remove", "Kill the session if it runs, then forget it.")
    ns = p.parse_args(argv)
    sess = sessions.get(ns.id)
    res = sess.remove()
    if ns.json:
        _print_json({"id": sess.id, "removed": True, "result": res.to_dict() if res else None})
    return 0


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "start": cmd_start, "list": cmd_list, "poll": cmd_poll, "log": cmd_log, "write": cmd_write,
    "send-keys": cmd_send_keys, "submit": cmd_submit, "paste": cmd_paste, "kill": cmd_kill, "wait": cmd_wait,
    "clear": cmd_clear, "remove": cmd_remove,
}


def main(argv: list[str]) -> int:
    """argv[0] is the subcommand; errors propagate to sandbox.cli.main (one line, exit 2)."""
    if not argv or argv[0] not in COMMANDS:
        raise InputError(f"unknown session subcommand {argv[:1]!r} (known: {', '.join(COMMANDS)})")
    return COMMANDS[argv[0]](argv[1:])
