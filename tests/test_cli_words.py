"""The CLI speaks of what was typed (a CLI audit): its errors name the option (--memory, not
`override: limits.memory`), take the units its help shows, and never suggest a value they
then refuse. Also what a session name or id may be, `start --json` of a blocked command,
and `sandboxrun batch` bounds and ends.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import sandbox
from sandbox import sessions
from sandbox.batch import MAX_CONCURRENCY, BatchError
from sandbox.errors import InputError, ProfileError
from sandbox.units import parse_duration, parse_size

ROOT = Path(sandbox.__file__).resolve().parent.parent


def cli(*args: str, stdin: bytes | None = None, env: dict[str, str] | None = None,
        timeout: float = 60) -> subprocess.CompletedProcess[bytes]:
    full = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run([sys.executable, "-m", "sandbox", *args], input=stdin, capture_output=True,
                          timeout=timeout, env=full, cwd=ROOT)


def error_line(r: subprocess.CompletedProcess[bytes]) -> str:
    """The one error line of an exit-2 failure (argparse's usage line aside)."""
    text = r.stderr.decode(errors="replace")
    assert "Traceback" not in text and "internal error" not in text, text
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith(("usage:", " "))]
    assert len(lines) == 1 and r.returncode == 2, (r.returncode, text)
    return lines[0]


@pytest.fixture
def state(private_state_dir: Path) -> Path:
    return private_state_dir


# ---------------------------------------------------------------------------- run options


@pytest.mark.parametrize(("args", "expected"), [
    (["--memory", "4096"], "--memory '4096': must be at least 4MiB"),
    (["--memory", "lots"], "--memory 'lots': expected a size such as 512MiB or 1GiB (a bare number is bytes)"),
    (["--timeout", "soon"], "--timeout 'soon': expected a duration such as 30s, 500ms or 2m"),
    (["--timeout", "0"], "--timeout '0': profile 'strict' does not allow running without a timeout"),
    (["--bind", "/no/such/dir"], "--bind: path does not exist: /no/such/dir"),
    (["--ro-bind", "/no/such/dir"], "--ro-bind: path does not exist: /no/such/dir"),
    (["--cwd", "/etc/passwd"], "--cwd: not a directory: /etc/passwd"),
    (["--yield-ms", "99999999999999"], "--yield-ms: expected 0 to 2592000000 milliseconds, got 99999999999999"),
    (["--profile", "no-such-profile"], "profile 'no-such-profile': unknown profile"),
])
def test_a_run_option_error_names_the_option(args: list[str], expected: str) -> None:
    # They said `override: limits.memory = '4096'`, `cwd:`, `yield_after: ... seconds`, and
    # `profile: profile = 'x'`; the size error suggested 4096, which --memory then refused.
    line = error_line(cli(*args, "--", "true"))
    assert line.startswith(f"sandboxrun: error: {expected}"), line


def test_a_timeout_of_400_digits_is_too_large_not_infinite() -> None:
    huge = "1" + "0" * 400
    with pytest.raises(ValueError, match="too large"):
        parse_duration(huge)
    with pytest.raises(ValueError, match="too large"):
        parse_duration(huge + "ms")
    with pytest.raises(ValueError, match="too large"):
        parse_size(huge)
    line = error_line(cli("--timeout", huge, "--", "true"))
    assert "--timeout '1000" in line and "(403 characters)" in line and "finite" not in line, line


@pytest.mark.parametrize("args", [["start", "--stdin-file", "/no/such/file", "--", "cat"],
                                  ["--yield-ms", "1000", "--stdin-file", "/no/such/file", "--", "cat"]])
def test_a_session_stdin_file_is_named_as_the_option(state: Path, args: list[str]) -> None:
    assert error_line(cli(*args)) == "sandboxrun: error: --stdin-file: no such file: /no/such/file"
    assert not state.exists() or not sessions.list_sessions(sweep=False)


def test_start_with_pty_and_a_stdin_file_names_both_options(state: Path) -> None:
    line = error_line(cli("start", "--pty", "--stdin-file", "/etc/hostname", "--", "cat"))
    assert line == "sandboxrun: error: --stdin-file cannot be used with --pty: a PTY session reads its terminal"


