"""Bad input gets a named error at every entry point: library, CLI, profile files,
payloads, batch lines. Each row says what is wrong and what the message must name;
none may end in a traceback or an "internal error", and the exit code is the
documented one (2 for bad input, 126/127 for a command that cannot be executed,
1 for a batch with an unrunnable line).

Rows marked xfail are bugs found here (see docs/reliability.md); they turn green
when fixed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import sandbox
from sandbox import record as records
from sandbox.errors import ProfileError, SandboxError
from sandbox.profile import load
from sandbox.supervisor import ARG_MAX

ROOT = Path(__file__).resolve().parent.parent
BIG = "x" * (ARG_MAX + 1)
NO_FILTER = records.replace(load("strict"), blocklist=False)


def bug(reason: str) -> pytest.MarkDecorator:
    return pytest.mark.xfail(reason=f"BUG: {reason}", strict=False)


def cli(*args: str | bytes, stdin: bytes | None = None, timeout: float = 60,
        cwd: Path = ROOT) -> subprocess.CompletedProcess[bytes]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "sandbox", *args], input=stdin, capture_output=True,
                          timeout=timeout, env=env, cwd=cwd)


def assert_clean_error(stderr: bytes, needle: str) -> None:
    """One error line naming the input; argparse's usage line may precede it."""
    text = stderr.decode(errors="replace")
    assert "Traceback" not in text, text
    assert "internal error" not in text, text
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith(("usage:", " "))]
    assert len(lines) == 1, text
    assert needle.lower() in lines[0].lower(), text


def _fix_ids(rows: list[Any]) -> list[Any]:
    """Rows as pytest params: (id, *values) tuples or pytest.param(id, *values, marks=...)."""
    out = []
    for r in rows:
        if hasattr(r, "marks"):  # already a pytest.param (a tuple subclass: test it first)
            out.append(pytest.param(*r.values[1:], id=r.values[0], marks=r.marks))
        else:
            out.append(pytest.param(*r[1:], id=r[0]))
    return out


# ----------------------------------------------------------------------------- library

