"""LLM JSON payloads (run_command, run_code_script), valid and broken, through the
CLI as an executor pipes them, and through sandbox.payload.execute."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sandbox.payload import execute, parse

ROOT = Path(__file__).resolve().parent.parent


def cli(payload: str | dict[str, Any], *args: str, cwd: Path | None = None) -> tuple[int, dict[str, Any]]:
    text = payload if isinstance(payload, str) else json.dumps(payload)
    r = subprocess.run([sys.executable, "-m", "sandbox", "payload", *args], input=text.encode(),
                       capture_output=True, timeout=120, cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert b"Traceback" not in r.stderr, r.stderr
    return r.returncode, json.loads(r.stdout)


def cmd(command: str | None, **props: str | None) -> dict[str, Any]:
    plist: list[dict[str, Any]] = [{"name": "command", "value": command}] if command is not None else []
    plist += [{"name": k, "value": v} if v is not None else {"name": k} for k, v in props.items()]
    return {"action": "run_command", "thinking": "list files", "sequential": {"prompt": "next step"},
            "properties": plist}


def code(**props: str | None) -> dict[str, Any]:
    return {"action": "run_code_script",
            "properties": [{"name": k, "value": v} if v is not None else {"name": k} for k, v in props.items()]}


@pytest.fixture
def calc(tmp_path: Path) -> Path:
    p = tmp_path / "calc.py"
    p.write_text("import sys\n"
                 "def add(a, b):\n    print('adding')\n    return a + b\n"
                 "def greet(name):\n    return {'hello': name}\n"
                 "if __name__ == '__main__':\n    print('args', sys.argv[1:])\n")
    return p


# ---------------------------------------------------------------------------- valid payloads


def test_run_command_reply(isolated, tmp_path: Path) -> None:
    (tmp_path / "here.txt").write_text("x")
    rc, d = cli(cmd("ls; pwd; echo $K; echo err >&2", env='{"K": "V"}', cwd=None, timeout="30", shell="true",
                    shelltype=None, description="list the directory"), cwd=tmp_path)
    assert rc == 0 and d["status"] == "ok" and d["returncode"] == 0 and d["exit_code"] == 0
    assert d["stdout"] == "here.txt\n/work\nV\n" and d["stderr"] == "err\n"
    assert d["sequential"] == {"prompt": "next step"} and d["prompt"] == "next step"
    assert d["action"] == "run_command" and d["profile"] == "strict"
    assert d["isolation"]["limits"]["output_bytes"] == 1_000_000
    assert d["isolation"]["limits"]["timeout_s"] == 30


def test_exit_code_and_timeout(isolated, tmp_path: Path) -> None:
    rc, d = cli(cmd("exit 3"), cwd=tmp_path)
    assert rc == 3 and d["returncode"] == 3 and d["status"] == "nonzero_exit"
    rc, d = cli(cmd("sleep 10", timeout="0.5"), cwd=tmp_path)
    assert rc == 124 and d["returncode"] == 124 and d["status"] == "timeout" and d["timed_out"]


def test_bash_shelltype_and_no_shell(isolated, tmp_path: Path) -> None:
    d = execute(json.dumps(cmd('echo "$BASH_VERSION" | cut -c1', shelltype="bash")), base=str(tmp_path))
    assert d["command"][0] == "/bin/bash" and d["stdout"].strip().isdigit()
    d = execute(json.dumps(cmd("echo $HOME 'a b'", shell="false")), base=str(tmp_path))
    assert d["command"] == ["echo", "$HOME", "a b"] and d["stdout"] == "$HOME a b\n"


def test_relative_cwd_and_output_cap(isolated, tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "f").write_text("in sub\n")
    d = execute(json.dumps(cmd("cat f", cwd="sub")), base=str(tmp_path))
    assert d["stdout"] == "in sub\n"
    d = execute(json.dumps(cmd("head -c 3000000 /dev/zero")), base=str(tmp_path))
    assert d["stdout_truncated"] and d["stdout_bytes"] == 3_000_000 and len(d["stdout"]) == 1_000_000


def test_code_script_three_methods(isolated, calc: Path) -> None:
    base = str(calc.parent)
    d = execute(json.dumps(code(scriptPath="calc.py", args="1 'two words'")), base=base)
    assert d["stdout"] == "args ['1', 'two words']\n" and d["returncode"] == 0
    d = execute(json.dumps(code(scriptPath="./", fileName="calc.py", method="function", args="add 2 3")), base=base)
    assert d["return_value"] == 5 and d["stdout"] == "adding\n" and d["returned"]
    d = execute(json.dumps(code(scriptPath=str(calc), method="function", args="greet world")), base=base)
    assert d["return_value"] == {"hello": "world"}
    d = execute(json.dumps(code(scriptPath="calc.py", method="statement", args="add('a', 'b') * 2")), base=base)
    assert d["return_value"] == "abab" and d["status"] == "ok"


def test_code_script_through_cli(isolated, calc: Path) -> None:
    rc, d = cli(code(scriptPath="calc.py", method="function", args="add 40 2", timeout="20"), cwd=calc.parent)
    assert rc == 0 and d["return_value"] == 42 and d["action"] == "run_code_script"
    rc, d = cli(code(scriptPath="calc.py", method="function", args="nope"), cwd=calc.parent)
    assert rc == 1 and "no function 'nope'" in d["stderr"]


def test_dry_run_runs_nothing(tmp_path: Path) -> None:
    rc, d = cli(cmd("touch made", timeout="5"), "--dry-run", cwd=tmp_path)
    assert rc == 0 and d["dry_run"] and not (tmp_path / "made").exists()
    req, box = d["request"], d["sandbox"]
    assert req["argv"] == ["/bin/sh", "-c", "touch made"] and req["timeout"] == 5 and req["cwd"] == str(tmp_path)
    assert box["profile"] == "strict" and box["limits"]["timeout"] == 5 and box["network"] == "none"
    work = [m for m in box["mounts"] if m.get("workdir")]
    assert work == [{"source": str(tmp_path), "target": "/work", "mode": "rw", "workdir": True}]
    assert {"source": "/usr", "target": "/usr", "mode": "ro"} in box["mounts"]
    assert d["prompt"] == "next step"


def test_dry_run_says_what_this_host_makes_of_the_cgroup(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """--dry-run showed rootless's memory limit as if it applied, on a host with no usable
    cgroup (it does not), and strict's run as if it would go ahead (it is a setup_error)."""
    from sandbox.isolation import cgroups

    text = json.dumps(cmd("ls"))
    d = execute(text, base=str(tmp_path), dry_run=True)["sandbox"]
    assert d["cgroup_here"] in ("v1", "v2") and "would_fail" not in d, d
    monkeypatch.setenv("SANDBOXRUN_CGROUP", "none")
    monkeypatch.setattr(cgroups, "_backend", None)
    monkeypatch.setattr(cgroups, "_backend_error", None)
    d = execute(text, base=str(tmp_path), dry_run=True, profile="rootless")["sandbox"]
    assert d["cgroup_here"] is None and d["limits_not_applied"] == ["memory", "cpus"], d
    assert "SANDBOXRUN_CGROUP=none" in d["cgroup_unavailable"] and d["limits"]["memory"]
    d = execute(text, base=str(tmp_path), dry_run=True)["sandbox"]
    assert d["would_fail"].startswith("cgroup:") and "limits_not_applied" not in d, d


