#!/usr/bin/env python3
"""Start-up cost and throughput of sandboxrun beside bare subprocess and bwrap, in one run.

    .venv/bin/python scripts/bench.py [--quick] [--json out.json] [--png out.png]

Every goal is a ratio between two cases measured side by side in this one process,
so a slow or noisy machine moves both sides. Latency cases are sampled round-robin
(each round runs every case once, in a rotating order) after a warm-up, and the
medians are compared. Throughput runs each mode over the same programs, in rotating
order, each from a quiet host (the kernel's teardown of one mode's namespaces must not be
charged to the next), in rounds: its goals judge the median of the rounds' own ratios
(the ratio of the median rates is printed beside it).

Cases (every Python program runs the same interpreter, /usr/bin/python3 by default,
so that a slow `python3` shim on PATH cannot skew one side):

* /bin/true: subprocess.run, subprocess.run(bwrap strict), sandbox.run (strict)
* python3 -c pass: the same three
* throughput of short Python programs at concurrency = CPUs: ThreadPoolExecutor +
  subprocess.run (bare, bwrap), sandbox.run_many, `sandboxrun batch`, and one
  `sandboxrun -- PROGRAM` process per program (no goal: what shelling out per snippet costs)
  (with each mode's host CPU per program: the overhead each way adds to a program, from
  which the throughput ratio for programs of other lengths follows, printed under the table)
* CLI: `sandboxrun --profile strict -- /bin/true` vs `python -c pass` (the CLI's
  own interpreter), both as subprocesses
* supervisor peak RSS and drain rate for 1 MiB, 64 MiB, 1 GiB of stdout, each
  in a fresh Python running one sandbox.run
* nsjail / firejail /bin/true when installed (no goal: for the table only)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import sandbox  # noqa: E402

MiB = 1 << 20
BWRAP_STRICT = ["--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
                "--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
                "--symlink", "usr/bin", "/bin", "--symlink", "usr/sbin", "/sbin", "--proc", "/proc",
                "--dev", "/dev", "--tmpfs", "/tmp", "--chdir", "/tmp"]
PROGRAM = "print(sum(range(1000)))"


@dataclass
class Mode:
    """How much to measure."""

    iterations: int  # latency samples per case
    warmup: int
    programs: int  # throughput: programs per round
    rounds: int  # throughput rounds per mode
    cli_iterations: int
    drain_sizes: tuple[int, ...]
    quiet_s: float = 5.0  # throughput: longest wait for a quiet host before each mode


MODES = {
    # Throughput: more, shorter rounds rather than a few long ones: each round pairs the modes.
    "full": Mode(200, 10, 200, 8, 60, (MiB, 64 * MiB, 1024 * MiB)),
    "quick": Mode(30, 5, 100, 4, 20, (MiB, 64 * MiB, 1024 * MiB)),
    "smoke": Mode(2, 1, 8, 1, 2, (MiB, 8 * MiB), quiet_s=0.5),
}


@dataclass
class Case:
    name: str
    unit: str  # "ms" (lower is better), "/s" (higher is better), "MiB", "GiB/s"
    value: float | None = None
    samples: list[float] = field(default_factory=list)
    command: str = ""
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "unit": self.unit, "value": self.value, "command": self.command,
                "error": self.error, "samples": [round(s, 4) for s in self.samples]}


PAIRED = "median of the rounds' ratios"


@dataclass
class Goal:
    text: str
    subject: str
    reference: str | None  # None: an absolute target on the subject's value
    op: str  # "<=" or ">="
    target: float
    # Throughput: the median of the rounds' own ratios (each round runs every mode back to
    # back), where the rounds pair; a host whose speed drifts then moves both sides of each.
    paired: bool = False
    ratio: float | None = None
    passed: bool | None = None
    estimator: str = "ratio of medians"

    def judge(self, cases: dict[str, Case]) -> None:
        s = cases.get(self.subject)
        r = cases.get(self.reference) if self.reference else None
        if s is None or s.value is None or (self.reference and (r is None or not r.value)):
            return
        self.ratio = s.value / r.value if r is not None and r.value else s.value
        self.estimator = "ratio of medians" if r is not None else "median"
        if self.paired and r is not None and len(s.samples) >= 2 and len(s.samples) == len(r.samples) \
                and all(r.samples):
            self.ratio = statistics.median(a / b for a, b in zip(s.samples, r.samples, strict=True))
            self.estimator = PAIRED
        self.passed = self.ratio <= self.target if self.op == "<=" else self.ratio >= self.target

    def ratio_text(self) -> str:
        """Two decimals; three where two would round onto the target (a 1.196 shown as
        "1.20" beside "FAIL" reads as a mistake)."""
        if self.ratio is None:
            return "-"
        two = f"{self.ratio:.2f}"
        return f"{self.ratio:.3f}" if float(two) == self.target and self.ratio != self.target else two

    def to_dict(self) -> dict[str, Any]:
        return {"goal": self.text, "subject": self.subject, "reference": self.reference, "op": self.op,
                "target": self.target, "ratio": None if self.ratio is None else round(self.ratio, 4),
                "estimator": self.estimator, "pass": self.passed}


GOALS = [
    Goal("library /bin/true <= 0.8x bwrap", "sandbox_true", "bwrap_true", "<=", 0.8),
    Goal("library python -c pass <= 1.3x bare", "sandbox_py", "bare_py", "<=", 1.3),
    Goal("throughput >= 0.75x bare", "tput_run_many", "tput_bare", ">=", 0.75, paired=True),
    Goal("throughput >= 1.2x bwrap", "tput_run_many", "tput_bwrap", ">=", 1.2, paired=True),
    Goal("CLI /bin/true <= 2.5x bare python -c pass", "cli_true", "cli_bare_py", "<=", 2.5),
    # The same goal against the system's python3 (the "bare python3 -c pass"), which
    # starts a little faster than the venv's interpreter here.
    Goal("CLI /bin/true <= 2.5x system python3 -c pass", "cli_true", "cli_sys_py", "<=", 2.5),
    Goal("supervisor peak RSS spread <= 5 MiB", "rss_spread", None, "<=", 5.0),
    Goal("drain >= 1 GiB/s", "drain_rate", None, ">=", 1.0),
]

_LABELS = {g.text: lab for g, lab in zip(GOALS, ("library /bin/true vs bwrap", "library python vs bare",
                                                 "throughput vs bare", "throughput vs bwrap",
                                                 "CLI /bin/true vs python", "CLI vs system python3",
                                                 "supervisor RSS spread",
                                                 "drain rate"), strict=True)}


def _rotated(names: Sequence[str], i: int) -> list[str]:
    k = i % len(names)
    return [*names[k:], *names[:k]]


def _shell_text(argv: Sequence[str]) -> str:
    import shlex

    return shlex.join(argv)


# ---------------------------------------------------------------------------- latency


def run_ok(argv: Sequence[str], env: dict[str, str] | None = None) -> Callable[[], str | None]:
    def call() -> str | None:
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, env=env)
        return None if p.returncode == 0 else f"exit {p.returncode}: {p.stderr.decode(errors='replace')[-200:]}"

    return call


# The profile sandboxrun runs under (--profile): strict, or rootless for an unprivileged user on a
# host that delegates no cgroup. bwrap always runs with BWRAP_STRICT.
PROFILE = "strict"


def sandbox_ok(argv: list[str]) -> Callable[[], str | None]:
    def call() -> str | None:
        r = sandbox.run(argv, profile=PROFILE)
        return None if r.status == "ok" else f"{r.status}: {r.error or r.stderr[-200:]}"

    return call


def latency(cases: dict[str, tuple[str, Callable[[], str | None]]], mode: Mode, iterations: int) -> list[Case]:
    """Round-robin samples (ms) of each call; a case that fails during warm-up is dropped."""
    out = {name: Case(name, "ms", command=cmd) for name, (cmd, _) in cases.items()}
    live = []
    for name, (_, fn) in cases.items():
        for _ in range(mode.warmup):
            err = fn()
            if err:
                out[name].error = err
                break
        else:
            live.append(name)
    for i in range(iterations):
        for name in _rotated(live, i):
            t = time.perf_counter()
            err = cases[name][1]()
            out[name].samples.append((time.perf_counter() - t) * 1000)
            if err and out[name].error is None:
                out[name].error = err
    for c in out.values():
        if c.samples and c.error is None:
            c.value = statistics.median(c.samples)
    return list(out.values())


# ---------------------------------------------------------------------------- throughput


def load_programs(path: str | None, n: int, py: str) -> list[list[str]]:
    """argv of each program: N copies of a tiny one; or the programs of a JSONL file
    (optionally .gz) with {"code": "..."}, {"command": [...]} or HumanEval's fields
    (prompt + canonical_solution + test + check(entry_point)); or a dir of .py files."""
    if path is None:
        return [[py, "-c", PROGRAM] for _ in range(n)]
    p = Path(path)
    codes: list[list[str]] = []
    if p.is_dir():
        codes = [[py, "-c", f.read_text()] for f in sorted(p.glob("*.py"))]
    else:
        import gzip

        text = gzip.decompress(p.read_bytes()).decode() if p.suffix == ".gz" else p.read_text()
        for line in text.splitlines():
            if not line.strip():
                continue
            d = json.loads(line)
            if "command" in d:
                codes.append(list(d["command"]))
            elif "code" in d:
                codes.append([py, "-c", d["code"]])
            else:  # HumanEval
                code = d["prompt"] + d["canonical_solution"] + "\n" + d["test"] + f"\ncheck({d['entry_point']})\n"
                codes.append([py, "-c", code])
    if not codes:
        raise SystemExit(f"bench: no programs in {path}")
    return codes


def _bare_pool(argvs: list[list[str]], workers: int) -> int:
    def one(a: list[str]) -> bool:
        return subprocess.run(a, stdin=subprocess.DEVNULL, capture_output=True, timeout=60).returncode == 0

    with ThreadPoolExecutor(workers) as ex:
        return sum(ex.map(one, argvs))


def _run_many(argvs: list[list[str]], workers: int) -> int:
    return sum(r.success for r in sandbox.run_many(({"command": a} for a in argvs), concurrency=workers,
                                                   profile=PROFILE))


def _cli_batch(jsonl: str, workers: int, cli: list[str], env: dict[str, str]) -> int:
    p = subprocess.run([*cli, "batch", jsonl, "--concurrency", str(workers), "--profile", PROFILE], capture_output=True,
                       timeout=3600, env=env)
    return sum(json.loads(line).get("success", False) for line in p.stdout.splitlines() if line.strip())


def _cli_each(argvs: list[list[str]], workers: int, cli: list[str], env: dict[str, str]) -> int:
    """One `sandboxrun` process per program: what a caller pays that shells out per snippet."""
    def one(a: list[str]) -> bool:
        return subprocess.run([*cli, "--profile", PROFILE, "--", *a], stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=60, env=env).returncode == 0

    with ThreadPoolExecutor(workers) as ex:
        return sum(ex.map(one, argvs))


def _host_busy_s() -> float:
    """CPU seconds the whole host has spent busy (not idle or waiting for I/O), from /proc/stat:
    the sandbox's cost includes kernel threads (namespace and cgroup teardown) and the supervisor."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _quiesce(limit_s: float = 5.0) -> None:
    """Until the host is idle (under 5% busy over 100 ms), at most `limit_s`: the kernel tears
    namespaces and cgroups down in worker threads after their runs have returned, and one
    mode's backlog must not be charged to the next."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        busy, t = _host_busy_s(), time.monotonic()
        time.sleep(0.1)
        if (_host_busy_s() - busy) / (time.monotonic() - t) / (os.cpu_count() or 1) < 0.05:
            return


def throughput(argvs: list[list[str]], mode: Mode, workers: int, cli: list[str], bwrap: str | None,
               expected_ok: int, cli_env: dict[str, str]) -> list[Case]:
    bw = [[bwrap, *BWRAP_STRICT, *a] for a in argvs] if bwrap else []
    with tempfile.NamedTemporaryFile("w", prefix="sandboxrun-bench-", suffix=".jsonl", delete=False) as f:
        for a in argvs:
            f.write(json.dumps({"command": a}) + "\n")
    try:
        modes: dict[str, tuple[str, Callable[[], int]]] = {
            "tput_bare": ("ThreadPoolExecutor + subprocess.run", lambda: _bare_pool(argvs, workers)),
            "tput_run_many": ("sandbox.run_many", lambda: _run_many(argvs, workers)),
            "tput_cli_batch": ("sandboxrun batch FILE.jsonl", lambda: _cli_batch(f.name, workers, cli, cli_env)),
            "tput_cli_each": ("a `sandboxrun -- PROGRAM` process per program", lambda: _cli_each(argvs, workers, cli, cli_env)),
        }
        if bwrap:
            modes["tput_bwrap"] = ("ThreadPoolExecutor + subprocess.run(bwrap strict)", lambda: _bare_pool(bw, workers))
        out = {name: Case(name, "/s", command=f"{cmd}, {len(argvs)} programs, concurrency {workers}")
               for name, (cmd, _) in modes.items()}
        cpu = {name: Case("cpu_" + name.removeprefix("tput_"), "ms",
                          command=f"host CPU per program during {name} (all processes and kernel threads)")
               for name in modes}
        _run_many(argvs[: workers * 2], workers)  # warm: fork server, page cache
        for r in range(mode.rounds):
            for name in _rotated(list(modes), r):
                _quiesce(mode.quiet_s)
                t, busy = time.perf_counter(), _host_busy_s()
                ok = modes[name][1]()
                rate = len(argvs) / (time.perf_counter() - t)
                out[name].samples.append(rate)
                cpu[name].samples.append(1000 * (_host_busy_s() - busy) / len(argvs))
                if ok != expected_ok and out[name].error is None:
                    out[name].error = f"{ok} of {len(argvs)} programs succeeded (bare: {expected_ok})"
        for c in (*out.values(), *cpu.values()):
            c.value = statistics.median(c.samples)
        return [*out.values(), *cpu.values()]
    finally:
        os.unlink(f.name)


def cost_note(cases: dict[str, Case], cpus: int | None = None) -> str | None:
    """What the throughput cases' host CPU per program says about programs of other lengths.
    At concurrency = CPUs every CPU is busy, so a way of running a program costs its CPU
    bare (P ms, launch included) plus that way's overhead: against bwrap the ratio is about
    (P + bwrap's) / (P + ours), so the 1.2x goal holds up to some P and not beyond. That
    model leaves out the CPUs a mode leaves idle (its hand-offs), so each mode's busy share
    is named too: rate x CPU per program / CPUs."""
    vals = {k: cases[k].value for k in ("cpu_bare", "cpu_run_many", "cpu_bwrap") if k in cases}
    if len(vals) < 3 or any(v is None for v in vals.values()):
        return None
    bare, ours, bw = vals["cpu_bare"], vals["cpu_run_many"], vals["cpu_bwrap"]
    a, b = ours - bare, bw - bare  # type: ignore[operator]
    line = (f"host CPU per program over bare: run_many +{a:.2f} ms, bwrap +{b:.2f} ms; so for programs of P ms "
            f"bare the throughput ratio to bwrap is about (P + {b:.2f}) / (P + {a:.2f}): ")
    reach = (b - 1.2 * a) / 0.2
    if reach <= 0:
        line += "under 1.2x for every P"
    else:
        line += f">= 1.2x up to P = {reach:.1f} ms"
    line += (f" (these programs: {bare:.1f} ms; 1.2x bwrap for them would need run_many at "
             f"+{(bare + b) / 1.2 - bare:.2f} ms, the CPUs as busy)")
    busy = []
    for mode in ("bare", "run_many", "bwrap"):
        rate = cases[f"tput_{mode}"].value if f"tput_{mode}" in cases else None
        if not rate:
            return line
        busy.append(f"{mode} {rate * vals['cpu_' + mode] / 10 / (cpus or os.cpu_count() or 1):.0f}%")  # type: ignore[operator]
    return line + f"; CPUs busy: {', '.join(busy)}"


def round_ratios(cases: dict[str, Case]) -> str | None:
    """run_many's rate over bare's and bwrap's round by round (each round runs every mode
    back to back), their median (what the throughput goals judge) and the medians' ratio."""
    ours = cases.get("tput_run_many")
    if ours is None or len(ours.samples) < 2:
        return None
    parts = []
    for ref in ("tput_bare", "tput_bwrap"):
        other = cases.get(ref)
        if other is not None and len(other.samples) == len(ours.samples) and all(other.samples):
            each = [a / b for a, b in zip(ours.samples, other.samples, strict=True)]
            of_medians = f"; ratio of medians {ours.value / other.value:.2f}" if ours.value and other.value else ""
            parts.append(f"run_many/{ref.removeprefix('tput_')} {' '.join(f'{x:.2f}' for x in each)} "
                         f"(median {statistics.median(each):.3f}{of_medians})")
    return f"throughput round by round: {'; '.join(parts)}" if parts else None


