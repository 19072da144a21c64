"""`sandboxrun doctor`: which isolation layers work on this host, and why not.

A `--version`-style check passes on hosts where every real run then fails (Ubuntu's
AppArmor lets a user namespace be created and then denies its mounts; Docker's
seccomp profile denies unshare). So every layer is probed by running a real trivial
sandbox (`/bin/true`) with a profile that turns that one layer on over a minimal
base, through the same code path as any run; then each built-in profile is run as
shipped. A failing layer is reported with the step and errno the child reported and
the likely cause, read from the host where it is visible (sysctls, this process's
own seccomp filter, container markers, LSMs).

Library: `diagnose()` returns the report as a dict; `likely_cause(step, errno)`
names the probable reason for one setup error. CLI: exit 0 when `strict` can run
here, 1 otherwise.
"""

from __future__ import annotations

import errno as E
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from . import __version__
from . import record as records
from .profile import Profile, builtin_names, load

# ---------------------------------------------------------------------------- host facts


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _status_field(name: str) -> str | None:
    for line in (_read("/proc/self/status") or "").splitlines():
        key, _, value = line.partition(":")
        if key == name:
            return value.strip()
    return None


def _container() -> str | None:
    if os.path.exists("/.dockerenv"):
        return "docker"
    if os.path.exists("/run/.containerenv"):
        return "podman"
    env = _read("/proc/1/environ") or ""
    for part in env.split("\0"):
        if part.startswith("container="):
            return part.split("=", 1)[1] or "container"
    cg = _read("/proc/1/cgroup") or ""
    for word in ("docker", "kubepods", "containerd", "libpod", "lxc"):
        if word in cg:
            return word
    return None


def host_facts() -> dict[str, Any]:
    """What the host says about itself: the inputs to `likely_cause`."""
    sysctls = {}
    for name, path in (("kernel.unprivileged_userns_clone", "/proc/sys/kernel/unprivileged_userns_clone"),
                       ("user.max_user_namespaces", "/proc/sys/user/max_user_namespaces"),
                       ("kernel.apparmor_restrict_unprivileged_userns",
                        "/proc/sys/kernel/apparmor_restrict_unprivileged_userns"),
                       ("kernel.seccomp.actions_avail", "/proc/sys/kernel/seccomp/actions_avail")):
        value = _read(path)
        if value is not None:
            sysctls[name] = value
    from .isolation.cgroups import caller_uid

    cap_eff = int(_status_field("CapEff") or "0", 16)
    lsm = _read("/sys/kernel/security/lsm")
    uid = caller_uid()  # not 0 merely because this process entered a user namespace of its own
    return {
        "kernel": os.uname().release,
        "machine": os.uname().machine,
        "uid": uid,
        "rootless": uid != 0,
        "cap_sys_admin": bool(cap_eff & (1 << 21)),
        "seccomp_mode": int(_status_field("Seccomp") or "0"),  # 2: a filter is on us (a container's?)
        "no_new_privs": _status_field("NoNewPrivs") == "1",
        "container": _container(),
        "lsm": lsm.split(",") if lsm else None,
        "apparmor": _read("/sys/module/apparmor/parameters/enabled") == "Y",
        "sysctls": sysctls,
    }


# ---------------------------------------------------------------------------- causes

_USERNS_STEPS = ("user_namespace",)
_NS_STEPS = ("pid_namespace", "namespaces")


def _userns_cause(err: int, facts: dict[str, Any]) -> str:
    sc = facts["sysctls"]
    if sc.get("kernel.unprivileged_userns_clone") == "0":
        return ("kernel.unprivileged_userns_clone=0 forbids user namespaces to unprivileged users "
                "(sysctl -w kernel.unprivileged_userns_clone=1, or run as root)")
    if sc.get("user.max_user_namespaces") == "0" or err == E.ENOSPC:
        return ("user.max_user_namespaces is 0 or exhausted "
                f"(now {sc.get('user.max_user_namespaces', '?')}; sysctl -w user.max_user_namespaces=15000)")
    if sc.get("kernel.apparmor_restrict_unprivileged_userns") == "1":
        return ("AppArmor restricts unprivileged user namespaces "
                "(kernel.apparmor_restrict_unprivileged_userns=1, Ubuntu 23.10+): the namespace is created but "
                "loses its capabilities; add an AppArmor profile with `userns,` for this interpreter, or set the "
                "sysctl to 0")
    if facts["seccomp_mode"] == 2:
        return (f"a seccomp filter on this process denies unshare/clone with CLONE_NEWUSER"
                f"{' (the ' + facts['container'] + ' container runtime' + chr(39) + 's default profile?)' if facts['container'] else ''}"
                "; run the container with a profile that allows it, or use the `nested` profile")
    if facts["container"]:
        return f"the {facts['container']} container does not allow user namespaces; use the `nested` profile"
    return f"the kernel refused a user namespace ({E.errorcode.get(err, err)})"