def test_dry_run_code_script(calc: Path) -> None:
    d = execute(json.dumps(code(scriptPath="calc.py", method="function", args="add 1 2")), dry_run=True,
                base=str(calc.parent))
    assert d["request"]["script"] == str(calc) and d["request"]["function"] == "add"
    assert d["request"]["args"] == [1, 2] and d["request"]["script_inside"] == "/sandbox/script/calc.py"
    assert any(m["source"] == str(calc) and m["mode"] == "ro" for m in d["sandbox"]["mounts"])


# ---------------------------------------------------------------------------- broken payloads


BROKEN = [
    ("{not json", "payload", "invalid JSON"),
    ("", "payload", "empty"),
    ("[1, 2]", "payload", "JSON object"),
    ('{"properties": []}', "action", "missing"),
    ('{"action": "delete_everything", "properties": []}', "action", "unknown action"),
    ('{"action": "run_command", "props": []}', "props", "unknown key"),
    ('{"action": "run_command"}', "properties", "missing"),
    ('{"action": "run_command", "properties": {"command": "ls"}}', "properties", "list"),
    ('{"action": "run_command", "properties": ["ls"]}', "properties[0]", "object"),
    (json.dumps(cmd(None)), "command", "missing"),
    (json.dumps(cmd("   ")), "command", "missing"),
    (json.dumps(cmd("ls", colour="red")), "colour", "unknown property"),
    ('{"action": "run_command", "properties": [{"name": "command", "value": ["ls"]}]}', "command", "string"),
    (json.dumps(cmd("ls") | {"properties": [{"name": "command", "value": "ls"}, {"name": "timeout", "value": 30}]}),
     "timeout", "must be a string, got number"),
    (json.dumps(cmd("ls", timeout="121")), "timeout", "out of range"),
    (json.dumps(cmd("ls", timeout="0")), "timeout", "out of range"),
    (json.dumps(cmd("ls", timeout="soon")), "timeout", "number of seconds"),
    (json.dumps(cmd("ls", timeout="nan")), "timeout", "number of seconds"),
    (json.dumps(cmd("ls", timeout="1_0")), "timeout", "number of seconds"),  # float() reads 10
    (json.dumps(cmd("ls", timeout="\u0661\u0660")), "timeout", "number of seconds"),  # Arabic-Indic 10
    (json.dumps(cmd("ls", timeout="inf")), "timeout", "number of seconds"),
    (json.dumps(cmd("ls", timeout="1e999")), "timeout", "out of range"),
    ('{"action": "run_command", "action": "run_code_script", "properties": []}', "payload", "'action' given more than once"),
    (json.dumps(cmd("ls", env='{"K": "a", "K": "b"}')), "env", "'K' given more than once"),
    (json.dumps(cmd("ls", shell="maybe")), "shell", "true"),
    (json.dumps(cmd("ls", shelltype="windowsps")), "shelltype", "not supported on Linux"),
    (json.dumps(cmd("ls", shelltype="maccmd")), "shelltype", "not supported on Linux"),
    (json.dumps(cmd("ls", shelltype="windowsbat")), "shelltype", "not supported on Linux"),
    (json.dumps(cmd("ls", shelltype="fish")), "shelltype", "unknown shell"),
    (json.dumps(cmd("ls", env="K=V")), "env", "JSON object"),
    (json.dumps(cmd("ls", env='["K"]')), "env", "JSON object"),
    (json.dumps(cmd("ls", env='{"K": 1}')), "env.K", "string"),
    (json.dumps(cmd("ls", env='{"A=B": "x"}')), "env", "invalid variable"),
    (json.dumps(cmd("ls", cwd="/etc")), "cwd", "outside the allowed root"),  # the default root: base
    (json.dumps(cmd("ls 'unbalanced", shell="false")), "command", "cannot split"),
    (json.dumps(cmd("ls") | {"sequential": "p"}), "sequential", "object"),
    ('{"action": "run_command", "properties": [{"name": "command", "value": "ls"}, '
     '{"name": "command", "value": "pwd"}]}', "command", "more than once"),
    (json.dumps(code(method="function")), "scriptPath", "missing"),
    (json.dumps(code(scriptPath="nope.py")), "scriptPath", "no such file"),
    (json.dumps(code(scriptPath="./")), "fileName", "directory"),
    (json.dumps(code(scriptPath="calc.py", method="eval")), "method", "unknown method"),
    (json.dumps(code(scriptPath="calc.py", method="function")), "args", "function name"),
    (json.dumps(code(scriptPath="calc.py", method="function", args="1bad")), "args", "function name"),
    (json.dumps(code(scriptPath="calc.py", method="statement")), "args", "statement"),
    (json.dumps(code(scriptPath="calc.py", command="ls")), "command", "unknown property for run_code_script"),
    (json.dumps(code(scriptPath="data.txt")), "scriptPath", "Python script"),
    (json.dumps(code(scriptPath="calc.py", shelltype="windowsps")), "shelltype", "not supported on Linux"),
]


