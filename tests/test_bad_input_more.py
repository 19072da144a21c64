"""More bad input (a red-team report): each case gets a named error and exit code 2,
never a traceback, an "internal error" (exit 125) or a silent misreading.

Sessions: non-finite grace/timeout/TTL, unusable state directories, names that could
not be found again, bytes that are not UTF-8. Profiles: names too long, unusable
search dirs, files that are not regular, hostnames that are not host names. Also the
MCP server's script paths, `python -f` arguments nested too deeply, and
SANDBOXRUN_UID_LOCK.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import sandbox
from sandbox import coderunner, profile, sessions
from sandbox.errors import InputError, ProfileError, SandboxError
from sandbox.isolation import uids

ROOT = Path(sandbox.__file__).resolve().parent.parent
LONG = "x" * 300  # over NAME_MAX (255 bytes)


def cli(*args: str | bytes, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[bytes]:
    full = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run([sys.executable, "-m", "sandbox", *args], capture_output=True, timeout=timeout,
                          env=full, cwd=ROOT)


def assert_clean_error(r: subprocess.CompletedProcess[bytes], needle: str) -> None:
    """Exit 2 and one error line naming the input; argparse's usage line may precede it."""
    text = r.stderr.decode(errors="replace")
    assert "Traceback" not in text and "internal error" not in text, text
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith(("usage:", " "))]
    assert len(lines) == 1, text
    assert needle.lower() in lines[0].lower(), text
    assert r.returncode == 2, (r.returncode, text)


@pytest.fixture
def state(private_state_dir: Path) -> Path:
    """A private state directory (conftest); what a test left running is removed."""
    return private_state_dir


# ---------------------------------------------------------------------------- 1. grace, timeout, TTL


@pytest.mark.parametrize("grace", [math.inf, math.nan, -1.0, "x", True, 1e300])
def test_kill_with_a_bad_grace_is_refused_and_the_session_still_runs(state: Path, isolated, grace: object) -> None:
    s = sandbox.start(["sh", "-c", "trap '' TERM; sleep 25"])
    with pytest.raises(InputError, match="grace"):
        s.kill(grace=grace)  # type: ignore[arg-type]
    assert s.state == "running"  # refused before anything was sent: not half done
    res = s.kill(grace=0)
    assert res is not None and res.status == "signaled"


@pytest.mark.parametrize("timeout", [math.nan, -1.0, "x", True, 1e300])
def test_wait_with_a_bad_timeout_is_an_input_error(state: Path, isolated, timeout: object) -> None:
    s = sandbox.start(["sleep", "25"])
    with pytest.raises(InputError, match="timeout"):
        s.wait(timeout=timeout)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="timeout"):
        s.kill(grace=0, timeout=timeout)  # type: ignore[arg-type]
    assert s.state == "running"
    s.kill(grace=0)


def test_wait_with_an_infinite_timeout_waits_until_the_end(state: Path, isolated) -> None:
    s = sandbox.start(["sh", "-c", "sleep 0.5; exit 3"])
    res = s.wait(timeout=math.inf)
    assert res is not None and res.exit_code == 3