LIBRARY: list[Any] = [
    # (id, command, kwargs, what the message must name)
    ("unknown-profile", ["true"], {"profile": "nonesuch"}, "unknown profile"),
    ("profile-wrong-type", ["true"], {"profile": 3}, "profile"),
    ("profile-missing-file", ["true"], {"profile": "/no/such/p.toml"}, "no such profile file"),
    ("unknown-setting", ["true"], {"bogus": 1}, "bogus"),
    ("shell-as-text", "true", {"shell": "no"}, "shell: expected True or False"),
    ("shell-empty", " ", {"shell": True}, "command is empty"),
    ("trace-as-text", ["true"], {"trace": "false"}, "trace: expected True or False"),
    ("timeout-wrong-type", ["true"], {"timeout": [1]}, "timeout"),
    ("timeout-negative", ["true"], {"timeout": -1}, "negative"),
    ("timeout-words", ["true"], {"timeout": "soon"}, "timeout"),
    ("timeout-nan", ["true"], {"timeout": float("nan")}, "finite"),
    ("timeout-inf", ["true"], {"timeout": float("inf")}, "finite"),
    ("timeout-over-max", ["true"], {"timeout": 1e300}, "max_timeout"),
    ("timeout-huge-int", ["true"], {"timeout": 10**400}, "timeout"),
    ("kill-grace-huge", ["sleep", "5"], {"timeout": 0.1, "kill_grace": 1e300}, "kill_grace"),
    ("memory-bool", ["true"], {"memory": True}, "boolean"),
    ("memory-negative", ["true"], {"memory": -1}, "negative"),
    ("memory-negative-str", ["true"], {"memory": "-5MiB"}, "memory"),
    ("memory-unit", ["true"], {"memory": "5 parsecs"}, "unit"),
    ("memory-huge", ["true"], {"memory": 10**400}, "memory"),
    ("processes-huge", ["true"], {"processes": 2**63}, "processes"),
    ("file-size-huge", ["true"], {"file_size": 10**30}, "file_size"),
    ("cpus-tiny", ["true"], {"cpus": 1e-9}, "cpus"),
    ("tmp-size-zero", ["true"], {"tmp_size": 0}, "tmp_size"),
    ("processes-zero", ["true"], {"processes": 0}, "positive"),
    ("open-files-too-few", ["true"], {"open_files": 3}, "at least 8"),  # was a setup_error blaming Landlock
    ("cpus-negative", ["true"], {"cpus": -1}, "negative"),
    ("cwd-missing", ["true"], {"cwd": "/no/such/dir"}, "no such directory"),
    ("cwd-file", ["true"], {"cwd": "/etc/passwd"}, "not a directory"),
    ("cwd-nul", ["true"], {"cwd": "/tmp\0x"}, "NUL"),
    ("cwd-wrong-type", ["true"], {"cwd": 3}, "cwd"),
    ("ro-bind-relative", ["true"], {"ro_bind": "relative/path"}, "absolute"),
    ("ro-bind-dotdot", ["true"], {"ro_bind": "/usr/../etc"}, "'..'"),
    ("ro-bind-dst-relative", ["true"], {"ro_bind": "/usr:usr"}, "absolute"),
    ("ro-bind-root", ["true"], {"ro_bind": "/usr:/"}, "root"),
    ("bind-missing", ["true"], {"bind": "/no/such/dir"}, "does not exist"),
    ("bind-nul", ["true"], {"bind": "/tm\0p"}, "NUL"),
    ("network-unknown", ["true"], {"network": "bridge"}, "network"),
    ("env-not-mapping", ["true"], {"env": "A=1"}, "env"),
    ("env-int-value", ["true"], {"env": {"A": 1}}, "strings"),
    ("env-empty-name", ["true"], {"env": {"": "x"}}, "invalid"),
    ("env-equals-name", ["true"], {"env": {"A=B": "x"}}, "invalid"),
    ("env-nul-value", ["true"], {"env": {"A": "b\0c"}}, "invalid"),
    ("env-nul-name", ["true"], {"env": {"A\0": "b"}}, "invalid"),
    ("argv-nul", ["echo", "a\0b"], {}, "NUL"),
    ("string-nul", "echo a\0b", {}, "NUL"),
    ("argv-int", ["echo", 3], {}, "command[1]"),
    ("bytes-command", b"ls", {}, "bytes"),
    ("none-command", None, {}, "command"),
    ("int-command", 5, {}, "command"),
    ("empty-list", [], {}, "empty command"),
    ("empty-string", "", {}, "empty command"),
    ("blank-string", "   ", {}, "empty command"),
    ("empty-argv0", [""], {}, "empty command"),
    ("unbalanced-quotes", "echo 'oops", {}, "cannot split"),
    ("over-arg-max", ["true", BIG], {}, "ARG_MAX"),
    ("string-over-arg-max", "echo " + BIG, {}, "ARG_MAX"),  # refused before it is split
    ("lone-surrogate-string", "echo \ud800", {}, "lone surrogate"),
    ("lone-surrogate-argv", ["echo", "\ud800"], {}, "command[1]"),
    ("lone-surrogate-cwd", ["true"], {"cwd": "/tmp/\ud800"}, "cwd"),
    ("lone-surrogate-stdin", ["cat"], {"stdin": "a\ud800"}, "stdin"),
    ("lone-surrogate-env-value", ["true"], {"env": {"A": "\ud800"}}, "lone surrogate"),
    ("lone-surrogate-env-name", ["true"], {"env": {"\ud800": "x"}}, "lone surrogate"),
    ("over-arg-max-no-filter", ["true", BIG], {"profile": NO_FILTER}, "ARG_MAX"),
    ("env-over-arg-max", ["true"], {"env": {"BIG": BIG}}, "ARG_MAX"),
    # one argument or variable over 128 KiB: execve's E2BIG made it a run that failed (exit 126)
    ("one-var-over-max-arg-strlen", ["true"], {"env": {"A": "x" * (32 * os.sysconf("SC_PAGE_SIZE"))}},
     "env['A']: over the kernel's limit"),
    ("stdin-wrong-type", ["cat"], {"stdin": 3}, "stdin"),
    ("stdin-from-wrong-type", ["cat"], {"stdin_from": "0"}, "stdin_from: expected a file descriptor"),
    ("stdin-from-closed", ["cat"], {"stdin_from": 1 << 20}, "stdin_from: fd 1048576"),
    ("stdin-from-past-a-c-int", ["cat"], {"stdin_from": 2**70}, "stdin_from: fd 1180591620717411303424"),  # OverflowError
    ("stdin-fd-past-a-c-int", ["cat"], {"stdin_fd": 2**70}, "stdin_fd: 1180591620717411303424 is not an open"),
    ("stdin-from-device", ["cat"], {"stdin_from": 0}, "not a pipe, a socket or a regular file"),  # /dev/null
    ("stdin-from-and-stdin", ["cat"], {"stdin_from": 0, "stdin": b"x"}, "give one of"),
    # a session's options: were "override: stdin_file: unknown setting", as if a profile key
    ("stdin-file-without-yield", ["cat"], {"stdin_file": "/etc/hostname"}, "stdin_file: a session's option"),
    ("pty-without-yield", ["true"], {"pty": True}, "pty: a session's option"),
    ("bind-over-workdir", ["true"], {"bind": "/tmp:/work"}, "is the workdir"),
    ("ro-bind-over-tmp", ["true"], {"ro_bind": "/usr:/tmp"}, "/tmp"),
    ("ro-bind-file-over-dir", ["true"], {"ro_bind": "/etc/hostname:/usr"}, "a directory is bound"),  # was a 125
    ("ro-bind-dir-over-file", ["true"], {"ro_bind": "/usr/lib:/etc/ld.so.cache"}, "a file is bound"),
    ("ro-binds-of-two-kinds", ["true"], {"ro_bind": ["/usr/lib:/x", "/etc/hostname:/x"]}, "a directory is bound"),
    ("ro-bind-host-view", ["true"], {"profile": "nested", "ro_bind": "/usr:/x"}, "view = 'host'"),
]