@pytest.mark.parametrize(("payload", "field", "words"), BROKEN)
def test_broken_payload_names_the_field(payload: str, field: str, words: str, calc: Path) -> None:
    (calc.parent / "data.txt").write_text("x")
    d = execute(payload, base=str(calc.parent))
    assert list(d) == ["error"], d
    assert d["error"]["field"] == field and words in d["error"]["message"], d


@pytest.mark.parametrize(("cwd", "words"), [
    ("/no/such/dir", "no such directory"), ("/etc", "system directory"), ("/", "host's root"),
    ("/var", "contains /var/lib")])
def test_cwd_anywhere_with_root_slash_still_never_a_system_tree(cwd: str, words: str, tmp_path: Path) -> None:
    d = execute(json.dumps(cmd("ls", cwd=cwd)), base=str(tmp_path), root="/")
    assert d["error"]["field"] == "cwd" and words in d["error"]["message"], d


def test_payload_paths_stay_in_the_current_directory_by_default(tmp_path: Path) -> None:
    # The model writes cwd and scriptPath: without --root they may not leave where we started.
    (tmp_path / "ws").mkdir()
    secret = tmp_path / "secret.py"
    secret.write_text("print('host file')\n")
    for payload, field in ((cmd("ls", cwd=str(tmp_path)), "cwd"), (cmd("ls", cwd=".."), "cwd"),
                           (code(scriptPath=str(secret)), "scriptPath")):
        d = execute(json.dumps(payload), base=str(tmp_path / "ws"))
        assert d["error"]["field"] == field and "outside the allowed root" in d["error"]["message"], d


def test_broken_payload_cli_exit_2(tmp_path: Path) -> None:
    for payload, field in (("{oops", "payload"), (json.dumps(cmd("ls", timeout="500")), "timeout"),
                           (json.dumps(cmd("ls", shelltype="windowsps")), "shelltype")):
        rc, d = cli(payload, cwd=tmp_path)
        assert rc == 2 and d["error"]["field"] == field


def test_bad_profile_is_a_one_line_error(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "sandbox", "payload", "--profile", "nope"], input=b"{}",
                       capture_output=True, timeout=60, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and b"unknown profile" in r.stderr and b"Traceback" not in r.stderr


