"""Batch runs (run_many, `sandboxrun batch`) and the benchmark script's smoke path.

Ordering is proven with requests that wait on a file in a shared workdir, created
by another request or by the test itself, never with timing: a wrong order ends in
a bounded wait (the request's timeout) and a failed assertion, not a flaky pass.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import sandbox
from sandbox.batch import BatchError, BatchRequest, BatchResult, Progress, read_jsonl, run_many
from sandbox.errors import InputError, ProfileError
from sandbox.profile import load, with_overrides

ROOT = Path(__file__).resolve().parent.parent


def wait_for(name: str, then: str) -> dict:
    """A request that blocks until `name` exists in the shared workdir (at most its timeout)."""
    return {"command": f"while [ ! -e {name} ]; do sleep 0.01; done; echo {then}", "shell": True, "timeout": 20}


def cli(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "sandbox", *args], input=stdin, capture_output=True,
                          timeout=120, env=env)


# ---------------------------------------------------------------------------- library


def test_ordered_runs_ahead_and_yields_in_input_order(isolated, tmp_path: Path) -> None:
    cwd = str(tmp_path)
    reqs = [
        {**wait_for("go", "first"), "cwd": cwd},  # needs the third request to have run
        {"command": ["echo", "second"]},
        {"command": "touch go; echo third", "shell": True, "cwd": cwd},
    ]
    out = list(run_many(reqs, concurrency=3, trusted=True))
    assert [r.id for r in out] == [1, 2, 3]
    assert [r.stdout for r in out] == ["first\n", "second\n", "third\n"], [r.status for r in out]
    assert all(isinstance(r, BatchResult) and isinstance(r, sandbox.Result) for r in out)


def test_unordered_yields_as_they_finish(isolated, tmp_path: Path) -> None:
    # The first request can only finish after the test has *received* the second's result.
    reqs = [{**wait_for("go", "slow"), "cwd": str(tmp_path), "id": "slow"}, {"command": ["echo", "fast"], "id": "fast"}]
    got = []
    for r in run_many(reqs, concurrency=2, ordered=False, trusted=True):
        got.append(r.id)
        if r.id == "fast":
            (tmp_path / "go").touch()
    assert got == ["fast", "slow"]


def test_ids_requests_and_overrides(isolated) -> None:
    reqs = [
        {"command": ["cat"], "stdin": "abc", "id": {"task": 7}},
        BatchRequest(command="echo $X", shell=True, env={"X": "from-env"}, id="b"),
        BatchRequest(command=["head", "-c", "5000", "/dev/zero"], overrides={"output": "1KiB"}),
        {"command": ["sh", "-c", "exit 3"]},
        {"command": ["sh", "-c", "df -k /work | tail -n 1"], "workdir_size": "1MiB"},  # every run() setting
        {"command": ["yes"], "output": "1KiB", "output_overflow": "kill"},
    ]
    a, b, c, d, e, f = run_many(reqs)
    assert (f.status, f.stdout_truncated, f.signal) == ("output_limit", True, "SIGKILL"), f
    assert e.status == "ok" and e.stdout.split()[1] == "1024", e
    assert (a.id, a.stdout) == ({"task": 7}, "abc")
    assert (b.id, b.stdout) == ("b", "from-env\n")
    assert (c.id, c.stdout_bytes, c.stdout_truncated) == (3, 5000, True)
    assert (d.id, d.status, d.exit_code) == (4, "nonzero_exit", 3)
    assert json.loads(a.to_json())["id"] == {"task": 7}


def test_bad_requests_become_errors_and_the_batch_goes_on(isolated) -> None:
    reqs = [
        {"command": ["echo", "ok1"]},
        {"command": ["echo"], "bogus": 1, "id": "x"},
        {"shell": True},
        {"command": ["echo"], "memory": "lots"},
        {"command": ["echo"], "stdin_fd": 0},  # callers' fds are not a request key
        "not a request",
        {"command": ["echo"], "env": ["X=1"]},
        {"command": ["echo", "ok2"]},
    ]
    out = list(run_many(reqs, concurrency=2))
    assert [type(r) for r in out] == [BatchResult, *[BatchError] * 6, BatchResult]
    assert out[0].stdout == "ok1\n" and out[-1].stdout == "ok2\n"
    errs = out[1:7]
    assert [e.id for e in errs] == ["x", 3, 4, 5, 6, 7]
    assert "unknown key 'bogus'" in errs[0].error
    assert "missing key 'command'" in errs[1].error
    assert "memory" in errs[2].error
    assert "unknown key 'stdin_fd'" in errs[3].error
    assert "expected a JSON object or BatchRequest" in errs[4].error
    assert "env: expected an object" in errs[5].error
    assert all(not e.success and e.status == "invalid_request" for e in errs)
    assert errs[0].to_dict() == {"id": "x", "line": 2, "status": "invalid_request", "success": False,
                                 "error": errs[0].error}


def test_a_batch_lends_its_cpu_and_pids_cgroups_run_after_run_and_leaves_none(contained) -> None:
    """The cgroups that carry the CPU and process caps are kept from one run of a batch to the
    next (isolation/cgroups.py, Slots); each run's limits and pids-limit report are its own,
    and nothing of the batch's is left once it has ended."""
    from sandbox.leaks import runner_cgroups

    reqs = [{"command": "for i in 1 2 3 4 5 6 7 8; do sleep 0.2 & done; wait", "shell": True, "processes": 4},
            {"command": ["true"], "processes": 4},
            {"command": "(setsid sleep 30 &); sleep 30", "shell": True, "timeout": 0.3},
            {"command": ["true"], "cpus": 0.5}]
    batch = run_many(reqs, concurrency=1)
    first = next(batch)
    during = runner_cgroups(os.getpid())
    rest = list(batch)
    assert [r.status for r in (first, *rest)] == ["nonzero_exit", "ok", "timeout", "ok"], (first, rest)
    assert first.usage.pids_limit_hit is True and rest[0].usage.pids_limit_hit is False
    if first.isolation.cgroup == "v1":  # one slot (concurrency 1): a directory in the cpu and pids hierarchies
        assert len([d for d in during if d.endswith("-slot")]) == 2, during
    assert runner_cgroups(os.getpid()) == []


