"""Leak audit: thousands of mixed runs, then zero growth of everything a run could leave.

Short by default (1,000 sequential + 200 concurrent runs, about a minute on 2 cores);
`pytest -m soak --soak-long` runs 10x as many. The mix: normal runs, wall timeouts
that ignore SIGTERM, memory bombs, fork bombs, output floods on both streams, setup
errors, exec failures and blocked commands. Afterwards, against a baseline taken after
a warm-up: the supervisor's fds and threads are equal; host mounts, runner cgroups,
fresh workdirs, stray children, sandbox inits, unreaped zombies and state directories
are back to the baseline; no process of the soak survives; and every run ended with
the status its kind calls for.

The supervisor's RSS is judged by a second test that runs the same warm-up and soak in
a fresh interpreter (test_soak_rss_is_flat): there the heap holds only what the runs
left, and each half of the soak may grow it by 5 MiB at most (about 9 KiB a run).
In this process, after the rest of the suite, RSS steps up by 10-25 MiB now and then
(in either half or both, with and without a leak: glibc's arenas, most likely; Python's
allocated blocks are reported beside it to tell), so here RSS is only capped: 40 MiB
over the whole soak.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import marker

import sandbox
from sandbox import leaks
from sandbox import record as records
from sandbox.profile import Mount, load

RSS_SLACK_PER_HALF = 5 * 2**20  # a fresh interpreter (flat within 1 MiB): a leak of ~9 KiB a run
RSS_STEP_MAX = 40 * 2**20  # after the rest of the suite: the allocator's steps, with room
FORK_BOMB = """
import os, sys, time
root = os.getpid()
while True:  # every process forks until the pids limit says no
    try:
        os.fork()
    except OSError:
        break
if os.getpid() == root:
    sys.exit(0)  # the init then kills whatever is left in the namespace