def test_parse_normalises(tmp_path: Path) -> None:
    req = parse(json.dumps(cmd("ls", timeout="12s", shell="FALSE", cwd=".", env='{"A": "b"}')), base=str(tmp_path))
    assert (req.timeout, req.shell, req.cwd, req.env, req.argv) == (12.0, False, str(tmp_path), {"A": "b"}, ["ls"])
    assert req.prompt == "next step" and req.has_prompt
    req = parse(json.dumps(cmd("ls")).encode(), base=str(tmp_path))
    assert (req.timeout, req.shell, req.argv) == (30.0, True, ["/bin/sh", "-c", "ls"])


def test_blocked_command_is_a_result_not_an_error(isolated, tmp_path: Path) -> None:
    rc, d = cli(cmd("rm -rf /"), cwd=tmp_path)
    assert rc == 125 and d["status"] == "blocked" and d["blocked"] and d["block_reason"]


def test_root_confines_payload_paths(calc: Path, tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    d = execute(json.dumps(cmd("ls", cwd="..")), base=str(tmp_path / "sub"), root=str(tmp_path / "sub"),
                dry_run=True)
    assert d["error"]["field"] == "cwd" and "outside the allowed root" in d["error"]["message"]
    d = execute(json.dumps(code(scriptPath=str(calc))), base=str(tmp_path / "sub"), root=str(tmp_path / "sub"),
                dry_run=True)
    assert d["error"]["field"] == "scriptPath" and "outside" in d["error"]["message"]
    d = execute(json.dumps(cmd("ls", cwd="sub")), base=str(tmp_path), root=str(tmp_path), dry_run=True)
    assert d["request"]["cwd"] == str(tmp_path / "sub")


def test_root_below_the_current_directory_is_the_default_cwd(calc: Path, tmp_path: Path) -> None:
    """`--root sub`, run from its parent: a payload without cwd, and every run_code_script (which
    has no cwd to give), works in the root; the default ./ would be outside it."""
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "calc.py").write_text(calc.read_text())
    for payload in (cmd("ls"), code(scriptPath="sub/calc.py")):
        d = execute(json.dumps(payload), base=str(tmp_path), root=str(sub), dry_run=True)
        assert d["request"]["cwd"] == str(sub), d
    d = execute(json.dumps(cmd("ls", cwd=".")), base=str(tmp_path), root=str(sub), dry_run=True)
    assert d["error"]["field"] == "cwd" and "outside the allowed root" in d["error"]["message"]