@pytest.mark.parametrize("command, kwargs, needle", _fix_ids(LIBRARY))
def test_library_rejects_with_a_named_error(command: Any, kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(SandboxError) as ei:
        sandbox.run(command, **kwargs)
    msg = str(ei.value)
    assert needle.lower() in msg.lower(), msg
    assert "\n" not in msg and len(msg) < 1000, msg


def test_a_directory_is_never_a_commands_stdin() -> None:
    # A directory fd in the sandbox would be a way out of its view (openat from it).
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(SandboxError, match="stdin_from: fd .* is not a pipe"):
            sandbox.run(["cat"], stdin_from=fd)
    finally:
        os.close(fd)


def test_options_that_python_would_take_for_true_or_for_nothing_are_refused() -> None:
    with pytest.raises(SandboxError, match="ordered: expected True or False, got 'no'"):
        sandbox.run_many([], ordered="no")
    with pytest.raises(SandboxError, match="cols and rows size the session's terminal: only with pty=True"):
        sandbox.start(["true"], cols=120)  # the CLI refuses --cols without --pty alike


def test_a_write_only_fd_is_never_a_commands_stdin(tmp_path) -> None:
    """A pipe's write end hung the run to its timeout; a file opened for writing ran as if
    empty (the copy took EBADF for the end of input). Through the CLI: `cat <&5` of `exec 5>f`."""
    r, w = os.pipe()
    wo = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        for fd in (w, wo):
            with pytest.raises(SandboxError, match=f"stdin_from: fd {fd} is open for writing only"):
                sandbox.run(["cat"], stdin_from=fd, timeout="5s")
        p = subprocess.run([sys.executable, "-m", "sandbox", "--", "cat"], stdin=wo, capture_output=True,
                           timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert p.returncode == 2 and p.stderr.endswith(b"stdin: fd 0 is open for writing only (a pipe's write "
                                                       b"end?): nothing to read\n"), p
    finally:
        for fd in (r, w, wo):
            os.close(fd)


def test_stdin_from_a_socket_is_copied_not_handed_over(isolated) -> None:
    import socket
    import threading

    ours, theirs = socket.socketpair()
    t = threading.Thread(target=lambda: (ours.sendall(b"x" * 300_000), ours.shutdown(socket.SHUT_WR)))
    t.start()
    try:
        r = sandbox.run(["sh", "-c", "wc -c; readlink /proc/self/fd/0"], stdin_from=theirs.fileno())
    finally:
        t.join()
        ours.close()
        theirs.close()
    count, link = r.stdout.split()
    assert (r.status, count) == ("ok", "300000") and link.startswith("pipe:"), r


def test_a_file_stuck_in_its_filesystem_cannot_hold_the_deadline(isolated, monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    # A regular file cannot be polled and a read of one on a hung NFS server blocks for ever:
    # read in the supervisor's loop, it kept that loop (and the run's timeout) from running.
    import threading

    unstuck = threading.Event()
    fds_before = len(os.listdir("/proc/self/fd"))
    f = tmp_path / "on-nfs"
    f.write_bytes(b"data\n")
    stuck_file = (f.stat().st_dev, f.stat().st_ino)
    real_read = os.read

    def read(fd: int, n: int) -> bytes:  # a read of that file hangs, as on a dead NFS server
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) == stuck_file:
            unstuck.wait(15)
            return b""
        return real_read(fd, n)

    monkeypatch.setattr(os, "read", read)
    with open(f, "rb") as src:
        try:
            r = sandbox.run(["cat"], stdin_from=src.fileno(), timeout="1s", kill_grace="0.2s")
        finally:
            unstuck.set()
    assert r.status == "timeout" and r.duration_ms < 10_000, r
    for _ in range(200):  # the copy thread closes its fds once its read returns
        if len(os.listdir("/proc/self/fd")) == fds_before:
            break
        time.sleep(0.01)
    assert len(os.listdir("/proc/self/fd")) == fds_before


def test_command_that_cannot_be_executed_is_127_or_126_with_a_message(isolated) -> None:
    for argv, code, needle in (
        (["/no/such/binary"], 127, "not found"),
        (["no-such-command-sbx"], 127, "not found"),
        (["/etc"], 126, "/etc: is a directory"),  # (execve says EACCES)
        (["/etc/passwd"], 126, "permission denied"),  # not executable
    ):
        r = sandbox.run(argv)
        assert (r.status, r.exit_code) == ("nonzero_exit", code), (argv, r)
        assert needle in (r.error or ""), (argv, r.error)
        assert needle in r.stderr, (argv, r.stderr)


def test_a_script_that_cannot_start_says_why_through_either_child(isolated, child, tmp_path) -> None:
    # "command not found" for a file that is there (its #! interpreter is missing), and a bare
    # "exec format error" for a script without a #! line, sent users looking the wrong way.
    (tmp_path / "nointerp").write_text("#!/no/such/interp -x\necho hi\n")
    (tmp_path / "noshebang").write_text("echo hi\n")
    (tmp_path / "crlf").write_bytes(b"#!/bin/sh\r\necho hi\r\n")  # /bin/sh is there: /bin/sh\r is not
    elf = bytearray(Path("/bin/true").read_bytes())
    loader = re.search(rb"/lib[0-9a-z_/.-]*/ld-[^\0]+", bytes(elf))
    assert loader, "no dynamic loader named in /bin/true"
    elf[loader.start():loader.start() + 6] = b"/nolib"
    (tmp_path / "noloader").write_bytes(bytes(elf))
    for name in ("nointerp", "noshebang", "noloader", "crlf"):
        (tmp_path / name).chmod(0o755)
    for name, code, why in (
        ("nointerp", 127, "./nointerp: bad interpreter: /no/such/interp: not found (its #! line)"),
        ("noshebang", 126, "./noshebang: exec format error (no #! line, and not a program for this machine)"),
        ("noloader", 127, "./noloader: the ELF interpreter (dynamic loader) it names was not found"),
        ("crlf", 127, "./crlf: bad interpreter: /bin/sh^M: not found (its #! line, which ends in a CR: "
                      "CRLF line endings?)"),
    ):
        r = sandbox.run([f"./{name}"], cwd=str(tmp_path))
        assert (r.status, r.exit_code, r.error) == ("nonzero_exit", code, why), r


def test_single_argument_over_the_kernel_limit_is_bad_input_not_a_failed_run() -> None:
    # Under ARG_MAX in total, but one string over MAX_ARG_STRLEN (32 pages): execve said E2BIG,
    # a run that "failed" with 126; it is refused before any sandbox, naming the argument.
    from sandbox.supervisor import MAX_ARG_STRLEN

    with pytest.raises(sandbox.InputError, match=r"command\[1\]: over the kernel's limit"):
        sandbox.run(["true", "y" * MAX_ARG_STRLEN])


def test_non_utf8_argv_and_output_bytes_are_preserved(isolated) -> None:
    raw = b"\xff\xfe\x80ok\n"
    arg = os.fsdecode(raw)  # surrogateescape: how Python spells non-UTF-8 argv
    r = sandbox.run(["printf", "%s", arg])
    assert r.status == "ok", r
    assert r.stdout_raw == raw and r.stdout_bytes == len(raw)
    assert r.stdout == raw.decode("utf-8", "replace")
    r = sandbox.run(["sh", "-c", "printf '\\377\\376' >&2"])
    assert r.stderr_raw == b"\xff\xfe" and r.stderr == "\ufffd\ufffd" and r.stderr_bytes == 2
    json.dumps(r.to_dict())  # text fields stay serialisable


# ----------------------------------------------------------------------------- CLI

CLI_ROWS: list[Any] = [
    ("unknown-profile", ["--profile", "nonesuch", "--", "true"], "unknown profile"),
    ("profile-is-dir", ["--profile", "/tmp/", "--", "true"], "is a directory, not a profile file"),
    ("timeout-words", ["--timeout", "soon", "--", "true"], "timeout"),
    ("timeout-negative", ["--timeout", "-3", "--", "true"], "negative"),
    ("timeout-over-max", ["--timeout", "9" * 400, "--", "true"], "timeout"),
    ("memory-words", ["--memory", "lots", "--", "true"], "memory"),
    ("memory-huge", ["--memory", "99999999999TiB", "--", "true"], "memory"),
    ("cwd-missing", ["--cwd", "/no/such/dir", "--", "true"], "no such directory"),
    ("cwd-file", ["--cwd", "/etc/passwd", "--", "true"], "not a directory"),
    ("env-no-equals", ["--env", "NOEQUALS", "--", "true"], "NAME=VALUE"),
    ("env-empty-name", ["--env", "=x", "--", "true"], "NAME=VALUE"),
    ("ro-bind-relative", ["--ro-bind", "relative", "--", "true"], "absolute"),
    ("ro-bind-dotdot", ["--ro-bind", "/usr/../etc", "--", "true"], "'..'"),
    ("bind-missing", ["--bind", "/no/such/dir", "--", "true"], "does not exist"),
    ("network-unknown", ["--network", "bridge", "--", "true"], "network"),
    ("stdin-file-missing", ["--stdin-file", "/no/such/file", "--", "cat"], "/no/such/file"),
    ("stdin-file-directory", ["--stdin-file", "/etc", "--", "cat"], "/etc: is a directory"),
    ("yield-negative", ["run", "--yield-ms", "-5", "--", "true"], "--yield-ms: expected 0 to"),
    ("unknown-flag", ["--bogus", "--", "true"], "--bogus"),
    ("no-command", ["--"], "no command"),
    ("nothing", [], "no command"),
    ("empty-command", ["--", ""], "empty command"),
    ("profiles-show-unknown", ["profiles", "show", "nonesuch"], "unknown profile"),
    ("check-unknown-profile", ["check", "--profile", "nonesuch", "--", "ls"], "unknown profile"),
    ("batch-missing-file", ["batch", "/no/such/file.jsonl"], "/no/such/file.jsonl"),
    ("batch-bad-concurrency", ["batch", "-j", "0", "-"], "concurrency"),
    ("payload-missing-file", ["payload", "--file", "/no/such/p.json"], "/no/such/p.json"),
]


@pytest.mark.parametrize("args, needle", _fix_ids(CLI_ROWS))
def test_cli_rejects_with_one_line_and_exit_2(args: list[str], needle: str) -> None:
    r = cli(*args, stdin=b"")
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert_clean_error(r.stderr, needle or "sandboxrun")


@pytest.mark.parametrize("argv, code, needle", [
    pytest.param(["/no/such/binary"], 127, "not found"),
    pytest.param(["/etc"], 126, "/etc"),
])
def test_cli_command_that_cannot_be_executed(isolated, argv: list[str], code: int, needle: str) -> None:
    r = cli("--", *argv)
    assert r.returncode == code, r
    assert b"Traceback" not in r.stderr
    assert needle.encode() in r.stderr, r.stderr


def test_cli_non_utf8_argv_and_output(isolated) -> None:
    raw = b"\xff\xfe\x80ok"
    r = cli("--", "printf", "%s", raw)
    assert (r.returncode, r.stdout) == (0, raw), r.stderr
    r = cli("--json", "--", "printf", "%s", raw)
    d = json.loads(r.stdout)
    assert d["stdout"] == raw.decode("utf-8", "replace") and d["stdout_bytes"] == len(raw)


def test_debug_flag_may_show_a_traceback() -> None:
    r = cli("--debug", "--profile", "nonesuch", "--", "true")
    assert r.returncode != 0 and b"unknown profile" in r.stderr
    assert b"Traceback" in r.stderr and b"ProfileError" in r.stderr, r.stderr  # only with --debug


# ----------------------------------------------------------------------------- profile files

PROFILE_ROWS: list[Any] = [
    # (id, TOML text ({dir} = the file's directory), what the message must name)
    ("malformed", "[limits\ntimeout = 3", "malformed TOML"),
    ("bad-value-syntax", "[limits]\ntimeout = 3s", "malformed TOML"),
    ("unknown-table", "[bogus]\nx = 1", "bogus"),
    ("unknown-key", "[limits]\nbogus = 1", "limits.bogus"),
    ("table-not-table", "limits = 5", "limits"),
    ("name-wrong-type", "name = 5", "name"),
    ("memory-bool", "[limits]\nmemory = true", "limits.memory"),
    ("memory-float", "[limits]\nmemory = 1.5", "limits.memory"),
    ("memory-tiny", "[limits]\nmemory = \"1KiB\"", "at least"),
    ("memory-huge", "[limits]\nmemory = \"99999999TiB\"", "too large"),
    ("timeout-negative", "[limits]\ntimeout = -1", "negative"),
    ("timeout-zero", "[limits]\ntimeout = 0", "allow_no_timeout"),
    ("timeout-huge", "[limits]\ntimeout = 99999999999999999999999", "limits.timeout"),
    ("processes-negative", "[limits]\nprocesses = -5", "positive"),
    ("processes-string", "[limits]\nprocesses = \"many\"", "limits.processes"),
    ("output-unlimited", "[limits]\noutput = \"unlimited\"", "unlimited"),
    ("tmp-size-zero", "[limits]\ntmp_size = 0", "limits.tmp_size"),
    ("workdir-relative", "[filesystem]\nworkdir = \"work\"", "absolute"),
    ("view-unknown", "[filesystem]\nview = \"shared\"", "filesystem.view"),
    ("ro-bind-relative", "[filesystem]\nro_bind = [\"usr\"]", "absolute"),
    ("ro-bind-dotdot", "[filesystem]\nro_bind = [\"/usr/../etc\"]", "'..'"),
    ("ro-bind-not-list", "[filesystem]\nro_bind = \"/usr\"", "list"),
    ("bind-missing", "[filesystem]\nbind = [\"/no/such/dir\"]", "does not exist"),
    ("hostname-slash", "[process]\nhostname = \"a/b\"", "process.hostname"),
    ("hostname-nul", "[process]\nhostname = \"a\\u0000b\"", "NUL"),
    pytest.param("hostname-64-bytes", "[process]\nhostname = \"" + "\u00e9" * 40 + "\"", "process.hostname"),
    ("env-int", "[process]\nenv = { A = 1 }", "process.env.A = 1: expected a string"),
    ("env-bad-name", "[process]\nenv = { \"A=B\" = \"x\" }", "process.env.A=B = 'x': invalid variable name"),
    # named alone, not with the whole table it inherits from strict (PATH, HOME, LANG...)
    ("env-int-extends", "extends = \"strict\"\n[process]\nenv = { A = 1 }", ".toml: process.env.A = 1: expected"),
    ("seccomp-unknown", "[security]\nseccomp = \"lax\"", "security.seccomp"),
    ("namespace-unknown", "[security]\nnamespaces = [\"user\"]", "unknown namespace"),
    ("private-without-mount", "[security]\nnamespaces = [\"pid\", \"net\"]", "mount namespace"),
    ("network-unknown", "[network]\nmode = \"bridge\"", "network.mode"),
    ("filter-block-not-list", "[filter]\nblock = \"rm\"", "filter.block"),
    pytest.param("filter-block-bad-regex", "[filter]\nblock = [\"(\"]", "filter.block"),
    ("extends-unknown", "extends = \"nonesuch\"", "extends"),
    ("extends-self", "extends = \"{dir}/p.toml\"", "cycle"),
    ("extends-wrong-type", "extends = 3", "extends"),
    ("timeout-over-max-timeout", "extends = \"strict\"\n[limits]\ntimeout = \"1h\"", "limits.max_timeout = '10m'"),
    ("binds-nothing-read-only", "[limits]\nmemory = \"1GiB\"", "binds nothing read-only"),
    ("bind-over-workdir", "extends = \"strict\"\n[filesystem]\nbind = [\"/tmp:/work\"]", "is the workdir"),
    ("workdir-system-tree", "extends = \"strict\"\n[filesystem]\nworkdir = \"/usr\"", "filesystem.workdir"),
    ("bind-under-host-view", "extends = \"nested\"\n[filesystem]\nro_bind = [\"/usr:/x\"]", "view = 'host'"),
    pytest.param("not-utf8", b"name = \"\xff\"", "UTF-8"),
    pytest.param("deeply-nested", "x = " + "[" * 5000 + "]" * 5000, "p.toml"),
]


@pytest.mark.parametrize("text, needle", _fix_ids(PROFILE_ROWS))
def test_profile_file_rejected_by_loader_and_cli(tmp_path: Path, text: str | bytes, needle: str) -> None:
    from sandbox.profile import load

    path = tmp_path / "p.toml"
    if isinstance(text, str):
        path.write_text(text.replace("{dir}", str(tmp_path)))
    else:
        path.write_bytes(text)
    with pytest.raises(ProfileError) as ei:
        load(str(path))
    msg = str(ei.value)
    assert needle.lower() in msg.lower(), msg
    assert str(path) in msg or "p.toml" in msg, msg  # names the file
    r = cli("--profile", str(path), "--", "true")
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert_clean_error(r.stderr, needle)


# ----------------------------------------------------------------------------- payloads


def _payload(props: dict[str, str] | None = None, action: str = "run_command", **top: Any) -> str:
    doc: dict[str, Any] = {"action": action, **top}
    if props is not None:
        doc["properties"] = [{"name": k, "value": v} for k, v in props.items()]
    return json.dumps(doc)


PAYLOAD_ROWS: list[Any] = [
    # (id, payload text, the field the error must name)
    ("empty", "", "payload"),
    ("not-json", "run ls please", "payload"),
    ("json-array", "[]", "payload"),
    ("json-string", "\"ls\"", "payload"),
    ("unknown-top-key", _payload({"command": "ls"}, extra=1), "extra"),
    ("missing-action", json.dumps({"properties": []}), "action"),
    ("unknown-action", _payload({"command": "ls"}, action="format_disk"), "action"),
    ("missing-properties", _payload(None), "properties"),
    ("properties-not-list", json.dumps({"action": "run_command", "properties": {"command": "ls"}}), "properties"),
    ("property-not-object", json.dumps({"action": "run_command", "properties": ["ls"]}), "properties[0]"),
    ("unknown-property", _payload({"command": "ls", "sudo": "true"}), "sudo"),
    ("value-not-string", json.dumps({"action": "run_command",
                                     "properties": [{"name": "command", "value": ["ls"]}]}), "command"),
    ("missing-command", _payload({"cwd": "/tmp"}), "command"),
    ("empty-command", _payload({"command": "  "}), "command"),
    ("nul-in-command", _payload({"command": "echo a\0b"}), "command"),
    ("timeout-negative", _payload({"command": "ls", "timeout": "-1"}), "timeout"),
    ("timeout-huge", _payload({"command": "ls", "timeout": "1e999"}), "timeout"),
    ("timeout-words", _payload({"command": "ls", "timeout": "soon"}), "timeout"),
    ("shell-not-bool", _payload({"command": "ls", "shell": "maybe"}), "shell"),
    ("env-not-json", _payload({"command": "ls", "env": "A=1"}), "env"),
    ("cwd-missing", _payload({"command": "ls", "cwd": "/no/such/dir"}), "cwd"),
    ("cwd-file", _payload({"command": "ls", "cwd": "/etc/passwd"}), "cwd"),
    ("cwd-system-tree", _payload({"command": "ls", "cwd": "/etc"}), "cwd"),
    ("over-arg-max", _payload({"command": BIG}), "command"),
    ("over-arg-max-split", _payload({"command": BIG, "shell": "false"}), "command"),  # before splitting
    ("shelltype-foreign", _payload({"command": "dir", "shelltype": "windowsbat"}), "shelltype"),
    ("unsplittable", _payload({"command": "echo 'oops", "shell": "false"}), "command"),
    ("lone-surrogate-shell", _payload({"command": "echo \ud800"}), "command"),
    ("lone-surrogate-split", _payload({"command": "echo \ud800", "shell": "false"}), "command"),
    ("script-missing", _payload({"scriptPath": "/no/such.py"}, action="run_code_script"), "scriptPath"),
    pytest.param("deeply-nested", "[" * 100_000, "payload"),
    ("not-utf8", b'{"action": "run_command", "properties": [{"name": "command", "value": "\xff"}]}', "payload"),
]


@pytest.mark.parametrize("text, field", _fix_ids(PAYLOAD_ROWS))
def test_payload_rejected_naming_the_field(text: str | bytes, field: str, tmp_path: Path) -> None:
    payload = pytest.importorskip("sandbox.payload")
    reply = payload.execute(text, base=str(tmp_path))  # (the checkout holds sandboxrun's own code: no workdir)
    assert set(reply) == {"error"}, reply
    assert reply["error"]["field"] == field, reply
    assert reply["error"]["message"] and "\n" not in reply["error"]["message"], reply


@pytest.mark.parametrize("text, field", [p for p in _fix_ids(PAYLOAD_ROWS)
                                         if p.id in ("not-json", "unknown-action", "timeout-negative",
                                                     "cwd-missing", "over-arg-max", "not-utf8", "deeply-nested",
                                                     "lone-surrogate-split")])
def test_payload_cli_exits_2_with_a_json_error(text: str | bytes, field: str, tmp_path: Path) -> None:
    pytest.importorskip("sandbox.payload")
    r = cli("payload", stdin=text if isinstance(text, bytes) else text.encode(), cwd=tmp_path)
    assert b"Traceback" not in r.stderr and b"internal error" not in r.stderr, r.stderr
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert json.loads(r.stdout)["error"]["field"] == field


# ----------------------------------------------------------------------------- batch lines

BATCH_ROWS: list[Any] = [
    # (id, one JSONL line, what the line's error must name)
    ("invalid-json", b"not json", "invalid JSON"),
    ("not-object", b"[1, 2]", "JSON object"),
    ("not-utf8", b'{"command": "\xff"}', "UTF-8"),
    ("missing-command", b"{}", "command"),
    ("unknown-key", b'{"command": "true", "on_stdout": 1}', "on_stdout"),
    ("shell-not-bool", b'{"command": "true", "shell": "yes"}', "shell"),
    ("command-nul", b'{"command": ["echo", "a\\u0000b"]}', "NUL"),
    ("empty-command", b'{"command": ""}', "empty command"),
    ("argv-int", b'{"command": ["echo", 1]}', "command[1]"),
    ("command-int", b'{"command": 5}', "command"),
    ("timeout-negative", b'{"command": "true", "timeout": -1}', "negative"),
    ("unknown-profile", b'{"command": "true", "profile": "nonesuch"}', "unknown profile"),
    ("cwd-missing", b'{"command": "true", "cwd": "/no/such/dir"}', "no such directory"),
    ("env-int", b'{"command": "true", "env": {"A": 1}}', "env"),
    ("ro-bind-relative", b'{"command": "true", "ro_bind": "rel"}', "absolute"),
    ("over-arg-max", json.dumps({"command": ["true", BIG]}).encode(), "ARG_MAX"),
    ("lone-surrogate", b'{"command": ["echo", "\\ud800"]}', "lone surrogate"),
    ("number-of-5000-digits", b'{"command": "true", "timeout": ' + b"9" * 5000 + b"}", "4300 digits"),
    ("nan", b'{"command": "true", "id": NaN}', "NaN is not JSON"),
    ("infinity", b'{"command": "true", "timeout": -Infinity}', "Infinity is not JSON"),
    ("overflowing-float", b'{"command": "true", "id": 1e999}', "too large a number"),
    pytest.param("deeply-nested", b"[" * 100_000, "JSON"),
]


def _batch_items(line: bytes) -> list[Any]:
    batch = pytest.importorskip("sandbox.batch")
    import io

    return list(batch.run_many((obj for _n, obj in batch.read_jsonl(io.BytesIO(line + b"\n"))), 1, trusted=True))


@pytest.mark.parametrize("line, needle", _fix_ids(BATCH_ROWS))
def test_batch_line_becomes_a_named_invalid_request(line: bytes, needle: str) -> None:
    items = _batch_items(line)
    assert len(items) == 1
    d = items[0].to_dict()
    assert d["status"] == "invalid_request", d
    assert needle.lower() in d["error"].lower(), d
    assert "internal error" not in d["error"], d


def test_batch_cli_reports_every_bad_line_and_exits_1() -> None:
    pytest.importorskip("sandbox.batch")
    rows = [p for p in _fix_ids(BATCH_ROWS) if not p.marks]
    text = b"\n".join(p.values[0] for p in rows) + b"\n"
    r = cli("batch", "--trusted", "-", stdin=text)
    assert b"Traceback" not in r.stderr, r.stderr
    assert r.returncode == 1, (r.returncode, r.stderr)
    out = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(out) == len(rows)
    for p, d in zip(rows, out, strict=True):
        assert d["status"] == "invalid_request" and p.values[1].lower() in d["error"].lower(), (p.id, d)


@pytest.mark.parametrize("env, needle", [
    ({"SANDBOXRUN_UID_BASE": "0", "SANDBOXRUN_UID_COUNT": "1"}, "SANDBOXRUN_UID_BASE=0: expected at least 65536"),
    ({"SANDBOXRUN_UID_BASE": "1000"}, "above the host's own users"),
    ({"SANDBOXRUN_UID_BASE": "abc"}, "SANDBOXRUN_UID_BASE='abc': expected a whole number"),
    ({"SANDBOXRUN_UID_COUNT": "0"}, "SANDBOXRUN_UID_COUNT=0: expected at least 1"),
    ({"SANDBOXRUN_UID_BASE": "4294967290"}, "past the last uid"),
    ({"SANDBOXRUN_CGROUP": "bogus"}, "SANDBOXRUN_CGROUP='bogus': expected v1, v2 or none"),
])
def test_uid_range_variables_are_checked(env: dict[str, str], needle: str) -> None:
    # A range reaching below the host's users could make a run root (uid 0) or a real user.
    if os.geteuid() != 0:
        pytest.skip("per-run host uids are allocated for root callers")
    p = subprocess.run([sys.executable, "-m", "sandbox", "--", "id", "-u"], capture_output=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), **env), cwd=ROOT)
    assert p.returncode == 2 and p.stdout == b"", p
    assert_clean_error(p.stderr, needle)


