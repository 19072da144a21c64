"""Profiles: built-ins load, inheritance works, every error names file, key and value."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sandbox.errors import ProfileError
from sandbox.profile import builtin_names, load, with_overrides
from sandbox.units import format_size, parse_duration, parse_size


def test_builtins_load() -> None:
    assert {"strict", "standard", "ci", "rootless", "nested"} <= set(builtin_names())
    for name in builtin_names():
        p = load(name)
        assert p.name == name and p.description


def test_strict_values() -> None:
    p = load("strict")
    lim = p.limits
    assert (lim.timeout, lim.memory, lim.processes, lim.file_size, lim.output) == (
        30.0, 512 * 2**20, 64, 64 * 2**20, 2**20)
    assert p.network == "none" and p.seccomp == "default" and p.cgroup == "required"


def test_extends_merges(tmp_path) -> None:
    f = tmp_path / "mine.toml"
    f.write_text('extends = "strict"\n[limits]\nmemory = "1GiB"\n[filesystem]\nro_bind_try = ["/opt"]\n')
    p = load(str(f))
    assert p.limits.memory == 2**30 and p.limits.timeout == 30.0
    assert any(m.target == "/opt" for m in p.mounts) and any(m.target == "/usr" for m in p.mounts)



def test_a_file_extending_nested_without_a_filesystem_table_loads(tmp_path) -> None:
    """The binds nested inherits from strict are unused under its host view, not the file's
    own mistake: only a file that names binds itself is refused."""
    f = tmp_path / "mine.toml"
    f.write_text('extends = "nested"\n[security]\ncgroup = "off"\n[limits]\nmemory = "unlimited"\ncpus = 0\n')
    p = load(str(f))
    assert p.view == "host" and p.cgroup == "off"
    assert p.mounts == () and load("nested").mounts == ()  # nor kept, nor shown (`profiles show`)
    f.write_text('extends = "strict"\n[filesystem]\nview = "host"\n[network]\nmode = "host"\n[security]\nnamespaces = []\n')
    assert load(str(f)).mounts == ()
    f.write_text('extends = "nested"\n[filesystem]\nro_bind = ["/usr"]\n')
    with pytest.raises(ProfileError, match="filesystem.ro_bind = '/usr'"):
        load(str(f))

@pytest.mark.parametrize("body, needle", [
    ('[limits]\nmemory = "12XB"', "limits.memory = '12XB': unknown size unit"),
    ('[limits]\nmemroy = "1GiB"', "limits.memroy: unknown key"),
    ('[limits]\nprocesses = -1', "limits.processes = -1: must be positive"),
    ('[limits]\ntimeout = "soon"', "limits.timeout = 'soon'"),
    ('[filesystem]\nro_bind = ["relative/path"]', "must be an absolute path"),
    ('[filesystem]\nro_bind = ["/no/such/dir/x"]', "path does not exist"),
    ('[filesystem]\nro_bind = ["/usr/../etc"]', "must not contain '..'"),
    ('[network]\nmode = "internet"', "network.mode = 'internet'"),
    ('[bogus]\nx = 1', "bogus: unknown table"),
    ('[limits\nmemory = 1', "malformed TOML"),
    ('[limits]\ntimeout = 0', "allow_no_timeout"),
    ('extends = "nope"', "extends = 'nope'"),
    ('[security]\ncgroup = "maybe"', "security.cgroup = 'maybe'"),
    ('[limits]\noutput_overflow = "stop"', "limits.output_overflow = 'stop': expected 'drain' or 'kill'"),
    # inherits strict's namespaces: no mount namespace, so a pid namespace that still saw /proc of the host
    ('extends = "strict"\n[filesystem]\nview = "host"', "remove 'mount' and 'pid' from security.namespaces"),
    ('[filesystem]\nview = "host"\n[security]\nnamespaces = ["pid"]', "remove 'pid' from security.namespaces"),
    ('[limits]\nkill_grace = "unlimited"', "limits.kill_grace = 'unlimited': cannot be unlimited"),
    ('[limits]\nprocesses = 4194305', "limits.processes = 4194305: is above the kernel's most pids"),
    # a file bound where the bind of /usr has a directory: its mount would fail at setup (ENOTDIR)
    ('extends = "strict"\n[filesystem]\nro_bind = ["/etc/hostname:/usr/bin"]',
     "/usr/bin is a directory in the bind of /usr: a file cannot be bound there"),
    # the same clash with the inner bind listed first (the check looked only at earlier binds)
    ('[filesystem]\nro_bind = ["/etc/hostname:/opt/a/bin", "/usr:/opt/a"]',
     "/opt/a/bin is a directory in the bind of /usr: a file cannot be bound there"),
    # anything inside a bound file, in either order
    ('[filesystem]\nro_bind = ["/etc/hostname:/opt/a", "/usr:/opt/a/b"]',
     "/opt/a/b is inside /opt/a, where the file /etc/hostname is bound"),
    ('[filesystem]\nro_bind = ["/etc/hosts:/opt/a/b", "/etc/hostname:/opt/a"]',
     "/opt/a/b is inside /opt/a, where the file /etc/hostname is bound"),
])
def test_errors_name_file_key_value(tmp_path, body: str, needle: str) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(body)
    with pytest.raises(ProfileError) as e:
        load(str(f))
    assert needle in str(e.value), str(e.value)
    if "extends" not in body or "nope" in body:
        assert "bad.toml" in str(e.value)


@pytest.mark.parametrize("body", ['[limits\nmemory = 1', '[limits]\nmemory = "lots"', 'extends = "nope"',
                                  'extends = "own.toml"'])
def test_errors_name_the_file_as_given_and_what_it_extends_in_full(tmp_path, monkeypatch, body: str) -> None:
    """Malformed TOML named the file by its resolved path, a bad value as given."""
    (tmp_path / "own.toml").write_text(body)
    os.symlink("own.toml", tmp_path / "link.toml")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "child.toml").write_text('extends = "../link.toml"\n')
    monkeypatch.chdir(tmp_path)
    for given in ("link.toml", "./link.toml", str(tmp_path / "link.toml")):
        with pytest.raises(ProfileError) as e:
            load(given)
        assert str(e.value).startswith(os.path.normpath(given) + ":"), str(e.value)
    with pytest.raises(ProfileError) as e:
        load("sub/child.toml")
    assert str(e.value).startswith(str(tmp_path / "own.toml") + ":"), str(e.value)


@pytest.mark.parametrize("key", ["ro_bind", "bind", "ro_bind_try"])
def test_a_bind_source_through_a_link_is_refused_at_load(tmp_path, key: str) -> None:
    """The view refuses it at setup (125, every run); a profile with one is wrong from the start."""
    (tmp_path / "real" / "d").mkdir(parents=True)
    os.symlink(tmp_path / "real", tmp_path / "link")
    f = tmp_path / "p.toml"
    f.write_text(f'extends = "strict"\n[filesystem]\n{key} = ["{tmp_path}/link/d:/mnt/d"]\n')
    with pytest.raises(ProfileError, match=f"{tmp_path}/link is a symbolic link"):
        load(str(f))
    f.write_text(f'extends = "strict"\n[filesystem]\n{key} = ["{tmp_path}/real/d:/mnt/d", "{tmp_path}/link:/mnt/l"]\n')
    assert load(str(f))  # the last component may be one (reproduced as a link in the view)


def test_extends_cycle(tmp_path) -> None:
    (tmp_path / "a.toml").write_text('extends = "./b.toml"')
    (tmp_path / "b.toml").write_text('extends = "./a.toml"')
    with pytest.raises(ProfileError, match="cycle"):
        load(str(tmp_path / "a.toml"))


def test_a_long_extends_chain_is_a_named_error(tmp_path) -> None:
    """A chain of 1000 files raised RecursionError (an internal error at the CLI)."""
    from sandbox.profile import MAX_EXTENDS

    (tmp_path / "c0.toml").write_text('extends = "strict"\n')
    for i in range(1, 1000):
        (tmp_path / f"c{i}.toml").write_text(f'extends = "./c{i - 1}.toml"\n')
    assert load(str(tmp_path / f"c{MAX_EXTENDS - 2}.toml")).limits.memory == load("strict").limits.memory
    with pytest.raises(ProfileError, match=f"chains more than {MAX_EXTENDS} profiles"):
        load(str(tmp_path / "c999.toml"))


def test_unknown_profile_lists_builtins() -> None:
    with pytest.raises(ProfileError, match="unknown profile.*strict"):
        load("nonesuch")


def test_overrides_validate() -> None:
    p = with_overrides(load("strict"), timeout="5s", memory="128MiB", env={"A": "b"}, network="loopback")
    assert p.limits.timeout == 5 and p.limits.memory == 128 * 2**20 and ("A", "b") in p.env
    with pytest.raises(ProfileError, match="memory"):
        with_overrides(load("strict"), memory="lots")
    with pytest.raises(ProfileError, match="does not allow"):
        with_overrides(load("strict"), timeout=0)
    with pytest.raises(ProfileError, match="max_timeout"):
        with_overrides(load("strict"), timeout="2h")
    with pytest.raises(ProfileError, match="unknown setting"):
        with_overrides(load("strict"), colour="blue")
    # what a file may not make unlimited, an override may not either (it failed at the run)
    for key in ("kill_grace", "output", "tmp_size", "workdir_size"):
        with pytest.raises(ProfileError, match=f"limits.{key} = 'none': cannot be unlimited"):
            with_overrides(load("strict"), **{key: "none"})
    with pytest.raises(ProfileError, match="most pids"):
        with_overrides(load("strict"), processes=4194305)
    assert load("strict").limits.output_overflow == "drain"
    assert with_overrides(load("strict"), output_overflow="kill").limits.output_overflow == "kill"
    with pytest.raises(ProfileError, match="output_overflow = True: expected 'drain' or 'kill'"):
        with_overrides(load("strict"), output_overflow=True)


def test_units() -> None:
    assert parse_size("512MiB") == 512 * 2**20 and parse_size("1.5GiB") == int(1.5 * 2**30)
    assert parse_size(4096) == 4096 and parse_size("unlimited") is None
    assert parse_duration("500ms") == 0.5 and parse_duration("2m") == 120 and parse_duration(3) == 3.0
    for bad in ("-1", "1 parsec", "", True):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_sizes_are_written_with_their_unit() -> None:
    # 10 bytes read "10" ("output limit of 10"): a bare number, whose unit the reader guessed.
    for n, text in ((10, "10B"), (0, "0B"), (1536, "1536B"), (1024, "1KiB"), (3 * 2**20, "3MiB"), (2**30, "1GiB"),
                    (None, "unlimited")):
        assert format_size(n) == text and (n is None or parse_size(text) == n)


def test_units_read_numbers_as_the_regex_they_replace() -> None:
    # units.py reads "1.5 GiB" without re (~3 ms of a CLI call, with its enum); this is the
    # regex it had, checked on random text over the characters that matter.
    import random
    import re

    from sandbox.units import _number_and_unit

    pattern = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
    rng = random.Random(20261203)
    chars = ["1", "0", "9", ".", " ", "\t", "\n", "\xa0", "\u2003", "k", "M", "i", "B", "s", "-", "é", "٣", "_"]
    for _ in range(20_000):
        text = "".join(rng.choice(chars) for _ in range(rng.randint(0, 7)))
        m = pattern.match(text)
        assert _number_and_unit(text) == (m.groups() if m else None), repr(text)


# ---------------------------------------------------------------------------- parsed-TOML disk cache


@pytest.fixture
def profile_cache(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """A private cache dir, a search dir on SANDBOXRUN_PROFILE_PATH, and no in-process memo."""
    from sandbox import profile as profile_mod
    from sandbox.isolation import seccomp

    cache = tmp_path / "cache"
    named = tmp_path / "named"
    named.mkdir()
    monkeypatch.setattr(seccomp, "default_cache_dir", lambda: str(cache))
    monkeypatch.setenv("SANDBOXRUN_PROFILE_PATH", str(named))
    monkeypatch.setattr(profile_mod, "_cache", {})
    return cache, named


def _cached_files(cache) -> list[str]:
    return sorted(p.name for p in cache.glob("profile-*")) if cache.exists() else []


def test_named_profile_is_cached_once_and_edits_are_seen(profile_cache) -> None:
    import os

    from sandbox import profile as profile_mod

    cache, named = profile_cache
    f = named / "mine.toml"
    f.write_text('extends = "strict"\n[limits]\nmemory = "1GiB"\n')
    assert load("mine").limits.memory == 2**30
    assert len(_cached_files(cache)) == 2  # mine and the strict it extends
    for n, size in enumerate(("2GiB", "3GiB"), 1):
        f.write_text(f'extends = "strict"\n[limits]\nmemory = "{size}"\n')
        os.utime(f, ns=(n * 10**9, n * 10**9))  # a new stamp even within one clock tick
        profile_mod._cache.clear()
        assert load("mine").limits.memory == parse_size(size)  # never the stale parse
    assert len(_cached_files(cache)) == 2  # one file per profile path, overwritten in place


def test_profile_files_outside_search_dirs_are_not_cached(profile_cache, tmp_path) -> None:
    cache, _ = profile_cache
    for i in range(3):
        f = tmp_path / f"adhoc{i}.toml"
        f.write_text('[limits]\nmemory = "1GiB"\n[filesystem]\nro_bind = ["/usr"]\n')
        assert load(str(f)).limits.memory == 2**30
    assert not [n for n in _cached_files(cache) if "adhoc" in n] and len(_cached_files(cache)) == 0


def test_planted_cache_entry_with_another_stamp_is_ignored(profile_cache) -> None:
    import marshal

    from sandbox import profile as profile_mod

    cache, named = profile_cache
    f = named / "mine.toml"
    f.write_text('[limits]\nmemory = "1GiB"\n[filesystem]\nro_bind = ["/usr"]\n')
    load("mine")
    (entry,) = cache.glob("profile-*")
    entry.write_bytes(marshal.dumps(((0, 0, 0), {"limits": {"memory": "9GiB"}})))
    profile_mod._cache.clear()
    assert load("mine").limits.memory == 2**30


def test_parsed_profile_cache_is_bounded(profile_cache, monkeypatch: pytest.MonkeyPatch) -> None:
    """Search dirs come and go (each test's temp dir): the cache keeps the newest entries only."""
    from sandbox import profile as profile_mod

    cache, named = profile_cache
    monkeypatch.setattr(profile_mod, "PARSED_CACHE_MAX", 5)
    for i in range(9):
        (named / f"p{i}.toml").write_text('[limits]\nmemory = "1GiB"\n[filesystem]\nro_bind = ["/usr"]\n')
        assert load(f"p{i}").limits.memory == 2**30
    assert len(_cached_files(cache)) == 5


# ---------------------------------------------------------------------------- contradictions and hidden binds


def _profile(tmp_path, body: str, name: str = "p.toml"):
    f = tmp_path / name
    f.write_text(body)
    return load(str(f))


@pytest.mark.parametrize("spec, needle", [
    ("/usr:/work", "bind target /work is the workdir"),
    ("/usr:/work/sub", "/work/sub is under the workdir /work"),
    ("/usr:/tmp", "/tmp"),
    ("/usr:/tmp/x", "/tmp"),
    ("/usr:/proc", "/proc"),
    ("/usr:/dev/shm", "/dev"),
    ("/usr:/run/x", "/run"),
    ("/usr:/etc", "/etc"),
    ("/etc/hosts", "/etc/hosts"),
])
def test_override_bind_hidden_by_the_sandbox_is_refused(spec: str, needle: str) -> None:
    for key in ("ro_bind", "bind"):
        with pytest.raises(ProfileError) as e:
            with_overrides(load("strict"), **{key: spec})
        assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
        assert spec in str(e.value)  # names the bind


@pytest.mark.parametrize("first, second", [
    (("ro_bind", "/usr/bin:/opt/a"), ("ro_bind", "/usr/lib:/opt/a")),  # the later hid the earlier
    (("ro_bind", "/usr:/opt/a"), ("bind", "{tmp}:/opt/a/")),  # a writable /opt/a over a read-only one
    (None, ("bind", "{tmp}:/usr")),  # over the profile's own read-only /usr: its system gone
    (None, ("ro_bind", "/opt:/usr")),
])
def test_two_binds_at_one_target_from_a_caller_are_refused(tmp_path, first, second) -> None:
    # A profile file refused it ("one mount per target"); the overrides took it.
    prof = load("strict")
    if first:
        prof = with_overrides(prof, **{first[0]: first[1]})
    key, spec = second[0], second[1].format(tmp=tmp_path)
    with pytest.raises(ProfileError) as e:
        with_overrides(prof, **{key: spec})
    text = str(e.value)
    assert "one mount per target" in text and spec in text and "\n" not in text, text
    with pytest.raises(ProfileError):  # also within one override's list
        with_overrides(load("strict"), ro_bind=["/usr/share:/opt/b", "/opt:/opt/b"])


def test_the_same_bind_twice_from_a_caller_is_one_mount() -> None:
    p = with_overrides(load("strict"), ro_bind=["/usr:/opt/a", "/usr:/opt/a/"])
    p = with_overrides(p, ro_bind="/usr:/usr")  # as the profile's own
    targets = [m.target.rstrip("/") for m in p.mounts]
    assert targets.count("/opt/a") == 1 and targets.count("/usr") == 1, targets


_LONG_NAME = "a" * 300  # over NAME_MAX (255)
_LONG_PATH = "/opt/" + "/".join(["c" * 200] * 25)  # over PATH_MAX (4096)


@pytest.mark.parametrize("key, spec", [
    ("ro_bind", f"/usr:/opt/{_LONG_NAME}"),
    ("bind", f"{{tmp}}:/opt/{_LONG_NAME}"),
    ("ro_bind", f"/usr:{_LONG_PATH}"),
    ("ro_bind", "/" + "b" * 5000),  # said "does not exist"
    ("ro_bind", "/usr:/opt/\ud800"),  # a UnicodeEncodeError from sandbox.run
])
def test_an_over_long_bind_path_is_refused_when_given(tmp_path, key: str, spec: str) -> None:
    # Ran, and failed in the child (exit 125) naming the view's staging path /tmp/opt/aaa...
    spec = spec.format(tmp=tmp_path)
    with pytest.raises(ProfileError) as e:
        with_overrides(load("strict"), **{key: spec})
    text = str(e.value)
    assert ("name too long" in text or "lone surrogate" in text) and f"override: {key} = " in text, text


@pytest.mark.parametrize("body", [
    f'ro_bind_try = ["/{_LONG_NAME}"]',  # failed at setup, with a wrong "likely cause"
    f'ro_bind = ["/usr:/opt/{_LONG_NAME}"]',
    f'workdir = "/opt/{_LONG_NAME}"',
    f'workdir = "{_LONG_PATH}"',
])
def test_an_over_long_path_in_a_profile_is_refused_at_load(tmp_path, body: str) -> None:
    with pytest.raises(ProfileError) as e:
        _profile(tmp_path, f'extends = "strict"\n[filesystem]\n{body}\n', "long.toml")
    text = str(e.value)
    assert "name too long" in text and "long.toml: filesystem." in text, text


def test_bind_beside_the_workdir_is_fine(tmp_path) -> None:
    p = with_overrides(load("strict"), ro_bind=["/usr:/workshop", "/usr:/opt/x", "/usr/share:/etc/share"])
    assert {m.target for m in p.mounts} >= {"/workshop", "/opt/x", "/etc/share"}
    p = _profile(tmp_path, 'extends = "strict"\n[filesystem]\nworkdir = "/srv/job"\nro_bind = ["/usr:/work"]\n')
    assert p.workdir == "/srv/job" and any(m.target == "/work" for m in p.mounts)


@pytest.mark.parametrize("body, needle", [
    ('[filesystem]\nbind = ["/usr:/work/data"]', "filesystem.bind = '/usr:/work/data': bind target /work/data is under"),
    ('[filesystem]\nro_bind_try = ["/usr:/tmp/cache"]', "filesystem.ro_bind_try = '/usr:/tmp/cache'"),
    ('[filesystem]\nworkdir = "/data"\nro_bind = ["/usr:/data"]', "bind target /data is the workdir"),
    ('[filesystem]\nworkdir = "/usr"', "filesystem.workdir = '/usr'"),
    ('[filesystem]\nworkdir = "/usr/local/work"', "filesystem.workdir = '/usr/local/work'"),
    ('[filesystem]\nworkdir = "/lib64"', "filesystem.workdir = '/lib64'"),
    ('[filesystem]\nworkdir = "/etc"', "filesystem.workdir = '/etc'"),
    ('[filesystem]\nworkdir = "/"', "filesystem.workdir = '/'"),
    ('[filesystem]\nworkdir = "/proc"', "filesystem.workdir = '/proc'"),
])
def test_profile_bind_or_workdir_hidden_by_the_sandbox_is_refused(tmp_path, body: str, needle: str) -> None:
    with pytest.raises(ProfileError) as e:
        _profile(tmp_path, 'extends = "strict"\n' + body + "\n", "bad.toml")
    assert needle in str(e.value) and "bad.toml" in str(e.value), str(e.value)


def test_timeout_over_max_timeout_is_refused_naming_both(tmp_path) -> None:
    with pytest.raises(ProfileError) as e:
        _profile(tmp_path, 'extends = "strict"\n[limits]\ntimeout = "1h"\n', "t1h.toml")
    assert "t1h.toml: limits.timeout = '1h'" in str(e.value) and "limits.max_timeout = '10m'" in str(e.value), e.value
    with pytest.raises(ProfileError) as e:  # an inherited timeout over a lowered max_timeout
        _profile(tmp_path, 'extends = "strict"\n[limits]\nmax_timeout = "1s"\n', "mt.toml")
    assert "limits.timeout = '30s'" in str(e.value) and "limits.max_timeout = '1s'" in str(e.value), e.value
    p = _profile(tmp_path, 'extends = "strict"\n[limits]\ntimeout = "1h"\nmax_timeout = "2h"\n')
    assert (p.limits.timeout, p.limits.max_timeout) == (3600, 7200)


def test_cpus_zero_means_no_cpu_limit(tmp_path) -> None:
    # Documented in the error for an out-of-range value: "(or 0 for no limit)", like "unlimited".
    assert _profile(tmp_path, 'extends = "strict"\n[limits]\ncpus = 0\n').limits.cpus is None
    assert with_overrides(load("strict"), cpus=0).limits.cpus is None
    with pytest.raises(ProfileError, match="or 0 for no limit"):
        with_overrides(load("strict"), cpus=0.001)


def test_binds_under_the_host_view_are_refused(tmp_path) -> None:
    nested = load("nested")
    assert nested.view == "host"  # its inherited strict binds stay: the file adds none
    for key in ("ro_bind", "bind"):
        with pytest.raises(ProfileError) as e:
            with_overrides(nested, **{key: "/usr:/x"})
        assert "filesystem.view = 'host'" in str(e.value) and "/usr:/x" in str(e.value), e.value
    for key in ("ro_bind", "ro_bind_try", "bind"):
        with pytest.raises(ProfileError) as e:
            _profile(tmp_path, f'extends = "nested"\n[filesystem]\n{key} = ["/usr:/x"]\n', "n.toml")
        assert f"n.toml: filesystem.{key} = " in str(e.value) and "view = 'host'" in str(e.value), e.value
    with pytest.raises(ProfileError, match="view = 'host'"):
        _profile(tmp_path, '[filesystem]\nview = "host"\nro_bind = ["/usr"]\n[security]\nnamespaces = []\n'
                           '[network]\nmode = "host"\n')
    # A private view again brings the inherited binds back into use.
    p = _profile(tmp_path, 'extends = "nested"\n[filesystem]\nview = "private"\nro_bind = ["/usr:/x"]\n'
                           '[security]\nnamespaces = ["pid", "mount", "net"]\n[network]\nmode = "none"\n')
    assert p.view == "private" and any(m.target == "/x" for m in p.mounts)


def test_profile_that_binds_nothing_read_only_is_refused(tmp_path) -> None:
    for body in ("", '[limits]\nmemory = "1GiB"\n', '[filesystem]\nbind = ["/usr:/data"]\n'):
        with pytest.raises(ProfileError) as e:
            _profile(tmp_path, body, "empty.toml")
        msg = str(e.value)
        assert msg.startswith(str(tmp_path / "empty.toml")) and "binds nothing read-only" in msg, msg
        assert 'extends = "strict"' in msg and "filesystem.ro_bind" in msg and "\n" not in msg, msg
    assert _profile(tmp_path, '[filesystem]\nro_bind = ["/usr"]\n').mounts[0].target == "/usr"
    assert _profile(tmp_path, '[filesystem]\nro_bind_try = ["/usr"]\n').mounts[0].target == "/usr"
    host = _profile(tmp_path, '[filesystem]\nview = "host"\n[security]\nnamespaces = []\n[network]\nmode = "host"\n')
    assert host.view == "host" and host.mounts == ()  # no private view: nothing to bind into


def test_a_profile_saved_with_a_byte_order_mark_loads(tmp_path) -> None:
    """Some Windows editors start UTF-8 files with a BOM, which TOML does not allow: it read
    as 'Invalid statement (at line 1, column 1)'."""
    f = tmp_path / "bom.toml"
    f.write_bytes(b"\xef\xbb\xbf" + b'extends = "strict"\n[limits]\ntimeout = "7s"\n')
    assert load(str(f)).limits.timeout == 7


def test_a_huge_file_is_no_profile(tmp_path) -> None:
    f = tmp_path / "huge.toml"
    f.write_bytes(b"# " + b"x" * (2 << 20) + b"\n")
    with pytest.raises(ProfileError, match="larger than 1 MiB"):
        load(str(f))


def test_shipped_profiles_pass_no_credential_shaped_variables() -> None:
    """The command is untrusted: a token in the caller's environment is not its to read."""
    import re

    looks_secret = re.compile(r"TOKEN|SECRET|PASSW|KEY|AUTH|CRED|_URL$|^AWS_|^GH_|^GITHUB_", re.I)
    for f in sorted((Path(__file__).resolve().parents[1] / "profiles").glob("*.toml")):
        prof = load(str(f))
        bad = [n for n in prof.env_passthrough if looks_secret.search(n)]
        assert not bad, f"{f.name} passes {bad} to the command"


def _asan_builds(tmp_path: Path) -> bool:
    import shutil
    import subprocess

    if shutil.which("gcc") is None:
        return False
    (tmp_path / "probe.c").write_text("int main(void) { return 0; }\n")
    p = subprocess.run(["gcc", "-fsanitize=address", "probe.c", "-o", "probe"], cwd=tmp_path,
                       capture_output=True, timeout=60)
    return p.returncode == 0


def test_no_shipped_profile_shows_a_hosts_caches_or_package_credentials() -> None:
    # ci once bound /root/.cache/pip read-only: useless to pip (it disables a cache it cannot
    # write) and a list of what the host has fetched; pip.conf holds index credentials.
    for name in builtin_names():
        sources = [m.source for m in load(name).mounts]
        assert not [s for s in sources if "/.cache" in s or s.endswith(("pip.conf", ".netrc", ".pypirc"))], name


def test_ci_runs_sanitizer_builds(tmp_path: Path) -> None:
    """A test suite's ASan build reserves terabytes of address space for its shadow memory: the ci
    profile caps real memory with its cgroup (required), not with RLIMIT_AS, which would abort it."""
    import sandbox

    if not _asan_builds(tmp_path):
        pytest.skip("gcc cannot build with -fsanitize=address here")
    (tmp_path / "leaky.c").write_text(
        '#include <stdio.h>\n#include <stdlib.h>\n'
        'int main(void) { char *p = malloc(8); p[0] = 42; printf("%d\\n", p[0]); free(p); return 0; }\n')
    (tmp_path / "overflow.c").write_text(
        '#include <stdlib.h>\nint main(void) { char *p = malloc(8); p[8] = 1; free(p); return 0; }\n')
    r = sandbox.run(["sh", "-c", "gcc -fsanitize=address leaky.c -o leaky && ./leaky"], profile="ci",
                    cwd=tmp_path, timeout=120)
    assert (r.status, r.stdout) == ("ok", "42\n"), r.stderr[-1500:]
    r = sandbox.run(["sh", "-c", "gcc -fsanitize=address overflow.c -o overflow && ./overflow"], profile="ci",
                    cwd=tmp_path, timeout=120)
    assert r.status == "nonzero_exit" and "heap-buffer-overflow" in r.stderr, r.stderr[-1500:]
    ci = load("ci").limits
    assert ci.address_space is None and ci.memory == 4 * 2**30  # the cgroup still caps real memory


def test_ci_builds_rust_with_the_hosts_rustup_and_sees_nothing_else_of_cargo_home(tmp_path: Path) -> None:
    import os

    import sandbox

    if not (os.path.isfile("/root/.cargo/bin/cargo") and os.path.isdir("/root/.rustup/toolchains")):
        pytest.skip("no rustup toolchain in /root")
    (tmp_path / "src").mkdir()
    (tmp_path / "Cargo.toml").write_text('[package]\nname = "probe"\nversion = "0.1.0"\nedition = "2021"\n')
    (tmp_path / "src" / "main.rs").write_text('fn main() { println!("built by {}", "rustc"); }\n')
    r = sandbox.run(["sh", "-c", "cargo run -q --offline && ls -A /root/.cargo"], profile="ci", cwd=tmp_path,
                    timeout=300)
    # ~/.cargo beyond its proxies holds credentials.toml (a registry token): only bin is shown.
    assert (r.status, r.stdout) == ("ok", "built by rustc\nbin\n"), r.stderr[-1500:]
    assert not (tmp_path / ".cargo").exists()  # cargo's caches went to the run's /tmp


def test_profiles_that_may_run_without_a_cgroup_keep_a_small_address_space() -> None:
    """Where the cgroup is optional, RLIMIT_AS may be the only memory cap there is; strict's
    64 GiB is a second line behind a cgroup it requires."""
    for name in builtin_names():
        p = load(name)
        if p.cgroup != "required":
            assert p.limits.address_space is not None and p.limits.address_space <= 4 * 2**30, name
        else:
            assert p.limits.memory is not None, name


# ---------------------------------------------------------------------------- profile audit


@pytest.mark.parametrize("body, needle", [
    # a read-write bind over a read-only one at the same target made it writable (the later mount won)
    ('extends = "strict"\n[filesystem]\nbind = ["/tmp:/data"]\nro_bind = ["/tmp:/data"]\n',
     "filesystem.bind = '/tmp:/data': binds /data, where filesystem.ro_bind = '/tmp:/data' binds too"),
    ('extends = "strict"\n[filesystem]\nro_bind = ["/usr/share:/opt/x", "/usr/lib:/opt/x"]\n',
     "one mount per target"),
    # ran 8 s past a 1 s timeout, and past max_timeout
    ('extends = "strict"\n[limits]\nkill_grace = "8min"\n', "limits.kill_grace = '8min': must be at most 60s"),
    # RLIMIT_CPU counts seconds: 0 killed at ~1 s as "signaled", 0.5 was reported as 0.5
    ('extends = "strict"\n[limits]\ncpu_time = 0\n', "limits.cpu_time = 0: must be a whole number of seconds"),
    ('extends = "strict"\n[limits]\ncpu_time = "0.5s"\n', "at least 1s"),
    ('extends = "strict"\n[limits]\ncpu_time = "1.5s"\n', "whole number of seconds"),
    ('extends = "strict"\n[limits]\nprocesses = 1\n', "limits.processes = 1: must be at least 2"),  # nothing ran
    # held in the supervisor's memory: 2^62 was taken
    ('extends = "strict"\n[limits]\noutput = "4GiB"\n', "limits.output = '4GiB': must be at most 1GiB per stream"),
    ('extends = "strict"\n[filesystem]\nro_bind = ["/usr/share://"]\n', "cannot bind over the sandbox root"),
    ('extends = "strict"\n[filesystem]\nro_bind = ["/usr/share:/opt/x:ro"]\n', "no :ro/:rw suffix"),
    # no timeout allowed, yet --timeout 20m was refused as over max_timeout
    ('extends = "strict"\n[limits]\nallow_no_timeout = true\ntimeout = 0\n',
     "limits.allow_no_timeout = True: contradicts limits.max_timeout = '10m'"),
    ('extends = "strict"\n[process]\nenv_passthrough = ["*"]\n', "env_passthrough = '*': expected a variable's name"),
    ('extends = "strict"\n[process]\nenv_passthrough = ["A=B"]\n', "no '=', no patterns"),
    # the hostname was not applied (the host's showed) while /etc/hostname said it was
    ('extends = "strict"\n[security]\nnamespaces = ["mount", "net", "pid"]\n[process]\nhostname = "wanted"\n',
     "process.hostname = 'wanted': needs the uts namespace"),
])
def test_contradictory_or_unappliable_settings_are_refused(tmp_path, body: str, needle: str) -> None:
    with pytest.raises(ProfileError) as e:
        _profile(tmp_path, body)
    assert needle in str(e.value), e.value


def test_same_bind_twice_is_one_mount_and_workdir_is_normalised(tmp_path) -> None:
    p = _profile(tmp_path, 'extends = "strict"\n[filesystem]\nro_bind = ["/usr", "/bin"]\nworkdir = "/opt/w/"\n')
    assert [m.target for m in p.mounts].count("/bin") == 1  # strict tries /bin too: the required one stands
    assert [m.optional for m in p.mounts if m.target == "/bin"] == [False]
    assert p.workdir == "/opt/w"  # "/opt/w/" failed at run time: File exists '/tmp/work/'
    p = _profile(tmp_path, 'extends = "strict"\n[limits]\nallow_no_timeout = true\ntimeout = 0\n'
                           'max_timeout = "unlimited"\n')
    assert (p.limits.timeout, p.limits.max_timeout) == (None, None)
    assert _profile(tmp_path, 'extends = "strict"\n[limits]\ncpu_time = "2s"\nprocesses = 2\n').limits.cpu_time == 2


@pytest.mark.parametrize("parent, needle", [
    ('extends = "strict"\n[limits]\ntimout = "5s"\n', "base.toml: limits.timout: unknown key"),
    ('extends = "strict"\n[limits]\nmemory = "12XB"\n', "base.toml: limits.memory = '12XB'"),
    ('extends = "strict"\n[filesystem]\nro_bind = ["/nonexistent-x"]\n', "base.toml: filesystem.ro_bind = '/nonexistent-x'"),
])
def test_an_error_in_a_parent_names_the_parent(tmp_path, parent: str, needle: str) -> None:
    """`extends = "./base.toml"` with base's typo was reported as the child's line."""
    (tmp_path / "base.toml").write_text(parent)
    with pytest.raises(ProfileError) as e:
        _profile(tmp_path, 'extends = "./base.toml"\n', "team.toml")
    assert needle in str(e.value) and "team.toml" not in str(e.value), e.value


def test_without_a_uts_namespace_etc_hostname_is_the_hosts_name(isolated, tmp_path) -> None:
    """/etc/hostname said strict's "sandbox" while `hostname` said the host's."""
    import os

    import sandbox

    f = tmp_path / "nouts.toml"
    f.write_text('extends = "strict"\n[security]\nnamespaces = ["pid", "mount", "net", "ipc", "cgroup"]\n')
    r = sandbox.run(["sh", "-c", "hostname; cat /etc/hostname"], profile=str(f))
    assert r.status == "ok" and r.stdout == f"{os.uname().nodename}\n" * 2, r
    r = sandbox.run(["sh", "-c", "hostname; cat /etc/hostname"])
    assert r.stdout == "sandbox\n" * 2, r