def test_bad_arguments_fail_at_the_call() -> None:
    with pytest.raises(InputError, match="concurrency"):
        run_many([], concurrency=0)
    with pytest.raises(ProfileError, match="unknown profile"):
        run_many([], profile="no-such-profile")
    assert list(run_many([])) == []
    for bad in (5, "true", {"command": "true"}):  # one request, not an iterable of them
        with pytest.raises(InputError, match="expected an iterable of requests"):
            run_many(bad)  # type: ignore[arg-type]


def test_input_is_streamed_and_closing_stops_the_batch(isolated, tmp_path: Path) -> None:
    pulled = itertools.count()
    cmd = "sleep 0.3; echo x >> ran"  # each run leaves a line: what ran is counted after the close

    def endless():
        for _ in itertools.count():
            next(pulled)
            yield {"command": cmd, "shell": True, "cwd": str(tmp_path)}

    it = run_many(endless(), concurrency=2, trusted=True)
    first = list(itertools.islice(it, 3))
    it.close()  # cancels what has not started, kills what runs
    assert [r.id for r in first] == [1, 2, 3] and all(r.status == "ok" for r in first), first
    submitted = next(pulled)
    assert submitted <= 3 + 2 * 4  # bounded window, never the whole input
    time.sleep(0.5)  # nothing runs on after the close
    ran = (tmp_path / "ran").read_text().count("x")
    # the 3 taken, one more finished meanwhile, 2 running at the close: not the queued ones
    assert ran <= 3 + 1 + 2 < submitted, (ran, submitted)


@pytest.mark.parametrize("ordered", [True, False])
def test_an_early_end_kills_the_runs_under_way(isolated, ordered: bool) -> None:
    """Closing the iterator (a break, an exception, Ctrl-C in the consumer) waited for every
    run already under way, up to its timeout: their results are not wanted, they are killed."""
    import threading

    from conftest import marker

    from sandbox import leaks

    mark = marker()
    reqs = [{"command": "echo quick", "shell": True},
            {"command": f"sleep 300 # {mark}", "shell": True, "timeout": 120}]
    it = run_many(reqs, concurrency=2, ordered=ordered)
    try:
        first = next(it)
        assert first.stdout == "quick\n", first
        deadline = time.monotonic() + 30  # a bound, not a benchmark
        while not leaks.marked(mark):
            assert time.monotonic() < deadline, "the second run never started"
            time.sleep(0.02)
        closer = threading.Thread(target=it.close)
        closer.start()
        closer.join(60)  # it waited out the run (120 s) before
        assert not closer.is_alive(), "close() waited for the run under way"
        assert not leaks.marked(mark)
    finally:
        for p in leaks.marked(mark):
            os.kill(p.pid, 9)