def likely_cause(step: str, err: int, facts: dict[str, Any] | None = None) -> str:
    """The probable reason a setup step failed with this errno, on this host."""
    facts = facts if facts is not None else host_facts()
    step = step or ""
    code = E.errorcode.get(err, str(err))
    if step == _REFUSED:  # no sandbox was made: the error itself says why
        return ""
    if err == E.EMFILE:  # whatever step met it
        return ("too many open files: a run holds about 20 at once, above what the caller holds; raise the "
                "soft and hard RLIMIT_NOFILE (ulimit -n)")
    if err == E.ENFILE:
        return "the host's open file table is full (fs.file-max)"
    if step in _USERNS_STEPS:
        return _userns_cause(err, facts)
    if step in _NS_STEPS and err == E.EAGAIN:  # the fork into the new pid namespace, not the namespace
        return ("no process could be created: this user's RLIMIT_NPROC (ulimit -u), or the host's "
                "kernel.pid_max / kernel.threads-max, is reached")
    if step in _NS_STEPS and err == E.ENOSPC:
        return "a namespace count limit is reached (the user.max_*_namespaces sysctls, or nesting deeper than 32)"
    if step in _NS_STEPS:
        if facts["rootless"]:
            return _userns_cause(err, facts)
        if facts["seccomp_mode"] == 2:
            return ("a seccomp filter on this process denies unshare() (a container runtime's default profile, "
                    "e.g. Docker's); allow it, or use the `nested` profile")
        if not facts["cap_sys_admin"]:
            return "this root lacks CAP_SYS_ADMIN (an unprivileged container); use the `nested` profile"
        return f"the kernel refused the namespace ({code}); is it compiled in (CONFIG_*_NS)?"
    if step == "filesystem:chdir:workdir" and err in (E.EACCES, E.EPERM):
        return "the run's user cannot enter its working directory: its owner or mode keeps the run's uid out"
    if step == "filesystem:mount:open-sources" and err in (E.ENOENT, E.ELOOP, E.EINVAL):
        return "a bind source was removed or replaced after it was checked (a run whose workdir holds it can do that)"
    if step.startswith("filesystem") or step == "pivot_root":
        if facts["sysctls"].get("kernel.apparmor_restrict_unprivileged_userns") == "1" and facts["rootless"]:
            return _userns_cause(err, facts)
        if "proc" in step and err in (E.EPERM, E.EACCES):
            return ("mounting a fresh /proc was refused: the host /proc has masked or read-only submounts "
                    "(as in containers), or there is no pid namespace of our own")
        if facts["container"] and err in (E.EPERM, E.EACCES):
            return f"the {facts['container']} container forbids mounts (AppArmor/SELinux or missing CAP_SYS_ADMIN)"
        return f"a mount was refused ({code})"
    if step == "network":
        if facts["sysctls"].get("kernel.apparmor_restrict_unprivileged_userns") == "1":
            return _userns_cause(err, facts)
        return f"bringing up loopback in the new net namespace was refused ({code})"
    if step == "cgroup":
        if facts["rootless"]:
            return ("no cgroup is delegated to this user: cgroup v1 has no delegation, and on v2 the user's "
                    "cgroup must be delegated (systemd-run --user -p Delegate=yes --scope ...); "
                    "or use the `rootless` profile, which gives up cgroup limits")
        return f"no usable cgroup hierarchy with the memory and pids controllers ({code})"
    if step == "seccomp":
        return f"the kernel refused the seccomp filter ({code}); CONFIG_SECCOMP_FILTER?"
    if step == "landlock":
        if facts["lsm"] is not None and "landlock" not in facts["lsm"]:
            return "Landlock is not among the active LSMs (boot with lsm=...,landlock)"
        return f"Landlock is unavailable ({code}); kernel 5.13+ with CONFIG_SECURITY_LANDLOCK"
    if step == "identity":
        if facts["rootless"]:
            return "cannot switch identity without a user namespace (an unprivileged caller cannot setgroups/setuid)"
        return f"changing uid/gid was refused ({code})"
    if step == "rlimits":
        return f"a resource limit could not be set ({code}): a hard limit below the profile's?"
    return f"{step} failed ({code})" if err else ""  # no errno (a probe's own error says it): no guess


# ---------------------------------------------------------------------------- probes


