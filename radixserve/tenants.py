"""Tenants: who a caller is (from its API key) and which radix cache namespace its requests
use (from its tenant and the request's `cache_salt`).

A shared prefix cache leaks across users: a request whose prefix is cached returns sooner
and reports `cached_tokens`, so one caller could probe another's prompts token by token
(vLLM's CVE-2025-46570 added `cache_salt` for this). Here every request is looked up and
cached in the namespace `namespace_of(tenant, cache_salt)`, which the server derives from
the *authenticated* tenant: a client can choose its salt, never its tenant, so no salt it
sends can reach another tenant's namespace (see docs/tenants.md for what this does and
does not hide). Namespaces, and the page hashes that name cached prefixes to a router
(cache/events.py), are keyed by the deployment's cache secret (`load_cache_secret`), so
nobody without it can compute a tenant's namespace or a prompt's page hashes.

Keys: `--api-key KEY` (the `default` tenant's key) or `--api-key KEY=TENANT`, any number
of times, and/or `--api-keys-file FILE` (one `key tenant` a line; `#` comments). Without
any key there is one tenant, `default`, and today's single namespace.

The operator (`--admin-api-key`) may do what concerns every tenant: flush the cache,
profile, take cache snapshots, subscribe to the cache events, see the whole configuration
and change a router's fleet (`Tenants.is_operator`); for every other call the admin key
is the default tenant's.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import stat
from pathlib import Path
from typing import Any, Iterable

from radixserve.disk_layout import PinnedDir, pinned

DEFAULT_TENANT = "default"
"""The tenant of a bare `--api-key KEY`, and of every caller when no key is configured."""

TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,63}")
"""Tenant names: short, printable, no spaces or `=` (they label metrics)."""

MAX_CACHE_SALT = 1024


CACHE_SECRET_FILE = "cache-secret"
"""The cache secret's file name in a server's state directory (its `kv_disk_dir`)."""
MIN_SECRET_CHARS = 16


def load_cache_secret(secret_file: str | None, state_dir: str | None = None) -> bytes:
    """The deployment's cache secret, as the 32-byte key that namespaces and page hashes
    are keyed with: from `secret_file` (the operator's, shared by a fleet), else from
    `state_dir`'s CACHE_SECRET_FILE (made there, mode 0600, on first use: a warm restart
    on the same disk tier keeps its namespaces), else made now (this process only).
    `state_dir` (the disk tier's directory, as this process pinned it) is made or checked
    first, so that a start on a directory other accounts can reach fails here
    (`disk_layout.pin`). ValueError naming the file when it cannot be read, is too short,
    or (the one in `state_dir`) is not this account's alone (`ensure_secret_file`)."""
    if state_dir is not None and secret_file is None:
        store = pinned(state_dir)
        _ensure_secret(store)
        try:
            with store.open_read(CACHE_SECRET_FILE) as f:
                raw = f.read(4096).strip()
        except OSError as e:
            raise ValueError(f"cache secret {store.path / CACHE_SECRET_FILE} cannot be read: "
                             f"{e}") from None
        return _checked_secret(raw, str(store.path / CACHE_SECRET_FILE))
    if state_dir is not None:
        pinned(state_dir)
    if secret_file is None:
        return _derive_key(secrets.token_bytes(32))
    try:
        raw = Path(secret_file).read_bytes().strip()
    except OSError as e:
        raise ValueError(f"cache_secret_file {secret_file!r} cannot be read: {e}") from None
    return _checked_secret(raw, secret_file)


def cache_secret_key(secret: str) -> bytes:
    """The key of a cache secret given as text (what a `cache_secret_file` holds), as
    `load_cache_secret` derives it from that file: for a router handed the secret itself."""
    return _checked_secret(secret.strip().encode(), "the cache secret")


def _checked_secret(raw: bytes, name: str) -> bytes:
    if len(raw) < MIN_SECRET_CHARS:
        raise ValueError(f"cache_secret_file {name!r} holds {len(raw)} characters; "
                         f"a secret needs at least {MIN_SECRET_CHARS} (openssl rand -hex 32)")
    return _derive_key(raw)


def ensure_secret_file(directory: Path) -> Path:
    """`directory`'s CACHE_SECRET_FILE, made (64 hex digits, mode 0600; O_EXCL, so nothing
    planted there, a symbolic link included, is written through) if it is missing, else
    checked: a regular file of this account's that no other account can read, since
    whoever could read or plant it could compute every tenant's namespace and every
    prompt's page hashes. ValueError naming the file, why and the fix otherwise."""
    _ensure_secret(pinned(directory))
    return directory / CACHE_SECRET_FILE


def _ensure_secret(store: PinnedDir) -> None:
    try:
        fd = store.create_private(CACHE_SECRET_FILE, os.O_WRONLY | os.O_EXCL)
    except FileExistsError:
        _check_own_secret(store)
        return
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _check_own_secret(store: PinnedDir) -> None:
    path = store.path / CACHE_SECRET_FILE
    fix = "delete it (a new one is made; the disk tier's namespaces start afresh)"
    try:
        with store.open_read(CACHE_SECRET_FILE) as f:
            st = os.fstat(f.fileno())
    except OSError as e:
        raise ValueError(f"cache secret {path} cannot be opened ({e}; a symbolic link is never "
                         f"followed): {fix}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"cache secret {path} is not a regular file: {fix}")
    if st.st_uid != os.geteuid():
        raise ValueError(f"cache secret {path} is owned by uid {st.st_uid}, not by this "
                         f"server's account (uid {os.geteuid()}), so another account may know "
                         f"it: {fix}")
    if st.st_mode & 0o077:
        raise ValueError(f"cache secret {path} has mode {stat.S_IMODE(st.st_mode):04o}, "
                         f"readable by other accounts: {fix}, or run `chmod 600 {path}` if no "
                         "other account can have read it")


def _derive_key(raw: bytes) -> bytes:
    return hashlib.blake2b(raw, digest_size=32, person=b"radixserve-key").digest()


def namespace_of(tenant: str, cache_salt: str | None, secret: bytes) -> str | None:
    """The radix cache namespace of `tenant`'s requests with `cache_salt`: None (the tree's
    default namespace) for the default tenant without a salt, else
    `tenant_namespace_prefix(tenant, secret)` and a keyed hash of both. The pair is encoded
    unambiguously (JSON) and hashed with a personalised BLAKE2b keyed by the deployment's
    cache `secret`, so two different (tenant, salt) pairs never share a namespace and
    nobody without the secret can compute one; the prefix lets the cache view show a
    tenant its own namespaces (whatever their salts) and no others."""
    if tenant == DEFAULT_TENANT and cache_salt is None:
        return None
    digest = hashlib.blake2b(json.dumps([tenant, cache_salt]).encode(), digest_size=16,
                             key=secret, person=b"radixserve-ns")
    return tenant_namespace_prefix(tenant, secret) + digest.hexdigest()


def tenant_namespace_prefix(tenant: str, secret: bytes) -> str:
    """How every namespace of `tenant` begins (`ns-`, a keyed hash of the tenant, `-`)."""
    tag = hashlib.blake2b(tenant.encode(), digest_size=8, key=secret, person=b"radixserve-tn")
    return f"ns-{tag.hexdigest()}-"


ADAPTER_MARK = "~lora-"
"""Between a namespace's tenant part and its LoRA adapter's fingerprint."""


def adapter_namespace(namespace: str | None, fingerprint: str) -> str:
    """The namespace of a request of `namespace` (its tenant and salt) run under the LoRA
    adapter whose weights `fingerprint` names (lora/adapter.py): KV computed under one
    adapter is matched only by requests of the same weights, tenant and salt."""
    return f"{namespace or ''}{ADAPTER_MARK}{fingerprint}"


def tenant_part(namespace: str | None) -> str | None:
    """The namespace `adapter_namespace` was given (what decides who may see it)."""
    if namespace is None:
        return None
    return namespace.partition(ADAPTER_MARK)[0] or None


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
    """The configured API keys and their tenants, and who the operator is. Keys are kept
    as SHA-256 fingerprints and looked up by fingerprint, so a lookup's time does not
    depend on how much of a guessed key is right.

    The operator: the holder of `admin_key` when one is set; else, without API keys,
    every caller (a keyless server is single-user), with keys that all belong to the
    default tenant, those keys (one tenant has no one to cross), and with keys of several
    tenants, nobody. The admin key is accepted for every call, as the default tenant."""

    def __init__(self, keys: dict[str, str], admin_key: str | None = None) -> None:
        self._by_key = {_fingerprint(k): t for k, t in keys.items()}
        self.names = sorted(set(keys.values()))
        """Every configured tenant (for metrics labels; bounded by the configuration)."""
        self.enabled = bool(self._by_key)
        """Whether API keys are configured (else every caller is the default tenant)."""
        self.operator_keys: list[str] = (
            [admin_key] if admin_key else
            [k for k, t in keys.items() if t == DEFAULT_TENANT] if set(keys.values()) == {
                DEFAULT_TENANT} else [])
        """The keys that make their holder the operator (meaningless when `everyone`)."""
        self.everyone_operates = not admin_key and not keys
        self._operators = {_fingerprint(k) for k in self.operator_keys}
        if admin_key and self.enabled:
            self._by_key.setdefault(_fingerprint(admin_key), DEFAULT_TENANT)

    def who(self, api_key: str | None) -> tuple[str, bool] | None:
        """The tenant `api_key` belongs to and whether its holder may make the operator's
        calls (see the class), from one fingerprint; None if it is no configured key.
        Without configured keys every caller is the default tenant, whatever it sends."""
        fingerprint = _fingerprint(api_key) if isinstance(api_key, str) and api_key else b""
        tenant = self._by_key.get(fingerprint) if self._by_key else DEFAULT_TENANT
        if tenant is None:
            return None
        return tenant, self.everyone_operates or fingerprint in self._operators

    def tenant_of(self, api_key: str | None) -> str | None:
        found = self.who(api_key)
        return None if found is None else found[0]

    def knows(self, api_key: str | None) -> bool:
        """Whether `api_key` is a key of this deployment's (anything is, without keys)."""
        return self.tenant_of(api_key) is not None

    def is_operator(self, api_key: str | None) -> bool:
        found = self.who(api_key)
        return found is not None and found[1]

    def add_internal_key(self, api_key: str) -> None:
        """A key for the server's own HTTP gateway (a secret made at start-up): it counts as
        the default tenant, never as the operator (the gateway passes each caller's own key
        with the operator's calls); only configured keys make `enabled` true."""
        if self._by_key:
            self._by_key[_fingerprint(api_key)] = DEFAULT_TENANT

    @classmethod
    def from_config(cls, config: Any) -> Tenants:
        """The keys a server's or a router's config (ServerConfig, RouterConfig) sets:
        `api_key`, `api_keys_file` and `admin_api_key`."""
        return cls(parse_keys(config.api_key, config.api_keys_file), config.admin_api_key)


def forbidden_message(what: object) -> str:
    """The `forbidden` error's text for an operator call `what` made without the key."""
    return (f"{what} is an operator call: it needs the admin API key (--admin-api-key), "
            "which this key is not")


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