def test_a_request_the_pools_cancel_lost_does_not_hold_up_the_teardown(isolated, monkeypatch) -> None:
    """The pool's cancel of what has not started takes each request off its queue, then cancels
    its future: a second Ctrl-C between the two left that future pending for ever, and the
    teardown, waiting on the futures, hung (1 in 30 double Ctrl-Cs). A lossy cancel stands in."""
    import queue
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from conftest import marker

    from sandbox import leaks

    real = ThreadPoolExecutor.shutdown

    def lossy(self: ThreadPoolExecutor, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if cancel_futures:
            try:
                self._work_queue.get_nowait()  # type: ignore[attr-defined]  # taken, never cancelled
            except queue.Empty:
                pass
        real(self, wait=wait, cancel_futures=cancel_futures)

    mark = marker()
    reqs = [{"command": "echo quick", "shell": True}] + [
        {"command": f"sleep 300 # {mark}", "shell": True, "timeout": 120}] * 4
    it = run_many(reqs, concurrency=1)
    try:
        assert next(it).stdout == "quick\n"
        _until_running(mark, 1)
        monkeypatch.setattr(ThreadPoolExecutor, "shutdown", lossy)
        closer = threading.Thread(target=it.close, daemon=True)
        closer.start()
        closer.join(30)
        assert not closer.is_alive(), "the teardown waited for a request that will never run"
        assert not leaks.marked(mark)
    finally:
        for p in leaks.marked(mark):
            os.kill(p.pid, 9)


def test_an_early_end_waits_for_the_runs_teardown_not_for_their_threads(isolated, monkeypatch) -> None:
    """CPython 3.11's Thread.join, cut by a Ctrl-C while its thread still runs, marks the thread
    stopped, and every later join returns at once: a batch's teardown cut so (a second Ctrl-C)
    returned while a killed run was still being torn down, and the interpreter's exit then left
    that run's memory cgroup (about 1 in 15 double Ctrl-Cs). Joins that return at once stand in."""
    import threading

    from conftest import marker

    from sandbox import leaks, supervisor

    mark = marker()
    reqs = [{"command": "echo quick", "shell": True},
            {"command": f"sleep 300 # {mark}", "shell": True, "timeout": 120}]
    it = run_many(reqs, concurrency=2)
    try:
        assert next(it).stdout == "quick\n"
        _until_running(mark, 1)
        monkeypatch.setattr(threading.Thread, "join", lambda self, timeout=None: None)
        remove = supervisor._remove_quietly

        def slow_remove(cg: Any) -> None:  # the teardown under way at the return
            time.sleep(0.3)
            remove(cg)

        monkeypatch.setattr(supervisor, "_remove_quietly", slow_remove)
        it.close()
        left = leaks.runner_cgroups(os.getpid())
        monkeypatch.undo()
        assert left == [] and not leaks.marked(mark), left
    finally:
        for p in leaks.marked(mark):
            os.kill(p.pid, 9)


_STRESS = """
import sys
sys.path.insert(0, sys.argv[1])
import sandbox
reqs = [{"command": ["cat"], "stdin": "x" * (i % 3), "timeout": 20} for i in range(200)]
bad = [(r.id, r.status, r.error) for r in sandbox.run_many(reqs, concurrency=4) if getattr(r, "stdout", None) != "x" * ((r.id - 1) % 3)]
print("done", bad)
"""


def test_many_threads_with_stdin_all_finish(isolated) -> None:
    # Regression: a run that fed stdin closed its pipe twice; in a threaded caller the
    # second close hit another run's freshly opened fd (its pidfd), which then waited
    # forever. In a subprocess, so that a hang fails the test instead of the suite.
    try:
        p = subprocess.run([sys.executable, "-c", _STRESS, str(ROOT)], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("run_many hung: some run never finished (fd closed twice in a threaded caller?)")
    assert p.returncode == 0 and p.stdout.strip() == "done []", p.stdout + p.stderr[-2000:]


def test_package_level_alias(isolated) -> None:
    (r,) = sandbox.run_many([{"command": ["echo", "hi"], "id": "z"}])
    assert (r.id, r.stdout) == ("z", "hi\n")


# ---------------------------------------------------------------------------- JSONL, progress


def test_read_jsonl_names_lines() -> None:
    src = io.BytesIO(b'{"command": ["true"]}\n\n   \nnot json\n[1, 2]\n\xff\xfe\n{"command": "x"}\n')
    items = list(read_jsonl(src))
    assert [n for n, _ in items] == [1, 4, 5, 6, 7]
    assert items[0][1] == {"command": ["true"]}
    assert "invalid JSON" in items[1][1].error
    assert "expected a JSON object, got list" in items[2][1].error
    assert "UTF-8" in items[3][1].error or "invalid JSON" in items[3][1].error



def test_an_over_long_line_is_refused_and_the_next_ones_still_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from sandbox import batch

    monkeypatch.setattr(batch, "MAX_LINE", 64)
    src = io.BytesIO(b'{"command": "a"}\n' + b'{"command": "' + b"x" * 500 + b'"}\n' + b'{"command": "b"}\n')
    items = list(read_jsonl(src))
    assert [n for n, _ in items] == [1, 2, 3]
    assert items[0][1] == {"command": "a"} and items[2][1] == {"command": "b"}
    assert "longer than" in items[1][1].error


def test_a_line_that_never_ends_stops_the_batch_with_memory_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """`sandboxrun batch /dev/zero` read one endless line into memory until MemoryError."""
    from sandbox import batch

    class Zeros(io.RawIOBase):
        served = 0

        def readable(self) -> bool:
            return True

        def readinto(self, b: Any) -> int:
            b[:] = bytes(len(b))
            self.served += len(b)
            return len(b)

    monkeypatch.setattr(batch, "MAX_LINE", 1 << 16)
    monkeypatch.setattr(batch, "MAX_SKIP", 8 << 20)
    zeros = Zeros()
    with pytest.raises(InputError, match="line 1: no end of line"):
        list(read_jsonl(io.BufferedReader(zeros)))
    assert zeros.served < 16 << 20


def test_requests_are_counted_only_in_a_regular_file(tmp_path: Path) -> None:
    from sandbox.batch import count_requests

    f = tmp_path / "r.jsonl"
    f.write_bytes(b'{"command": "a"}\n\n{"command": "b"}\n')
    with open(f, "rb") as src:
        assert count_requests(src) == 2 and src.read(1) == b"{"  # rewound for the run itself
    r, w = os.pipe()
    os.write(w, b'{"command": "a"}\n')
    os.close(w)
    with open(r, "rb") as src:
        assert count_requests(src) is None and src.readline() == b'{"command": "a"}\n'  # nothing consumed

class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _res(ok: bool) -> BatchError:
    e = BatchError(1, "x")
    e.success = ok
    return e


def test_progress_on_a_terminal_only() -> None:
    tty = _Tty()
    p = Progress(tty, total=3, every=0)
    for ok in (True, False, True):
        p.update(_res(ok))
    p.close()
    text = tty.getvalue()
    assert text.startswith("\r") and text.endswith("\n")
    last = text.rstrip("\n").split("\r")[-1]
    assert last.startswith("3/3") and "/s" in last and "ETA 0:00" in last and "failures 1" in last

    piped = io.StringIO()
    p = Progress(piped, total=3, every=0)
    p.update(_res(True))
    p.close()
    assert piped.getvalue() == ""

    p = Progress(_Tty(), total=None, every=0)  # stdin: no total, no ETA
    p.update(_res(True))
    assert "ETA" not in p.line(p.start + 1) and p.line(p.start + 1).startswith("1 ")


def test_ids_that_collide_are_told_apart_by_the_line(isolated) -> None:
    """An explicit id may equal another request's, or another's position (its default id)."""
    out = list(sandbox.run_many([{"command": ["echo", "one"], "id": 2}, {"command": ["echo", "two"]},
                                 {"command": ["echo", "three"], "id": 2}]))
    assert [(r.id, r.line, r.stdout) for r in out] == [(2, 1, "one\n"), (2, 2, "two\n"), (2, 3, "three\n")]
    assert [json.loads(r.to_json())["line"] for r in out] == [1, 2, 3]
    assert list(json.loads(out[0].to_json()))[:2] == ["id", "line"]


# ---------------------------------------------------------------------------- CLI


def test_cli_batch_file_in_order(isolated, tmp_path: Path) -> None:
    f = tmp_path / "reqs.jsonl"
    f.write_text("\n".join([
        json.dumps({"command": ["echo", "a"], "id": "a"}),
        "",
        json.dumps({"command": "echo b; exit 4", "shell": True}),
        "{broken",
        json.dumps({"command": ["cat"], "stdin": "c", "timeout": 10}),
    ]) + "\n")
    r = cli("batch", str(f), "--concurrency", "2")
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert r.returncode == 1, r.stderr  # a line could not be run
    assert [d["id"] for d in lines] == ["a", 3, 4, 5]
    assert [d["line"] for d in lines] == [1, 3, 4, 5]
    assert [d.get("stdout") for d in lines] == ["a\n", "b\n", None, "c"]
    assert lines[1]["exit_code"] == 4 and lines[1]["status"] == "nonzero_exit"
    assert lines[2]["line"] == 4 and "invalid JSON" in lines[2]["error"]
    assert b"\r" not in r.stderr  # no progress bar when stderr is not a terminal


def _validator(name: str) -> Any:
    """A validator for one of the package's schemas, with both schemas registered for $ref."""
    jsonschema = pytest.importorskip("jsonschema")
    referencing = pytest.importorskip("referencing")
    here = Path(sandbox.__file__).parent
    docs = {n: json.loads((here / n).read_text()) for n in ("result.schema.json", "batch.schema.json")}
    registry = referencing.Registry().with_resources(
        (d["$id"], referencing.Resource.from_contents(d)) for d in docs.values())
    return jsonschema.Draft202012Validator(docs[name], registry=registry)


def test_batch_lines_match_the_published_schemas(isolated, tmp_path: Path) -> None:
    # Every output line (a run, or a line that could not be run) against batch.schema.json;
    # the runs against result.schema.json too: what a consumer validating the stream checks.
    f = tmp_path / "reqs.jsonl"
    f.write_text("\n".join([json.dumps({"command": ["echo", "a"], "id": "a"}), "{broken",
                            json.dumps({"command": ["true"], "nope": 1}),
                            json.dumps({"command": "exit 3", "shell": True, "timeout": 5})]) + "\n")
    lines = [json.loads(x) for x in cli("batch", str(f)).stdout.splitlines()]
    batch, result = _validator("batch.schema.json"), _validator("result.schema.json")
    assert [d["status"] for d in lines] == ["ok", "invalid_request", "invalid_request", "nonzero_exit"]
    for d in lines:
        batch.validate(d)
    for d in (lines[0], lines[3]):
        result.validate(d)
    assert not result.is_valid(lines[1])  # why a batch stream needs its own schema
    assert not batch.is_valid({**lines[1], "status": "ok"}) and not batch.is_valid({"id": 1})
    assert not batch.is_valid({k: v for k, v in lines[0].items() if k != "line"})  # a run's line too


def test_cli_batch_stdin_unordered_all_valid(isolated) -> None:
    data = "".join(json.dumps({"command": ["echo", str(i)], "id": i}) + "\n" for i in range(5))
    r = cli("batch", "-", "--unordered", "-p", "strict", stdin=data.encode())
    assert r.returncode == 0, r.stderr
    got = {d["id"]: d["stdout"] for d in map(json.loads, r.stdout.splitlines())}
    assert got == {i: f"{i}\n" for i in range(5)}
    assert r.stderr == b""



@pytest.mark.parametrize("how", ["fifo", "dev-stdin"])
def test_cli_batch_reads_a_pipe_once(isolated, tmp_path: Path, how: str) -> None:
    """A FIFO hung (read once to count, then opened again); /dev/stdin ran nothing, exit 0."""
    line = json.dumps({"command": ["echo", "piped"]}).encode() + b"\n"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if how == "fifo":
        fifo = tmp_path / "reqs"
        os.mkfifo(fifo)
        p = subprocess.Popen([sys.executable, "-m", "sandbox", "batch", str(fifo)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env)
        try:
            with open(fifo, "wb") as w:
                w.write(line)
            out, err = p.communicate(timeout=60)
        finally:
            if p.poll() is None:  # it hung: end it, by pid
                p.kill()
                p.wait()
        rc = p.returncode
    else:
        r = subprocess.run([sys.executable, "-m", "sandbox", "batch", "/dev/stdin"], input=line,
                           capture_output=True, timeout=60, env=env)
        out, err, rc = r.stdout, r.stderr, r.returncode
    assert rc == 0, err
    assert [json.loads(x)["stdout"] for x in out.splitlines()] == ["piped\n"]

def test_cli_batch_bad_usage_is_one_line() -> None:
    r = cli("batch", "/nonexistent/reqs.jsonl")
    assert r.returncode == 2 and r.stderr.count(b"\n") == 1 and b"No such file" in r.stderr
    r = cli("batch", "-", "--concurrency", "0", stdin=b"")
    assert r.returncode == 2 and b"concurrency" in r.stderr and b"Traceback" not in r.stderr
    r = cli("batch", "-", "--profile", "nope", stdin=b"")
    assert r.returncode == 2 and b"unknown profile" in r.stderr


# ---------------------------------------------------------------------------- bench


def test_bench_smoke(isolated, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--smoke", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(out.read_text())
    cases = {c["name"]: c for c in doc["cases"]}
    for name in ("bare_true", "sandbox_true", "bare_py", "sandbox_py", "cli_true", "cli_bare_py",
                 "cli_sys_py", "tput_bare", "tput_run_many", "tput_cli_batch", "tput_cli_each", "cpu_bare", "cpu_run_many", "rss_spread",
                 "drain_rate"):
        assert cases[name]["value"] is not None and cases[name]["error"] is None, cases[name]
    assert len(cases["sandbox_true"]["samples"]) == 2
    assert cases["cpu_run_many"]["unit"] == "ms" and cases["cpu_run_many"]["value"] > 0  # host CPU per program
    if "tput_bwrap" in cases:  # what the CPU figures mean for programs of other lengths
        assert "throughput ratio to bwrap" in doc["meta"]["cost_note"] and doc["meta"]["cost_note"] in p.stdout
    assert {g["goal"] for g in doc["goals"]} >= {"throughput >= 0.75x bare", "drain >= 1 GiB/s"}
    assert all(g["ratio"] is not None for g in doc["goals"] if g["reference"] in cases or g["reference"] is None)
    assert "goal" in p.stdout and "ratio" in p.stdout  # the table
    # The CLI's baseline (this interpreter's own start) is not inflated by an editable-install
    # import hook: scripts/setup.sh installs in "compat" mode (a path in a .pth file).
    assert doc["meta"]["cli_baseline_finders"] == [], "rerun ./scripts/setup.sh"


def _bench_module() -> Any:
    """scripts/bench.py as a module (it is a script, not part of the package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_for_test", ROOT / "scripts" / "bench.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # (its dataclasses look their module up)
    try:
        spec.loader.exec_module(bench)
    finally:
        del sys.modules[spec.name]
    return bench


def test_bench_cost_note() -> None:
    """Host CPU per program turned into the program length up to which 1.2x bwrap holds:
    (P + bwrap's overhead) / (P + ours) >= 1.2."""
    bench = _bench_module()

    def cases(**values: float) -> dict:
        return {k: bench.Case(k, "ms", value=v) for k, v in values.items()}

    note = bench.cost_note(cases(cpu_bare=10.0, cpu_run_many=14.0, cpu_bwrap=16.0))
    assert note is not None
    assert "+4.00 ms" in note and "+6.00 ms" in note  # over bare
    assert "up to P = 6.0 ms" in note and "(these programs: 10.0 ms;" in note  # (6 - 1.2*4) / 0.2
    assert "under 1.2x for every P" in bench.cost_note(cases(cpu_bare=10.0, cpu_run_many=15.0, cpu_bwrap=16.0))
    assert bench.cost_note(cases(cpu_bare=10.0, cpu_run_many=14.0)) is None  # no bwrap here
    assert "+3.33 ms" in note  # what 1.2x bwrap would need for these programs: (10 + 6) / 1.2 - 10


def test_bench_cost_note_names_the_cpus_busy_share() -> None:
    """Rate x host CPU per program / CPUs: how busy each mode kept the CPUs, which the CPU
    model above leaves out (a mode that leaves CPUs idle runs slower than its CPU says)."""
    bench = _bench_module()
    cs = {k: bench.Case(k, u, value=v) for k, u, v in (
        ("cpu_bare", "ms", 10.0), ("cpu_run_many", "ms", 14.0), ("cpu_bwrap", "ms", 16.0),
        ("tput_bare", "/s", 190.0), ("tput_run_many", "/s", 130.0), ("tput_bwrap", "/s", 100.0))}
    note = bench.cost_note(cs, cpus=2)
    assert note is not None and "CPUs busy: bare 95%, run_many 91%, bwrap 80%" in note
    del cs["tput_bwrap"]
    assert "CPUs busy" not in (bench.cost_note(cs, cpus=2) or "")  # only with every rate


def test_bench_round_ratios_pair_each_round() -> None:
    bench = _bench_module()
    cases = {k: bench.Case(k, "/s", value=v[0], samples=v) for k, v in
             {"tput_run_many": [100.0, 120.0], "tput_bare": [125.0, 150.0], "tput_bwrap": [80.0, 120.0]}.items()}
    assert bench.round_ratios(cases) == ("throughput round by round: run_many/bare 0.80 0.80 (median 0.800; ratio "
                                         "of medians 0.80); run_many/bwrap 1.25 1.00 (median 1.125; ratio of medians "
                                         "1.25)")
    cases["tput_run_many"].samples = [100.0]  # one round: nothing to pair beyond the medians
    assert bench.round_ratios(cases) is None


def test_bench_throughput_goals_judge_the_rounds_paired() -> None:
    """Each round runs every mode back to back: the goal is the median of the rounds' own
    ratios, so that a host whose speed drifts between rounds moves both sides of each."""
    bench = _bench_module()
    rates = {"tput_run_many": [100.0, 150.0, 90.0], "tput_bwrap": [80.0, 125.0, 80.0]}
    cases = {k: bench.Case(k, "/s", value=sorted(v)[1], samples=v) for k, v in rates.items()}
    g = bench.Goal("t", "tput_run_many", "tput_bwrap", ">=", 1.2, paired=True)
    g.judge(cases)
    assert g.ratio == pytest.approx(1.2) and g.passed  # rounds 1.25, 1.2, 1.125; medians' ratio 1.25
    assert g.to_dict()["estimator"] == "median of the rounds' ratios"
    unpaired = bench.Goal("t", "tput_run_many", "tput_bwrap", ">=", 1.2)
    unpaired.judge(cases)
    assert unpaired.ratio == pytest.approx(1.25) and unpaired.to_dict()["estimator"] == "ratio of medians"
    cases["tput_bwrap"].samples = [80.0, 125.0]  # rounds that do not pair: the medians
    g.judge(cases)
    assert g.ratio == pytest.approx(1.25) and g.to_dict()["estimator"] == "ratio of medians"
    assert {x.subject for x in bench.GOALS if x.paired} == {"tput_run_many"}


def test_bench_ratio_near_its_target_shows_three_decimals() -> None:
    bench = _bench_module()
    g = bench.Goal("t", "a", "b", ">=", 1.2)
    for ratio, shown in ((1.1958, "1.196"), (1.2041, "1.204"), (1.2, "1.20"), (1.1849, "1.18"), (0.5, "0.50")):
        g.ratio = ratio
        assert g.ratio_text() == shown


@pytest.mark.parametrize("ordered", [True, False])
def test_an_input_that_fails_midway_still_gives_the_results_of_what_ran(isolated, ordered: bool) -> None:
    """A request iterator that raises after some requests: the runs it already started are
    not thrown away; their results come first, then the iterator's error."""
    def requests():
        yield {"command": "echo 1"}
        yield {"command": "echo 2"}
        raise ValueError("the source broke")

    got: list[Any] = []
    with pytest.raises(ValueError, match="the source broke"):
        for r in run_many(requests(), concurrency=2, ordered=ordered):
            got.append(r)
    assert sorted((r.id, r.stdout) for r in got) == [(1, "1\n"), (2, "2\n")], got


# ---------------------------------------------------------------------------- output and depth limits


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
@pytest.mark.parametrize("order", [[], ["--unordered"]])
def test_cli_batch_stdout_that_cannot_be_written_is_one_line(isolated, tmp_path: Path, order: list[str]) -> None:
    """`sandboxrun batch f.jsonl > /dev/full` ended as `internal error: OSError ...`, exit 125."""
    f = tmp_path / "reqs.jsonl"
    f.write_text("".join(json.dumps({"command": ["echo", str(i)]}) + "\n" for i in range(6)))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with open("/dev/full", "wb") as full:
        r = subprocess.run([sys.executable, "-m", "sandbox", "batch", str(f), "-j", "2", *order], stdout=full,
                           stderr=subprocess.PIPE, timeout=120, env=env)  # a hang fails here
    assert r.returncode == 1, r.stderr  # as a reader gone (BrokenPipeError): the results were lost
    assert r.stderr.count(b"\n") == 1, r.stderr
    assert b"stdout" in r.stderr and b"No space left on device" in r.stderr, r.stderr
    assert b"internal error" not in r.stderr and b"Traceback" not in r.stderr


def _nested(depth: int) -> str:
    """A JSON array `depth` levels deep: [[[...]]]."""
    return "[" * depth + "]" * depth


def test_read_jsonl_refuses_a_line_nested_too_deep() -> None:
    from sandbox.batch import MAX_DEPTH

    ok = '{"command": ["true"], "id": ' + _nested(MAX_DEPTH - 1) + "}"  # the object itself is one level
    deep = '{"command": ["true"], "env": {"X": ' + _nested(MAX_DEPTH) + "}}"
    items = list(read_jsonl(io.BytesIO(f"{ok}\n{deep}\n".encode())))
    assert [n for n, _ in items] == [1, 2]
    assert isinstance(items[0][1], dict)
    assert f"nested more than {MAX_DEPTH} levels deep" in items[1][1].error
    assert items[1][1].id is None  # the line number stands in: the request's own id may be the deep part


@pytest.mark.parametrize("depth", [450, 980])
def test_cli_batch_a_deeply_nested_id_is_an_invalid_line_not_the_end(isolated, tmp_path: Path,
                                                                      depth: int) -> None:
    """A valid JSON id nested hundreds deep aborted the batch (RecursionError in to_dict); the
    results of every later line were lost."""
    f = tmp_path / "reqs.jsonl"
    f.write_text("\n".join([json.dumps({"command": ["echo", "a"]}),
                            '{"command": ["echo"], "id": ' + _nested(depth) + "}",
                            json.dumps({"command": ["echo", "c"], "id": "c"})]) + "\n")
    r = cli("batch", str(f))
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert r.returncode == 1, r.stderr  # a line could not be run
    assert [d["id"] for d in lines] == [1, 2, "c"], r.stderr
    assert lines[1]["status"] == "invalid_request" and lines[1]["line"] == 2
    assert "nested more than" in lines[1]["error"]
    assert [lines[0]["stdout"], lines[2]["stdout"]] == ["a\n", "c\n"]
    assert r.stderr == b""


def test_run_many_a_deeply_nested_python_id_is_an_error_not_a_broken_result(isolated) -> None:
    """An id nested deeper than a JSONL line may be, given from Python, ran; its result's
    to_json then failed with a RecursionError: it is refused as the JSONL line is."""
    from sandbox.batch import MAX_DEPTH

    deep: list = []
    for _ in range(2000):
        deep = [deep]
    shallow = [[["fine"]]]
    out = list(sandbox.run_many([{"command": ["true"], "id": deep}, {"command": ["true"], "id": shallow}],
                                concurrency=1))
    assert isinstance(out[0], BatchError), out[0]
    assert out[0].id == 1 and f"id: nested more than {MAX_DEPTH - 1} levels deep" in out[0].error
    assert json.loads(out[0].to_json())["status"] == "invalid_request"
    assert out[1].status == "ok" and json.loads(out[1].to_json())["id"] == shallow


def test_an_id_with_a_lone_surrogate_is_refused_not_echoed(isolated, tmp_path: Path) -> None:
    """A JSONL id "\\ud800" (or one nested in a list) was echoed into the result: JSON that no
    strict reader takes (it stands for no Unicode text). It is an invalid line, as a NaN id is."""
    f = tmp_path / "reqs.jsonl"
    f.write_text('{"command": ["true"], "id": "\\ud800"}\n{"command": ["true"], "id": ["a", {"k": "\\udfff"}]}\n'
                 '{"command": ["true"], "id": "\\ud83d\\ude00"}\n')
    r = cli("batch", str(f))
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert r.returncode == 1 and [d["id"] for d in lines] == [1, 2, "\U0001f600"], r.stdout
    for d in lines[:2]:
        assert d["status"] == "invalid_request" and "lone surrogate" in d["error"], d
    assert lines[2]["status"] == "ok"  # a surrogate pair is one character
    out = list(sandbox.run_many([{"command": ["true"], "id": "x\udc80"}], concurrency=1))
    assert isinstance(out[0], BatchError) and "lone surrogate" in out[0].error and out[0].id == 1


# ---------------------------------------------------------------------------- a batch as a stream (audit)


def _batch_proc(*args: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "sandbox", "batch", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def _sleepers(tmp_path: Path, mark: str, n: int, **extra: Any) -> str:
    """A JSONL file of `n` requests that sleep 120 s, tagged with `mark`; its path."""
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"command": f"sleep 120 # {mark}", "shell": True, **extra}) + "\n"
                           for _ in range(n)))
    return str(src)


def _until_running(mark: str, n: int) -> None:
    from sandbox import leaks

    deadline = time.monotonic() + 30  # a bound, not a benchmark
    while len(leaks.marked(mark)) < n:
        assert time.monotonic() < deadline, "the runs never started"
        time.sleep(0.02)


def _line_within(stream: Any, seconds: float) -> bytes:
    import select

    ready, _, _ = select.select([stream], [], [], seconds)
    return stream.readline() if ready else b""


@pytest.mark.parametrize("mode", [[], ["--unordered"]])
def test_cli_batch_writes_each_result_before_the_next_line_comes(isolated, mode: list[str]) -> None:
    # A driver that sends a line and waits for its result before the next: the result was held
    # until the next line came (or the input ended), so both sides waited for ever.
    p = _batch_proc("-j2", *mode, "-")
    try:
        for word in ("one", "two"):
            p.stdin.write(json.dumps({"command": ["echo", word]}).encode() + b"\n")
            p.stdin.flush()
            line = _line_within(p.stdout, 30)  # a bound, not a benchmark: before, no line came at all
            assert line and json.loads(line)["stdout"] == f"{word}\n", (line, p.stderr.peek() if line else "")
        p.stdin.close()
        assert p.wait(30) == 0
    finally:
        p.kill()
        p.wait()


def test_run_many_takes_concurrency_by_position(isolated) -> None:
    assert [r.stdout for r in sandbox.run_many([{"command": ["echo", "x"]}], 2)] == ["x\n"]


def _tgkill(pid: int, tid: int, sig: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "tgkill"):
        pytest.skip("no tgkill in this libc")
    assert libc.tgkill(pid, tid, sig) == 0, os.strerror(ctypes.get_errno())


@pytest.mark.parametrize("gap", [0, 0.002])
def test_cli_batch_interrupted_twice_tears_down_whole_and_exits_130(isolated, tmp_path: Path, gap: float) -> None:
    # A second Ctrl-C during the first's teardown cut pool.shutdown short: the batch's slot
    # cgroups stayed; or it landed in Event.wait's Condition: "internal error: RuntimeError:
    # release unlocked lock", exit 125.
    from conftest import marker

    from sandbox import leaks

    for _ in range(3):
        mark = marker()
        p = _batch_proc("-j4", _sleepers(tmp_path, mark, 8))
        try:
            _until_running(mark, 4)
            p.send_signal(2)
            time.sleep(gap)
            p.send_signal(2)
            code, err = p.wait(30), p.stderr.read()
            assert code == 130 and b"internal error" not in err, err
            left = leaks.runner_cgroups(owner=p.pid)  # its slots, and (about 1 in 15) a run's own
            assert leaks.marked(mark) == [] and left == [], left
        finally:
            p.kill()
            p.wait()
            for q in leaks.marked(mark):
                os.kill(q.pid, 9)


@pytest.mark.parametrize("sig", [2, 15])
def test_cli_batch_ends_at_a_signal_the_kernel_gave_a_worker_thread(isolated, tmp_path: Path, sig: int) -> None:
    # Python runs signal handlers in the main thread only; it waited in Future.result() until
    # the run under way ended (up to its timeout) before it saw the Ctrl-C.
    from conftest import marker

    from sandbox import leaks

    mark = marker()
    p = _batch_proc("-j2", _sleepers(tmp_path, mark, 4, timeout=150))
    try:
        _until_running(mark, 2)
        others = sorted(int(t) for t in os.listdir(f"/proc/{p.pid}/task") if int(t) != p.pid)
        assert others
        _tgkill(p.pid, others[0], sig)
        assert p.wait(30) == 128 + sig  # (bounded: the runs sleep 120 s)
        assert b"interrupted" in p.stderr.read()
        assert leaks.marked(mark) == []
    finally:
        p.kill()
        p.wait()
        for q in leaks.marked(mark):
            os.kill(q.pid, 9)


def test_a_run_many_left_open_at_exit_is_killed_not_run_out(isolated) -> None:
    # The pool's workers, joined at interpreter exit, ran the whole window (each run to its end).
    from conftest import marker

    from sandbox import leaks

    mark = marker()
    code = (f"import sandbox\nit = sandbox.run_many([{{'command': ['echo', 'first']}}] + "
            f"[{{'command': 'sleep 60 # {mark}', 'shell': True, 'timeout': 90}}] * 6, 2)\nprint(next(it).stdout, end='')")
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=45,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)))  # before: 3 rounds of 60 s
        assert r.returncode == 0 and r.stdout == b"first\n", r.stderr
        assert leaks.marked(mark) == []
    finally:
        for q in leaks.marked(mark):
            os.kill(q.pid, 9)