time.sleep(30)
"""
MEMORY_BOMB = "a = []\nwhile True:\n    a.append(bytearray(1 << 20))\n"
FLOOD = "import sys\nfor s in (sys.stdout, sys.stderr):\n    s.buffer.write(b'x' * (4 << 20))\n"


@dataclasses.dataclass(frozen=True)
class Kind:
    name: str
    make: Callable[[str], tuple[Any, dict[str, Any]]]  # mark -> (command, kwargs)
    expect: Callable[[sandbox.Result], bool]


def _broken_profile() -> sandbox.Profile:
    """Validated, then unsatisfiable: a bind whose source is gone by the time the child mounts it."""
    p = load("strict")
    return records.replace(p, mounts=(*p.mounts, Mount("/nonexistent-sandboxrun-soak", "/data")))


BROKEN = _broken_profile()
NORMAL = (
    Kind("true", lambda m: (["/bin/true", m], {}), lambda r: r.status == "ok"),
    Kind("echo", lambda m: (["sh", "-c", 'echo "$0"', m], {}), lambda r: r.status == "ok" and r.stdout.strip() != ""),
)
HEAVY = (
    Kind("timeout", lambda m: (["sh", "-c", "trap '' TERM; while :; do sleep 1; done", m],
                               {"timeout": 0.2, "kill_grace": 0.1}),
         lambda r: r.status == "timeout" and r.timed_out),
    Kind("memory_bomb", lambda m: (["python3", "-c", MEMORY_BOMB, m], {"memory": "32MiB"}),
         lambda r: r.status == "memory_limit"),
    Kind("fork_bomb", lambda m: (["python3", "-c", FORK_BOMB, m], {"timeout": 10}),
         lambda r: r.status in ("ok", "nonzero_exit") and not r.timed_out),
    Kind("output_flood", lambda m: (["python3", "-c", FLOOD, m], {}),
         lambda r: r.stdout_truncated and r.stderr_truncated and r.stdout_bytes == r.stderr_bytes == 4 << 20),
    Kind("setup_error", lambda m: (["/bin/true", m], {"profile": BROKEN}),
         lambda r: r.status == "setup_error" and (r.error_step or "").startswith("filesystem")),
    Kind("exec_failure", lambda m: ([f"/nonexistent-{m}"], {}), lambda r: r.exit_code == 127),
    Kind("blocked", lambda m: (f"rm -rf / {m}", {}), lambda r: r.status == "blocked"),
    # a fresh workdir on the host (no mount namespace): what the temp-dir counter watches
    Kind("host_workdir", lambda m: (["sh", "-c", 'echo "$0" > f; mkdir -p d/e; cat f', m], {"profile": "nested"}),
         lambda r: r.status == "ok" and r.stdout.strip() != ""),
)


def plan(n: int, heavy_every: int) -> list[Kind]:
    """n runs: mostly normal, every `heavy_every`-th one heavy, kinds in rotation."""
    out = []
    for i in range(n):
        if i % heavy_every == heavy_every - 1:
            out.append(HEAVY[(i // heavy_every) % len(HEAVY)])
        else:
            out.append(NORMAL[i % len(NORMAL)])
    return out


def run_one(kind: Kind, mark: str) -> tuple[str, bool, str]:
    command, kw = kind.make(mark)
    r = sandbox.run(command, **kw)
    detail = (f"status={r.status} exit={r.exit_code} signal={r.signal} step={r.error_step} error={r.error!r} "
              f"oom_kills={r.usage.oom_kills} wall={r.usage.wall_s:.2f}s out={r.stdout_bytes}/{r.stderr_bytes}")
    return kind.name, kind.expect(r), detail


def warm_up(mark: str) -> None:
    """Every kind a few times, then the mix sequential and concurrent (glibc gives each thread
    an arena), so the allocators reach their high-water marks before a baseline."""
    for kind in NORMAL + HEAVY:
        for _ in range(3):
            run_one(kind, mark)
    for kind in plan(100, 10):
        run_one(kind, mark)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: run_one(k, mark), plan(100, 5)))


def soak_half(sequential: int, concurrent: int, mark: str) -> list[tuple[str, bool, str]]:
    out = [run_one(kind, mark) for kind in plan(sequential, 10)]
    with ThreadPoolExecutor(8) as pool:
        out += pool.map(lambda k: run_one(k, mark), plan(concurrent, 5))
    return out


def _settle_allocator() -> None:
    """Collect, and hand free heap back to the OS (glibc keeps freed blocks of every thread's
    arena otherwise): RSS then measures what is still referenced, which is what a leak is."""
    gc.collect()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Fresh workdirs go here: counted exactly, apart from other users' runs in /tmp."""
    base = tmp_path / "tmp"
    base.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    monkeypatch.setenv("TMPDIR", str(base))  # where fresh host workdirs go (workdir.tmpdir)
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    monkeypatch.setenv("SANDBOXRUN_STATE_DIR", str(state))  # (not other users' sessions in /run/sandboxrun)
    yield base