def test_stdin_fd_is_only_a_file_open_for_reading_only(isolated, tmp_path) -> None:
    """stdin_fd hands the fd itself to the command: a file opened O_RDWR was written
    (`echo X >&0`), a pipe's write end wrote into the caller's pipe, a directory fd listed the
    host's directory. Only a regular file open for reading only is handed over; the rest is
    refused by name (stdin_from copies it through a pipe of ours)."""
    f = tmp_path / "f"
    f.write_bytes(b"hello\n")
    r, w = os.pipe()
    fds = {"rdwr": os.open(f, os.O_RDWR), "path": os.open(f, os.O_PATH), "dir": os.open(tmp_path, os.O_RDONLY),
           "pipe-r": r, "pipe-w": w}
    try:
        for kind, why in (("rdwr", "open for writing too"), ("path", "not open for reading"),
                          ("dir", "a directory"), ("pipe-r", "a pipe"), ("pipe-w", "a pipe")):
            fd = fds[kind]
            with pytest.raises(SandboxError, match=f"^stdin_fd: fd {fd} is {why}.*stdin_from="):
                sandbox.run("cat; echo X >&0", shell=True, stdin_fd=fd, timeout="5s")
        assert f.read_bytes() == b"hello\n"
        ro = os.open(f, os.O_RDONLY)
        try:
            res = sandbox.run("cat; echo X >&0", shell=True, stdin_fd=ro)
        finally:
            os.close(ro)
        assert res.stdout == "hello\n" and f.read_bytes() == b"hello\n", res
    finally:
        for fd in fds.values():
            os.close(fd)


