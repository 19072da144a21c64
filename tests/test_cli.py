"""The CLI as a user meets it: exit codes, one-line errors, no tracebacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent


def cli(*args: str, stdin: bytes | None = None, timeout: float = 60) -> subprocess.CompletedProcess[bytes]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "sandbox", *args], input=stdin, capture_output=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module", autouse=True)
def _needs_sandbox(isolated) -> None:
    pass


def test_readme_command() -> None:
    r = cli("--profile", "strict", "--", "python3", "-c", "print(6*7)")
    assert (r.returncode, r.stdout) == (0, b"42\n"), r.stderr


def test_cli_runs_in_its_own_pid_namespace() -> None:
    # The CLI's stage makes the pid namespace itself (stage.c, clone_pid_namespace): the
    # command is PID 2 under our init, and this test's own process is out of its sight.
    r = cli("--", "sh", "-c", f"echo $$; tr '\\0' ' ' < /proc/1/cmdline; echo; "
                              f"test -e /proc/{os.getpid()}/status && echo visible || echo hidden")
    assert r.returncode == 0 and r.stdout.split() == [b"2", b"sandboxrun-init", b"hidden"], (r.stdout, r.stderr)


def test_a_command_line_over_8_kib_runs_and_its_init_shows_no_host_paths(tmp_path: Path) -> None:
    # 220 long --ro-bind: more binds than the native stage holds (the Python child runs it)
    # and over 8 KiB of arguments, past where python-prctl's set_proctitle looks for them:
    # it dereferenced NULL and PID 1 died of SIGSEGV (reported as SIGKILL, exit 137).
    src = tmp_path / ("s" * 40)
    src.mkdir()
    binds = [a for i in range(220) for a in ("--ro-bind", f"{src}:/opt/{'d' * 12}{i}")]
    assert len(" ".join(binds)) > 8192
    r = cli(*binds, "--", "sh", "-c", "tr '\\0' ' ' < /proc/1/cmdline; echo; ls /opt | wc -l")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [b"sandboxrun-init", b"220"], r.stdout


@pytest.mark.parametrize("columns", ["9" * 4400, "99999999999", "0", "abc", "-5"])
def test_any_columns_value_leaves_usage_errors_named(columns: str) -> None:
    # 4,400 digits: Python's int() refuses over 4,300, and the help formatter's ValueError
    # became "internal error" (exit 125) instead of the usage error.
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS=columns)
    r = subprocess.run([sys.executable, "-m", "sandbox", "--bogus"], capture_output=True, env=env, timeout=60)
    assert r.returncode == 2 and b"unrecognized arguments: --bogus" in r.stderr, r.stderr[-300:]


def test_exit_code_mirrors_command() -> None:
    assert cli("--", "sh", "-c", "exit 7").returncode == 7
    r = cli("--", "sh", "-c", "kill -TERM $$")
    assert r.returncode == 128 + 15 and b"SIGTERM" in r.stderr


@pytest.mark.parametrize("sig", [33, 40, 63])
def test_exit_code_of_a_signal_python_has_no_name_for(sig: int) -> None:
    # Signals 32, 33 and 35-63 have no name in Python's signal module: they exited 1.
    r = cli("--", "python3", "-c", f"import os; os.kill(os.getpid(), {sig})")
    assert r.returncode == 128 + sig, (r.returncode, r.stderr)


def test_timeout_is_124_with_a_line() -> None:
    r = cli("--timeout", "0.5", "--", "sleep", "10")
    assert r.returncode == 124 and b"timed out" in r.stderr


def test_blocked_is_125() -> None:
    r = cli("--", "rm", "-rf", "/")
    assert r.returncode == 125 and b"blocked" in r.stderr


def test_json_result() -> None:
    r = cli("--json", "--", "sh", "-c", "echo hi; exit 3")
    d = json.loads(r.stdout)
    assert r.returncode == 3 and d["status"] == "nonzero_exit" and d["stdout"] == "hi\n" and d["exit_code"] == 3


def test_check_subcommand() -> None:
    assert cli("check", "--", "ls", "-la").returncode == 0
    r = cli("check", "--", "mkfs.ext4", "/dev/sda1")
    assert r.returncode == 1 and b"mkfs" in r.stdout


def test_profiles_subcommand() -> None:
    r = cli("profiles")
    assert r.returncode == 0 and b"strict" in r.stdout and b"ci" in r.stdout
    r = cli("profiles", "show", "standard")
    assert json.loads(r.stdout)["name"] == "standard"


def test_stdin_file(tmp_path) -> None:
    f = tmp_path / "in"
    f.write_bytes(b"abc")
    r = cli("--stdin-file", str(f), "--", "cat")
    assert r.stdout == b"abc"


def test_piped_stdin_reaches_the_command() -> None:
    r = cli("--", "sh", "-c", "cat; echo; readlink /proc/self/fd/0", stdin=b"hello")
    assert r.returncode == 0, r.stderr
    data, link = r.stdout.decode().split("\n")[:2]
    assert data == "hello" and link.startswith("pipe:")


def test_a_file_on_stdin_is_copied_from_where_the_caller_is(tmp_path) -> None:
    # As with any wrapper command, `{ read first; sandboxrun -- cat; } < file` goes on from the
    # second line; and the command holds a pipe of ours, never the caller's file.
    f = tmp_path / "lines"
    f.write_text("one\ntwo\nthree\n")
    exe = f"{sys.executable} -m sandbox"
    script = f'{{ read -r first; {exe} -- sh -c "cat; readlink /proc/self/fd/0"; }} < {f}'
    r = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("two\nthree\npipe:"), r.stdout
    assert str(tmp_path) not in r.stdout


def test_a_stdin_flood_ends_with_the_command_and_leaves_the_callers_pipe_as_it_was() -> None:
    rfd, wfd = os.pipe()
    stop = threading.Event()

    def flood() -> None:
        try:
            while not stop.is_set():
                os.write(wfd, b"y" * 65536)
        except OSError:
            pass

    t = threading.Thread(target=flood)
    t.start()
    try:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        r = subprocess.run([sys.executable, "-m", "sandbox", "--", "head", "-c", "3"], stdin=rfd,
                           capture_output=True, timeout=60, env=env)
        assert (r.returncode, r.stdout) == (0, b"yyy"), r.stderr
        r = subprocess.run([sys.executable, "-m", "sandbox", "--timeout", "1", "--", "sleep", "10"], stdin=rfd,
                           capture_output=True, timeout=60, env=env)
        assert r.returncode == 124, r.stderr  # an unread flood holds nothing up
        assert os.get_blocking(rfd)  # its flags are the caller's: never set for the copy
    finally:
        stop.set()
        os.close(rfd)
        t.join()
        os.close(wfd)


def test_a_terminal_on_stdin_is_not_passed_on() -> None:
    master, slave = os.openpty()
    try:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        r = subprocess.run([sys.executable, "-m", "sandbox", "--", "sh", "-c", "cat; readlink /proc/self/fd/0"],
                           stdin=slave, capture_output=True, timeout=60, env=env)
        assert r.returncode == 0 and r.stdout.startswith(b"pipe:"), (r.stdout, r.stderr)
    finally:
        os.close(master)
        os.close(slave)


@pytest.mark.parametrize("args, needle", [
    (("--profile", "nonesuch", "--", "true"), b"unknown profile"),
    (("--memory", "lots", "--", "true"), b"memory"),
    (("--cwd", "/no/such/dir", "--", "true"), b"no such directory"),
    (("--cwd", "/etc/passwd", "--", "true"), b"not a directory"),
    (("--env", "NOEQUALS", "--", "true"), b"NAME=VALUE"),
    (("--ro-bind", "relative", "--", "true"), b"absolute"),
    (("--",), b"no command"),
    (("--shell", "--", "echo 'unbalanced"), b"Syntax error"),  # the shell's own, inside: passed on as it is
    (("--timeout", "-3", "--", "true"), b"negative"),
])
def test_bad_input_is_one_line_never_a_traceback(args, needle) -> None:
    r = cli(*args)
    assert b"Traceback" not in r.stderr, r.stderr
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip() and not line.startswith(b"usage:")]
    assert len(lines) == 1 and needle in lines[0], r.stderr


def test_sigint_tears_down_and_exits_130() -> None:
    import signal
    import time

    from conftest import end_marked, marker

    from sandbox import leaks

    mark = marker()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-m", "sandbox", "--", "bash", "-c", f"exec -a {mark} sleep 30"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while not [q for q in leaks.marked(mark) if q.pid != p.pid] and time.monotonic() < deadline:
            time.sleep(0.02)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=10)
        assert p.returncode == 130, err
        assert b"sandbox torn down" in err and leaks.marked(mark) == [], err
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
        end_marked(mark)


RUN_EXIT_4 = json.dumps({"action": "run_command", "properties": [{"name": "command", "value": "echo hi; exit 4"}]})


@pytest.mark.parametrize("args, stdin, code", [
    (("--json", "--", "sh", "-c", "echo hi; exit 3"), None, 3),
    (("--shell", "--", "seq 1 100000"), None, 0),  # streaming: the command's output goes nowhere
    (("payload",), RUN_EXIT_4, 4),
    (("payload", "--dry-run"), RUN_EXIT_4, 0),
    (("check", "--json", "--", "ls"), None, 0),
], ids=["run-json", "run-streaming", "payload", "payload-dry-run", "check-json"])
def test_reader_gone_is_quiet_and_keeps_the_exit_code(args, stdin, code, tmp_path: Path) -> None:
    """`sandboxrun ... | head`: the reader left before the result was printed. No "internal error",
    no traceback, no exit 125 (that means "blocked"): the exit status is still the command's."""
    r_fd, w_fd = os.pipe()
    os.close(r_fd)  # the reader is gone before the first write: every write meets EPIPE
    try:
        p = subprocess.run([sys.executable, "-m", "sandbox", *args], stdout=w_fd, stderr=subprocess.PIPE,
                           input=stdin.encode() if stdin else b"", timeout=60, cwd=tmp_path,  # a payload's workdir
                           env=dict(os.environ, PYTHONPATH=str(ROOT)))
    finally:
        os.close(w_fd)
    assert (p.returncode, p.stderr) == (code, b""), p.stderr


