"""Property and fuzz tests: for any input, the profile loader, the payload parser,
the batch reader and the output cap either succeed with their invariants intact or
fail with their own named error; the filter neither crashes nor hangs.

Known bugs are pinned by xfail tests rather than excluded silently; the strategies
stay clear of only those inputs, so that any other crash shows up here.
"""

from __future__ import annotations

import io
import json
import os
import string
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from sandbox.errors import InputError, ProfileError
from sandbox.output import Capture
from sandbox.profile import _SCHEMA, Profile, from_dict, load, with_overrides

FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def bug(reason: str) -> pytest.MarkDecorator:
    return pytest.mark.xfail(reason=f"BUG: {reason}", strict=False)


# ----------------------------------------------------------------------------- output capping

chunks = st.lists(st.binary(max_size=300), max_size=30)
caps = st.integers(min_value=0, max_value=2000)


def _check_capture(c: Capture, produced: bytes, cap: int) -> None:
    assert len(c.data) <= cap
    assert c.total == len(produced)  # counted = produced
    assert bytes(c.data) == produced[:cap]  # a prefix, byte for byte
    assert c.truncated == (len(produced) > cap)  # exact
    assert c.text() == bytes(c.data).decode("utf-8", "replace")


@FAST
@given(chunks, caps)
def test_capture_feed_invariants(parts: list[bytes], cap: int) -> None:
    seen: list[bytes] = []
    c = Capture(cap, seen.append)
    for p in parts:
        c.feed(p)
    produced = b"".join(parts)
    _check_capture(c, produced, cap)
    assert b"".join(seen) == bytes(c.data)  # the live callback saw exactly what was kept


@FAST
@given(chunks, caps)
def test_capture_from_a_pipe_invariants(parts: list[bytes], cap: int) -> None:
    """The real path: non-blocking reads up to the cap, then splice to /dev/null."""
    produced = b"".join(parts)
    assume(len(produced) < 60_000)  # fits a pipe buffer: write everything, then drain
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        for p in parts:
            if p:
                os.write(w, p)
        os.close(w)
        w = -1
        os.set_blocking(r, False)
        c = Capture(cap)
        for _ in range(len(parts) + 10_000):
            if not c.read_from(r):
                break
        else:
            pytest.fail("read_from never reported EOF")
        _check_capture(c, produced, cap)
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_capture_large_stream_through_a_pipe() -> None:
    """Past the pipe buffer, with a writer thread: cap honoured, every byte counted."""
    import threading

    r, w = os.pipe2(os.O_CLOEXEC)
    total = 5 * 2**20 + 123
    block = bytes(range(256)) * 256

    def writer() -> None:
        left = total
        while left:
            left -= os.write(w, block[: min(len(block), left)])
        os.close(w)

    t = threading.Thread(target=writer)
    t.start()
    c = Capture(100_000)
    import selectors

    os.set_blocking(r, False)
    sel = selectors.DefaultSelector()
    sel.register(r, selectors.EVENT_READ)
    while True:
        sel.select(5)
        if not c.read_from(r):
            break
    sel.close()
    os.close(r)
    t.join()
    assert (len(c.data), c.total, c.truncated) == (100_000, total, True)
    assert bytes(c.data) == (block * 2)[:100_000]


# ----------------------------------------------------------------------------- profile loader

_any_scalar = st.one_of(
    st.none(), st.booleans(),
    st.integers(), st.integers(min_value=2**60, max_value=2**70), st.sampled_from([10**400, -(10**400)]),
    st.floats(allow_nan=True, allow_infinity=True, width=64),
    st.text(max_size=20),
    st.sampled_from(["30s", "1m", "500ms", "512MiB", "4GiB", "0", "unlimited", "none", "-1", "1e3", "10 KB",
                     "/usr", "/no/such", "relative", "/a/../b", "strict", "optional", "required", "off",
                     "host", "private", "same", "\0", "é" * 70]),
)
_values = st.recursive(
    _any_scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=8,
)