def test_an_explicit_run_gets_no_subcommand_hint(isolated) -> None:
    r = cli("run", "lsit")
    assert r.returncode == 127 and b"did you mean" not in r.stderr, r.stderr
    r = cli("lsit")  # (the word run left out: lsit may well be a mistyped `list`)
    assert r.returncode == 127 and b"did you mean `sandboxrun list`?" in r.stderr, r.stderr


@pytest.mark.parametrize("native", ["1", "0"])
def test_a_directory_as_the_command_is_named_so(isolated, native: str) -> None:
    # execve says EACCES for a directory: "permission denied" read as a permissions problem.
    r = cli("--", "/etc", env={"SANDBOXRUN_NATIVE": native})
    assert r.returncode == 126 and r.stderr.strip() == b"sandboxrun: /etc: is a directory", r.stderr
    r = cli("--", "/etc/passwd", env={"SANDBOXRUN_NATIVE": native})  # not executable: still that
    assert r.returncode == 126 and r.stderr.strip() == b"sandboxrun: /etc/passwd: permission denied", r.stderr


@pytest.mark.parametrize(("args", "expected"), [
    (["mcp", "--workspace", "/etc/passwd"], "--workspace: not a directory: /etc/passwd"),
    (["mcp", "--workspace", "/no/such/dir"], "--workspace: no such directory: /no/such/dir"),
    (["payload", "--root", "/etc/passwd"], "--root: not a directory: /etc/passwd"),
    (["batch", ""], "batch: empty file name (give a JSONL file, or - for stdin)"),
    (["batch", "-j", str(MAX_CONCURRENCY + 1), "x.jsonl"],
     f"--concurrency: expected a whole number from 1 to {MAX_CONCURRENCY}, got {MAX_CONCURRENCY + 1}"),
    (["paste", "some-session", ""], "paste: nothing to paste (TEXT is empty)"),
])
def test_other_subcommand_paths_and_values(args: list[str], expected: str) -> None:
    # They said "no such directory" of a file, ": No such file or directory" of '', and
    # -j 1000000 made a pool of a million; `paste ID ''` wrote nothing where `write ID ''` is an error.
    assert error_line(cli(*args, stdin=b"")) == f"sandboxrun: error: {expected}"


# ---------------------------------------------------------------------------- wait, kill


def test_wait_and_kill_take_durations_with_units(state: Path, isolated) -> None:
    s = sandbox.start(["sh", "-c", "trap '' TERM; sleep 25"], name="slow")
    r = cli("wait", "slow", "--timeout", "200ms")
    assert r.returncode == 124 and b"still running" in r.stderr, r.stderr
    for args, expected in ((("wait", "slow", "--timeout", "5x"), "--timeout '5x': unknown time unit 'x'"),
                           (("wait", "slow", "--timeout", "nan"), "--timeout 'nan': expected a duration"),
                           (("kill", "slow", "--grace", "-1"), "--grace '-1': a duration cannot be negative"),
                           (("kill", "slow", "--grace", "unlimited"), "--grace 'unlimited': expected a duration")):
        line = error_line(cli(*args))
        assert line.startswith(f"sandboxrun: error: {expected}"), line
    assert s.state == "running"
    r = cli("kill", "slow", "--grace", "100ms")
    assert r.returncode == 0 and s.state == "exited", r.stderr
    assert s.result is not None and s.result.signal == "SIGKILL"  # TERM was trapped: the grace ran out


# ---------------------------------------------------------------------------- names and ids


@pytest.mark.parametrize("name", ["abc", "0123", "deadbeef", " x", "x ", " "])
def test_a_name_that_reads_as_an_id_prefix_or_has_spaces_at_its_ends_is_refused(state: Path, name: str) -> None:
    with pytest.raises(InputError, match="name"):
        sandbox.start(["true"], name=name)


@pytest.mark.parametrize("name", ["ab", "abcdef123", "cafe-1", "ABC", "web server"])
def test_names_near_those_are_accepted(state: Path, isolated, name: str) -> None:
    s = sandbox.start(["true"], name=name)
    assert sessions.get(name).id == s.id
    s.wait(30)


def test_a_derived_name_that_reads_as_another_sessions_id_prefix_is_ambiguous(state: Path, isolated) -> None:
    first = sandbox.start(["true"])
    first.wait(30)
    prefix = first.id[:4]
    second = sandbox.start(prefix, shell=True)  # its name is the command's text: the prefix
    second.wait(30)
    assert second.name == prefix
    with pytest.raises(InputError, match=f"ambiguous: the name of {second.id}, and a prefix of {first.id}"):
        sessions.get(prefix)
    assert sessions.get(first.id).id == first.id and sessions.get(second.id).id == second.id


