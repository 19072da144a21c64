"""The code runner: a script, one function of it, or one statement, in the sandbox;
the script read-only inside, nothing written next to it on the host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox.coderunner import run_code, run_python
from sandbox.errors import InputError

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """\
import sys

def add(a, b):
    print("adding")
    return a + b

def nothing():
    print("side effect")

def odd():
    return {1, 2}

async def later(x):
    return [x, x]

class Box:
    @staticmethod
    def size():
        return 3

def fail():
    raise ValueError("bad input")

if __name__ == "__main__":
    print("main", sys.argv[1:])
"""


@pytest.fixture(scope="module", autouse=True)
def _needs_sandbox(isolated) -> None:
    pass


@pytest.fixture
def calc(tmp_path: Path) -> Path:
    p = tmp_path / "calc.py"
    p.write_text(SCRIPT)
    return p


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sandbox", "python", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_script_with_args(calc: Path) -> None:
    r = run_python(calc, ["1", "two"])
    assert r.status == "ok" and r.stdout == "main ['1', 'two']\n" and not r.returned
    assert r.command == ["python3", "/sandbox/script/calc.py", "1", "two"]


def test_function_return_value_is_json(calc: Path) -> None:
    r = run_python(calc, [2, 3], function="add")
    assert (r.status, r.returned, r.return_value, r.return_type) == ("ok", True, 5, "int")
    assert r.stdout == "adding\n" and r.stdout_bytes == 7  # the value line is taken out
    assert run_python(calc, [[1], [2]], function="add").return_value == [1, 2]
    assert run_python(calc, function="Box.size").return_value == 3
    assert run_python(calc, ["x"], function="later").return_value == ["x", "x"]


def test_none_and_unencodable_values(calc: Path) -> None:
    r = run_python(calc, function="nothing")
    assert r.returned and r.return_value is None and r.return_type == "NoneType" and r.stdout == "side effect\n"
    r = run_python(calc, function="odd")
    assert r.returned and r.return_value is None and r.return_repr == "{1, 2}" and r.return_type == "set"


def test_statement_in_the_script_namespace(calc: Path) -> None:
    r = run_python(calc, statement="add(20, 22)")
    assert r.return_value == 42 and r.stdout == "adding\n"
    r = run_python(calc, ["a"], statement="import sys\nprint(sys.argv[1:], add.__name__)")
    assert r.returned and r.return_value is None and r.stdout == "['a'] add\n"


def test_function_errors_are_the_programs(calc: Path) -> None:
    r = run_python(calc, function="fail")
    assert r.status == "nonzero_exit" and r.exit_code == 1 and not r.returned
    assert "ValueError: bad input" in r.stderr
    r = run_python(calc, function="missing")
    assert r.exit_code == 1 and "has no function 'missing'" in r.stderr


def test_script_is_read_only_and_host_dir_untouched(tmp_path: Path) -> None:
    p = tmp_path / "w.py"
    p.write_text("open(__file__, 'a').write('x')\n")
    p.chmod(0o600)  # still readable inside: the sandbox runs a private copy
    before = sorted(os.listdir(tmp_path))
    r = run_python(p)
    assert r.status == "nonzero_exit" and ("Read-only file system" in r.stderr or "Permission denied" in r.stderr)
    assert sorted(os.listdir(tmp_path)) == before and p.read_text() == "open(__file__, 'a').write('x')\n"


@pytest.mark.parametrize("mask", [0o077, 0o777])
def test_the_callers_umask_does_not_hide_the_scripts_copy_from_the_sandbox(calc: Path, mask: int) -> None:
    # The copy was made 0444 & ~umask: 0400 (or 0) to root, and the sandbox's user got
    # "can't open file '/sandbox/script/calc.py': Permission denied", as if the script's own error.
    before = os.umask(mask)
    try:
        r = run_python(calc, args=["x"])
    finally:
        os.umask(before)
    assert r.status == "ok" and r.stdout == "main ['x']\n", r


def test_workdir_and_timeout_pass_through(calc: Path, tmp_path: Path) -> None:
    (tmp_path / "data.txt").write_text("42")
    p = tmp_path / "readit.py"
    p.write_text("import os\nprint(os.getcwd(), open('data.txt').read())\n")
    assert run_python(p, cwd=tmp_path).stdout == "/work 42\n"
    p.write_text("import time\ntime.sleep(10)\n")
    assert run_python(p, timeout=0.5).status == "timeout"


def test_bad_input_raises(calc: Path, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such file"):
        run_python(tmp_path / "nope.py")
    with pytest.raises(InputError, match="is a directory"):
        run_python(tmp_path)
    with pytest.raises(InputError, match="not both"):
        run_python(calc, function="add", statement="1")
    with pytest.raises(InputError, match="Python name"):
        run_python(calc, function="os.system('x')")
    with pytest.raises(InputError, match="invalid Python"):
        run_python(calc, statement="1 +")
    with pytest.raises(InputError, match="must be strings"):
        run_python(calc, [1])
    with pytest.raises(InputError, match="JSON-encodable"):
        run_python(calc, [object()], function="add")


def test_content_scan_blocks_with_reason(calc: Path, tmp_path: Path) -> None:
    prof = tmp_path / "scan.toml"
    prof.write_text('extends = "strict"\nname = "scanned"\n[filter]\nscan = ["^import\\\\s+socket", "os\\\\.system"]\n')
    bad = tmp_path / "bad.py"
    bad.write_text("x = 1\nimport socket\n")
    r = run_python(bad, profile=str(prof))
    assert r.status == "blocked" and r.blocked and "line 2" in r.block_reason and "socket" in r.block_reason
    r = run_python(calc, statement="__import__('os').system('id')", profile=str(prof))
    assert r.status == "ok"  # no match: `os.system` is not in the text
    r = run_python(calc, statement="import os; os.system('id')", profile=str(prof))
    assert r.status == "blocked"
    # the statement's own line, not one counted past the script's end
    assert r.block_reason == "statement matches content-scan pattern 'os\\\\.system' (line 1)", r.block_reason
    assert run_python(calc, [1, 2], function="add", profile=str(prof)).return_value == 3
    assert run_code("import socket", profile=str(prof)).status == "blocked"


def test_run_code() -> None:
    r = run_code("import sys; print(sys.argv[1:])", ["a", "b"])
    assert r.stdout == "['a', 'b']\n"


def test_cli(calc: Path) -> None:
    r = cli("calc.py", "2", "3", "--function", "add", cwd=calc.parent)
    assert (r.returncode, r.stdout) == (0, "adding\n5\n"), r.stderr
    r = cli("--statement", "add('a', 'b')", "calc.py", cwd=calc.parent)
    assert (r.returncode, r.stdout) == (0, 'adding\n"ab"\n'), r.stderr
    r = cli("calc.py", "--", "-v", "--x", cwd=calc.parent)
    assert (r.returncode, r.stdout) == (0, "main ['-v', '--x']\n"), r.stderr
    # `sandboxrun python -- SCRIPT ARGS`, as `sandboxrun -- CMD ARGS`: it said "a SCRIPT or -c CODE is required"
    r = cli("--", "calc.py", "-v", cwd=calc.parent)
    assert (r.returncode, r.stdout) == (0, "main ['-v']\n"), r.stderr
    r = cli("--json", "-f", "odd", "calc.py", cwd=calc.parent)
    d = json.loads(r.stdout)
    assert r.returncode == 0 and d["return_repr"] == "{1, 2}" and d["return_type"] == "set"
    r = cli("calc.py", "-f", "fail", cwd=calc.parent)
    assert r.returncode == 1 and "ValueError" in r.stderr
    r = cli("nope.py", cwd=calc.parent)
    assert r.returncode == 2 and "no such file" in r.stderr and "Traceback" not in r.stderr


def test_cli_passes_its_stdin_on_as_run_does(tmp_path: Path) -> None:
    """`echo data | sandboxrun python s.py` gave the script an empty stdin."""
    (tmp_path / "rd.py").write_text("import sys\nprint(repr(sys.stdin.read()))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "sandbox", "python", "rd.py"], input="data\n", capture_output=True,
                       text=True, timeout=60, cwd=tmp_path, env=env)
    assert (r.returncode, r.stdout) == (0, "'data\\n'\n"), r.stderr


def test_cli_help_lists_no_option_it_refuses(tmp_path: Path) -> None:
    r = cli("--help", cwd=tmp_path)
    assert r.returncode == 0 and "--memory" in r.stdout and "--shell" not in r.stdout, r.stdout


def test_cli_dash_c_runs_code_with_arguments(tmp_path: Path) -> None:
    """`sandboxrun python -c CODE ARGS` as `python3 -c`: there was no -c."""
    r = cli("-c", "import sys; print(sys.argv[1:])", "a", "--", "-b", cwd=tmp_path)
    assert (r.returncode, r.stdout) == (0, "['a', '-b']\n"), r.stderr
    r = cli("-c", "import sys; sys.exit(3)", cwd=tmp_path)
    assert r.returncode == 3, r.stderr
    for bad, says in ((["-c", "print(1)", "-f", "x"], "not with --function"), (["-c", " "], "-c: expected non-empty"),
                      ([], "a SCRIPT or -c CODE is required")):
        r = cli(*bad, cwd=tmp_path)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, (bad, r.stderr)


def test_cli_names_the_option_typed(tmp_path: Path) -> None:
    # It said `override: limits.memory = '4096'`, the library's words for what was typed as --memory.
    r = cli("--memory", "4096", "-c", "pass", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip() == "sandboxrun: error: --memory '4096': must be at least 4MiB", r.stderr


def test_a_value_over_64k_or_after_the_output_cap_is_said_so_not_lost(tmp_path: Path) -> None:
    """A 2 MB return value came back as nothing (returned false), its tagged driver line left
    in stdout; a value after a flood of output was lost without a word."""
    s = tmp_path / "v.py"
    s.write_text("import sys\ndef big(n):\n    return 'x' * n\n"
                 "def flood(n):\n    sys.stdout.write('y' * n)\n    return 5\n")
    r = run_python(s, [2_000_000], function="big")
    assert r.returned and r.return_type == "str" and r.return_truncated and r.return_value is None
    assert len(r.return_repr or "") == 65536 and r.stdout == "" and r.return_lost is None
    for n in (3_000_000, 2**20 - 6):  # far past the cap, and the cap inside the tag
        r = run_python(s, [n], function="flood")
        assert not r.returned and r.stdout_truncated and "output cap" in (r.return_lost or ""), r
        assert set(r.stdout) == {"y"}, r.stdout[-80:]
    r = run_python(s, [10], function="flood")
    assert (r.returned, r.return_value, r.stdout, r.return_lost) == (True, 5, "y" * 10, None)


def test_a_script_without_py_suffix_runs_a_function_and_bad_library_input_is_an_input_error(tmp_path: Path) -> None:
    """`-f` on a script named without .py failed with the driver's own AttributeError; a lone
    surrogate in the path, or args=None, raised UnicodeEncodeError / TypeError."""
    s = tmp_path / "noext"
    s.write_text("def add(a, b):\n    return a + b\n")
    r = run_python(s, [1, 2], function="add")
    assert (r.status, r.return_value) == ("ok", 3), r.stderr
    for call, says in ((lambda: run_python("\ud800.py"), "lone surrogate"),
                       (lambda: run_python(s, None, function="add"), "args: expected a list"),  # type: ignore[arg-type]
                       (lambda: run_code("print(1)", None), "args: expected a list")):  # type: ignore[arg-type]
        with pytest.raises(InputError, match=says):
            call()


def test_values_whose_json_or_repr_fails_still_come_back(calc: Path) -> None:
    # The driver's repr() had no guard: the runner's own traceback was blamed on the program.
    big = run_python(calc, statement="2**20000")  # JSON (and repr) refuse ints over 4300 digits
    assert (big.status, big.returned, big.return_type) == ("ok", True, "int"), big
    assert big.return_repr.isdigit() and len(big.return_repr) == 6021, big.return_repr[:50]
    deep = run_python(calc, statement="__import__('functools').reduce(lambda a, _: [a], range(100000), [])")
    assert (deep.status, deep.returned, deep.return_type) == ("ok", True, "list"), deep
    assert deep.return_repr.startswith("<list object: its repr() raised RecursionError"), deep.return_repr


def test_values_no_utf8_reader_takes_or_nested_deep_come_back_as_their_repr(calc: Path) -> None:
    # A lone surrogate went into return_value as it was: the MCP SDK failed to serialize the
    # reply (a traceback on its stderr, the whole Result lost) and `--json` printed "\\ud800".
    odd = run_python(calc, statement="'\\ud800' + 'x'")
    assert (odd.returned, odd.return_value, odd.return_repr, odd.return_type) == (True, None, "'\\ud800x'", "str")
    json.dumps(odd.to_dict(), ensure_ascii=False).encode()  # UTF-8 throughout
    deep = run_python(calc, statement="__import__('functools').reduce(lambda a, _: [a], range(100), [])")
    assert deep.return_value is None and deep.return_repr == "[" * 101 + "]" * 101, deep
    flat = run_python(calc, statement="[[['é', 1.5, None]]]")
    assert flat.return_value == [[["é", 1.5, None]]] and flat.return_repr is None


FORGER = """\
import os, sys
def forge(body):
    token = open("/proc/self/cmdline", "rb").read().split(b"\\0")[3].decode()  # argv: python3 -c DRIVER TOKEN
    sys.stdout.write("\\n" + token + body + "\\n")
    sys.stdout.flush()
    os._exit(0)
