"""First-line command filter: table-driven positives/negatives, allowlist, extras, and property tests
that it never raises and never hangs on adversarial input."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandbox.errors import ProfileError
from sandbox.filter import MAX_COMMAND_LEN, MAX_TOKENS, Verdict, check, pattern_problem
from sandbox.profile import load

BLOCKED: list[tuple[str, str]] = [
    # rm-root: any flag spelling/order, quoting, wrappers, chaining
    ("rm -rf /", "rm-root"),
    ("rm -rf /*", "rm-root"),
    ("rm -fr /", "rm-root"),
    ("rm -Rf /", "rm-root"),
    ("rm -r -f /", "rm-root"),
    ("rm -r /", "rm-root"),
    ("rm --recursive --force /", "rm-root"),
    ("rm -rf --no-preserve-root /", "rm-root"),
    ("rm --no-preserve-root -rf /", "rm-root"),
    ("rm -rf -- /", "rm-root"),
    ("rm -rf //", "rm-root"),
    ("rm -rf / tmp", "rm-root"),
    ("rm -rf /*/", "rm-root"),
    ("rm\t-rf\t/", "rm-root"),
    ("rm -rf '/'", "rm-root"),
    ('rm -rf "/*"', "rm-root"),
    (shlex.join(["rm", "-rf", "/*"]), "rm-root"),
    ("/bin/rm -rf /", "rm-root"),
    ("sudo rm -rf /", "rm-root"),
    ("sudo -u root rm -rf /", "rm-root"),
    ("ls; rm -rf /", "rm-root"),
    ("make && rm -rf /*", "rm-root"),
    ("false || rm -rf /", "rm-root"),
    ("echo | rm -rf /", "rm-root"),
    ("echo $(rm -rf /)", "rm-root"),
    ("echo `rm -rf /`", "rm-root"),
    ("sh -c 'rm -rf /'", "rm-root"),
    (shlex.join(["bash", "-lc", "cd /tmp && rm -rf /"]), "rm-root"),
    ("sudo sh -c \"bash -c 'rm -rf /'\"", "rm-root"),
    # mkfs
    ("mkfs /dev/sda1", "mkfs"),
    ("mkfs.ext4 /dev/sda1", "mkfs"),
    ("mkfs -t xfs /dev/nvme0n1p1", "mkfs"),
    ("/sbin/mkfs.vfat /dev/sdb", "mkfs"),
    ("mke2fs /dev/sdb", "mkfs"),
    ("echo \"$(mkfs.ext4 /dev/sda)\"", "mkfs"),
    # dd / redirects to block devices
    ("dd if=/dev/zero of=/dev/sda bs=1M", "dd-blockdev"),
    ("dd if=image.iso of=/dev/nvme0n1", "dd-blockdev"),
    ("dd of=/dev/vdb if=/dev/urandom", "dd-blockdev"),
    ("dd if=/dev/zero of=/dev/hda", "dd-blockdev"),
    ("echo x > /dev/sda", "redirect-blockdev"),
    ("cat img >/dev/sdb1", "redirect-blockdev"),
    ("cat img >> /dev/nvme0n1", "redirect-blockdev"),
    ("cat img 1>/dev/vda", "redirect-blockdev"),
    ("> /dev/sda", "redirect-blockdev"),
    # chmod / chown
    ("chmod -R 777 /", "chmod-root"),
    ("chmod 777 -R /", "chmod-root"),
    ("chmod --recursive 777 /", "chmod-root"),
    ("sudo chmod -Rv 000 /*", "chmod-root"),
    ("chown -R nobody /", "chown-root"),
    # fork bomb, whitespace-tolerant, anywhere (it is usually wrapped in sh -c)
    (":(){ :|:& };:", "fork-bomb"),
    (":(){:|:&};:", "fork-bomb"),
    (": ( ) { : | : & } ; :", "fork-bomb"),
    ("bomb() { bomb | bomb & }; bomb", "fork-bomb"),
    ("sh -c ':(){ :|:& };:'", "fork-bomb"),
    # power
    ("shutdown -h now", "shutdown"),
    ("reboot", "shutdown"),
    ("halt", "shutdown"),
    ("poweroff", "shutdown"),
    ("/sbin/reboot -f", "shutdown"),
    ("systemctl reboot", "shutdown"),
    ("systemctl --force poweroff", "shutdown"),
    ("init 0", "init-runlevel"),
    ("init 6", "init-runlevel"),
    ("telinit 6", "init-runlevel"),
    # firewall
    ("systemctl disable firewalld", "firewall-disable"),
    ("systemctl stop firewalld", "firewall-disable"),
    ("systemctl disable --now firewalld.service", "firewall-disable"),
    ("service firewalld stop", "firewall-disable"),
    ("ufw disable", "firewall-disable"),
    ("iptables -F", "iptables-flush"),
    ("iptables --flush", "iptables-flush"),
    ("iptables -t nat -F", "iptables-flush"),
    ("ip6tables -F INPUT", "iptables-flush"),
    ("nft flush ruleset", "iptables-flush"),
    # command position after separators, substitutions, wrappers, keywords, assignments, quoting
    ("echo ok; reboot", "shutdown"),
    ("echo ok;reboot", "shutdown"),
    ("true && reboot", "shutdown"),
    ("false || reboot", "shutdown"),
    ("echo | reboot", "shutdown"),
    ("echo |& reboot", "shutdown"),
    ("sleep 1 & reboot", "shutdown"),
    ("echo ok\nreboot", "shutdown"),
    ("echo $(reboot)", "shutdown"),
    ("echo `reboot`", "shutdown"),
    ('echo "$(reboot)"', "shutdown"),
    ('echo "`reboot`"', "shutdown"),
    ("echo $(echo $(reboot))", "shutdown"),
    ('echo "x $(echo ")"; reboot; echo "(")"', "shutdown"),
    ("(reboot)", "shutdown"),
    ("{ reboot; }", "shutdown"),
    ("if true; then reboot; fi", "shutdown"),
    ("while true; do reboot; done", "shutdown"),
    ("! reboot", "shutdown"),
    ("sudo reboot", "shutdown"),
    ("sudo -u root -- reboot", "shutdown"),
    ("sudo -E env FOO=1 nice -n 5 timeout 10 reboot", "shutdown"),
    ("FOO=1 BAR=2 reboot", "shutdown"),
    ("nohup reboot &", "shutdown"),
    ("xargs -n1 reboot", "shutdown"),
    ("busybox reboot", "shutdown"),
    ("exec reboot", "shutdown"),
    ("command reboot", "shutdown"),
    ("> /tmp/log reboot", "shutdown"),
    ("re''boot", "shutdown"),
    ('"reboot"', "shutdown"),
    ("\\reboot", "shutdown"),
    ("eval reboot", "shutdown"),
    ("eval 'echo hi; reboot'", "shutdown"),
    ("su -c reboot", "shutdown"),
    ("su root --command=reboot", "shutdown"),
    ("bash -o pipefail -c reboot", "shutdown"),
    ("echo hi # a comment\nreboot", "shutdown"),
    ("$(reboot", "shutdown"),  # unterminated substitution is still inspected
]

ALLOWED: list[str] = [
    "",
    "   ",
    "ls -la",
    "echo reboot-notes",
    "cat shutdown.txt",
    "rm -rf /tmp/x",
    "rm -rf ./build",
    "rm -rf build/",
    "rm -rf /tmp/*",
    "rm /",
    "rm -f /",
    "grep mkfs docs.txt",  # rules match the command word, not arguments
    "man reboot",
    "echo 'rm -rf /'",
    "echo \"reboot\"",
    "echo reboot",
    "printf '%s' '$(reboot)'",
    "echo '`reboot`'",
    "git commit -m 'reboot; halt'",
    shlex.join(["echo", "; reboot", "$(reboot)", "`halt`", "&& rm -rf /"]),
    "echo hi # ; reboot",
    "ls /",
    "du -sh /",
    "dd if=/dev/sda of=disk.img",
    "dd if=/dev/zero of=/tmp/file bs=1M count=1",
    "cat /dev/sda > disk.img",
    "echo x > /dev/null",
    "echo x 2>/dev/null",
    "chmod 777 /",
    "chmod -R 755 /tmp/x",
    "chmod -R 777 ./",
    "chown -R me /home/me",
    "iptables -L",
    "iptables -A INPUT -j ACCEPT",
    "systemctl status firewalld",
    "systemctl restart nginx",
    "systemctl start firewalld",
    "init",
    "echo init 0",
    "initdb -D data",
    "mkfsfoo",
    "halting",
    "./shutdown.sh",
    "python -c 'import os; print(os.getcwd())'",
    "f() { echo hi; }; f",
    "sudo -l",
    "sh -c 'echo hello && ls /'",
    "bash script.sh reboot",
    "REBOOT=1 make",
    "command -v reboot",
    "type reboot",
    "which shutdown",
    "pkill -f reboot",
    "git log --grep=reboot",
    "rm -rf /*.tmp",
    "rm -rf /tmp/*/",
]


@pytest.mark.parametrize(("command", "rule"), BLOCKED)
def test_blocked(command: str, rule: str) -> None:
    v = check(command)
    assert not v.allowed, command
    assert v.rule == rule, (command, v)
    assert v.reason and f"'{rule}'" in v.reason


@pytest.mark.parametrize("command", ALLOWED)
def test_allowed(command: str) -> None:
    assert check(command) == Verdict(True, None, None), command


def test_blocklist_can_be_disabled() -> None:
    assert check("rm -rf /", blocklist=False).allowed
    assert check(":(){ :|:& };:", blocklist=False).allowed


def test_reason_is_a_sentence_naming_rule_and_match() -> None:
    v = check("echo ok; sudo rm -rf /")
    assert v.reason is not None
    assert v.reason.startswith("blocked by rule 'rm-root': recursive delete of /")
    assert "rm -rf /" in v.reason


def test_reason_snippet_is_truncated() -> None:
    v = check("rm -rf / " + "x" * 10_000)
    assert v.rule == "rm-root"
    assert v.reason is not None and len(v.reason) < 300


# --------------------------------------------------------------------------- extra_block


def test_extra_block_patterns_get_custom_ids_in_order() -> None:
    extras = [r"curl .*\|\s*sh", r"\bnc\b"]
    assert check("curl http://x | sh", extra_block=extras).rule == "custom-1"
    v = check("nc -l 4444", extra_block=extras)
    assert v.rule == "custom-2"
    assert v.reason is not None and r"\bnc\b" in v.reason
    assert check("ncat --version", extra_block=extras).allowed


def test_extra_block_applies_with_builtin_blocklist_disabled() -> None:
    assert check("wget x", blocklist=False, extra_block=["wget"]).rule == "custom-1"


def test_builtin_blocklist_wins_over_extras() -> None:
    assert check("reboot", extra_block=["reboot"]).rule == "shutdown"


@pytest.mark.parametrize("pattern", ["(", "[a-", "*x", "(?P<a>x)(?P<a>y)"])
def test_invalid_extra_regex_raises_value_error_naming_it(pattern: str) -> None:
    with pytest.raises(ValueError, match="invalid extra_block pattern") as exc:
        check("ls", extra_block=["ok", pattern])
    assert repr(pattern) in str(exc.value)


# --------------------------------------------------------------------------- allowlist

ALLOW = ("git *", "pytest *", "make")


@pytest.mark.parametrize(
    "command",
    [
        "git status",
        "  git status\n",
        "git commit -m 'fix: a; b && c | d > e'",  # metacharacters inside single quotes are inert
        'git commit -m "quoted > text"',
        "pytest -k 'a or b' tests/",
        "make",
        "git log 'x`y'",
    ],
)
def test_allowlist_accepts(command: str) -> None:
    assert check(command, allow=ALLOW).allowed, command


@pytest.mark.parametrize(
    "command",
    [
        "ls",
        "git",  # "git *" needs an argument
        "make install",
        "Git status",  # globs are case-sensitive
        "git status; ls",
        "git status && ls",
        "git status || ls",
        "git log | head",
        "git log & ls",
        "git log\nls",
        "git log > out.txt",
        "git log < in.txt",
        "git log 2>&1",
        "git $(ls)",
        'git "$(ls)"',
        "git `ls`",
        'git "`ls`"',
        "git log # comment",
        "git (log)",
        "git <(ls)",
    ],
)
def test_allowlist_rejects(command: str) -> None:
    v = check(command, allow=ALLOW)
    assert not v.allowed, command
    assert v.rule == "allowlist"
    assert v.reason


def test_blocklist_applies_before_allowlist() -> None:
    assert check("git status; reboot", allow=ALLOW).rule == "shutdown"
    assert check("rm -rf /", allow=("rm *",)).rule == "rm-root"
    assert check("rm -rf /", allow=("rm *",), blocklist=False).allowed


def test_allowlist_only_mode_still_validates_chaining() -> None:
    assert check("git status; ls", allow=ALLOW, blocklist=False).rule == "allowlist"


# --------------------------------------------------------------------------- size limits


def test_too_long() -> None:
    v = check("x" * (MAX_COMMAND_LEN + 1))
    assert (v.allowed, v.rule) == (False, "too-long")
    assert check("x" * (MAX_COMMAND_LEN + 1), blocklist=False).allowed  # nothing to check
    assert check("a" * MAX_COMMAND_LEN).allowed  # one long word is cheap and fine


def test_too_many_tokens() -> None:
    assert check("a " * (MAX_TOKENS // 2)).allowed
    assert check("; " * (MAX_TOKENS + 10)).allowed  # runs of separators are a single token
    assert check("'' " * (MAX_TOKENS + 1)).rule == "too-long"
    assert check("eval " * (MAX_TOKENS // 2 + 10)).rule == "too-long"  # budget is shared with payloads


def test_too_deep() -> None:
    assert check("$(" * 1000).rule == "too-deep"
    nested = "reboot"
    for _ in range(8):  # 8 nested payloads are still inspected ...
        nested = shlex.join(["sh", "-c", nested])
    assert check(nested).rule == "shutdown"
    assert check(shlex.join(["sh", "-c", nested])).rule == "too-deep"  # ... a 9th is refused


# --------------------------------------------------------------------------- properties


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_never_raises_on_text(command: str) -> None:
    v = check(command)
    assert isinstance(v, Verdict)
    assert isinstance(check(command, allow=ALLOW, extra_block=[r"\bzz\b"]), Verdict)


@settings(max_examples=300, deadline=None)
@given(st.binary())
def test_never_raises_on_surrogateescaped_bytes(data: bytes) -> None:
    command = data.decode("utf-8", "surrogateescape")
    assert isinstance(check(command), Verdict)
    assert isinstance(check(command, allow=ALLOW), Verdict)


_SHELLISH = st.lists(
    st.sampled_from([*"ab /-$()`'\"\\;&|<>#{}\n\t:=*", "rm", "sh -c", "eval", "reboot", "-rf", "&&", "$("])
).map("".join)


@settings(max_examples=300, deadline=None)
@given(_SHELLISH)
def test_never_raises_on_shell_soup(command: str) -> None:
    assert isinstance(check(command), Verdict)
    assert isinstance(check(command, allow=ALLOW, blocklist=False), Verdict)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(), max_size=8))
def test_quoted_arguments_never_reach_command_position(args: list[str]) -> None:
    # shlex.join quotes every argument, so nothing in them may be seen as a command.
    v = check(shlex.join(["echo", *args]))
    assert v.allowed or v.rule in ("fork-bomb", "too-long"), v  # fork-bomb is matched as raw syntax


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(), max_size=5), st.sampled_from(["reboot", "halt", "poweroff"]))
def test_wrapped_power_command_always_blocked(args: list[str], word: str) -> None:
    assert check(shlex.join(["sudo", word, *args])).rule == "shutdown"
    assert check("echo hi; " + shlex.join([word, *args])).rule == "shutdown"


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abcxyz019 -_./=", max_size=50), st.sampled_from(["; ", " && ", " || ", " | ", "\n"]))
def test_blocked_command_after_a_separator_is_found(prefix: str, sep: str) -> None:
    assert check(prefix + sep + "rm -rf /").rule == "rm-root"


ADVERSARIAL = {
    "rm-dashes": "rm " + "-" * 50_000,
    "rm-flag-run": "rm -" + "r" * 50_000 + "=",
    "rm-many-flags": "rm " + "-r " * 30_000 + "/x",
    "chmod-many-flags": "chmod " + "-R " * 30_000 + "/x",
    "systemctl-verbs": "systemctl " + "disable " * 20_000 + "x",
    "dd-targets": "dd " + "of=/dev/ " * 20_000,
    "fork-bomb-heads": ":(){" * 10_000,
    "fork-bomb-partial": ":(){ :|" * 10_000,
    "long-name-bomb": "a" * 100_000 + "(){",
    "spaces": " " * 100_000 + "x",
    "nested-subst": "$(" * 10_000,
    "nested-dq-subst": '"$(' * 10_000,
    "sequential-subst": "$()" * 30_000,
    "backticks": "`" * 100_000,
    "backtick-pairs": "`x`" * 30_000,
    "semicolons": ";" * 1_000_000,
    "closing-parens": ")" * 100_000,
    "opening-parens": "(" * 1_000_000,
    "quotes": "'" * 100_001,
    "double-quotes": '"' * 100_001,
    "backslashes": "\\" * 100_001,
    "comments": "#\n" * 50_000,
    "digits-redirect": "1>" * 50_000,
    "dollars": "$" * 100_000,
    "eval-chain": "eval " * 50_000,
    "sh-c-chain": "sh -c " * 20_000,
    "sudo-chain": "sudo -u " * 50_000,
    "mixed": "a'b\"c$(d`e;f|g&h>i<j\\" * 20_000,
    "max-length-word": "a" * MAX_COMMAND_LEN,
    "max-length-words": "ab " * (MAX_COMMAND_LEN // 3),
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_adversarial_input_does_not_hang(name: str) -> None:
    command = ADVERSARIAL[name]
    for kwargs in ({}, {"allow": ALLOW}, {"allow": ALLOW, "blocklist": False}):
        start = time.perf_counter()
        v = check(command, **kwargs)  # type: ignore[arg-type]
        elapsed = time.perf_counter() - start
        assert isinstance(v, Verdict)
        # A hang detector, not a benchmark: a regex gone exponential takes minutes, these ~0.2 s;
        # the bound is wide so that a loaded CI machine never fails it.
        assert elapsed < 10.0, f"{name} {kwargs}: {elapsed:.2f}s"


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(["rm ", "chmod ", "chown ", "dd ", "systemctl ", "iptables ", "nft ", "ufw ", "sh -c ", ""]),
    st.text(alphabet="-rRf/ *=of:(){}|&;$`'\"\\", min_size=1, max_size=8),
    st.integers(min_value=1_000, max_value=20_000),
)
def test_repeated_fragments_do_not_hang(head: str, fragment: str, times: int) -> None:
    command = head + fragment * times
    start = time.perf_counter()
    check(command)
    assert time.perf_counter() - start < 2.0


def test_import_compiles_nothing_and_needs_no_re() -> None:
    # The CLI's path imports this module for every run; the regexes (and `re`, with its enum)
    # wait for the first command the cheap pre-check cannot clear. -S: nothing else imports re.
    code = ("import sys, sandbox.filter as f; v = f.check('ls -l'); "
            "print(v.allowed, sorted(f._compiled), 're' in sys.modules); "
            "v = f.check('rm -rf /'); print(v.allowed, sorted(f._compiled))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=root)).stdout.splitlines()
    assert out == ["True [] False", "False ['lexer', 'rules']"], out


# ---------------------------------------------------------------------------- operators' patterns


def _answers_within(seconds: float, fn: Any) -> Any:
    """fn() in a thread, joined for at most `seconds`: a hang guard, not a benchmark."""
    import threading

    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert out, f"no answer within {seconds} s"
    return out[0]


@pytest.mark.parametrize("pattern, command", [
    (r"(a|aa)*c", "a" * 60),  # exponential in re: 15 s at 38 characters
    (r"(aa?)+!", "echo " + "a" * 60),
    (r"^(a+)+$", "a" * 60 + "!"),
    (r"(?i)(?:ab|AB)+!", "echo " + "ab" * 60),
    (r"a.*b.*c.*d", "abc" * 20_000),  # polynomial in re: 110 s at 3 KB
    (r"curl.*\|.*sh\b", "curl |" * 50_000),
])
def test_an_operators_pattern_answers_in_linear_time_on_a_hostile_command(pattern: str, command: str) -> None:
    assert pattern_problem(pattern) is None
    v = _answers_within(10, lambda: check(command, blocklist=False, extra_block=[pattern]))
    assert v.allowed  # none of them matches: the whole text was searched


def test_an_operators_pattern_still_blocks_what_it_matches() -> None:
    v = check("echo aaab c", blocklist=False, extra_block=[r"(a|aa)*b\s+c"])
    assert v.rule == "custom-1" and "(a|aa)*b\\s+c" in v.reason


@pytest.mark.parametrize("pattern", [r"curl(?=\s)", r"(a)\1", r"a*+", r"(?>a)", r"x\Z"])
def test_a_pattern_no_linear_time_matcher_can_run_is_refused(pattern: str) -> None:
    why = pattern_problem(pattern)
    assert why and "linear-time" in why, (pattern, why)


def test_a_profile_with_a_pattern_re2_cannot_run_does_not_load(tmp_path: Path) -> None:
    f = tmp_path / "p.toml"
    f.write_text('extends = "strict"\n[filter]\nblock = ["curl(?=\\\\s)"]\n')
    with pytest.raises(ProfileError, match="linear-time"):
        load(str(f))


def test_a_blocked_run_counts_no_oom_kills_nor_pid_refusals() -> None:
    """No process, no cgroup: unknown (null, as the README says), not "0 happened"."""
    import sandbox

    usage = sandbox.run("rm -rf /").to_dict()["usage"]
    assert (usage["oom_kills"], usage["pids_limit_hit"]) == (None, None), usage