# ---------------------------------------------------------------------------- memory

_DRAIN = """
import json, resource, sys, time
sys.path.insert(0, sys.argv[2])
import sandbox
n, profile = int(sys.argv[1]), sys.argv[3]
sandbox.run(["/bin/true"], profile=profile)
t = time.perf_counter()
r = sandbox.run(["head", "-c", str(n), "/dev/zero"], timeout=600, profile=profile)
d = time.perf_counter() - t
print(json.dumps({"status": r.status, "bytes": r.stdout_bytes, "seconds": d,
                  "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def drain(sizes: Sequence[int]) -> list[Case]:
    """Peak RSS of a fresh supervisor per size, and the drain rate between the two largest
    sizes (extra bytes / extra seconds: the set-up cost cancels out)."""
    cases = []
    runs: list[tuple[int, float, float]] = []  # (bytes, seconds, peak MiB)
    for n in sizes:
        c = Case(f"rss_{n // MiB}MiB", "MiB", command=f"sandbox.run(['head', '-c', '{n}', '/dev/zero'])")
        p = subprocess.run([sys.executable, "-c", _DRAIN, str(n), str(ROOT), PROFILE], capture_output=True, timeout=900)
        try:
            d = json.loads(p.stdout)
        except json.JSONDecodeError:
            c.error = p.stderr.decode(errors="replace")[-300:] or f"exit {p.returncode}"
            cases.append(c)
            continue
        if d["status"] != "ok" or d["bytes"] != n:
            c.error = f"status {d['status']}, {d['bytes']} of {n} bytes"
        c.value = d["maxrss_kib"] / 1024
        c.samples = [c.value]
        runs.append((n, d["seconds"], c.value))
        cases.append(c)
    complete = len(runs) == len(sizes) and not any(c.error for c in cases)
    rss = [r[2] for r in runs]
    spread = Case("rss_spread", "MiB", value=max(rss) - min(rss) if complete else None,
                  command=f"max - min peak RSS over {', '.join(f'{s // MiB} MiB' for s in sizes)}")
    out = [*cases, spread]
    if complete and len(runs) >= 2:
        (n1, t1, _), (n2, t2, _) = runs[-2], runs[-1]
        out.append(Case("drain_rate", "GiB/s", value=(n2 - n1) / max(t2 - t1, 1e-9) / (1024 * MiB),
                        samples=[t1, t2], command=f"({n2 // MiB} - {n1 // MiB}) MiB / (t{n2 // MiB} - t{n1 // MiB})"))
        out.append(Case("drain_whole_run", "GiB/s", value=n2 / t2 / (1024 * MiB), samples=[t2],
                        command=f"{n2 // MiB} MiB / whole run, set-up included"))
    return out


# ---------------------------------------------------------------------------- report


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "ms":
        return f"{v:.2f} ms"
    if unit == "/s":
        return f"{v:.1f}/s"
    if unit == "GiB/s":
        return f"{v:.2f} GiB/s"
    return f"{v:.1f} {unit}"


def table(cases: dict[str, Case], goals: list[Goal]) -> str:
    rows = [("case", "median", "command")]
    for c in cases.values():
        rows.append((c.name, _fmt(c.value, c.unit) if not c.error else f"FAILED ({c.error[:60]})", c.command[:90]))
    w = [max(len(r[i]) for r in rows) for i in range(2)]
    lines = [f"{r[0]:<{w[0]}}  {r[1]:>{w[1]}}  {r[2]}" for r in rows]
    lines.insert(1, "-" * (w[0] + w[1] + 40))
    grows = [("goal", "ratio", "target", "result")]
    for g in goals:
        ratio = "-" if g.ratio is None else g.ratio_text() + ("" if g.reference is None else "x")
        res = "n/a" if g.passed is None else ("pass" if g.passed else "FAIL")
        grows.append((g.text, ratio, f"{g.op} {g.target:g}", res))
    gw = [max(len(r[i]) for r in grows) for i in range(4)]
    lines += ["", *(f"{r[0]:<{gw[0]}}  {r[1]:>{gw[1]}}  {r[2]:<{gw[2]}}  {r[3]}" for r in grows)]
    lines.insert(len(lines) - len(goals), "-" * (sum(gw) + 6))
    paired = _paired_note(goals)
    return "\n".join([*lines, *([paired] if paired else [])])


def _paired_note(goals: list[Goal]) -> str | None:
    names = [g.text for g in goals if g.estimator == PAIRED]
    if not names:
        return None
    return (f"({' and '.join(names)}: the median of the rounds' own ratios, each round running the modes back "
            "to back)")


def markdown(cases: dict[str, Case], goals: list[Goal], meta: dict[str, Any]) -> str:
    """The same two tables in Markdown, for the README."""
    out = [f"{meta['cpus']} CPUs, kernel {meta['kernel']}, {meta['bwrap'] or 'no bwrap'}, programs run with "
           f"{meta['python_programs_version']}, commit {meta['commit']}, {meta['date']}, mode {meta['mode']}"
           f"{', profile ' + meta['profile'] if meta.get('profile', 'strict') != 'strict' else ''}.", "",
           "| case | median | what |", "|---|---:|---|"]
    for c in cases.values():
        val = _fmt(c.value, c.unit) if not c.error else f"failed: {c.error[:60]}"
        out.append(f"| `{c.name}` | {val} | {c.command.replace('|', '/')} |")
    out += ["", "| goal | measured | target | result |", "|---|---:|---:|---|"]
    for g in goals:
        unit = "x" if g.reference else ""
        ratio = "-" if g.ratio is None else f"{g.ratio_text()}{unit}"
        res = "n/a" if g.passed is None else ("**pass**" if g.passed else "**fail**")
        out.append(f"| {g.text} | {ratio} | {g.op.replace('<=', '≤').replace('>=', '≥')} {g.target:g}{unit} | {res} |")
    paired = _paired_note(goals)
    if paired:
        out += ["", paired]
    for key in ("cost_note", "round_ratios"):
        if meta.get(key):
            out += ["", meta[key][0].upper() + meta[key][1:] + "."]
    return "\n".join(out) + "\n"


def chart(path: str, cases: dict[str, Case], goals: list[Goal], meta: dict[str, Any]) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (.venv/bin/pip install matplotlib, or the [bench] extra): no chart"
    v = {k: (c.value if c.value is not None and not c.error else 0.0) for k, c in cases.items()}
    colors = {"bare": "#8c8c8c", "bwrap": "#d9822b", "sandboxrun": "#2b6cb0", "batch CLI": "#5a9bd5",
              "CLI each": "#a3c4e8"}
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8), gridspec_kw={"width_ratios": [1, 1, 1.3]})
    ax = axes[0]
    groups = [("/bin/true", "true"), ("python -c pass", "py")]
    for gi, (_label, key) in enumerate(groups):
        for j, (who, pre) in enumerate((("bare", "bare"), ("bwrap", "bwrap"), ("sandboxrun", "sandbox"))):
            val = v.get(f"{pre}_{key}", 0.0)
            ax.bar(gi + (j - 1) * 0.27, val, 0.25, color=colors[who], label=who if gi == 0 else None)
            ax.text(gi + (j - 1) * 0.27, val, f"{val:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(groups)), [g[0] for g in groups])
    ax.set_ylabel("median ms per run (lower is better)")
    ax.set_title("start-up latency, library call")
    ax.legend(fontsize=8)
    ax = axes[1]
    names = [("bare", "tput_bare"), ("bwrap", "tput_bwrap"), ("sandboxrun", "tput_run_many"),
             ("batch CLI", "tput_cli_batch"), ("CLI each", "tput_cli_each")]
    for j, (who, key) in enumerate(names):
        ax.bar(j, v.get(key, 0.0), color=colors[who])
        ax.text(j, v.get(key, 0.0), f"{v.get(key, 0.0):.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), ["bare", "bwrap", "run_many", "batch CLI", "CLI each"], fontsize=8)
    ax.set_ylabel("programs per second (higher is better)")
    ax.set_title(f"throughput, concurrency {meta['cpus']}")
    ax = axes[2]
    # One scale for every goal: share of the allowance used (ratio / target for "<=",
    # target / ratio for ">="), so a bar left of 1.0 passes.
    shown = [g for g in goals if g.ratio is not None]
    for i, g in enumerate(shown):
        score = g.ratio / g.target if g.op == "<=" else (g.target / g.ratio if g.ratio else float("inf"))
        ax.barh(i, min(max(score, 0.02), 3.0), color="#2f855a" if g.passed else "#c53030")
        unit = "x" if g.reference else ""
        ax.text(min(score, 3.0), i, f" {g.ratio_text()}{unit} (goal {g.op} {g.target:g}{unit})", va="center",
                fontsize=7)
    ax.axvline(1.0, color="black", lw=1.5)
    ax.set_xlim(0, 4.2)
    ax.set_yticks(range(len(shown)), [_LABELS.get(g.text, g.text) for g in shown], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("measured / goal (left of 1.0 passes; capped at 3)")
    ax.set_title("goals")
    fig.suptitle(f"sandboxrun bench ({meta['mode']}): {meta['cpus']} CPUs, kernel {meta['kernel']}, "
                 f"{meta['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# ---------------------------------------------------------------------------- main


def editable_finders(python: str) -> list[str]:
    """Import hooks of default-mode editable installs that `python` runs at every start (~20 ms
    here): they would make `python -c pass`, the CLI's baseline, look slower than an installed
    package's interpreter, and flatter the CLI ratio. `scripts/setup.sh` installs without them."""
    code = ("import glob, os, sysconfig; print('\\n'.join(glob.glob(os.path.join("
            "sysconfig.get_paths()['purelib'], '__editable___*finder.py'))))")
    try:
        p = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return [os.path.basename(line) for line in p.stdout.splitlines() if line]