def test_submodules_are_attributes_of_the_package_imported_on_first_use() -> None:
    """README: `sandbox.doctor.diagnose()`, `sandbox.payload.execute(...)`, `sandbox.batch.BatchRequest`
    after a plain `import sandbox`, which stays cheap (the CLI's start-up): none is imported before."""
    names = ("doctor", "payload", "batch", "sessions", "coderunner")
    code = ("import sys, sandbox\n"
            f"names = {names!r}\n"
            "early = [n for n in names if 'sandbox.' + n in sys.modules]\n"
            "assert not early, early\n"
            "assert callable(sandbox.doctor.diagnose) and callable(sandbox.payload.execute)\n"
            "assert sandbox.batch.BatchRequest and callable(sandbox.sessions.start)\n"
            "assert callable(sandbox.coderunner.run_python)\n"
            "assert all(getattr(sandbox, n) is sys.modules['sandbox.' + n] for n in names)\n"
            "try:\n"
            "    sandbox.nosuchthing\n"
            "except AttributeError as e:\n"
            "    assert 'nosuchthing' in str(e), e\n"
            "else:\n"
            "    raise AssertionError('sandbox.nosuchthing did not raise')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr


def test_core_does_not_import_the_optional_extras() -> None:
    code = ("import sys, sandbox, sandbox.cli, sandbox.payload, sandbox.coderunner, sandbox.mcp_server\n"
            "bad = [m for m in ('mcp', 'langchain_core', 'pydantic', 'anyio') if m in sys.modules]\n"
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr


def test_payload_cwd_through_a_planted_link_is_refused(tmp_path: Path) -> None:
    (tmp_path / "victim").mkdir()
    os.symlink(tmp_path / "victim", tmp_path / "build")  # as an earlier run could have
    d = execute(json.dumps(cmd("ls", cwd="build")), base=str(tmp_path))
    assert d["error"]["field"] == "cwd" and "is a symbolic link" in d["error"]["message"], d


def test_payload_paths_never_go_through_a_hidden_directory(tmp_path: Path) -> None:
    # Started in a home directory, the model's cwd must not be .ssh or .config.
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".cfg").mkdir()
    (tmp_path / ".cfg" / "x.py").write_text("print(1)\n")
    for payload, field in ((cmd("ls", cwd=".ssh"), "cwd"), (code(scriptPath=".cfg/x.py"), "scriptPath")):
        d = execute(json.dumps(payload), base=str(tmp_path))
        assert d["error"]["field"] == field and "hidden directory" in d["error"]["message"], d
    d = execute(json.dumps(cmd("ls", cwd="\udc2e")), base=str(tmp_path))
    assert d["error"]["field"] == "cwd" and "UTF-8" in d["error"]["message"], d


# ---------------------------------------------------------------------------- hostile input


def _strict_json(text: str) -> Any:
    """json.loads that refuses NaN and Infinity, as any other JSON reader would."""
    def refuse(name: str) -> Any:
        raise ValueError(f"{name} in the output")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize(("payload", "field"), [
    (code(scriptPath="\ud800"), "scriptPath"),
    (code(scriptPath="sub/\udc2e.py"), "scriptPath"),
    (code(scriptPath="./", fileName="\ud800"), "fileName"),
    (cmd("ls", cwd="~\ud800"), "cwd"),
    (code(scriptPath="calc.py", args="\ud800"), "args"),
    (code(scriptPath="calc.py", method="function", args="add \ud800 1"), "args"),
    (cmd("ls", env='{"K\\ud800": "v"}'), "env"),
    (cmd("ls", env='{"K": "\\ud800"}'), "env.K"),
], ids=["scriptPath", "scriptPath-escape", "fileName", "cwd-tilde", "script-args", "function-args", "env-name",
        "env-value"])
def test_lone_surrogate_in_a_path_or_argument_names_the_field(payload: dict[str, Any], field: str,
                                                               calc: Path) -> None:
    d = execute(json.dumps(payload), base=str(calc.parent), dry_run=True)
    assert list(d) == ["error"] and d["error"]["field"] == field, d
    assert "surrogate" in d["error"]["message"], d


def test_lone_surrogate_script_path_through_cli_exits_2(calc: Path) -> None:
    rc, d = cli('{"action":"run_code_script","properties":[{"name":"scriptPath","value":"\\ud800"}]}',
                cwd=calc.parent)
    assert rc == 2 and d["error"]["field"] == "scriptPath" and "surrogate" in d["error"]["message"], d


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"])
def test_nan_and_infinity_in_the_payload_are_refused(number: str, tmp_path: Path) -> None:
    text = json.dumps(cmd("ls")).replace('"next step"', number)
    assert number in text
    d = execute(text, base=str(tmp_path), dry_run=True)
    assert list(d) == ["error"] and d["error"]["field"] == "payload", d
    assert "invalid JSON" in d["error"]["message"] and number.lstrip("-") in d["error"]["message"], d
    r = subprocess.run([sys.executable, "-m", "sandbox", "payload", "--dry-run"], input=text.encode(),
                       capture_output=True, timeout=60, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and b"Traceback" not in r.stderr, r.stderr
    assert _strict_json(r.stdout.decode())["error"]["field"] == "payload"


def _deep(n: int) -> Any:
    v: Any = "core"
    for _ in range(n):
        v = [v]
    return v


def test_over_deep_payload_is_refused_by_name(tmp_path: Path) -> None:
    deep = json.dumps(cmd("ls") | {"sequential": {"prompt": _deep(500)}})
    rc, d = cli(deep, "--dry-run", cwd=tmp_path)
    assert rc == 2 and d["error"]["field"] == "sequential.prompt" and "nested" in d["error"]["message"], d
    d = execute(deep, base=str(tmp_path))  # refused before anything runs, dry run or not
    assert list(d) == ["error"] and d["error"]["field"] == "sequential.prompt", d
    d = execute(json.dumps(cmd("ls") | {"properties": _deep(200)}), base=str(tmp_path), dry_run=True)
    assert d["error"]["field"] == "properties[0]" and "nested" in d["error"]["message"], d
    # A function argument is JSON too: as deep a one is refused, naming args.
    (tmp_path / "f.py").write_text("def f(x):\n    return x\n")
    arg = json.dumps(_deep(500)).replace(" ", "").replace("\"core\"", "0")  # no quotes: shell words
    d = execute(json.dumps(code(scriptPath="f.py", method="function", args=f"f {arg}")), base=str(tmp_path),
                dry_run=True)
    assert list(d) == ["error"] and d["error"]["field"] == "args" and "nested" in d["error"]["message"], d


def test_nested_prompt_within_the_limit_still_passes_through(tmp_path: Path) -> None:
    prompt = _deep(60)
    rc, d = cli(cmd("ls") | {"sequential": {"prompt": prompt}}, "--dry-run", cwd=tmp_path)
    assert rc == 0 and d["prompt"] == prompt and d["sequential"] == {"prompt": prompt}, d


def _limited_child() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))  # a regression fails, not the host


@pytest.mark.parametrize("how", ["file", "stdin"])
def test_endless_payload_input_is_capped(how: str, tmp_path: Path) -> None:
    args = ["--file", "/dev/zero"] if how == "file" else []
    with open("/dev/zero", "rb") as zero:
        r = subprocess.run([sys.executable, "-m", "sandbox", "payload", "--dry-run", *args],
                           stdin=zero if how == "stdin" else subprocess.DEVNULL, capture_output=True, timeout=60,
                           cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, preexec_fn=_limited_child)
    assert r.returncode == 2 and b"Traceback" not in r.stderr and b"internal error" not in r.stderr, r.stderr
    d = json.loads(r.stdout)
    assert d["error"]["field"] == "payload" and "larger than" in d["error"]["message"], d