def test_read_jsonl_is_utf8_only_and_counts_columns_in_the_line() -> None:
    # json.loads of bytes guessed UTF-16; split at the byte \n, its lines were not the text's
    # (a UTF-16 file of one line gave two results): the input is refused as a whole
    for encoding in ("utf-16", "utf-16-le", "utf-16-be", "utf-32"):
        text = '{"command": "a"}\n{"command": "b"}\n'.encode(encoding)
        with pytest.raises(InputError, match=r"^not UTF-8: UTF-16 or UTF-32 text"):
            list(read_jsonl(io.BytesIO(text)))
    (_, nul), (_, ok) = read_jsonl(io.BytesIO(b'{"command": "a\0"}\n{"command": "b"}\n'))
    assert "NUL bytes" in nul.error and ok == {"command": "b"}  # a later line's NUL: that line alone
    (_, cut), = read_jsonl(io.BytesIO(b'{"command": "x"\n'))
    assert cut.error == "invalid JSON: Expecting ',' delimiter at column 16", cut.error  # was "column 1"
    (_, bom), (_, mid) = read_jsonl(io.BytesIO(b'\xef\xbb\xbf{"command": "x"}\r\n\xef\xbb\xbf{"command": "y"}\n'))
    assert bom == {"command": "x"} and "invalid JSON" in mid.error  # a BOM opens a file only
    ((n, first),) = read_jsonl(io.BytesIO(b'\xef\xbb\xbf\r\n{"command": "x"}\n'))  # a BOM, then a blank line
    assert (n, first) == (2, {"command": "x"}), first  # was line 1: invalid JSON


