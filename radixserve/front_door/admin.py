"""What the operator's calls need at the front door besides the key check: the profile
directory, the tenant's view of the stats, and a tenant's pin bounds (docs/security.md)."""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixserve.config import ServerConfig
from radixserve.messages import AbortCall, WorkersCall
from radixserve.rids import RidsInFlight, scoped_rid

PROFILE_SUBDIR = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
"""A caller's `output_dir` for a profile: one plain name, made inside `--profile-dir`."""

OPERATOR_STATS = frozenset({"pinned_tokens", "lora_running", "lora_waiting"})
"""The operator's only: the totals of every tenant's pins, and the adapters every tenant's
requests run under."""

TENANT_CONFIG = ("page_size", "max_prompt_chars", "max_call_chars", "max_stop_strings",
                 "max_stop_chars", "max_top_logprobs_num", "max_constraint_chars",
                 "max_grammar_compile_seconds", "max_request_bytes", "max_frame_bytes",
                 "max_pin_ttl")
"""The options a tenant's `/get_server_info` shows: the limits its own requests are
checked against. The rest (keys, other tenants, paths, hosts and ports, pool sizes,
restarts) is the operator's."""


class ProfileDir:
    """The server's profile directory: `--profile-dir` (made if missing: the operator's
    path), else a private temporary one (mode 0700), made at the first profile, so a server
    that never profiles leaves no directory behind."""

    def __init__(self, configured: str | None) -> None:
        self._path = None if configured is None else Path(configured)

    def path(self) -> Path:
        if self._path is None:
            self._path = Path(tempfile.mkdtemp(prefix="radixserve-profiles-"))
        self._path.mkdir(parents=True, exist_ok=True)
        return self._path


def profile_output(base: Path, subdir: str | None) -> str:
    """Where a trace goes: `base`, or its subdirectory `subdir` (one plain name; the
    worker makes it, one level, never its parents). ValueError naming the rule otherwise:
    no path, no `..`, nothing outside `base`."""
    if subdir is None:
        return str(base)
    if not PROFILE_SUBDIR.fullmatch(subdir):  # no separator, no leading dot: no `..`
        raise ValueError(f"output_dir names a subdirectory of the server's profile directory "
                         f"(--profile-dir): one name matching {PROFILE_SUBDIR.pattern}, not "
                         f"a path; got {subdir[:80]!r}")
    return str(base / subdir)


def tenant_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """The stats a tenant sees: the pool's, without the totals of every tenant's pins."""
    return {k: v for k, v in stats.items() if k not in OPERATOR_STATS}


def tenant_pin(config: ServerConfig, ttl: float | None, pool_tokens: int,
               tenants: int) -> tuple[float, int]:
    """A tenant's pin's (ttl, quota): its `ttl` within `--max-pin-ttl` (none: that), and
    the most tokens the tenant's pins may hold, `--max-pinned-tokens-per-tenant` or a fair
    share of `--max-pinned-tokens` among `tenants`. ValueError naming a bound it is past."""
    limit = config.max_pin_ttl
    if ttl is not None and ttl > limit:
        raise ValueError(f"ttl {ttl:g} is more than max_pin_ttl={limit:g} seconds "
                         "(--max-pin-ttl)")
    quota = (config.max_pinned_tokens_per_tenant
             if config.max_pinned_tokens_per_tenant is not None
             else config.pin_limit(pool_tokens) // max(1, tenants))
    return (limit if ttl is None else ttl), quota


def abort_targets(call: AbortCall, tenant: str, operator: bool,
                  rids: RidsInFlight[Any]) -> list[str]:
    """The scoped rids an abort reaches: `rid`, or with `abort_all` every request in
    flight, of the caller's `tenant`; the `operator`'s reach every tenant's, or with
    `tenant` that tenant's (issue 41: the operator can stop a runaway tenant). ValueError
    for an abort that names nothing, or a tenant named by anyone but the operator."""
    if call.tenant is not None and not operator:
        raise ValueError("tenant: only the operator (--admin-api-key) aborts another "
                         "tenant's requests; a tenant's abort reaches its own")
    if not call.abort_all and not call.rid:
        raise ValueError("pass rid, or abort_all: true")
    whose = call.tenant if call.tenant is not None else (
        None if operator and call.abort_all else tenant)
    if call.abort_all:
        return rids.of_tenant(whose)
    scoped = scoped_rid(whose if whose is not None else tenant, call.rid)
    return [scoped] if rids.owners.get(scoped) is not None else []


@dataclass(frozen=True)
class Who:
    """A caller, as its key names it."""

    tenant: str
    operator: bool


def not_a_router(call: WorkersCall, address: str) -> None:
    """A server refuses a `workers` call (a router's)."""
    raise ValueError(f"workers {call.action}: {address} is a server, not a router; replicas "
                     "are added to and removed from a router (radixserve router)")