def test_start_json_of_a_blocked_command_is_session_info(state: Path) -> None:
    # It printed a Result here, and session info for every other start.
    r = cli("start", "--json", "--name", "wipe", "--", "sh", "-c", "rm -rf /")
    assert r.returncode == 125 and b"blocked" in r.stderr, r.stderr
    info = json.loads(r.stdout)
    assert (info["id"], info["state"], info["status"], info["name"]) == (None, "blocked", "blocked", "wipe")
    assert "rm-root" in info["block_reason"] and info["command"] == ["sh", "-c", "rm -rf /"]
    assert info["pty"] is False
    r = cli("start", "--json", "--pty", "--", "sh", "-c", "rm -rf /")
    assert r.returncode == 125 and json.loads(r.stdout)["pty"] is True, r.stdout
    started = cli("start", "--json", "--", "true")
    assert started.returncode == 0, started.stderr
    assert set(json.loads(started.stdout)) <= set(info), "a blocked start has every key a start has"


# ---------------------------------------------------------------------------- batch


def test_run_many_refuses_ids_that_json_cannot_write(isolated) -> None:
    # A NaN id was written as NaN (no JSON reader takes it); an object() made to_json raise.
    reqs = [{"command": ["true"], "id": math.nan}, {"command": ["true"], "id": object()},
            {"command": ["true"], "id": ["ok", 1, None, 2.5]}]
    out = list(sandbox.run_many(reqs, concurrency=2))
    assert [type(r) for r in out] == [BatchError, BatchError, type(out[2])] and out[2].status == "ok"
    for item, pos in zip(out[:2], (1, 2), strict=True):
        assert item.id == pos and "id: expected a JSON value" in item.error, item.error
        json.loads(item.to_json())
    assert json.loads(out[2].to_json())["id"] == ["ok", 1, None, 2.5]


def test_run_many_concurrency_is_bounded() -> None:
    with pytest.raises(InputError, match=f"concurrency: expected a whole number from 1 to {MAX_CONCURRENCY}"):
        sandbox.run_many([], concurrency=MAX_CONCURRENCY + 1)


def test_batch_stops_when_its_reader_goes_away(tmp_path: Path, isolated) -> None:
    """`batch ... | head -1`: the reader was noticed gone only at the next write, here when
    the 20 s sleeps ended; the batch now stops within a wait slice (0.25 s) and kills them."""
    lines = [{"command": ["echo", "first"], "id": "a"},
             *({"command": ["sleep", "20"], "id": f"s{i}"} for i in range(2))]
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    read, write = os.pipe()
    started = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "sandbox", "batch", "-j", "3", str(tmp_path / "b.jsonl")],
                         stdout=write, stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    os.close(write)
    with os.fdopen(read, "rb") as f:
        first = f.readline()
    assert json.loads(first)["id"] == "a"
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1 and err == b"", err  # quietly, as on EPIPE
    assert time.monotonic() - started < 15, "the sleeps ran to their end"


def test_a_profile_error_names_the_profile_once() -> None:
    with pytest.raises(ProfileError) as e:
        sandbox.run(["true"], profile="no-such-profile")
    assert str(e.value).startswith("profile 'no-such-profile': unknown profile"), e.value


def test_batch_exits_1_when_a_sandbox_could_not_be_set_up(tmp_path: Path, isolated) -> None:
    # Every line a setup_error (strict needs a cgroup; none here) exited 0: "every line ran".
    (tmp_path / "b.jsonl").write_text('{"command": ["true"]}\n{"command": ["true"], "profile": "rootless"}\n')
    r = cli("batch", "--trusted", str(tmp_path / "b.jsonl"), env={"SANDBOXRUN_CGROUP": "none"})
    assert [json.loads(x)["status"] for x in r.stdout.splitlines()] == ["setup_error", "ok"], r.stdout
    assert r.returncode == 1, r.stderr
    r = cli("batch", "--trusted", str(tmp_path / "b.jsonl"))
    assert r.returncode == 0, (r.stdout, r.stderr)
