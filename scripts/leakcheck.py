#!/usr/bin/env python3
"""Print what sandboxrun could leave on the host, before and after a command.

    scripts/leakcheck.py -- sandboxrun -- sh -c 'sleep 1 & echo hi'
    scripts/leakcheck.py --runs 500 -- /bin/true          # in-process: the library, 500 times
    scripts/leakcheck.py --runs 200 --threads 8 --json -- sh -c 'echo x'

Without --runs the command runs as a child of this script, which makes itself a child
subreaper first: whatever the command leaves running is re-parented here and counted
as a stray child (and reaped on exit). With --runs the command runs N times through
`sandbox.run` in this process, so the supervisor's own fds, threads and RSS are
audited too (the fork server, which persists by design, is not counted as a child).

Exit status: 0 when no counter grew, 1 when one did (the report lists what is new),
2 for bad arguments. The counters live in sandbox/leaks.py, shared with the soak test.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sandbox import leaks  # noqa: E402

PR_SET_CHILD_SUBREAPER = 36
# Counters of this process itself: meaningful only when the runs happen in it (--runs).
SELF_COUNTERS = ("fds", "threads", "rss_bytes", "own_cgroups")
RSS_SLACK = 20 * 2**20


def _subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print(f"leakcheck: cannot become a child subreaper: {os.strerror(ctypes.get_errno())}", file=sys.stderr)


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _run_command(cmd: list[str]) -> int:
    try:
        return subprocess.call(cmd)
    except OSError as e:
        print(f"leakcheck: cannot run {cmd[0]!r}: {e.strerror}", file=sys.stderr)
        return 127


def _run_inprocess(cmd: list[str], runs: int, threads: int, profile: str) -> int:
    import sandbox

    failures = 0

    def one(_i: int) -> str:
        return sandbox.run(cmd, profile=profile).status

    if threads <= 1:
        statuses = [one(i) for i in range(runs)]
    else:
        with ThreadPoolExecutor(threads) as pool:
            statuses = list(pool.map(one, range(runs)))
    counts: dict[str, int] = {}
    for s in statuses:
        counts[s] = counts.get(s, 0) + 1
        failures += s not in ("ok", "nonzero_exit")
    print("leakcheck: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())), file=sys.stderr)
    return 0 if failures == 0 else 1


def _settled(before: leaks.Snapshot, skip: tuple[str, ...], settle: float, slack: int,
             reap: bool) -> tuple[leaks.Snapshot, dict[str, tuple[int, int]]]:
    """Poll until nothing grew or `settle` seconds passed: teardown may lag a run's return.
    As a subreaper, first reap what was re-parented here and died: init would have (live
    strays are what counts)."""
    deadline = time.monotonic() + settle
    while True:
        if reap:
            _reap()
        after = leaks.snapshot()
        grown = {k: v for k, v in leaks.growth(before, after, rss_slack=slack).items() if k not in skip}
        if not grown or time.monotonic() >= deadline:
            return after, grown
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="leakcheck.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=0, help="run CMD this many times through sandbox.run, in-process")
    p.add_argument("--threads", type=int, default=1, help="with --runs: from this many threads")
    p.add_argument("--profile", default="strict", help="with --runs: the profile (default: strict)")
    p.add_argument("--settle", type=float, default=2.0, help="seconds to let teardown finish (default: 2)")
    p.add_argument("--json", action="store_true", help="print the counters as JSON")
    p.add_argument("--details", action="store_true", help="list the entries behind every counter")
    p.add_argument("command", nargs=argparse.REMAINDER)
    ns = p.parse_args(argv)
    cmd = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not cmd:
        p.error("no command given (leakcheck.py [OPTIONS] -- CMD [ARGS...])")
    if ns.runs < 0 or ns.threads < 1 or ns.settle < 0:
        p.error("--runs must be >= 0, --threads >= 1, --settle >= 0")

    inprocess = ns.runs > 0
    skip = () if inprocess else SELF_COUNTERS
    if inprocess:
        import sandbox

        sandbox.run(["/bin/true"], profile=ns.profile)  # warm-up: the fork server and caches
    else:
        _subreaper()
    before = leaks.snapshot()
    started = time.monotonic()
    if inprocess:
        code = _run_inprocess(cmd, ns.runs, ns.threads, ns.profile)
    else:
        code = _run_command(cmd)
    elapsed = time.monotonic() - started
    after, grown = _settled(before, skip, ns.settle, RSS_SLACK if inprocess else 0, reap=not inprocess)

    rows = [(k, v, after.counters()[k]) for k, v in before.counters().items() if k not in skip]
    if ns.json:
        print(json.dumps({
            "command": cmd, "exit_code": code, "seconds": round(elapsed, 3), "runs": ns.runs or 1,
            "before": {k: b for k, b, _ in rows}, "after": {k: a for k, _, a in rows},
            "grown": {k: {"before": b, "after": a, "new": leaks.new_items(before, after, k)}
                      for k, (b, a) in grown.items()},
        }, indent=2))
    else:
        print(f"{'counter':<16}{'before':>14}{'after':>14}{'delta':>12}")
        for k, b, a in rows:
            flag = "  LEAK" if k in grown else ""
            print(f"{k:<16}{b:>14}{a:>14}{a - b:>+12}{flag}")
        print(f"command exit {code}, {elapsed:.2f}s" + (f", {ns.runs} runs" if inprocess else ""))
        if grown:
            print("\nnew since before:\n" + leaks.describe(before, after, grown))
        if ns.details:
            for key, items in after.details.items():
                if key not in skip and items:
                    print(f"\n{key}:\n" + "\n".join(f"    {x}" for x in items))
    return 1 if grown else 0


if __name__ == "__main__":
    sys.exit(main())
