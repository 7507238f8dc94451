"""API keys -> tenants, (tenant, cache_salt) -> cache namespace, the CLI's flags, and
Engine.generate's cache_salt."""

from __future__ import annotations

import pytest

from radixserve.cli import add_options
from radixserve.config import ServerConfig
from radixserve.cache.events import page_hashes
from radixserve.tenants import (DEFAULT_TENANT, Tenants, check_cache_salt, load_cache_secret,
                                namespace_of, parse_keys, tenant_namespace_prefix)
from tests.conftest import checked_engine
from tests.factories import tiny_model_dir


def test_keys_and_tenants(tmp_path) -> None:
    f = tmp_path / "keys"
    f.write_text("# comment\nk-file t-file\n\nk-bare   # a key alone\n")
    keys = parse_keys(["k1", "k2=alice", "pad==", "pad2==bob"], str(f))
    assert keys == {"k1": DEFAULT_TENANT, "k2": "alice", "pad==": DEFAULT_TENANT,
                    "pad2=": "bob", "k-file": "t-file", "k-bare": DEFAULT_TENANT}
    t = Tenants(keys)
    assert t.enabled and t.tenant_of("k2") == "alice" and t.tenant_of("k1") == DEFAULT_TENANT
    for bad in (None, "", "alice", "k2 ", "k"):
        assert t.tenant_of(bad) is None
    assert "alice" in t.names
    assert Tenants({}).tenant_of(None) == DEFAULT_TENANT  # no keys: everyone is default


@pytest.mark.parametrize("entry, error", [
    (["=alice"], "tenant name|must not be empty"), (["k=bad tenant"], "tenant name"),
    (["k=a", "k=b"], "already the key of tenant"), ([" "], "must not be empty")])
def test_bad_keys_are_refused(entry, error) -> None:
    with pytest.raises(ValueError, match=error):
        parse_keys(entry, None)


def test_bad_keys_file_is_refused(tmp_path) -> None:
    f = tmp_path / "keys"
    f.write_text("k t extra\n")
    with pytest.raises(ValueError, match=":1: expected 'key tenant'"):
        parse_keys(None, str(f))
    with pytest.raises(ValueError, match="cannot be read"):
        ServerConfig.from_kwargs(api_keys_file=str(tmp_path / "missing"))


def test_namespaces_are_distinct_and_default_is_none() -> None:
    secret = load_cache_secret(None)
    assert namespace_of(DEFAULT_TENANT, None, secret) is None
    names = {namespace_of(t, s, secret) for t in ("default", "a", "b", "a,b")
             for s in (None, "x", "a", "b", "null")}
    assert len(names) == 20 and all(n is None or n.startswith("ns-") for n in names)
    assert namespace_of("a", None, secret) != namespace_of("default", "a", secret)
    assert namespace_of("a", "x", secret) == namespace_of("a", "x", secret)


def test_namespaces_and_page_hashes_are_keyed_by_the_deployment_secret(tmp_path) -> None:
    """Issue 25, class 5: without the secret, a tenant's name does not give its
    namespace, nor a prompt its page hashes; a warm restart (same state directory) or a
    fleet (same file) gets the same ones."""
    a, b = load_cache_secret(None), load_cache_secret(None)
    assert a != b
    assert namespace_of("alice", None, a) != namespace_of("alice", None, b)
    assert tenant_namespace_prefix("alice", a) != tenant_namespace_prefix("alice", b)
    ids = list(range(64))
    assert page_hashes(ids, 16, None, key=a) != page_hashes(ids, 16, None, key=b)
    assert page_hashes(ids, 16, None, key=a) != page_hashes(ids, 16, None)
    kept = load_cache_secret(None, str(tmp_path / "kv"))
    assert kept == load_cache_secret(None, str(tmp_path / "kv"))  # a warm restart
    path = tmp_path / "kv" / "cache-secret"
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_cache_secret(str(path)) == kept  # a fleet sharing the file
    (tmp_path / "short").write_text("too short")
    with pytest.raises(ValueError, match="at least 16"):
        load_cache_secret(str(tmp_path / "short"))
    with pytest.raises(ValueError, match="cannot be read"):
        load_cache_secret(str(tmp_path / "missing"))


@pytest.mark.parametrize("keys, admin, operators, others", [
    ({}, None, [None, "anything"], []),  # no keys: a single-user server
    ({}, "adm", ["adm"], [None, "x"]),
    ({"k1": "default", "k2": "default"}, None, ["k1", "k2"], [None, "x"]),  # the fallback
    ({"k1": "default", "ka": "alice"}, None, [], ["k1", "ka", None]),  # several: nobody
    ({"k1": "default", "ka": "alice"}, "adm", ["adm"], ["k1", "ka", None]),
])
def test_who_is_the_operator(keys, admin, operators, others) -> None:
    t = Tenants(keys, admin)
    assert all(t.is_operator(k) for k in operators)
    assert not any(t.is_operator(k) for k in others)
    if admin and keys:
        assert t.tenant_of(admin) == DEFAULT_TENANT  # accepted for every call
    t.add_internal_key("gateway")
    assert t.is_operator("gateway") == t.everyone_operates  # the gateway is no operator


def test_cache_salt_checks() -> None:
    assert check_cache_salt(None) is None and check_cache_salt("s") == "s"
    for bad in ("", "x" * 1025, 3):
        with pytest.raises(ValueError, match="cache_salt"):
            check_cache_salt(bad)


def test_cli_takes_api_key_several_times() -> None:
    import argparse
    parser = argparse.ArgumentParser()
    add_options(parser, ServerConfig)
    args = vars(parser.parse_args(["--api-key", "a=t1", "--api-key", "b",
                                   "--api-keys-file", "f"]))
    assert args["api_key"] == ["a=t1", "b"] and args["api_keys_file"] == "f"
    assert vars(parser.parse_args([]))["api_key"] is None


def test_engine_cache_salt(tmp_path_factory) -> None:
    tiny = tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models")
    ids = list(range(100, 180))
    sp = {"max_new_tokens": 1, "temperature": 0}
    with checked_engine(tiny, max_total_tokens=2048, debug_invariants=True) as engine:
        def cached(**kw) -> int:
            return engine.generate(input_ids=ids, sampling_params=sp, **kw)[
                "meta_info"]["cached_tokens"]
        assert cached() == 0 and cached() == 64
        assert cached(cache_salt="s") == 0 and cached(cache_salt="s") == 64
        assert cached(cache_salt="t") == 0
        with pytest.raises(ValueError, match="cache_salt"):
            cached(cache_salt="")
        # Compiled grammars are cached per namespace too: a hit would be a timing signal.
        regex = {"max_new_tokens": 2, "temperature": 0, "regex": "[ab]{2}"}
        compiles = lambda: engine.stats()["grammar_compiles"]  # noqa: E731
        start = compiles()
        engine.generate(input_ids=ids, sampling_params=regex, cache_salt="s")
        engine.generate(input_ids=ids, sampling_params=regex, cache_salt="s")
        assert compiles() == start + 1
        engine.generate(input_ids=ids, sampling_params=regex, cache_salt="t")
        assert compiles() == start + 2