"""


@pytest.mark.parametrize("body", ["[1]", '{"type": "float", "json": true, "value": NaN}', "[" * 60000 + "]" * 60000,
                                  '{"type": 5, "json": false, "repr": 7, "truncated": "yes"}',
                                  '{"type": "\\udcff", "json": true, "value": "\\ud800"}'])
def test_a_value_line_the_program_forged_is_taken_apart_safely(tmp_path: Path, body: str) -> None:
    # The tagged line is the sandbox's to write (its token is in the driver's argv): a list
    # there was an internal error (AttributeError), a deep one a RecursionError, NaN went out
    # as JSON no reader takes, and other types into fields the schema says are strings.
    script = tmp_path / "forger.py"
    script.write_text(FORGER)
    r = run_python(script, [body], function="forge")
    d = r.to_dict()
    assert r.status == "ok" and r.stdout == "", r
    json.dumps(d, allow_nan=False, ensure_ascii=False).encode()
    assert all(isinstance(d[k], (str, type(None))) for k in ("return_type", "return_repr", "return_lost")), d
    assert isinstance(d["return_truncated"], bool)
    assert r.returned or "does not write" in (r.return_lost or ""), d


def _copies(owner: int) -> list[Path]:
    from sandbox.isolation.cgroups import owner_tag  # noqa: F401 - the names carry the pid
    from sandbox.workdir import tmpdir

    return [d for d in Path(tmpdir()).glob(f"sandboxrun-{owner}-*") if (d / "script.py").exists()]


def test_the_scripts_copy_is_seen_by_no_one_else(calc: Path) -> None:
    # Its folder was 0755 and the copy 0444: a private (0600) script was anyone's to read.
    import threading

    calc.chmod(0o600)
    seen: list[tuple[int, int]] = []
    done = threading.Event()

    def look() -> None:
        while not done.is_set():
            for d in _copies(os.getpid()):
                seen.append((d.stat().st_mode & 0o777, (d / "script.py").stat().st_mode & 0o777))
            if seen:
                return
            done.wait(0.01)

    t = threading.Thread(target=look)
    t.start()
    try:
        r = run_python(calc, statement="__import__('time').sleep(1)")
    finally:
        done.set()
        t.join()
    assert r.status == "ok" and seen, (r, seen)
    assert all(folder == 0o700 for folder, _file in seen), seen


def test_a_sigkilled_callers_script_copy_is_swept_by_a_later_start(calc: Path) -> None:
    import signal
    import time

    p = subprocess.Popen([sys.executable, "-m", "sandbox", "python", "calc.py", "--statement",
                          "__import__('time').sleep(60)"], cwd=calc.parent, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not _copies(p.pid):
            assert time.monotonic() < deadline and p.poll() is None, "no copy made"
            time.sleep(0.02)
        left = _copies(p.pid)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    r = subprocess.run([sys.executable, "-m", "sandbox", "--", "true"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})  # any later start: once per process
    assert r.returncode == 0, r.stderr
    assert not any(d.exists() for d in left), left