def _probe_profiles(rootless: bool) -> dict[str, Profile]:
    """One profile per layer: a minimal base plus that layer."""
    strict = load("strict")
    # Rootless, uid separation itself needs a user namespace, and the core creates one only
    # when some namespace is asked for: the base carries the cheapest one (uts).
    base_ns: tuple[str, ...] = ("uts",) if rootless else ()
    base = records.replace(strict, name="doctor-base", namespaces=base_ns, view="host", network="host",
                               mounts=(), cgroup="off", seccomp="off", landlock="off", blocklist=False)

    def with_(name: str, **kw: Any) -> Profile:
        return records.replace(base, name=f"doctor-{name}", **kw)

    def ns(*extra: str) -> tuple[str, ...]:
        return tuple(dict.fromkeys(base_ns + extra))

    return {
        "base": base,
        "pid": with_("pid", namespaces=ns("pid")),
        "ipc": with_("ipc", namespaces=ns("ipc")),
        "uts": with_("uts", namespaces=ns("uts")),
        "cgroupns": with_("cgroupns", namespaces=ns("cgroup")),
        "net": with_("net", namespaces=ns("net"), network="none"),
        "mount": with_("mount", namespaces=ns("pid", "mount"), view="private", mounts=strict.mounts),
        "seccomp": with_("seccomp", seccomp="default"),
        "landlock": with_("landlock", landlock="required"),
        "cgroup": with_("cgroup", cgroup="required"),
    }


_REFUSED = "sandboxrun"  # a probe's "step" when run() refused it before any sandbox (its error says why)


def _run(prof: Profile) -> dict[str, Any]:
    from .supervisor import run

    try:
        r = run(["/bin/true"], profile=prof)
    except Exception as e:  # noqa: BLE001 - a probe that crashes is a finding, not a crash
        return {"status": "error", "step": _REFUSED, "errno": 0, "error": f"{type(e).__name__}: {e}"}
    return {"status": r.status, "step": r.error_step, "errno": r.error_errno or 0, "error": _without_cause(r.error),
            "isolation": r.isolation}


def _without_cause(error: str | None) -> str | None:
    """A run's error without the likely cause the supervisor added: the report gives its own,
    from what it read of the host, on a line of its own."""
    if error and error.endswith(")") and " (likely cause: " in error:
        return error[:error.rindex(" (likely cause: ")]
    return error


def _cgroup_detail() -> dict[str, Any]:
    """What cgroup hierarchies exist and which one a run would use (without running)."""
    from .isolation import cgroups

    out: dict[str, Any] = {"v1": {}, "v2": None, "backend": None, "error": None}
    try:
        mounts = cgroups._mountinfo()
    except OSError:
        mounts = []
    for point, fstype, opts in mounts:
        if fstype == "cgroup":
            for c in cgroups.V1_CONTROLLERS:
                if c in opts.split(","):
                    out["v1"].setdefault(c, {"path": point, "writable": os.access(point, os.W_OK)})
        elif out["v2"] is None:
            ctl = (_read(os.path.join(point, "cgroup.controllers")) or "").split()
            sub = (_read(os.path.join(point, "cgroup.subtree_control")) or "").split()
            out["v2"] = {"path": point, "controllers": ctl, "subtree_control": sub,
                         "writable": os.access(point, os.W_OK),
                         "usable": "memory" in ctl and "pids" in ctl}
    try:
        out["backend"] = cgroups.detect().version
    except OSError as e:
        out["error"] = str(e)
    return out


def _landlock_abi() -> int:
    try:
        from .isolation import landlock

        return int(landlock.abi_version())
    except (ImportError, OSError, AttributeError):
        return 0


def _row(layer: str, works: bool | None, detail: str = "", step: str | None = None, err: int = 0,
         cause: str | None = None) -> dict[str, Any]:
    return {"layer": layer, "works": works, "detail": detail, "step": step, "errno": err or None,
            "errno_name": E.errorcode.get(err) if err else None, "cause": cause}