@pytest.mark.soak
def test_soak_leaves_nothing_behind(contained, private_tmp: Path, request: pytest.FixtureRequest) -> None:
    long = request.config.getoption("--soak-long")
    sequential, concurrent = (10_000, 2_000) if long else (1_000, 200)
    mark = marker()
    bases = [str(private_tmp)]

    warm_up(mark)  # fork server, caches, the allocator's arenas
    _settle_allocator()
    before = leaks.snapshot(temp_bases=bases)
    started = time.monotonic()

    outcomes: Counter[tuple[str, bool]] = Counter()
    wrong: list[str] = []

    def record(res: tuple[str, bool, str]) -> None:
        name, ok, detail = res
        outcomes[name, ok] += 1
        if not ok and len(wrong) < 20:
            wrong.append(f"{name}: {detail}")

    rss = [before.rss_bytes]
    blocks = [sys.getallocatedblocks()]  # Python objects still referenced: grows with a Python leak only
    for _half in range(2):
        for res in soak_half(sequential // 2, concurrent // 2, mark):
            record(res)
        _settle_allocator()
        rss.append(leaks.snapshot(temp_bases=bases).rss_bytes)
        blocks.append(sys.getallocatedblocks())
    elapsed = time.monotonic() - started

    # Teardown may lag a run's return by a moment (cgroup rmdir, reaping): a bounded wait.
    deadline = time.monotonic() + 10
    while True:
        _settle_allocator()
        after = leaks.snapshot(temp_bases=bases)
        grown = leaks.growth(before, after, rss_slack=1 << 40)  # RSS: judged per half, below
        if not grown or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    survivors = leaks.marked(mark)

    summary = (f"{sequential} sequential + {concurrent} concurrent runs in {elapsed:.1f}s; "
               f"fds {before.fds}->{after.fds}, threads {before.threads}->{after.threads}, "
               f"rss {'->'.join(str(r >> 20) for r in rss)} MiB (per half), "
               f"Python blocks {'->'.join(str(b) for b in blocks)}; "
               + ", ".join(f"{name} {n}" for (name, ok), n in sorted(outcomes.items()) if ok))
    print("\nsoak:", summary)
    request.node.user_properties.append(("soak", summary))
    assert not wrong, "runs that ended with the wrong status:\n" + "\n".join(wrong)
    assert sum(outcomes.values()) == sequential + concurrent
    assert not grown, "grew during the soak:\n" + leaks.describe(before, after, grown)
    assert rss[2] - rss[0] <= RSS_STEP_MAX, f"RSS grew by {(rss[2] - rss[0]) >> 20} MiB (a cache without bound?)"
    assert survivors == [], f"processes of the soak still alive: {[str(p) for p in survivors]}"


_RSS_SOAK = """
import json, sys
sys.path.insert(0, sys.argv[1])
import test_soak as t
from sandbox import leaks

sequential, concurrent, mark = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
t.warm_up(mark)
t._settle_allocator()
rss, blocks, wrong = [leaks.rss_bytes()], [sys.getallocatedblocks()], []
for _half in range(2):
    wrong += [f"{name}: {detail}" for name, ok, detail in t.soak_half(sequential // 2, concurrent // 2, mark)
              if not ok]
    t._settle_allocator()
    rss.append(leaks.rss_bytes())
    blocks.append(sys.getallocatedblocks())
print(json.dumps({"rss": rss, "blocks": blocks, "wrong": wrong[:20]}))
"""


@pytest.mark.soak
def test_soak_rss_is_flat(contained, private_tmp: Path, request: pytest.FixtureRequest) -> None:
    """The supervisor's RSS over the soak's mix, in a fresh interpreter: a leak grows it in
    each half; nothing else does once warmed up."""
    long = request.config.getoption("--soak-long")
    sequential, concurrent = (10_000, 2_000) if long else (1_000, 200)
    mark = marker()
    env = {**os.environ, "TMPDIR": str(private_tmp)}
    p = subprocess.run([sys.executable, "-c", _RSS_SOAK, str(Path(__file__).parent), str(sequential),
                        str(concurrent), mark], capture_output=True, text=True, timeout=1800, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    rss = out["rss"]
    summary = (f"fresh interpreter, {sequential} sequential + {concurrent} concurrent runs: rss "
               f"{'->'.join(str(r >> 20) for r in rss)} MiB (per half), Python blocks "
               f"{'->'.join(str(b) for b in out['blocks'])}")
    print("\nsoak:", summary)
    request.node.user_properties.append(("soak_rss", summary))
    assert not out["wrong"], "runs that ended with the wrong status:\n" + "\n".join(out["wrong"])
    halves = [rss[1] - rss[0], rss[2] - rss[1]]
    assert max(halves) <= RSS_SLACK_PER_HALF, f"RSS grew by {[h >> 20 for h in halves]} MiB per half (a leak): {summary}"
    assert leaks.marked(mark) == []