def test_progress_line_is_cleared_before_a_result_line() -> None:
    tty = _Tty()
    p = Progress(tty, total=2, every=0)
    p.update(_res(True))
    drawn = tty.getvalue()
    p.clear()
    assert tty.getvalue() == drawn + "\r" + " " * (len(drawn) - 1) + "\r"


def test_cli_batch_an_unreadable_input_is_named(isolated) -> None:
    r = cli("batch", "/proc/self/mem")  # EIO at offset 0: was an internal error (exit 125)
    assert r.returncode == 2 and r.stderr == b"sandboxrun: error: /proc/self/mem: cannot read: Input/output error\n"


def test_read_jsonl_refuses_a_key_given_twice() -> None:
    """json.loads keeps the last of two `timeout`s silently: the line is invalid instead."""
    (_, twice), (_, nested) = read_jsonl(io.BytesIO(b'{"command": "x", "timeout": 1, "timeout": 99}\n'
                                                    b'{"command": "x", "env": {"K": "a", "K": "b"}}\n'))
    assert twice.error == "invalid JSON: key 'timeout' given more than once in an object", twice
    assert "'K' given more than once" in nested.error, nested


# ---------------------------------------------------------------------------- untrusted requests


def test_an_untrusted_request_chooses_no_profile_host_directory_or_network(isolated, tmp_path: Path) -> None:
    # Each line had the caller's say: a profile file with seccomp, Landlock and namespaces off,
    # a root-owned host directory read-write, the host's network.
    evil = tmp_path / "evil.toml"
    evil.write_text('extends = "strict"\n[security]\nseccomp = "off"\n')
    refused = [
        ({"profile": str(evil)}, "profile: an untrusted request may not choose its profile"),
        ({"profile": "nested"}, "profile: an untrusted request may not choose its profile"),
        ({"cwd": str(tmp_path)}, "cwd: an untrusted request may not choose a host directory"),
        ({"bind": f"{tmp_path}:/x"}, "bind: an untrusted request may not choose a host directory"),
        ({"ro_bind": "/root"}, "ro_bind: an untrusted request may not choose a host directory"),
        ({"network": "host"}, "network: 'host' is more than the profile's 'none'"),
        ({"memory": "unlimited"}, "memory: 'unlimited' is above the 512MiB of profile 'strict'"),
        ({"memory": "1GiB"}, "memory: '1GiB' is above"),
        ({"cpus": 0}, "cpus: 0 (no limit) is above the 1 of profile 'strict'"),  # was "0 is above the 1"
        ({"processes": 65}, "processes: 65 is above"),
        ({"kill_grace": 5}, "kill_grace: 5 is above"),
    ]
    killing = with_overrides(load("strict"), output_overflow="kill")
    (drain,) = run_many([{"command": ["true"], "output_overflow": "drain"}], profile=killing)
    assert isinstance(drain, BatchError) and drain.error.startswith(
        "output_overflow: 'drain' is more than the profile's 'kill'"), drain
    reqs = [{"command": ["true"], **extra} for extra, _ in refused]
    out = list(run_many(reqs, concurrency=2))
    for item, (extra, why) in zip(out, refused, strict=True):
        assert isinstance(item, BatchError) and item.error.startswith(why), (extra, item)
        assert item.error.endswith("(a request you wrote may: run_many(trusted=True), sandboxrun batch --trusted)")
    ok = list(run_many([{"command": ["true"], "memory": "64MiB", "processes": 20, "timeout": 500,
                         "network": "none", "profile": "strict"}]))
    assert ok[0].status == "ok", ok
    assert (ok[0].isolation.limits["memory_bytes"], ok[0].isolation.limits["processes"],
            ok[0].isolation.limits["timeout_s"]) == (64 * 2**20, 20, 500)
    trusted = list(run_many([{"command": ["true"], "profile": str(evil)}], trusted=True))
    assert trusted[0].status == "ok" and trusted[0].isolation.seccomp == "off", trusted  # the caller's say