@st.composite
def raw_profiles(draw: st.DrawFn) -> dict[str, Any]:
    """Mostly-schema-shaped tables with values of every type, plus some unknown keys."""
    raw: dict[str, Any] = {}
    for table in draw(st.lists(st.sampled_from([t for t in _SCHEMA if t] + ["bogus"]), max_size=4, unique=True)):
        keys = list(_SCHEMA.get(table, {})) + ["bogus_key"]
        content = draw(st.dictionaries(st.sampled_from(keys), _values, max_size=5))
        raw[table] = content if draw(st.integers(0, 20)) else draw(_values)
    if draw(st.booleans()):
        raw["name"] = draw(_any_scalar)
    return raw


def _profile_invariants(p: Profile) -> None:
    lim = p.limits
    assert lim.output is not None and lim.tmp_size is not None
    assert lim.timeout is None or lim.timeout > 0
    assert lim.timeout is not None or lim.allow_no_timeout
    assert lim.memory is None or 4 * 2**20 <= lim.memory <= 2**62
    for m in p.mounts:
        assert m.source.startswith("/") and m.target.startswith("/") and ".." not in m.target.split("/")
    assert p.workdir == "same" or p.workdir.startswith("/")
    assert set(p.namespaces) <= {"pid", "mount", "net", "ipc", "uts", "cgroup"}
    assert p.seccomp in ("default", "off") and p.cgroup in ("required", "optional", "off")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw_profiles())
def test_from_dict_returns_a_valid_profile_or_a_profile_error(raw: dict[str, Any]) -> None:
    try:
        p = from_dict(raw, source="fuzz.toml")
    except ProfileError as e:
        assert str(e).startswith("fuzz.toml"), e  # names the file
        return
    _profile_invariants(p)


_override_keys = st.sampled_from(["timeout", "kill_grace", "cpu_time", "memory", "address_space", "processes",
                                  "file_size", "open_files", "cpus", "output", "tmp_size", "ro_bind", "bind",
                                  "network", "env", "hostname", "bogus"])


@FAST
@given(st.dictionaries(_override_keys, _values, max_size=4))
def test_with_overrides_returns_a_profile_or_a_profile_error(overrides: dict[str, Any]) -> None:
    try:
        p = with_overrides(load("strict"), **overrides)
    except ProfileError as e:
        assert "\n" not in str(e)
        return
    assert isinstance(p, Profile)


@pytest.mark.parametrize("key, value", [
    ("timeout", 10**400), ("kill_grace", 1e300), ("memory", 2**63), ("processes", 2**63), ("file_size", 2**63),
    ("cpu_time", 1e300), ("tmp_size", 0),
    pytest.param("ro_bind", False),
])
def test_out_of_range_override_is_a_profile_error(key: str, value: Any) -> None:
    with pytest.raises(ProfileError, match=key):
        with_overrides(load("strict"), **{key: value})


_toml_soup = st.lists(st.sampled_from([
    "[limits]\n", "[filesystem]\n", "[security]\n", "[process]\n", "[filter]\n", "[[limits]]\n", "[bogus]\n",
    "timeout = ", "memory = ", "processes = ", "ro_bind = ", "namespaces = ", "env = ", "hostname = ", "extends = ",
    "workdir = ", "view = ", "cgroup = ", "block = ", "tmp_size = ", "output = ",
    '"30s"', '"512MiB"', "-1", "0", "1.5", "true", "99999999999999999999", '["/usr"]', '["rel"]', "[]", "{}",
    '{ A = "1" }', '"strict"', '"/no/such"', '"same"', '"private"', '"\\u0000"', "\n", " ", "=", "[", "]", '"',
]), max_size=25).map("".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(_toml_soup, st.text(max_size=200), st.binary(max_size=200)))
def test_profile_file_text_loads_or_fails_named(tmp_path_factory: pytest.TempPathFactory, text: str | bytes) -> None:
    path = Path(tmp_path_factory.getbasetemp()) / "fuzz.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    try:
        p = load(str(path))
    except ProfileError as e:
        assert "fuzz.toml" in str(e)
        return
    _profile_invariants(p)


# ----------------------------------------------------------------------------- payloads, batch lines

_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=30))
_json = st.recursive(_json_leaf, lambda i: st.one_of(st.lists(i, max_size=4),
                                                     st.dictionaries(st.text(max_size=10), i, max_size=4)),
                     max_leaves=12)