@pytest.mark.parametrize("landlock", ["confines", "off", "unavailable"])
def test_a_stdin_fd_cannot_be_reopened_for_writing_where_landlock_does_not_confine_the_run(
        isolated, tmp_path, monkeypatch, landlock) -> None:
    """A file handed over as stdin is reopened by /proc/self/fd/0, which checks only the file's
    owner and mode: a file the run's uid may write (0666) was overwritten, read-only fd or not.
    Only Landlock refuses that reopen (the file is then handed over, no copy); where it does not
    confine the run (a profile's landlock off, or "optional" on a kernel without it) the file
    is copied through a pipe instead."""
    f = tmp_path / "f"
    f.write_bytes(b"line1\nline2\n")
    f.chmod(0o666)
    from sandbox.isolation import landlock as ll

    if landlock == "confines" and ll.abi_version() == 0:
        pytest.skip("no Landlock on this kernel")
    if landlock == "unavailable":  # as on a kernel without Landlock: strict's "optional" is then skipped
        from sandbox import supervisor

        monkeypatch.setattr(ll, "abi_version", lambda: 0)
        monkeypatch.setattr(supervisor, "_landlock_abi", [])
    from sandbox.record import replace

    prof = sandbox.load_profile("strict")
    prof = replace(prof, landlock="off") if landlock == "off" else prof
    fd = os.open(f, os.O_RDONLY)
    try:
        res = sandbox.run("read -r a; echo $a; readlink /proc/self/fd/0; echo PWNED > /proc/self/fd/0", shell=True,
                          stdin_fd=fd, profile=prof)
    finally:
        os.close(fd)
    assert f.read_bytes() == b"line1\nline2\n", res
    if landlock == "confines":
        assert res.isolation.landlock_abi > 0, res
        assert res.stdout.startswith("line1\n/") and "Permission denied" in res.stderr, res  # handed over; refused
    else:
        assert res.stdout.startswith("line1\npipe:") and str(tmp_path) not in res.stdout, res