# Modules that a plain `sandboxrun -- CMD` must not import: each costs 1-5 ms of every CLI call
# (pathlib, typing, contextlib, socket, locale via argparse's gettext, logging via concurrent.futures;
# re, enum, signal, argparse, selectors, threading, functools, collections, ctypes: ~15 ms together).
# Checked by what is imported, not by timing it (timings are scripts/bench.py's job).
HEAVY_FOR_THE_CLI = {"pathlib", "typing", "contextlib", "socket", "locale", "logging", "concurrent.futures",
                     "subprocess", "tomllib", "json", "tempfile", "shutil", "dataclasses", "inspect", "asyncio",
                     "re", "enum", "signal", "argparse", "gettext", "selectors", "threading", "functools",
                     "collections", "ctypes", "shlex", "fnmatch", "math", "atexit"}


def test_the_run_path_imports_nothing_heavy() -> None:
    code = ("import sys\nfrom sandbox.cli import main\n"
            "sys.argv = ['sandboxrun', '--profile', 'strict', '--', '/bin/true']\ncode = main()\n"
            "print(code, ' '.join(sorted(sys.modules)))")
    # -S: no site-packages hook can import any of them first (the package comes from PYTHONPATH)
    p = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    code_text, _, modules = p.stdout.strip().partition(" ")
    assert code_text == "0", p.stdout + p.stderr
    loaded = set(modules.split())
    assert "sandbox.supervisor" in loaded  # it did run
    assert not loaded & HEAVY_FOR_THE_CLI, loaded & HEAVY_FOR_THE_CLI