_prop_names = st.sampled_from(["command", "cwd", "timeout", "shell", "shelltype", "env", "description",
                               "scriptPath", "fileName", "method", "args", "bogus"])
_prop_values = st.one_of(st.text(max_size=40), st.sampled_from(["true", "false", "30", "-1", "1e999", "nan",
                                                                "/tmp", "/no/such", "./", "..", "{}", "{\"A\": 1}",
                                                                "bash", "windowsps", "\0"]), _json)


@st.composite
def payload_docs(draw: st.DrawFn) -> Any:
    if draw(st.integers(0, 9)) == 0:
        return draw(_json)
    action = draw(st.one_of(st.sampled_from(["run_command", "run_code_script"]), _json))
    doc: dict[str, Any] = {"action": action}
    props = draw(st.lists(st.fixed_dictionaries({"name": _prop_names, "value": _prop_values}), max_size=5))
    doc["properties"] = props if draw(st.integers(0, 9)) else draw(_json)
    if draw(st.booleans()):
        doc[draw(st.sampled_from(["thinking", "sequential", "extra"]))] = draw(_json)
    return doc


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payload_docs())
def test_payload_parse_returns_a_request_or_names_a_field(doc: Any) -> None:
    payload = pytest.importorskip("sandbox.payload")
    try:
        req = payload.parse(json.dumps(doc), base="/tmp")
    except payload.PayloadError as e:
        assert isinstance(e.field, str) and e.message and "\n" not in e.message
        return
    assert req.action in ("run_command", "run_code_script")
    assert 0 < req.timeout <= payload.MAX_TIMEOUT
    assert os.path.isabs(req.cwd)
    if req.action == "run_command":
        assert req.argv and all(isinstance(a, str) and "\0" not in a for a in req.argv)


@pytest.mark.parametrize("action", [
    pytest.param([]),
    pytest.param({}),
])
def test_payload_action_of_the_wrong_type_names_the_field(action: Any) -> None:
    payload = pytest.importorskip("sandbox.payload")
    with pytest.raises(payload.PayloadError) as ei:
        payload.parse(json.dumps({"action": action, "properties": []}), base="/tmp")
    assert ei.value.field == "action"


@FAST
@given(st.one_of(st.binary(max_size=200), st.text(max_size=200)))
def test_payload_parse_of_any_text(text: bytes | str) -> None:
    payload = pytest.importorskip("sandbox.payload")
    try:
        payload.parse(text, base="/tmp")
    except payload.PayloadError:
        pass


@FAST
@given(st.lists(st.one_of(st.binary(max_size=80).filter(lambda b: b"\n" not in b),
                          _json.map(lambda d: json.dumps(d).encode())), max_size=8))
def test_batch_reader_yields_one_item_per_nonblank_line(lines: list[bytes]) -> None:
    batch = pytest.importorskip("sandbox.batch")
    if lines and lines[0].strip() and batch.wide_text(lines[0]):  # UTF-16 or UTF-32: refused as a whole
        with pytest.raises(batch.InputError, match="^not UTF-8"):
            list(batch.read_jsonl(io.BytesIO(b"\n".join(lines) + b"\n")))
        return
    items = list(batch.read_jsonl(io.BytesIO(b"\n".join(lines) + b"\n")))
    assert [n for n, _ in items] == [i for i, ln in enumerate(lines, 1) if ln.strip()]
    for _n, obj in items:
        assert isinstance(obj, (dict, batch._Invalid))


@FAST
@given(st.dictionaries(st.sampled_from(["command", "shell", "timeout", "env", "cwd", "profile", "memory",
                                        "ro_bind", "network", "stdin", "bogus"]), _json, max_size=4))
def test_batch_request_validation_never_crashes(obj: dict[str, Any]) -> None:
    """Only the validation: every failure is an InputError/ProfileError, never a TypeError."""
    batch = pytest.importorskip("sandbox.batch")
    from sandbox.supervisor import build_env, to_argv

    try:
        _rid, kw = batch._as_kwargs(obj)
        prof = load(kw["profile"]) if isinstance(kw.get("profile"), str) else load("strict")
        over = {k: v for k, v in kw.items() if k in batch.OVERRIDE_KEYS}
        with_overrides(prof, timeout=kw.get("timeout"), **over)
        to_argv(kw["command"], bool(kw.get("shell")))
        build_env(prof, kw.get("env"))
    except (InputError, ProfileError):
        pass


