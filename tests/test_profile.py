"""Profiles: built-ins load, inheritance works, every error names file, key and value."""

from __future__ import annotations

import pytest

from sandbox.errors import ProfileError
from sandbox.profile import builtin_names, load, with_overrides
from sandbox.units import parse_duration, parse_size


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
])
def test_errors_name_file_key_value(tmp_path, body: str, needle: str) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(body)
    with pytest.raises(ProfileError) as e:
        load(str(f))
    assert needle in str(e.value), str(e.value)
    if "extends" not in body or "nope" in body:
        assert "bad.toml" in str(e.value)


def test_extends_cycle(tmp_path) -> None:
    (tmp_path / "a.toml").write_text('extends = "./b.toml"')
    (tmp_path / "b.toml").write_text('extends = "./a.toml"')
    with pytest.raises(ProfileError, match="cycle"):
        load(str(tmp_path / "a.toml"))


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


def test_units() -> None:
    assert parse_size("512MiB") == 512 * 2**20 and parse_size("1.5GiB") == int(1.5 * 2**30)
    assert parse_size(4096) == 4096 and parse_size("unlimited") is None
    assert parse_duration("500ms") == 0.5 and parse_duration("2m") == 120 and parse_duration(3) == 3.0
    for bad in ("-1", "1 parsec", "", True):
        with pytest.raises(ValueError):
            parse_size(bad)


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
        f.write_text('[limits]\nmemory = "1GiB"\n')
        assert load(str(f)).limits.memory == 2**30
    assert not [n for n in _cached_files(cache) if "adhoc" in n] and len(_cached_files(cache)) == 0


def test_planted_cache_entry_with_another_stamp_is_ignored(profile_cache) -> None:
    import marshal

    from sandbox import profile as profile_mod

    cache, named = profile_cache
    f = named / "mine.toml"
    f.write_text('[limits]\nmemory = "1GiB"\n')
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
        (named / f"p{i}.toml").write_text('[limits]\nmemory = "1GiB"\n')
        assert load(f"p{i}").limits.memory == 2**30
    assert len(_cached_files(cache)) == 5