@pytest.mark.parametrize("threads", ["yes", "no", "no fds"])
def test_a_file_given_as_stdin_from_is_left_where_the_command_stopped_reading(isolated, tmp_path, monkeypatch,
                                                                               threads) -> None:
    # The copy reads a chunk ahead and fills the pipe: the caller's offset was left up to
    # 128 KiB past what the command read. What it did not take is given back (a seek).
    f = tmp_path / "nums"
    f.write_text("".join(f"{i}\n" for i in range(1, 100_001)))
    if threads == "no":  # a process that cannot start one reads the file in its loop
        import _thread

        def refuse(*_: object) -> None:
            raise RuntimeError("can't start new thread")

        monkeypatch.setattr(_thread, "start_new_thread", refuse)
    if threads == "no fds":  # EMFILE making the copy's pipe: an OSError out of run(), the sandbox left running
        from sandbox import supervisor

        def no_fds(*_: object) -> None:
            raise OSError(24, "Too many open files")  # EMFILE

        monkeypatch.setattr(supervisor, "FileCopy", no_fds)
    with open(f, "rb") as src:
        # (`read` takes a pipe a byte at a time; head -n1 would take a block, 8 KiB, as it
        # does of any pipe: only a file of its own could it seek back in.)
        for cmd, at in (("read -r x", 2), ("true", 0), ("head -c 70000 >/dev/null", 70_000),
                        ("head -c 200000 >/dev/null", 200_000)):
            src.seek(0)
            res = sandbox.run(cmd, shell=True, stdin_from=src.fileno())
            assert res.status == "ok" and os.lseek(src.fileno(), 0, os.SEEK_CUR) == at, (cmd, res)
        src.seek(0)
        res = sandbox.run("cat", stdin_from=src.fileno())  # all of it: the offset is at the end
        assert res.status == "ok" and os.lseek(src.fileno(), 0, os.SEEK_CUR) == f.stat().st_size