# ----------------------------------------------------------------------------- filter: backtracking

check = pytest.importorskip("sandbox.filter").check

# Near misses aimed at each built-in rule's regex (and the allowlist globs), at a size where
# anything super-linear takes seconds. tests/test_filter.py covers the lexer's own inputs.
NEAR_MISSES = {
    "rm-slash-run": "rm -r " + "/" * 500_000 + "x",
    "rm-slash-words": "rm -r " + "/x " * 150_000,
    "rm-star-words": "rm -r " + "/*x " * 120_000,
    "rm-flag-words": "rm " + "-rx " * 120_000 + "-",
    "dd-slashes": "dd of=" + "/" * 500_000 + "dev",
    "dd-dev-slashes": "dd of=/dev" + "/" * 500_000 + "x",
    "dd-of-words": "dd " + "of=//dev//x " * 40_000,
    "redirect-slashes": "cat x > " + "/" * 500_000 + "dev",
    "redirect-digits": "cat x " + "9" * 500_000 + "> /dev/x",
    "chown-flag-words": "chown " + "-hR " * 120_000 + "x",
    "mkfs-dotted": "mkfs." + "." * 500_000,
    "systemctl-targets": "systemctl " + "reboot.targetx " * 40_000,
    "firewall-words": "systemctl stop " + "ufw.servicex " * 40_000,
    "iptables-flags": "iptables " + "-Fx-F " * 80_000,
    "fork-bomb-names": " ".join(["f(){ f|f& }"] * 30_000),
    "fork-bomb-spaces": "f" + " " * 300_000 + "(" + " " * 300_000 + ")",
    "fork-bomb-long-name": "a" * 300_000 + "(){ " + "a" * 300_000 + "|",
    "init-digits": "init " + "0" * 500_000,
}


@pytest.mark.parametrize("name", sorted(NEAR_MISSES))
def test_rule_regexes_stay_linear_on_near_misses(name: str) -> None:
    command = NEAR_MISSES[name]
    start = time.perf_counter()
    v = check(command)
    elapsed = time.perf_counter() - start
    assert v.rule != "fork-bomb" or "(){" in command
    assert elapsed < 10.0, f"{name}: {elapsed:.2f}s"  # a hang detector (exponential: minutes), not a benchmark


@pytest.mark.parametrize("glob", ["*a*a*a*a*a*a*a*a*a*a*b", "*[a]*[a]*[a]*[a]*[a]*[a]*b", "?*?*?*?*?*?*?*?*!"])
def test_allowlist_globs_stay_linear(glob: str) -> None:
    start = time.perf_counter()
    v = check("a" * 100_000, allow=[glob], blocklist=False)
    assert not v.allowed and v.rule == "allowlist"
    assert time.perf_counter() - start < 2.0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(alphabet=string.printable, max_size=40), st.integers(min_value=2_000, max_value=20_000),
       st.sampled_from(["rm -r ", "dd ", "chmod -R ", "systemctl ", "cat x > ", "f(){ ", "iptables ", ""]))
def test_near_miss_repetitions_do_not_hang(fragment: str, times: int, head: str) -> None:
    command = head + fragment * times
    assume(len(command) <= 400_000)
    start = time.perf_counter()
    check(command)
    assert time.perf_counter() - start < 2.0


def test_profile_block_pattern_cannot_hang_the_runner() -> None:
    """Run in a child process so the hang, if any, is bounded: operators' patterns are
    matched by RE2 (linear time), so even (a+)+ answers at once."""
    import subprocess
    import sys

    code = ("from sandbox.filter import check\n"
            "print(check('a' * 40 + '!', blocklist=False, extra_block=[r'^(a+)+$']).allowed)")
    try:
        out = subprocess.run([sys.executable, "-c", code], timeout=5, check=True, capture_output=True, text=True,
                             cwd=str(Path(__file__).resolve().parent.parent)).stdout
    except subprocess.TimeoutExpired:
        pytest.fail("check() with filter.block = ['^(a+)+$'] ran for more than 5 s on 41 characters")
    assert out == "True\n", out