def _cli_argv() -> list[str]:
    exe = Path(sys.executable).parent / "sandboxrun"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "sandbox"]


def _meta(mode: str, py: str, bwrap: str | None) -> dict[str, Any]:
    def out(argv: list[str]) -> str:
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=10)
            return (p.stdout or p.stderr).strip().splitlines()[0] if (p.stdout or p.stderr) else ""
        except (OSError, subprocess.SubprocessError):
            return ""

    return {
        "mode": mode, "cpus": os.cpu_count(), "kernel": platform.release(), "machine": platform.machine(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "python_bench": sys.version.split()[0],
        "python_programs": py, "python_programs_version": out([py, "-V"]),
        "bwrap": out([bwrap, "--version"]) if bwrap else None, "sandboxrun": sandbox.__version__,
        "commit": out(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"])
        + ("+dirty" if out(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"]) else ""),
        "argv": sys.argv,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer samples (a minute or so on 2 cores)")
    ap.add_argument("--smoke", action="store_true", help="2 samples per case: proves the script works")
    ap.add_argument("--iterations", type=int, help="latency samples per case (overrides the mode)")
    ap.add_argument("--programs", help="throughput programs: JSONL[.gz] ({\"code\"}, {\"command\"} or HumanEval's) "
                    "or a directory of .py files (default: N copies of a tiny one)")
    ap.add_argument("--python", default="/usr/bin/python3", help="interpreter for the Python cases")
    ap.add_argument("--concurrency", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--profile", default="strict",
                    help="sandboxrun's profile (default strict; an unprivileged user without a delegated "
                         "cgroup: rootless)")
    ap.add_argument("--only", help="comma list of groups to run: latency, cli, throughput, memory (default: all)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--png", help="draw the chart here (needs matplotlib)")
    ap.add_argument("--md", help="write the tables here in Markdown")
    ns = ap.parse_args(argv)
    groups = {"latency", "cli", "throughput", "memory"}
    only = set(ns.only.split(",")) if ns.only else groups
    if only - groups:
        ap.error(f"--only: unknown group {', '.join(sorted(only - groups))} (groups: {', '.join(sorted(groups))})")
    global PROFILE
    try:
        sandbox.load_profile(ns.profile)
    except sandbox.SandboxError as e:
        ap.error(f"--profile: {e}")
    PROFILE = ns.profile
    mode_name = "smoke" if ns.smoke else "quick" if ns.quick else "full"
    mode = MODES[mode_name]
    iterations = ns.iterations or mode.iterations
    py = shutil.which(ns.python) or ns.python
    bwrap = shutil.which("bwrap")
    meta = _meta(mode_name, py, bwrap)
    meta["profile"] = PROFILE
    started = time.perf_counter()
    cases: dict[str, Case] = {}

    def add(cs: list[Case]) -> None:
        for c in cs:
            cases[c.name] = c
            print(f"  {c.name:<16} {_fmt(c.value, c.unit) if not c.error else 'FAILED: ' + c.error[:100]}",
                  file=sys.stderr, flush=True)

    print(f"bench ({mode_name}): {meta['cpus']} CPUs, programs run with {meta['python_programs_version']}",
          file=sys.stderr)
    true, pypass = ["/bin/true"], [py, "-c", "pass"]
    lat: dict[str, tuple[str, Callable[[], str | None]]] = {
        "bare_true": ("subprocess.run(['/bin/true'])", run_ok(true)),
        "sandbox_true": (f"sandbox.run(['/bin/true']) {PROFILE}", sandbox_ok(true)),
        "bare_py": (f"subprocess.run({pypass})", run_ok(pypass)),
        "sandbox_py": (f"sandbox.run({pypass}) {PROFILE}", sandbox_ok(pypass)),
    }
    if bwrap:
        lat["bwrap_true"] = ("subprocess.run(bwrap strict /bin/true)", run_ok([bwrap, *BWRAP_STRICT, *true]))
        lat["bwrap_py"] = ("subprocess.run(bwrap strict python -c pass)", run_ok([bwrap, *BWRAP_STRICT, *pypass]))
    for tool, args in (("nsjail", ["-Mo", "--quiet", "--chroot", "/", "--"]),
                       ("firejail", ["--quiet", "--noprofile", "--private", "--net=none"])):
        exe = shutil.which(tool)
        if exe:
            lat[f"{tool}_true"] = (f"subprocess.run({tool} /bin/true)", run_ok([exe, *args, *true]))
        else:
            meta[tool] = "not installed"
    if "latency" in only:
        print("latency ...", file=sys.stderr, flush=True)
        add(latency(lat, mode, iterations))

    cli = _cli_argv()
    # An installed package has its bytecode compiled; a dev shell with
    # PYTHONDONTWRITEBYTECODE=1 would recompile every edited module on each start.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    meta["cli_env"] = "PYTHONDONTWRITEBYTECODE unset for every CLI case (bytecode cached, as in an install)"
    if "cli" in only:
        print("CLI ...", file=sys.stderr, flush=True)
        finders = editable_finders(sys.executable)
        meta["cli_baseline_finders"] = finders
        if finders:
            print(f"bench: {sys.executable} imports {', '.join(finders)} at every start (a default-mode "
                  "editable install): the CLI's baseline is inflated; rerun ./scripts/setup.sh", file=sys.stderr)
        add(latency({
            "cli_true": (_shell_text([*cli, "--profile", PROFILE, "--", "/bin/true"]),
                         run_ok([*cli, "--profile", PROFILE, "--", "/bin/true"], env)),
            "cli_bare_py": (_shell_text([sys.executable, "-c", "pass"]), run_ok([sys.executable, "-c", "pass"], env)),
            "cli_sys_py": (_shell_text(pypass), run_ok(pypass, env)),
        }, mode, ns.iterations or mode.cli_iterations))

    if "throughput" in only:
        print("throughput ...", file=sys.stderr, flush=True)
        argvs = load_programs(ns.programs, mode.programs, py)
        expected = _bare_pool(argvs, ns.concurrency)  # programs that succeed bare; warms the page cache
        add(throughput(argvs, mode, ns.concurrency, cli, bwrap, expected, env))
        meta["programs"] = {"count": len(argvs), "source": ns.programs or PROGRAM, "succeed_bare": expected}

    if "memory" in only:
        print("supervisor memory and drain ...", file=sys.stderr, flush=True)
        add(drain(mode.drain_sizes))

    for g in GOALS:
        g.judge(cases)
    meta["seconds"] = round(time.perf_counter() - started, 1)
    note = cost_note(cases)
    if note:
        meta["cost_note"] = note
    rounds = round_ratios(cases)
    if rounds:
        meta["round_ratios"] = rounds
    print()
    print(table(cases, GOALS))
    for line in (note, rounds):
        if line:
            print(f"\n{line}")
    print(f"\n{meta['cpus']} CPUs, {meta['seconds']} s, mode {mode_name}, profile {PROFILE}, {iterations} samples per "
          "latency case")
    if ns.json:
        doc = {"meta": meta, "cases": [c.to_dict() for c in cases.values()], "goals": [g.to_dict() for g in GOALS]}
        Path(ns.json).write_text(json.dumps(doc, indent=2) + "\n")
    if ns.md:
        Path(ns.md).write_text(markdown(cases, GOALS, meta))
    if ns.png:
        note = chart(ns.png, cases, GOALS, meta)
        if note:
            print(f"bench: {note}", file=sys.stderr)
    failed = [c.name for c in cases.values() if c.error]
    if failed:
        print(f"bench: cases that failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