def test_stdin_from_a_pipe_leaves_its_flags_as_they_were_during_the_run(isolated) -> None:
    # O_NONBLOCK was set on the caller's open file description (shared with every holder of
    # the pipe: a shell's other commands saw EAGAIN) for the whole run.
    import threading

    r, w = os.pipe()
    seen: list[bool] = []
    t = threading.Thread(target=lambda: (time.sleep(0.3), os.write(w, b"data\n"), os.close(w)))
    t.start()
    try:
        res = sandbox.run(["sh", "-c", "echo started; cat"], stdin_from=r,
                          on_stdout=lambda _d: seen.append(os.get_blocking(r)))
    finally:
        t.join()
        os.close(r)
    assert res.status == "ok" and res.stdout == "started\ndata\n" and seen and all(seen), (res, seen)


@pytest.mark.parametrize("how", ["fifo", "bounded"])
def test_stdin_from_is_read_without_blocking_where_the_kernel_has_no_rwf_nowait_for_it(isolated, tmp_path,
                                                                                         monkeypatch, how) -> None:
    # A named FIFO has no RWF_NOWAIT (EOPNOTSUPP): it is read through a non-blocking
    # description of our own; failing that (forced here), no more than FIONREAD says is there.
    import threading

    from sandbox.stdin import StdinSource

    if how == "bounded":
        monkeypatch.setattr(StdinSource, "_fallback", lambda self: "bounded", raising=False)
    seen: list[bool] = []
    ff = tmp_path / "ff"
    os.mkfifo(ff)
    r = os.open(ff, os.O_RDONLY | os.O_NONBLOCK)
    os.set_blocking(r, True)
    w = os.open(ff, os.O_WRONLY)
    t = threading.Thread(target=lambda: (time.sleep(0.3), os.write(w, b"x" * 200_000), os.close(w)))
    t.start()
    try:
        res = sandbox.run(["sh", "-c", "echo started; wc -c"], stdin_from=r,
                          on_stdout=lambda _d: seen.append(os.get_blocking(r)), timeout="20s")
    finally:
        t.join()
        os.close(r)
    assert res.status == "ok" and res.stdout.split() == ["started", "200000"] and all(seen), (res, seen)