def test_the_installed_command_imports_nothing_heavy() -> None:
    # The `sandboxrun` script itself (bin/sandboxrun), not a console-script wrapper: pip's imports re.
    launcher = Path(sys.executable).parent / "sandboxrun"
    if not launcher.exists():
        pytest.skip("no sandboxrun command next to this interpreter (not installed by scripts/setup.sh)")
    p = subprocess.run([str(launcher), "--profile", "strict", "--", "/bin/true"], capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, PYTHONPROFILEIMPORTTIME="1"))
    assert p.returncode == 0, p.stderr
    imported = {line.rsplit("|", 1)[1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}
    assert "sandbox.supervisor" in imported
    assert not imported & HEAVY_FOR_THE_CLI, imported & HEAVY_FOR_THE_CLI


# The plain run options are parsed without argparse (cli.parse_plain_run); whatever it accepts,
# argparse must read the same way. Words drawn from the options, their values and their traps.
_WORDS = ["--profile", "-p", "--timeout", "-t", "--memory", "--cwd", "--env", "-e", "--ro-bind", "--bind",
          "--network", "--stdin-file", "--shell", "--json", "--trace", "--debug", "--yield-ms", "--prof",
          "--profile=strict", "--env=A=1", "--network=host", "--network=bad", "-pstrict", "--json=1",
          "--", "-", "-1", "strict", "30s", "A=1", "/tmp", "none", "loopback", "echo", "hi", "-x", "a b", ""]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(_WORDS), max_size=8), st.lists(st.sampled_from(_WORDS), max_size=3))