def _layer_rows(res: dict[str, dict[str, Any]], facts: dict[str, Any], cg: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    rootless = facts["rootless"]

    def failed(r: dict[str, Any]) -> bool:
        return r["status"] != "ok"

    def fail_row(layer: str, r: dict[str, Any]) -> dict[str, Any]:
        return _row(layer, False, r["error"] or r["status"], r["step"], r["errno"],
                    likely_cause(r["step"] or "", r["errno"], facts))

    base = res["base"]
    userns_down = rootless and failed(base) and base["step"] == "user_namespace"
    if not rootless:
        sc = facts["sysctls"]
        notes = ", ".join(f"{k}={v}" for k, v in sc.items() if "userns" in k or "user_namespaces" in k)
        rows.append(_row("user namespace", None, "not needed as root (per-run host uids instead)"
                         + (f"; {notes}" if notes else "")))
    elif userns_down:
        rows.append(fail_row("user namespace", base))
    else:
        rows.append(_row("user namespace", not failed(base) or base["step"] not in _USERNS_STEPS,
                         "the fork side maps the caller to root in its own user namespace"))
    rows.append(fail_row("process", base) if failed(base) and not userns_down else
                _row("process", None if userns_down else True,
                     "needs a user namespace" if userns_down else
                     "session, pdeathsig, closed fds, no capabilities, no_new_privs, rlimits"))

    def layer(name: str, key: str, ok_detail: str, steps: tuple[str, ...] | None = None) -> None:
        r = res[key]
        if userns_down:
            rows.append(_row(name, None, "untested: needs a user namespace"))
        elif not failed(r):
            rows.append(_row(name, True, ok_detail))
        elif failed(base) and r["step"] == base["step"]:
            rows.append(_row(name, None, f"untested: the base probe fails at {base['step']}"))
        elif steps is None or any((r["step"] or "").startswith(s) for s in steps):
            rows.append(fail_row(name, r))
        elif r["step"] == _REFUSED:
            rows.append(_row(name, None, f"untested: the probe was refused before any sandbox: {r['error']}"))
        else:
            rows.append(_row(name, None, f"untested: the probe failed earlier, at {r['step']}"))

    layer("pid namespace", "pid", "the command is PID 1's child in its own pid namespace", _NS_STEPS)
    layer("ipc namespace", "ipc", "private SysV IPC and POSIX queues", _NS_STEPS)
    layer("uts namespace", "uts", "private hostname", ("namespaces", "hostname"))
    layer("cgroup namespace", "cgroupns", "own cgroup root in /proc/self/cgroup", _NS_STEPS)
    layer("net namespace", "net", "no interfaces but its own", _NS_STEPS)
    layer("loopback", "net", "lo up inside the net namespace", ("network",))
    layer("mount namespace", "mount", "private mount table", _NS_STEPS + ("filesystem:mount:private",))
    layer("filesystem view", "mount", "tmpfs root, read-only binds, rw workdir, /tmp, /dev",
          ("filesystem:mount:open", "filesystem:mount:root", "filesystem:mount:binds", "filesystem:mount:workdir",
           "filesystem:mount:tmp", "filesystem:mount:dev", "filesystem:mount:etc", "filesystem:chdir:workdir"))
    layer("/proc", "mount", "fresh procfs, knobs read-only", ("filesystem:mount:proc",))
    layer("pivot_root", "mount", "old root detached, / read-only", ("filesystem:pivot_root", "filesystem:mount:root-readonly"))
    layer("seccomp", "seccomp", "default policy: the kernel surface denied with EPERM, foreign ABIs killed", ("seccomp",))
    lr = res["landlock"]
    if not failed(lr):
        abi = lr["isolation"].landlock_abi or _landlock_abi()
        rows.append(_row("landlock", True, f"ABI {abi}: everything read-only but workdir, /tmp, /dev"))
    else:
        layer("landlock", "landlock", "", ("landlock",))
    cr = res["cgroup"]
    if not failed(cr):
        rows.append(_row("cgroup", True, f"{cr['isolation'].cgroup}: memory, pids, cpu limits; peak and OOM report"))
    else:
        layer("cgroup", "cgroup", "", ("cgroup",))
    v2 = cg["v2"]
    if v2 is None:
        rows.append(_row("cgroup v2", None, "not mounted"))
    else:
        works = True if cg["backend"] == "v2" else (None if v2["usable"] else False)
        rows.append(_row("cgroup v2", works,
                         f"{v2['path']}: controllers {' '.join(v2['controllers']) or 'none'}"
                         + ("" if v2["usable"] else " (no memory/pids: not usable for limits)")
                         + ("" if v2["writable"] else f"; not writable by uid {facts['uid']} (not delegated)")))
    if cg["v1"]:
        names = sorted(cg["v1"])
        unwritable = [c for c in names if not cg["v1"][c]["writable"]]
        works = True if cg["backend"] == "v1" else (False if "memory" in cg["v1"] else None)
        rows.append(_row("cgroup v1", works, "controllers " + " ".join(names)
                         + (f"; not writable by uid {facts['uid']} (v1 has no delegation)" if unwritable else "")))
    else:
        rows.append(_row("cgroup v1", None, "not mounted"))
    rl_detail = "cpu time, address space, file size, open files, processes, core 0"
    if not failed(base):
        rows.append(_row("rlimits", True, rl_detail))
    elif base["step"] == "rlimits":
        rows.append(fail_row("rlimits", base))
    else:
        rows.append(_row("rlimits", None, f"untested: the base probe fails at {base['step']}"))
    return rows


def diagnose(profiles: list[str] | None = None) -> dict[str, Any]:
    """Probe every layer and every built-in profile with real trivial runs."""
    from .supervisor import check_environment

    check_environment()  # a switch that means nothing is the caller's error, not every layer failing here
    started = time.monotonic()
    facts = host_facts()
    probes = _probe_profiles(facts["rootless"])
    names = profiles if profiles is not None else builtin_names()
    jobs: dict[str, Profile] = {f"layer:{k}": p for k, p in probes.items()}
    for n in names:
        jobs[f"profile:{n}"] = load(n)
    with ThreadPoolExecutor(max_workers=6) as ex:
        done = dict(zip(jobs, ex.map(_run, jobs.values()), strict=True))
    res = {k.split(":", 1)[1]: v for k, v in done.items() if k.startswith("layer:")}
    cg = _cgroup_detail()
    prof_rows = []
    for n in names:
        r = done[f"profile:{n}"]
        row: dict[str, Any] = {"profile": n, "runs": r["status"] == "ok"}
        if r["status"] != "ok":
            row.update(step=r["step"], errno=r["errno"] or None, error=r["error"] or r["status"],
                       cause=likely_cause(r["step"] or "", r["errno"], facts))
        else:
            iso = r["isolation"]
            row["isolation"] = {"namespaces": iso.namespaces, "cgroup": iso.cgroup, "seccomp": iso.seccomp,
                                "landlock_abi": iso.landlock_abi, "filesystem": iso.filesystem}
        prof_rows.append(row)
    strict_ok = any(r["profile"] == "strict" and r["runs"] for r in prof_rows)
    from . import native

    why = native.unavailable()
    return {
        "native_stage": {"used": why is None, "path": native.stage_path() if why is None else None, "why_not": why},
        "version": __version__,
        "host": facts,
        "cgroup": cg,
        "layers": _layer_rows(res, facts, cg),
        "profiles": prof_rows,
        "strict": strict_ok,
        "duration_ms": round((time.monotonic() - started) * 1000, 1),
    }


# ---------------------------------------------------------------------------- CLI


def _mark(works: bool | None) -> str:
    return {True: "yes", False: "NO", None: "-"}[works]


def format_report(rep: dict[str, Any]) -> str:
    h = rep["host"]
    who = "root" if not h["rootless"] else f"uid {h['uid']} (rootless)"
    lines = [f"sandboxrun {rep['version']} doctor: Linux {h['kernel']} {h['machine']}, {who}"
             + (f", in a {h['container']} container" if h["container"] else "")
             + (", under a seccomp filter" if h["seccomp_mode"] == 2 else ""), ""]
    width = max(len(r["layer"]) for r in rep["layers"])
    lines.append(f"{'LAYER':<{width}}  WORKS  DETAIL")
    for r in rep["layers"]:
        detail = r["detail"]
        if r["works"] is False and r["step"]:
            detail = f"[{r['errno_name'] or r['step']}] {detail}"
        lines.append(f"{r['layer']:<{width}}  {_mark(r['works']):<5}  {detail}")
        if r["cause"]:
            lines.append(f"{'':<{width}}         likely cause: {r['cause']}")
    ns = rep.get("native_stage") or {}
    lines += ["", "child setup: " + ("native stage " + str(ns.get("path")) if ns.get("used")
                                     else f"Python child ({ns.get('why_not')})")]
    lines += ["", "PROFILE     RUNS HERE"]
    for p in rep["profiles"]:
        if p["runs"]:
            lines.append(f"{p['profile']:<10}  yes")
        else:
            lines.append(f"{p['profile']:<10}  NO   {p['error']}")
            if p["cause"]:
                lines.append(f"{'':<10}       likely cause: {p['cause']}")
    lines.append("")
    lines.append("strict runs here." if rep["strict"] else
                 "strict cannot run here: use a profile marked yes above, or fix the cause.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from .cliargs import Parser

    p = Parser(prog="sandboxrun doctor",
                                description="Probe each isolation layer with a real trivial sandbox and say "
                                            "which profiles can run here. Exit 0 when strict can.")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    ns = p.parse_args(sys.argv[1:] if argv is None else argv)
    rep = diagnose()
    print(json.dumps(rep, indent=2, default=str) if ns.json else format_report(rep))
    return 0 if rep["strict"] else 1