def test_payload_size_limit_is_exact(tmp_path: Path) -> None:
    import sandbox.payload

    cap = sandbox.payload.MAX_PAYLOAD_BYTES
    assert cap == 16 << 20
    text = json.dumps(cmd("ls")).encode()
    padded = text + b" " * (cap - len(text))
    assert execute(padded, base=str(tmp_path), dry_run=True)["request"]["command"] == "ls"
    for big in (padded + b" ", (padded + b" ").decode(), text.decode() + "\u00e9" * (cap // 2)):
        d = execute(big, base=str(tmp_path), dry_run=True)
        assert list(d) == ["error"] and d["error"]["field"] == "payload", d
        assert "larger than" in d["error"]["message"], d


def test_function_arguments_nan_and_infinity_are_strings(calc: Path) -> None:
    d = execute(json.dumps(code(scriptPath="calc.py", method="function",
                                args="add NaN Infinity -Infinity 1e999 [NaN] 1.5 -2 null")),
                base=str(calc.parent), dry_run=True)
    assert d["request"]["args"] == ["NaN", "Infinity", "-Infinity", "1e999", "[NaN]", 1.5, -2, None], d


def test_function_argument_nan_reaches_the_function_as_a_string(isolated, calc: Path) -> None:
    rc, d = cli(code(scriptPath="calc.py", method="function", args="greet NaN"), cwd=calc.parent)
    assert rc == 0 and d["return_value"] == {"hello": "NaN"}, d
    d = execute(json.dumps(code(scriptPath="calc.py", method="function", args="add 1e999 -Infinity")),
                base=str(calc.parent))
    assert d["returncode"] == 0 and d["return_value"] == "1e999-Infinity", d


# ---------------------------------------------------------------------------- audit: home directories


def _fake_passwd(home: Path) -> Any:
    import pwd

    real = pwd.getpwall()
    return lambda: [*real, pwd.struct_passwd(("someone", "x", 4242, 4242, "", str(home), "/bin/sh"))]


@pytest.mark.parametrize("how", ["HOME", "passwd", "holds-a-home", "dotfile", "holds-own-cache"])
def test_workdir_is_never_a_home_directory(how: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Run from a home directory, `echo KEY >> .ssh/authorized_keys; echo pwned >> .bashrc` changed
    both host files: the default ./ was the home, and the hidden-directory rule only looked at the
    path as written."""
    import pwd

    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("# mine\n")
    base = home
    if how == "passwd":
        monkeypatch.setattr(pwd, "getpwall", _fake_passwd(home))
        (home / ".bashrc").unlink()
    elif how == "HOME":
        monkeypatch.setenv("HOME", str(home))
        (home / ".bashrc").unlink()
    elif how == "holds-a-home":  # /home itself: every user's dotfiles below it
        monkeypatch.setenv("HOME", str(home))
        base = tmp_path
    elif how == "holds-own-cache":  # a rootless user's: its stage is built in ~/.cache/sandboxrun, whose
        from sandbox import hostpaths  # refusal came first and said nothing of the home

        monkeypatch.setenv("HOME", str(home))
        (home / ".cache" / "sandboxrun").mkdir(parents=True)
        monkeypatch.setattr(hostpaths, "own_dirs", lambda: [("cache", str(home / ".cache" / "sandboxrun"))])
    payload = json.dumps(cmd("echo pwned >> .bashrc"))
    for dry_run in (True, False):
        d = execute(payload, base=str(base), dry_run=dry_run)
        assert list(d) == ["error"] and d["error"]["field"] == "cwd", d
        assert "home directory" in d["error"]["message"] and "--root" in d["error"]["message"], d
    assert not (home / ".bashrc").exists() or (home / ".bashrc").read_text() == "# mine\n"
    d = execute(json.dumps(code(scriptPath="calc.py")), base=str(base), dry_run=True)
    assert d["error"]["field"] in ("cwd", "scriptPath"), d  # a script's run gets the same workdir


@pytest.mark.parametrize("name", [".ssh", ".gnupg", ".aws", ".bashrc", ".profile", ".netrc", ".git-credentials"])
def test_workdir_holding_credentials_or_login_files_is_refused(name: str, tmp_path: Path) -> None:
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / name).mkdir() if not name.startswith((".bash", ".pro", ".net", ".git")) else (proj / name).write_text("")
    for payload in (cmd("ls"), cmd("ls", cwd=".")):
        d = execute(json.dumps(payload), base=str(proj), dry_run=True)
        assert d["error"]["field"] == "cwd" and name in d["error"]["message"], d
    (tmp_path / "proj" / "src").mkdir()  # a project directory below it is fine
    d = execute(json.dumps(cmd("ls", cwd="src")), base=str(proj), dry_run=True)
    assert d["request"]["cwd"] == str(proj / "src"), d


def test_a_project_holding_config_docker_or_kube_folders_is_no_home(tmp_path: Path) -> None:
    # .NET repositories keep .config/dotnet-tools.json at their root; .docker and .kube are common too
    proj = tmp_path / "proj"
    for name in (".config", ".docker", ".kube"):
        (proj / name).mkdir(parents=True)
    d = execute(json.dumps(cmd("ls")), base=str(proj), dry_run=True)
    assert d["request"]["cwd"] == str(proj), d


def test_dry_run_of_a_script_whose_path_holds_a_colon_is_what_the_run_does(tmp_path: Path) -> None:
    # The dry run bound the script as "SRC:DST", which split at the path's own ':' ("must be an
    # absolute path"); the run binds a copy of its own and ran.
    d = tmp_path / "a:b"
    d.mkdir()
    (d / "x.py").write_text("print(6 * 7)\n")
    payload = {"action": "run_code_script", "properties": [{"name": "scriptPath", "value": "a:b/x.py"}]}
    dry = execute(json.dumps(payload), base=str(tmp_path), dry_run=True)
    assert "error" not in dry, dry


# ---------------------------------------------------------------------------- audit: an honest dry run


@pytest.mark.parametrize(("command", "words"), [
    ("echo \ud800", "surrogate"),
    ("echo " + "a" * 200_000, "MAX_ARG_STRLEN"),
], ids=["lone-surrogate", "over-max-arg-strlen"])
def test_dry_run_refuses_what_the_run_refuses(command: str, words: str, tmp_path: Path) -> None:
    for dry_run in (False, True):
        d = execute(json.dumps(cmd(command)), base=str(tmp_path), dry_run=dry_run)
        assert list(d) == ["error"] and d["error"]["field"] == "command", (dry_run, d)
        assert words in d["error"]["message"], d


def test_dry_run_shows_the_filters_verdict(isolated, tmp_path: Path) -> None:
    real = execute(json.dumps(cmd("rm -rf /")), base=str(tmp_path))
    assert real["status"] == "blocked"
    rc, d = cli(cmd("rm -rf /"), "--dry-run", cwd=tmp_path)
    assert rc == 125 and d["dry_run"] and d["blocked"] is True, (rc, d)
    assert d["block_reason"] == real["block_reason"], d
    rc, d = cli(cmd("ls"), "--dry-run", cwd=tmp_path)
    assert rc == 0 and d["blocked"] is False and "block_reason" not in d, d


@pytest.mark.parametrize("profile", ["strict", "nested"])  # nested: no private /tmp, HOME is the workdir
def test_dry_run_shows_the_real_argv_and_environment(profile: str, isolated, calc: Path) -> None:
    base = str(calc.parent)
    text = json.dumps(code(scriptPath="calc.py", method="function", args="add 1 2", env='{"K": "V"}'))
    dry, real = execute(text, base=base, dry_run=True, profile=profile), execute(text, base=base, profile=profile)
    if profile == "nested":  # no private view to bind the script into: refused, dry run or not
        assert list(real) == list(dry) == ["error"] and dry["error"]["field"] == real["error"]["field"], (dry, real)
        assert "no private view" in real["error"]["message"] and "no private view" in dry["error"]["message"]
    else:
        assert real["return_value"] == 3
        assert dry["request"]["argv"] == real["command"], (dry["request"], real["command"])
        assert dry["request"]["argv"][:3] == ["python3", "-c", "<sandboxrun driver>"]
    ws = calc.parent / "ws"
    ws.mkdir()
    if profile == "nested" and os.geteuid() == 0:
        os.chown(ws, 65534, 65534)  # (nested runs as its workdir's owner: never root)
    text = json.dumps(cmd("env", env='{"K": "V", "PATH": "/bin"}', cwd="ws"))
    dry, real = execute(text, base=base, dry_run=True, profile=profile), execute(text, base=base, profile=profile)
    shown = dict(line.split("=", 1) for line in real["stdout"].splitlines())
    assert dry["sandbox"]["env"]["K"] == "V" and dry["sandbox"]["env"]["PATH"] == "/bin"
    assert {k: shown[k] for k in dry["sandbox"]["env"]} == dry["sandbox"]["env"], (dry["sandbox"]["env"], shown)


# ---------------------------------------------------------------------------- audit: what the reply echoes


def _readable(d: dict[str, Any]) -> str:
    return json.dumps(d, ensure_ascii=False).encode().decode()  # a lone surrogate raises here


@pytest.mark.parametrize(("payload", "field"), [
    (cmd("ls") | {"sequential": {"prompt": "\ud800"}}, "sequential.prompt"),
    (cmd("ls") | {"sequential": {"prompt": {"a": ["ok", {"\udc80": 1}]}}}, "sequential.prompt"),
    (cmd("ls", description="list \ud800"), "description"),
    ({"action": "run_command", "properties": [{"name": "command", "value": "ls"}, {"name": "\ud800", "value": "x"}]},
     None),
    ({"action": "run_command", "\ud800": 1, "properties": []}, None),
], ids=["prompt", "prompt-key", "description", "property-name", "top-level-key"])
def test_lone_surrogate_is_never_echoed(payload: dict[str, Any], field: str | None, tmp_path: Path) -> None:
    for dry_run in (True, False):
        d = execute(json.dumps(payload), base=str(tmp_path), dry_run=dry_run)
        assert list(d) == ["error"], d
        _readable(d)
        if field:
            assert d["error"]["field"] == field and "surrogate" in d["error"]["message"], d


HUGE = "x" * (1 << 20)


@pytest.mark.parametrize("payload", [
    {"action": "run_command", "properties": [{"name": HUGE, "value": "x"}]},
    {"action": HUGE, "properties": []},
    {"action": "run_command", HUGE: 1, "properties": []},
    {"action": "run_command", "properties": [{"name": "command", "value": "ls", HUGE: 1}]},
    cmd("ls", timeout=HUGE),
    cmd("ls", timeout="9" * 500_000),
    cmd("ls", shelltype=HUGE),
    cmd("ls", shell=HUGE),
    cmd("ls", cwd=HUGE),
    cmd("ls", cwd="/" + HUGE),
    cmd("ls", env=json.dumps({HUGE + "=": "v"})),
    cmd("ls", env=json.dumps({"A" + HUGE: 1})),
    cmd("ls", env=f'{{"{HUGE}": "a", "{HUGE}": "b"}}'),
    code(scriptPath=HUGE),
    code(scriptPath="./", fileName=HUGE),
    code(scriptPath="calc.py", fileName=HUGE),
    code(scriptPath="calc.py", method=HUGE),
    code(scriptPath="calc.py", method="function", args=HUGE + "-"),
], ids=["property-name", "action", "top-level-key", "property-key", "timeout", "timeout-digits", "shelltype",
        "shell", "cwd", "cwd-absolute", "env-name", "env-value", "env-key-twice", "scriptPath", "fileName-dir",
        "fileName", "method", "function-name"])
def test_error_echoes_a_short_prefix_of_a_huge_value(payload: dict[str, Any], calc: Path) -> None:
    d = execute(json.dumps(payload), base=str(calc.parent), dry_run=True)
    assert list(d) == ["error"], str(d)[:300]
    assert len(json.dumps(d)) < 600, str(d)[:600]


# ---------------------------------------------------------------------------- audit: a property given twice


@pytest.mark.parametrize("first", [{"name": "command"}, {"name": "command", "value": "  "}])
def test_given_more_than_once_counts_an_absent_or_blank_first(first: dict[str, Any], tmp_path: Path) -> None:
    payload = {"action": "run_command", "properties": [first, {"name": "command", "value": "echo second"}]}
    d = execute(json.dumps(payload), base=str(tmp_path), dry_run=True)
    assert d["error"]["field"] == "command" and "more than once" in d["error"]["message"], d
    payload["properties"] = [{"name": "command", "value": "ls"}, {"name": "cwd", "value": ""},
                             {"name": "cwd", "value": "/"}]
    d = execute(json.dumps(payload), base=str(tmp_path), dry_run=True)
    assert d["error"]["field"] == "cwd" and "more than once" in d["error"]["message"], d


def test_null_value_is_a_broken_payload(tmp_path: Path) -> None:
    """README: a non-string value is a broken payload; null was taken as the property not given."""
    payload = {"action": "run_command", "properties": [{"name": "command", "value": None},
                                                       {"name": "command", "value": "echo second"}]}
    d = execute(json.dumps(payload), base=str(tmp_path), dry_run=True)
    assert d["error"]["field"] == "command" and "got null" in d["error"]["message"], d


# ---------------------------------------------------------------------------- audit: errors on stdout


def test_deleted_current_directory_is_a_json_error(tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    r = subprocess.run(["sh", "-c", 'cd "$1" && rmdir "$1" && exec "$2" -m sandbox payload --dry-run', "sh",
                        str(gone), sys.executable], input=json.dumps(cmd("ls")).encode(), capture_output=True,
                       timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and r.stderr == b"", r
    d = json.loads(r.stdout)
    assert d["error"]["field"] == "cwd" and "no longer exists" in d["error"]["message"], d


def test_dry_run_shows_the_content_scans_verdict(calc: Path, tmp_path: Path) -> None:
    prof = tmp_path / "scan.toml"
    prof.write_text('extends = "strict"\nname = "scanned"\n[filter]\nscan = ["os\\\\.system"]\n')
    text = json.dumps(code(scriptPath="calc.py", method="statement", args="os.system('id')"))
    real = execute(text, base=str(calc.parent), profile=str(prof))
    dry = execute(text, base=str(calc.parent), profile=str(prof), dry_run=True)
    assert real["status"] == "blocked" and dry["blocked"] is True, dry
    assert dry["block_reason"] == real["block_reason"] and dry["request"]["argv"] == real["command"], (dry, real)