def test_cli_kill_grace_inf_and_wait_timeout_nan(state: Path, isolated) -> None:
    s = sandbox.start(["sh", "-c", "trap '' TERM; sleep 25"], name="t")
    assert_clean_error(cli("kill", "--grace", "inf", "t"), "grace")
    assert s.state == "running"
    started = time.monotonic()
    r = cli("wait", "--timeout", "nan", "t")
    assert_clean_error(r, "timeout")  # not 124 at once, as if nan seconds had run out
    assert time.monotonic() - started < 30
    assert cli("kill", "--grace", "0", "t").returncode == 0


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "x"])
def test_session_ttl_must_be_a_finite_number(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("SANDBOXRUN_SESSION_TTL", raw)
    with pytest.raises(InputError, match="SANDBOXRUN_SESSION_TTL"):
        sessions.session_ttl()


def test_session_ttl_is_still_clamped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDBOXRUN_SESSION_TTL", "1e9")
    assert sessions.session_ttl() == sessions.TTL_MAX
    monkeypatch.setenv("SANDBOXRUN_SESSION_TTL", "0")
    assert sessions.session_ttl() == sessions.TTL_MIN


# ---------------------------------------------------------------------------- 2. profile files


def test_a_profile_name_too_long_is_a_profile_error() -> None:
    with pytest.raises(ProfileError, match="too long"):
        profile.load(LONG)
    with pytest.raises(ProfileError, match="File name too long"):
        profile.load(f"/tmp/{LONG}.toml")
    assert_clean_error(cli("-p", LONG, "--", "true"), "profile")


def test_an_unusable_profile_path_entry_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = tmp_path / "good"
    good.mkdir()
    (good / "mine.toml").write_text('extends = "strict"\n')
    monkeypatch.setenv("SANDBOXRUN_PROFILE_PATH", f"{tmp_path / LONG}:{good}")
    assert profile.load("strict").name == "strict"  # the built-in profiles still work
    assert profile.load("mine").name == "mine"
    with pytest.raises(ProfileError, match=f"unknown profile .*skipped {tmp_path / LONG}: File name too long"):
        profile.load("nosuch")


def test_a_profile_name_that_is_not_a_file_in_the_path_is_named(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # A directory named mine.toml read as "unknown profile", and one named strict.toml let the
    # built-in strict be used instead, with no word of what the caller had put there.
    (tmp_path / "mine.toml").mkdir()
    (tmp_path / "strict.toml").mkdir()
    monkeypatch.setenv("SANDBOXRUN_PROFILE_PATH", str(tmp_path))
    for name in ("mine", "strict"):
        with pytest.raises(ProfileError, match=f"{tmp_path / name}.toml is a directory, not a profile file"):
            profile.load(name)


def test_an_unusable_profile_path_entry_does_not_break_a_cli_run(tmp_path: Path) -> None:
    r = cli("--", "true", env={"SANDBOXRUN_PROFILE_PATH": str(tmp_path / LONG)})
    text = r.stderr.decode(errors="replace")
    assert "internal error" not in text and "Traceback" not in text, text
    assert r.returncode in (0, 125) and "File name too long" not in text, text


def test_a_profile_that_is_not_a_regular_file(tmp_path: Path) -> None:
    fifo = tmp_path / "p.toml"
    os.mkfifo(fifo)
    for path in (str(fifo), "/dev/zero"):
        with pytest.raises(ProfileError, match="not a regular file"):
            profile.load(path)
    with pytest.raises(ProfileError, match="is a directory"):
        profile.load(str(tmp_path) + "/")
    with pytest.raises(ProfileError, match="no such profile file"):
        profile.load(str(tmp_path / "none.toml"))
    with pytest.raises(ProfileError, match="no such profile file"):
        profile.load("a\ud800.toml")


# ---------------------------------------------------------------------------- 3. state directory


@pytest.mark.parametrize("where", ["/proc", "/sys", "/", "/tmp", "/run", "/var"])
def test_a_state_directory_of_the_hosts_own_is_refused(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    # "/" was taken: one folder per session made at the host's root.
    monkeypatch.setenv("SANDBOXRUN_STATE_DIR", where)
    with pytest.raises(SandboxError, match=f"state directory {where}"):
        sessions.list_sessions()
    if where in ("/proc", "/sys"):  # (a start elsewhere, were the check missing, would make a folder there)
        with pytest.raises(SandboxError, match=f"state directory {where}"):
            sessions.start(["true"])


def test_a_state_directory_others_may_write_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Anyone could plant a session folder there, naming pids that `list` would then judge and kill.
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    monkeypatch.setenv("SANDBOXRUN_STATE_DIR", str(shared))
    with pytest.raises(SandboxError, match="writable by others .mode 1777."):
        sessions.list_sessions()
    shared.chmod(0o755)
    assert sessions.list_sessions() == []


# ---------------------------------------------------------------------------- 4. MCP tools


class _ToolError(Exception):
    pass


@pytest.mark.parametrize("script, needle", [
    ("x\0.py", "script: contains a NUL byte"),
    ("x\ud800.py", "lone surrogate"),
    ("../outside.py", "outside the workspace"),
])
def test_mcp_script_paths(tmp_path: Path, script: str, needle: str) -> None:
    from sandbox.mcp_server import Tools

    tools = Tools(profile.load("strict"), str(tmp_path), _ToolError)
    with pytest.raises(_ToolError, match=needle):
        tools.run_python(script=script)


# ---------------------------------------------------------------------------- 5. python -f ARG


def test_a_function_argument_nested_too_deeply_is_a_string() -> None:
    deep = "[" * 100000
    assert coderunner._cli_value(deep) == deep
    assert coderunner._cli_value("[[1]]") == [[1]]


def test_a_library_argument_nested_too_deeply_is_an_input_error(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("def f(*a):\n    return len(a)\n")
    deep: list = []
    for _ in range(100000):
        deep = [deep]
    with pytest.raises(InputError, match="nested too deeply"):
        coderunner.run_python(str(script), [deep], function="f")


def test_cli_python_function_with_a_deep_argument(tmp_path: Path, isolated) -> None:
    script = tmp_path / "s.py"
    script.write_text("def f(a):\n    return len(a)\n")
    r = cli("python", str(script), "-f", "f", "[" * 100000)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    assert r.stdout.decode().strip().splitlines()[-1] == "100000"


# ---------------------------------------------------------------------------- 6. hostname


@pytest.mark.parametrize("name", ["a\nb", "\ud800", "-a", "", "a" * 65, "a b", "a/b", "h\u00e9"])
def test_a_hostname_override_that_is_no_host_name(name: str) -> None:
    with pytest.raises(ProfileError, match="hostname"):
        profile.with_overrides(profile.load("strict"), hostname=name)


@pytest.mark.parametrize("name", ["a\nb", "-a", "a b"])
def test_a_profile_hostname_that_is_no_host_name(name: str) -> None:
    with pytest.raises(ProfileError, match="x.toml: process.hostname"):
        profile.from_dict({"extends": "strict", "process": {"hostname": name}}, source="x.toml")


@pytest.mark.parametrize("name", ["box", "my-host.example", "a" * 64, "1.2"])
def test_plain_hostnames_are_accepted(name: str) -> None:
    assert profile.with_overrides(profile.load("strict"), hostname=name).hostname == name


# ---------------------------------------------------------------------------- 7. session names


@pytest.mark.parametrize("name", [".", ".."])
def test_a_session_name_that_could_not_be_found_again(state: Path, name: str) -> None:
    with pytest.raises(InputError, match="name"):
        sessions.start(["true"], name=name)
    assert not state.exists() or sessions.list_sessions() == []


@pytest.mark.parametrize("flag", ["shell", "pty", "trace", "ends_with_caller"])
def test_a_session_flag_as_text_is_refused(state: Path, flag: str) -> None:
    # As sandbox.run: "no" and "false" are true to Python, and were taken as True.
    with pytest.raises(InputError, match=f"{flag}: expected True or False, got 'no'"):
        sessions.start("true", **{flag: "no"})
    assert not state.exists() or sessions.list_sessions() == []


def test_cli_start_name_dotdot(state: Path) -> None:
    assert_clean_error(cli("start", "--name", "..", "--", "true"), "name")


# ---------------------------------------------------------------------------- 8. SANDBOXRUN_UID_LOCK


@pytest.mark.parametrize("value, needle", [
    ("", "expected an absolute path"),
    ("rel.lock", "expected an absolute path"),
    ("/", "Is a directory"),
    ("/dev/null", "not a regular file"),  # its locks are anyone's: two callers would share uids
])
def test_uid_lock_values(monkeypatch: pytest.MonkeyPatch, value: str, needle: str) -> None:
    monkeypatch.setenv("SANDBOXRUN_UID_LOCK", value)
    with pytest.raises(InputError, match=f"SANDBOXRUN_UID_LOCK=.*{needle}"):
        uids._open_lock_file()


def test_uid_lock_in_a_missing_directory_makes_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDBOXRUN_UID_LOCK", str(tmp_path / "nodir" / "x.lock"))
    with pytest.raises(InputError, match="SANDBOXRUN_UID_LOCK=.*No such file"):
        uids._open_lock_file()
    assert not (tmp_path / "nodir").exists()
    monkeypatch.setenv("SANDBOXRUN_UID_LOCK", str(tmp_path / "x.lock"))
    os.close(uids._open_lock_file())  # an existing directory: the file is made there
    assert (tmp_path / "x.lock").is_file()


def test_cli_run_with_a_uid_lock_in_a_missing_directory(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("per-run uids (and their lock file) are for root callers")
    r = cli("--", "true", env={"SANDBOXRUN_UID_LOCK": str(tmp_path / "nodir" / "x.lock")})
    assert not (tmp_path / "nodir").exists()
    if r.returncode == 0:
        pytest.skip("this host's runs take no per-run uid (rootless or owner mode)")
    assert_clean_error(r, "SANDBOXRUN_UID_LOCK")


@pytest.mark.parametrize("value, needle", [("rel.lock", "absolute path"), ("/dev/null", "regular file")])
def test_cli_start_with_a_bad_uid_lock_is_an_input_error(state: Path, value: str, needle: str) -> None:
    """Named by the starter (exit 2), not met later by the session's monitor (125)."""
    if os.geteuid() != 0:
        pytest.skip("per-run uids (and their lock file) are for root callers")
    r = cli("start", "--", "true", env={"SANDBOXRUN_UID_LOCK": value})
    assert_clean_error(r, needle)
    assert not state.exists() or not [p for p in state.iterdir() if p.is_dir()]  # no session was made


@pytest.mark.parametrize("value", ["/proc/self/status", "/proc/self/attr/current"])
def test_uid_lock_on_a_kernel_filesystem_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    # /proc/self/status is another file in each process: its locks would be no one else's.
    if not os.path.exists(value):
        pytest.skip(f"no {value} here")
    monkeypatch.setenv("SANDBOXRUN_UID_LOCK", value)
    with pytest.raises(InputError, match=r"SANDBOXRUN_UID_LOCK=.*a file of the kernel's \(proc\)"):
        uids._open_lock_file()


# ---------------------------------------------------------------------------- 8b. debugging switches


@pytest.mark.parametrize("name, value, needle", [
    ("SANDBOXRUN_NATIVE", "false", "expected 1 .on. or 0 .off."),  # was: native on, as if "1"
    ("SANDBOXRUN_NATIVE", "no", "expected 1"),
    ("SANDBOXRUN_TRACE", "yes", "expected 1"),  # was: no trace, silently
    ("SANDBOXRUN_NO_TEMPLATE", "true", "expected 1"),
    ("SANDBOXRUN_FAIL_STEP", "sekcomp", "not a setup step; expected one of session,"),  # was: nothing injected
])
def test_a_debugging_switch_that_means_nothing_is_named(monkeypatch: pytest.MonkeyPatch, state: Path, name: str,
                                                        value: str, needle: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(InputError, match=f"{name}='{value}': {needle}"):
        sandbox.run(["true"])
    with pytest.raises(InputError, match=f"{name}='{value}'"):
        sessions.start(["true"])  # in the caller, not as a monitor that failed
    assert_clean_error(cli("--", "true"), f"{name}='{value}'")
    assert_clean_error(cli("doctor"), f"{name}='{value}'")  # was: every layer NO, exit 1, as if the host lacked them
    monkeypatch.setenv(name, "0" if name != "SANDBOXRUN_FAIL_STEP" else "exec")
    assert sandbox.run(["true"]).status in ("ok", "nonzero_exit")  # a valid value still runs (or fails at exec)


def test_every_step_the_child_marks_is_a_known_step() -> None:
    # plan.STEPS is what SANDBOXRUN_FAIL_STEP accepts: a step added to either child but not to
    # it could not be injected at.
    import re

    from sandbox.plan import STEPS

    src = ROOT / "sandbox"
    marked = set(re.findall(r'\bmark\("([a-z_]+)"\)', (src / "child.py").read_text()))
    stepped = set(re.findall(r'\.step\("([a-z_]+)"\)', "".join(
        p.read_text() for p in (src / "native").glob("*.py"))))
    assert marked and stepped and marked | stepped == set(STEPS), (marked | stepped) ^ set(STEPS)


# ---------------------------------------------------------------------------- 9. bytes that are not UTF-8


def test_cli_write_paste_send_keys_take_the_bytes_as_given(state: Path, isolated) -> None:
    s = sandbox.start(["cat"], name="plain")
    # Raw, no echo: the terminal hands the command each byte as it came, and od says which.
    t = sandbox.start(["sh", "-c", "stty raw -echo; echo ready; head -c 2 | od -An -tx1"], name="term", pty=True)
    assert cli("write", "plain", b"\xff").returncode == 0
    assert cli("paste", "plain", b"a\xfe").returncode == 0
    deadline = time.monotonic() + 20
    while b"ready" not in t._read_log("output")[1] and time.monotonic() < deadline:
        time.sleep(0.05)  # (bytes sent before stty ran would be cooked by the line discipline)
    for args in (("send-keys", "term", b"\xff"), ("send-keys", "-L", "term", b"\xfe")):
        r = cli(*args)
        assert r.returncode == 0, r.stderr.decode(errors="replace")
    s.write(b"", eof=True)
    res = s.wait(20)
    assert res is not None and s._read_log("stdout")[1] == b"\xffa\xfe"
    res = t.wait(20)
    assert res is not None and t._read_log("output")[1].split() == [b"ready", b"ff", b"fe"], t._read_log("output")


def test_library_write_of_a_lone_surrogate(state: Path, isolated) -> None:
    s = sandbox.start(["cat"])
    for call in (lambda: s.write("a\ud800"), lambda: s.paste("\ud800")):
        with pytest.raises(InputError, match="lone surrogate"):
            call()
    t = sandbox.start(["cat"], pty=True)
    for literal in (False, True):
        with pytest.raises(InputError, match="lone surrogate"):
            t.send_keys("\ud800", literal=literal)
    with pytest.raises(InputError, match="stdin: .*lone surrogate"):
        sandbox.start(["cat"], stdin="\ud800")
    assert s.write("\udcff", eof=True) == 1  # a command line's byte (surrogateescape): that byte
    res = s.wait(20)
    assert res is not None and s._read_log("stdout")[1] == b"\xff"
    t.kill(grace=0)


# ---------------------------------------------------------------------------- a second report


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_a_function_argument_that_is_not_json_is_a_string(text: str) -> None:
    assert coderunner._cli_value(text) == text  # (json.loads took them as floats: refused later)
    assert coderunner._cli_value("1.5") == 1.5


@pytest.mark.parametrize("args", [["--stdin-file", "", "--", "cat"], ["python", "--stdin-file", "", "x.py"]])
def test_an_empty_stdin_file_is_refused_not_ignored(args: list[str]) -> None:
    assert_clean_error(cli(*args), "--stdin-file: empty path")


@pytest.mark.parametrize("args", [["payload"], ["batch", "-"]])
def test_a_closed_stdin_reads_as_empty_input(args: list[str]) -> None:
    full = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "sandbox", *args], stdin=subprocess.DEVNULL, capture_output=True,
                       timeout=60, env=full, cwd=ROOT, preexec_fn=lambda: os.close(0))
    text = r.stderr.decode()
    assert "internal error" not in text and "Traceback" not in text, text
    assert r.returncode in (0, 2), (r.returncode, text)


def test_the_code_runner_under_a_tmpdir_that_takes_no_folder_is_a_setup_error(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("print(1)\n")
    r = cli("python", str(script), env={"TMPDIR": "/proc"})
    text = r.stderr.decode()
    assert "internal error" not in text and "Traceback" not in text, text
    assert r.returncode == 125 and "setup failed: workdir: cannot make the script's folder under /proc" in text, text


def test_an_empty_workspace_is_refused_not_the_current_directory() -> None:
    from sandbox.mcp_server import _workspace

    for bad in ("", 5):
        with pytest.raises(InputError, match="expected a directory's path"):
            _workspace(bad)  # type: ignore[arg-type]
    assert_clean_error(cli("mcp", "--workspace", ""), "--workspace: expected a directory's path")


def test_a_log_page_past_the_end_says_it_shows_nothing() -> None:
    page = sessions.LogPage(id="x", stream="output", lines=[], offset=5, total_lines=5, dropped_bytes=0)
    assert page.hint() == "no lines from 5 of 5 (0-based); earlier: --offset 4 --limit 1"
    page = sessions.LogPage(id="x", stream="output", lines=["a", "b"], offset=1, total_lines=5, dropped_bytes=0)
    assert page.hint() == "lines 1-2 of 5 (0-based); earlier: --offset 0 --limit 1; later: --offset 3 --limit 2"
    # the tail of 301 lines: the page before it ends where it starts (it said --limit 200, from 0)
    page = sessions.LogPage(id="x", stream="output", lines=["l"] * 200, offset=101, total_lines=301, dropped_bytes=0)
    assert page.hint() == "lines 101-300 of 301 (0-based); earlier: --offset 0 --limit 101"


def test_library_callbacks_and_keys_of_the_wrong_type_are_input_errors(state: Path, isolated) -> None:
    for name in ("on_stdout", "on_stderr"):
        with pytest.raises(InputError, match=f"{name}: expected a function"):
            sandbox.run(["true"], **{name: 5})
    s = sandbox.start(["cat"], pty=True)
    try:
        with pytest.raises(InputError, match="send-keys: expected key names or text"):
            s.send_keys("a", 5)  # type: ignore[arg-type]
    finally:
        s.kill(grace=0)
        s.clear()


def test_check_of_an_empty_command_and_list_with_a_name() -> None:
    assert_clean_error(cli("check", "--", ""), "empty command")
    assert_clean_error(cli("profiles", "list", "extra"), "profiles list takes no name")


@pytest.mark.parametrize("option", ["--file", "--root"])
def test_payload_empty_path_options_are_refused_before_reading(option: str) -> None:
    # An empty --file read the payload from stdin instead, and ran it.
    payload = b'{"action": "run_command", "properties": [{"name": "command", "value": "echo ran"}]}'
    r = subprocess.run([sys.executable, "-m", "sandbox", "payload", option, ""], input=payload, capture_output=True,
                       timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT)
    assert_clean_error(r, f"{option}: empty path")
    assert b"ran" not in r.stdout
