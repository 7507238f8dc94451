"""Tenants: who a caller is (from its API key) and which radix cache namespace its requests
use (from its tenant and the request's `cache_salt`).

A shared prefix cache leaks across users: a request whose prefix is cached returns sooner
and reports `cached_tokens`, so one caller could probe another's prompts token by token
(vLLM's CVE-2025-46570 added `cache_salt` for this). Here every request is looked up and
cached in the namespace `namespace_of(tenant, cache_salt)`, which the server derives from
the *authenticated* tenant: a client can choose its salt, never its tenant, so no salt it
sends can reach another tenant's namespace (see docs/tenants.md for what this does and
does not hide).

Keys: `--api-key KEY` (the `default` tenant's key) or `--api-key KEY=TENANT`, any number
of times, and/or `--api-keys-file FILE` (one `key tenant` a line; `#` comments). Without
any key there is one tenant, `default`, and today's single namespace.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Iterable

DEFAULT_TENANT = "default"
"""The tenant of a bare `--api-key KEY`, and of every caller when no key is configured."""

TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,63}")
"""Tenant names: short, printable, no spaces or `=` (they label metrics)."""

MAX_CACHE_SALT = 1024


def namespace_of(tenant: str, cache_salt: str | None) -> str | None:
    """The radix cache namespace of `tenant`'s requests with `cache_salt`: None (the tree's
    default namespace) for the default tenant without a salt, else
    `tenant_namespace_prefix(tenant)` and a hash of both. The pair is encoded
    unambiguously (JSON) and hashed with a personalised BLAKE2b, so two different
    (tenant, salt) pairs never share a namespace; the prefix lets the cache view show a
    tenant its own namespaces (whatever their salts) and no others."""
    if tenant == DEFAULT_TENANT and cache_salt is None:
        return None
    digest = hashlib.blake2b(json.dumps([tenant, cache_salt]).encode(), digest_size=16,
                             person=b"radixserve-ns")
    return tenant_namespace_prefix(tenant) + digest.hexdigest()


def tenant_namespace_prefix(tenant: str) -> str:
    """How every namespace of `tenant` begins (`ns-`, a hash of the tenant alone, `-`)."""
    tag = hashlib.blake2b(tenant.encode(), digest_size=8, person=b"radixserve-tn")
    return f"ns-{tag.hexdigest()}-"


def scoped_rid(tenant: str, rid: str) -> str:
    """The name a tenant's request goes by inside a server (scheduler, front door) and in a
    router's books: rids are the caller's to choose, so two tenants may pick the same one,
    and neither may reach the other's by it (an abort finds only `scoped_rid(its caller's
    tenant, rid)`). Tenant names never contain `/`, so no two (tenant, rid) pairs share a
    name; callers only ever see their own rid."""
    return f"{tenant}/{rid}"


def check_cache_salt(salt: object) -> str | None:
    """`cache_salt` as given by a caller: None, or a non-empty string of at most
    MAX_CACHE_SALT characters; ValueError naming the field otherwise."""
    if salt is None:
        return None
    if not isinstance(salt, str):
        raise ValueError(f"cache_salt must be a string, got {type(salt).__name__}")
    if not salt or len(salt) > MAX_CACHE_SALT:
        raise ValueError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT} "
                         f"characters, got {len(salt)}")
    return salt


def _fingerprint(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class Tenants:
    """The configured API keys and their tenants. Keys are kept as SHA-256 fingerprints
    and looked up by fingerprint, so a lookup's time does not depend on how much of a
    guessed key is right."""

    def __init__(self, keys: dict[str, str]) -> None:
        self._by_key = {_fingerprint(k): t for k, t in keys.items()}
        self.names = sorted(set(keys.values()))
        """Every configured tenant (for metrics labels; bounded by the configuration)."""

    @property
    def enabled(self) -> bool:
        """Whether API keys are configured (else every caller is the default tenant)."""
        return bool(self._by_key)

    def tenant_of(self, api_key: str | None) -> str | None:
        """The tenant `api_key` belongs to, or None if it is no configured key. Without
        configured keys every caller is the default tenant, whatever it sends."""
        if not self._by_key:
            return DEFAULT_TENANT
        if not isinstance(api_key, str) or not api_key:
            return None
        return self._by_key.get(_fingerprint(api_key))

    def add_internal_key(self, api_key: str) -> None:
        """A key for the server's own HTTP gateway (a secret made at start-up): it counts as
        the default tenant; only configured keys make `enabled` true."""
        if self._by_key:
            self._by_key[_fingerprint(api_key)] = DEFAULT_TENANT

    @classmethod
    def from_config(cls, api_key: str | list[str] | None, api_keys_file: str | None) -> "Tenants":
        return cls(parse_keys(api_key, api_keys_file))


def _split_entry(entry: str) -> tuple[str, str]:
    """`KEY` or `KEY=TENANT`, split at the last `=` (keys may end in `=` padding: a bare
    key with a trailing `=` stays a bare key, since tenant names are never empty)."""
    key, sep, tenant = entry.rpartition("=")
    if not sep or not tenant:
        return entry, DEFAULT_TENANT
    return key, tenant  # an empty key (`=TENANT`) is refused by the caller


def parse_keys(api_key: str | list[str] | None, api_keys_file: str | None) -> dict[str, str]:
    """All configured keys -> tenant; ValueError naming the bad entry (never the key)."""
    entries: list[tuple[str, str, str]] = []  # (key, tenant, where)
    given: Iterable[str] = [] if api_key is None else (
        [api_key] if isinstance(api_key, str) else api_key)
    for i, entry in enumerate(given):
        if not isinstance(entry, str):
            raise ValueError(f"api_key entries must be strings, got {type(entry).__name__}")
        key, tenant = _split_entry(entry.strip())
        entries.append((key, tenant, f"api_key #{i + 1}"))
    if api_keys_file is not None:
        path = Path(api_keys_file)
        try:
            lines = path.read_text().splitlines()
        except OSError as e:
            raise ValueError(f"api_keys_file {api_keys_file!r} cannot be read: {e}") from None
        for n, line in enumerate(lines, 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            if len(fields) > 2:
                raise ValueError(f"{api_keys_file}:{n}: expected 'key tenant', got "
                                 f"{len(fields)} fields")
            entries.append((fields[0], fields[1] if len(fields) == 2 else DEFAULT_TENANT,
                            f"{api_keys_file}:{n}"))
    keys: dict[str, str] = {}
    for key, tenant, where in entries:
        if not key.strip():
            raise ValueError(f"{where}: the API key must not be empty")
        if not TENANT_NAME.fullmatch(tenant):
            raise ValueError(f"{where}: tenant name {tenant!r} must match "
                             f"{TENANT_NAME.pattern}")
        if keys.get(key, tenant) != tenant:
            raise ValueError(f"{where}: this key is already the key of tenant {keys[key]!r}")
        keys[key] = tenant
    return keys