@pytest.mark.parametrize("extra, why", [
    ({"network": "bogus"}, "override: network = 'bogus': expected none, loopback or host"),
    ({"network": 5}, "override: network = 5: expected none, loopback or host"),
    ({"output_overflow": 5}, "override: output_overflow = 5: expected 'drain' or 'kill'"),
])
def test_an_untrusted_requests_invalid_value_is_named_as_invalid(extra: dict, why: str) -> None:
    # It said "'bogus' is more than the profile's 'none'": as if a trusted caller could have it.
    (item,) = run_many([{"command": ["true"], **extra}])
    assert isinstance(item, BatchError) and item.error == why, item


def test_an_untrusted_request_naming_the_batch_profile_gets_that_very_profile(isolated, tmp_path: Path) -> None:
    # A batch profile file named nested.toml (extending strict) is "nested" by name: a line
    # that named it loaded the built-in nested by that name, with the host's filesystem.
    mine = tmp_path / "nested.toml"
    mine.write_text('extends = "strict"\n')
    (item,) = run_many([{"command": ["true"], "profile": "nested"}], profile=str(mine))
    assert item.status == "ok" and item.isolation.filesystem == "private", item


def test_cli_batch_lines_stay_within_the_profile_unless_trusted(isolated, tmp_path: Path) -> None:
    evil = tmp_path / "evil.toml"
    evil.write_text('extends = "strict"\n[security]\nseccomp = "off"\n')
    jobs = tmp_path / "b.jsonl"
    jobs.write_text(json.dumps({"command": ["grep", "Seccomp:", "/proc/self/status"], "profile": str(evil)}) + "\n")
    r = cli("batch", str(jobs))
    (line,) = [json.loads(x) for x in r.stdout.splitlines()]
    assert r.returncode == 1 and line["status"] == "invalid_request", r.stdout
    assert line["error"].startswith("profile: an untrusted request may not choose its profile"), line
    r = cli("batch", "--trusted", str(jobs))
    (line,) = [json.loads(x) for x in r.stdout.splitlines()]
    assert r.returncode == 0 and line["stdout"].split() == ["Seccomp:", "0"], r.stdout


def test_a_utf16_batch_file_is_refused_as_a_whole(tmp_path: Path) -> None:
    # One line of UTF-16 gave two results: lines were split at the byte \n, which its \n\0 holds.
    jobs = tmp_path / "u.jsonl"
    jobs.write_bytes('{"command": ["echo", "x"]}\n'.encode("utf-16"))
    r = cli("batch", str(jobs))
    assert (r.returncode, r.stdout) == (2, b""), r
    assert r.stderr == b"sandboxrun: error: not UTF-8: UTF-16 or UTF-32 text (JSONL is UTF-8: iconv -t UTF-8)\n"


def test_batch_request_overrides_of_the_wrong_type_are_named() -> None:
    (item,) = run_many([BatchRequest(command=["true"], overrides=None)])  # type: ignore[arg-type]
    assert isinstance(item, BatchError) and item.error == "overrides: expected a dict of setting: value, got NoneType"