def test_plain_run_options_read_as_argparse_reads_them(options: list[str], command: list[str]) -> None:
    from sandbox.cli import RUN_OPTIONS, option_attribute, parse_plain_run, parse_run_with_argparse

    for argv in (options, [*options, "--", "cmd", *command]):
        plain = parse_plain_run(argv)
        if plain is None:
            continue  # argparse's to parse (or to refuse, with its usage line)
        ns, cmd = parse_run_with_argparse(list(argv))  # a usage error here would be SystemExit: a failure
        assert cmd == plain.command
        for name in [*(option_attribute(o[0]) for o in RUN_OPTIONS), "yield_ms"]:
            assert getattr(ns, name) == getattr(plain, name), (argv, name)


def test_a_reader_that_stops_reading_does_not_hold_the_run_past_its_timeout() -> None:
    # The streaming CLI wrote the command's output to its stdout with blocking writes in the
    # loop that keeps the deadline: a reader that read nothing kept the sandbox running.
    import time

    from conftest import end_marked, marker

    from sandbox import leaks

    mark = marker()
    p = subprocess.Popen([sys.executable, "-m", "sandbox", "--timeout", "1", "--", "bash", "-c",
                          f"head -c 500000 /dev/zero; exec -a {mark} sleep 100"],
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        started = time.monotonic()
        while time.monotonic() - started < 10 and not [q for q in leaks.marked(mark) if q.pid != p.pid]:
            time.sleep(0.05)
        assert [q for q in leaks.marked(mark) if q.pid != p.pid], "the command never got past its output"
        deadline = time.monotonic() + 6  # the timeout (1 s) and its grace (1 s), and then some
        while [q for q in leaks.marked(mark) if q.pid != p.pid] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [q for q in leaks.marked(mark) if q.pid != p.pid] == [], "still running with its reader stalled"
        out, err = p.communicate(timeout=20)  # now read: everything the command wrote is there
        assert p.returncode == 124 and len(out) == 500000, (p.returncode, len(out), err)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
        end_marked(mark)


@pytest.mark.parametrize("where", ["closed", "full"])
@pytest.mark.parametrize("mode", [(), ("--json",)], ids=["streaming", "json"])
def test_an_unwritable_stdout_keeps_the_commands_exit_code(where: str, mode: tuple[str, ...]) -> None:
    # A closed fd 1 (`>&-`) or a full device: the output is lost, as to a reader that went
    # away; the command still runs and its exit code is the CLI's, never a traceback.
    out: Any = open("/dev/full", "wb") if where == "full" else subprocess.DEVNULL  # noqa: SIM115
    try:
        p = subprocess.run([sys.executable, "-m", "sandbox", *mode, "--", "sh", "-c", "echo hi; exit 4"],
                           env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=out, stderr=subprocess.PIPE,
                           preexec_fn=(lambda: os.close(1)) if where == "closed" else None, timeout=60)
    finally:
        if where == "full":
            out.close()
    assert p.returncode == 4 and b"Traceback" not in p.stderr and b"internal error" not in p.stderr, p.stderr


def test_a_closed_stderr_keeps_the_commands_exit_code() -> None:
    p = subprocess.run([sys.executable, "-m", "sandbox", "--", "sh", "-c", "echo hi >&2; exit 4"],
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                       preexec_fn=lambda: os.close(2), timeout=60)
    assert p.returncode == 4 and p.stdout == b"", p


def test_a_mistyped_subcommand_gets_a_hint(isolated) -> None:
    """Any first word that is no subcommand is the command (`sandboxrun make test`), so
    `sandboxrun lsit` ran `lsit`: not found, it now names the subcommand it looks like."""
    r = cli("lsit")
    assert r.returncode == 127 and b"did you mean `sandboxrun list`?" in r.stderr, r.stderr
    for args in (("--", "lsit"), ("frobnicate",), ("--json", "lsit")):  # after --, not close, or a Result
        r = cli(*args)
        assert r.returncode == 127 and b"did you mean" not in r.stderr + r.stdout, (args, r.stderr)


# ---------------------------------------------------------------------------- --debug


def test_debug_after_the_double_dash_is_the_commands_word(tmp_path: Path) -> None:
    # `-- echo --debug` switched sandboxrun's debug mode on: a traceback and exit 1 for a bad --cwd.
    # (A missing path of the test's own: a host may have a /nonexistent, as CI's had.)
    missing = tmp_path / "missing"
    r = cli("--cwd", str(missing), "--", "echo", "--debug")
    text = r.stderr.decode()
    assert r.returncode == 2 and "Traceback" not in text, text
    assert text.strip() == f"sandboxrun: error: --cwd: no such directory: {missing}"


def test_debug_adds_a_traceback_and_keeps_the_message_and_exit_code(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    r = cli("--debug", "--cwd", str(missing), "--", "true")
    text = r.stderr.decode()
    assert r.returncode == 2 and "Traceback" in text, (r.returncode, text)
    assert text.strip().splitlines()[-1] == f"sandboxrun: error: --cwd: no such directory: {missing}"


@pytest.mark.parametrize("argv", [["check", "--debug", "--", "ls"], ["profiles", "--debug"],
                                  ["profiles", "show", "--debug", "strict"], ["list", "--debug"]])
def test_every_subcommand_takes_debug(argv: list[str], private_state_dir: Path) -> None:
    r = cli(*argv)
    assert r.returncode == 0 and b"unrecognized" not in r.stderr, r.stderr
    assert b"--debug" in cli(argv[0], "--help").stdout  # and says so in its help


def test_debug_before_a_subcommand_is_that_subcommands(private_state_dir: Path) -> None:
    # `sandboxrun --debug list` ran a command named `list` (127: not found).
    r = cli("--debug", "list")
    assert r.returncode == 0 and b"no sessions" in r.stdout + r.stderr, (r.returncode, r.stderr)
    r = cli("--debug", "python", "--memory", "1", "-c", "pass")
    assert r.returncode == 2 and b"Traceback" in r.stderr, r.stderr  # debug reached python's handler


def test_options_between_positionals() -> None:
    # argparse's `?` positional after an option was refused: `profiles show --json strict`.
    r = cli("profiles", "show", "--json", "strict")
    assert r.returncode == 0 and json.loads(r.stdout)["name"] == "strict", r.stderr


def test_json_has_no_lone_surrogates_for_a_command_that_is_not_utf8() -> None:
    # "\udcff" (Python's escape for the byte 0xff) is text no strict JSON reader takes.
    r = subprocess.run([sys.executable, "-m", "sandbox", "--json", "--", os.fsdecode(b"\xff")], capture_output=True,
                       timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    d = json.loads(r.stdout)
    assert r.returncode == 127 and d["command"] == ["\ufffd"], d["command"]
    json.dumps(d, ensure_ascii=False).encode("utf-8")  # every string is UTF-8 text


@pytest.mark.parametrize("args", [["--yield-ms", "1_0", "--", "true"], ["batch", "-j", "\u0661", "/dev/null"],
                                  ["log", "x", "--limit", "2_0"], ["start", "--pty", "--cols", "8_0", "--", "sh"]])
def test_whole_number_options_take_ascii_digits_only(args: list[str]) -> None:
    """int() reads "1_0" as 10 and Arabic-Indic "١" as 1: each was taken."""
    r = cli(*args)
    assert r.returncode == 2 and b"invalid int value" in r.stderr, r


_NONBLOCKING_STDOUT = ("import fcntl, os, sys; fcntl.fcntl(1, fcntl.F_SETFL, fcntl.fcntl(1, fcntl.F_GETFL) | os.O_NONBLOCK); "
                       "os.execv(sys.executable, [sys.executable, '-m', 'sandbox', *sys.argv[1:]])")


@pytest.mark.parametrize("mode", ["json", "batch"])
def test_a_non_blocking_stdout_with_a_slow_reader_loses_nothing(isolated, mode: str) -> None:
    # Another holder of a shared pipe set O_NONBLOCK: --json stopped at 64 KiB with an internal
    # error, and batch cut each line at 64 KiB, without a word and with exit 0.
    import time

    big = "yes | head -c 500000"
    args = ["--json", "--", "sh", "-c", big] if mode == "json" else ["batch", "-"]
    p = subprocess.Popen([sys.executable, "-c", _NONBLOCKING_STDOUT, *args], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.stdin is not None and p.stdout is not None
    if mode == "batch":
        p.stdin.write((json.dumps({"command": big, "shell": True}) + "\n").encode() * 2)
    p.stdin.close()
    time.sleep(2)  # the pipe fills while nobody reads
    out = p.stdout.read()
    err = p.stderr.read() if p.stderr else b""
    assert p.wait(timeout=60) == 0, err[-2000:]
    docs = [json.loads(line) for line in out.splitlines()] if mode == "batch" else [json.loads(out)]
    assert len(docs) == (2 if mode == "batch" else 1) and all(d["stdout_bytes"] == 500000 for d in docs), err


@pytest.mark.parametrize(("args", "code"), [
    (["--timeout", "1", "--", "sleep", "3"], 124),
    (["--", "no-such-command-xyz"], 127),
    (["--memory", "1", "--", "true"], 2),
    (["--", "sh", "-c", "head -c 2000000 /dev/zero"], 0),  # (output truncated: a line on stderr)
])
def test_a_stderr_that_cannot_be_written_keeps_every_exit_code(isolated, args: list[str], code: int) -> None:
    # The line sandboxrun writes there failed, the error handler's own line too: exit 1.
    with open("/dev/full", "wb") as full:
        cp = subprocess.run([sys.executable, "-m", "sandbox", *args], stdout=subprocess.DEVNULL, stderr=full,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=60)
    assert cp.returncode == code


def _ended(**fields: Any) -> Any:
    import sandbox

    return sandbox.Result(command=["x"], **fields)


@pytest.mark.parametrize("ended", [
    {"exit_code": 0},  # it had exited by itself, 0, before the supervisor read the byte past the cap
    {"exit_code": 3},
    {"signal": "SIGKILL"},  # the supervisor's kill
])
def test_an_output_limit_exits_137_however_the_command_ended(ended: dict[str, Any]) -> None:
    from sandbox.cli import exit_code_for, explain

    r = _ended(status="output_limit", error="stdout passed the output limit of 64KiB", **ended)
    assert exit_code_for(r) == 137
    assert explain(r) == "sandboxrun: output limit: stdout passed the output limit of 64KiB"


def test_an_output_limit_from_the_cli_is_137_with_a_line(tmp_path: Path) -> None:
    prof = tmp_path / "p.toml"
    prof.write_text('extends = "strict"\n[limits]\noutput = "64KiB"\noutput_overflow = "kill"\n')
    # (the first passes the cap as it exits: the kill lands before or after its own exit 0)
    for command in ("head -c 65537 /dev/zero; exit 0",) * 4 + ("yes",):
        r = cli("--profile", str(prof), "--", "sh", "-c", command)
        assert r.returncode == 137 and b"sandboxrun: output limit: stdout passed the output limit of 64KiB" in r.stderr, (
            command, r.returncode, r.stderr[-300:])


def test_a_signaled_run_says_why_when_the_result_does() -> None:
    from sandbox.cli import explain

    why = "SIGXFSZ, the signal a write past the file size limit of 1MiB gets (limits.file_size)"
    assert explain(_ended(status="signaled", signal="SIGXFSZ", error=why)) == f"sandboxrun: killed by {why}"
    assert explain(_ended(status="signaled", signal="SIGSEGV")) == "sandboxrun: killed by SIGSEGV"
    assert (explain(_ended(status="signaled", signal="SIGKILL", error="the sandbox was killed"))
            == "sandboxrun: killed by SIGKILL: the sandbox was killed")


def test_a_sigxfsz_from_the_cli_names_the_file_size_limit() -> None:
    r = cli("--", "sh", "-c", "kill -XFSZ $$")
    assert r.returncode == 128 + 25, r.stderr
    assert b"sandboxrun: killed by SIGXFSZ, the signal a write past the file size limit of 64MiB gets" in r.stderr, r.stderr


def test_a_file_on_stdin_is_left_where_the_command_stopped_reading(tmp_path) -> None:
    # `{ read -r x; head -n1; } < nums` gives 2 to head: through sandboxrun it read a fragment
    # of a much later line (the copy had read up to 128 KiB ahead of the command). (`read`
    # takes its pipe a byte at a time; head -n1 takes a block of any pipe.)
    f = tmp_path / "nums"
    f.write_text("".join(f"{i}\n" for i in range(1, 100_001)))
    exe = f"{sys.executable} -m sandbox"
    script = f"{{ {exe} -- sh -c 'read -r x; echo \"$x\"'; head -n1; }} < {f}"
    r = subprocess.run(["sh", "-c", script], capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT)
    assert (r.returncode, r.stdout) == (0, "1\n2\n"), r


def test_a_cli_killed_mid_run_leaves_the_callers_pipe_blocking() -> None:
    # O_NONBLOCK was set on the shell's pipe and taken off in a finally: after a SIGKILL
    # (`timeout -s KILL`) the shell's next reader got EAGAIN.
    import signal

    rfd, wfd = os.pipe()
    try:
        p = subprocess.Popen([sys.executable, "-m", "sandbox", "--", "sh", "-c", "echo go; sleep 30"], stdin=rfd,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)))
        try:
            assert p.stdout is not None and p.stdout.readline() == b"go\n"
            assert os.get_blocking(rfd)  # while it runs, too
        finally:
            p.send_signal(signal.SIGKILL)
            p.communicate(timeout=60)
        assert os.get_blocking(rfd)
    finally:
        os.close(rfd)
        os.close(wfd)


def test_stdin_file_of_a_fifo_waits_for_its_writer(tmp_path) -> None:
    # Opened O_NONBLOCK (never to hang on the open), it read EOF at once when no writer was
    # there yet; `< ff` waits for one, and so does --stdin-file now (Ctrl-C ends the wait).
    import signal
    import time

    ff = tmp_path / "ff"
    os.mkfifo(ff)

    def late_writer() -> None:
        time.sleep(0.5)
        for _ in range(100):  # (never blocked for good on a reader that is gone)
            try:
                w = os.open(ff, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # ENXIO: no reader (yet)
                time.sleep(0.1)
                continue
            os.write(w, b"data\n")
            os.close(w)
            return

    t = threading.Thread(target=late_writer)
    t.start()
    try:
        r = cli("--stdin-file", str(ff), "--", "sh", "-c", "cat; readlink /proc/self/fd/0")
    finally:
        t.join()
    assert r.returncode == 0 and r.stdout.startswith(b"data\npipe:"), r
    p = subprocess.Popen([sys.executable, "-m", "sandbox", "--stdin-file", str(ff), "--", "cat"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    time.sleep(1)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 130 and err.endswith(b"sandboxrun: interrupted\n"), (out, err)  # (no sandbox yet to tear down)


def test_stdin_file_of_a_device_is_refused_by_name_but_dev_null_is_no_input() -> None:
    r = cli("--stdin-file", "/dev/zero", "--", "head", "-c", "1")
    assert r.returncode == 2 and r.stderr.startswith(b"sandboxrun: error: --stdin-file: /dev/zero: a device"), r
    r = cli("--stdin-file", "/dev/null", "--", "wc", "-c")
    assert r.returncode == 0 and r.stdout.strip() == b"0", r
