"""The checks of `EngineConfig`'s options (each takes the config as `Any`: config.py imports
this module, not the other way round) (`EngineConfig.validate`): each a ValueError that
names the option and what it must be."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any



QUANTIZATIONS = ("none", "int8", "q4")
"""The weight formats `quantization` names (`model/quantize.py`)."""
SPECULATIVE_MODES = ("off", "lookup", "tree")
"""How a sequence drafts (`speculative`; speculative/drafter.py): not at all, from its own
context, or also from what the radix tree holds."""
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections a LoRA adapter may adapt (Hugging Face names; `lora_target_modules`)."""
LORA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@/-]{0,127}")
"""Adapter names: what a request's `lora_name` and an OpenAI `model` name."""


def require_positive(config: Any, name: str) -> None:
    """A ValueError unless option `name` of `config` is a positive integer (bool is not)."""
    value = getattr(config, name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


MIN_STALL_SECONDS = 2.0
"""Twice the idle scheduler's heartbeat (server/processes.py, `CACHE_EVENTS_HEARTBEAT`): a
shorter bound would call an idle scheduler stalled between two heartbeats."""


def check_engine(config: Any) -> None:
    positive = functools.partial(require_positive, config)
    for name in ("page_size", "chunked_prefill_size", "max_running_requests",
                 "max_queued_requests", "max_queued_requests_per_tenant", "tenant_prefill_tokens",
                 "cascade_max_levels", "cascade_min_group_size",
                 "admission_max_new_tokens", "max_stop_strings", "max_stop_chars",
                 "max_constraint_chars", "grammar_compile_threads",
                 "max_pending_grammar_compiles", "max_grammar_compiles_per_tenant",
                 "max_constraint_depth", "speculative_num_draft_tokens", "tp_size", "nnodes",
                 "cuda_graph_max_bs", "max_logprob_entries"):
        positive(name)
    if config.tp_size % config.nnodes:
        raise ValueError(f"tp_size ({config.tp_size}) must divide by nnodes ({config.nnodes})")
    if not isinstance(config.node_rank, int) or not 0 <= config.node_rank < config.nnodes:
        raise ValueError(f"node_rank must be in [0, nnodes), got {config.node_rank!r}")
    if config.dist_init_addr is not None:
        host, _, port = str(config.dist_init_addr).rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("dist_init_addr must be host:port, got "
                             f"{config.dist_init_addr!r}")
    elif config.nnodes > 1:
        raise ValueError("nnodes > 1 needs dist_init_addr (node 0's host:port)")
    for name in ("max_prompt_chars", "max_call_chars"):
        if getattr(config, name) is not None:
            positive(name)
    for name in ("max_top_logprobs_num", "max_running_requests_per_tenant",
                 "cascade_min_shared_tokens"):
        if not isinstance(getattr(config, name), int) or getattr(config, name) < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {getattr(config, name)!r}")
    if not config.scheduler_stall_seconds >= MIN_STALL_SECONDS:
        raise ValueError(f"scheduler_stall_seconds must be at least {MIN_STALL_SECONDS:g} "
                         "(an idle scheduler says it is alive once a second), got "
                         f"{config.scheduler_stall_seconds!r}")
    if not config.max_grammar_compile_seconds > 0:
        raise ValueError("max_grammar_compile_seconds must be > 0, "
                         f"got {config.max_grammar_compile_seconds!r}")
    if config.max_total_tokens is not None:
        positive("max_total_tokens")
        if config.max_total_tokens < config.page_size:
            raise ValueError("max_total_tokens must hold at least one page")
    if config.context_length is not None:
        positive("context_length")
    if config.max_pinned_tokens is not None and (
            not isinstance(config.max_pinned_tokens, int) or config.max_pinned_tokens < 0):
        raise ValueError("max_pinned_tokens must be an integer >= 0, "
                         f"got {config.max_pinned_tokens!r}")
    if config.kv_disk_dir is not None:
        if not isinstance(config.kv_disk_dir, str) or not config.kv_disk_dir:
            raise ValueError("kv_disk_dir must be a directory path, "
                             f"got {config.kv_disk_dir!r}")
        if not config.enable_prefix_cache:
            raise ValueError("kv_disk_dir needs the prefix cache (enable_prefix_cache)")
    if not isinstance(config.kv_disk_size, int) or config.kv_disk_size < 0:
        raise ValueError("kv_disk_size must be a number of bytes >= 0, "
                         f"got {config.kv_disk_size!r}")
    if not config.kv_persist_interval >= 0:
        raise ValueError("kv_persist_interval must be >= 0 seconds, "
                         f"got {config.kv_persist_interval!r}")
    for name, allowed in (("schedule_policy", ("lpm", "fcfs")),
                          ("attention_backend", ("auto", "torch", "triton")),
                          ("kv_layout", ("paged", "virtual")),
                          ("virtual_page_layout", ("auto", "block", "layer")),
                          ("speculative", SPECULATIVE_MODES), ("quantization", QUANTIZATIONS),
                          ("dtype", ("auto", "float32", "bfloat16", "float16")),
                          ("kv_events", ("off", "radixserve", "llm-d"))):
        if getattr(config, name) not in allowed:
            choices = ", ".join(allowed[:-1]) + f" or {allowed[-1]}"
            raise ValueError(f"{name} must be {choices}, got {getattr(config, name)!r}")
    if config.virtual_max_map_count is not None:
        positive("virtual_max_map_count")
    if not 0 < config.kv_memory_fraction < 1:
        raise ValueError("kv_memory_fraction must be in (0, 1)")
    if not 0 <= config.min_new_token_ratio <= config.init_new_token_ratio <= 1:
        raise ValueError("need 0 <= min_new_token_ratio <= init_new_token_ratio <= 1")
    check_lora(config)


def check_server(config: Any) -> None:
    """The server's own options (a ServerConfig's beyond an EngineConfig's)."""
    for name in ("rpc_port", "cache_events_port", "port", "kv_events_port",
                 "kv_events_replay_port"):
        if not 0 <= getattr(config, name) <= 65535:
            raise ValueError(f"{name} must be in [0, 65535], got {getattr(config, name)}")
    from radixserve.tenants import parse_keys
    parse_keys(config.api_key, config.api_keys_file)  # ValueError naming the bad entry
    if config.admin_api_key is not None and (
            not isinstance(config.admin_api_key, str) or not config.admin_api_key.strip()):
        raise ValueError("admin_api_key must be a non-empty string")
    if config.max_pinned_tokens_per_tenant is not None and (
            not isinstance(config.max_pinned_tokens_per_tenant, int)
            or config.max_pinned_tokens_per_tenant < 0):
        raise ValueError("max_pinned_tokens_per_tenant must be an integer >= 0, "
                         f"got {config.max_pinned_tokens_per_tenant!r}")
    if not config.max_pin_ttl > 0:
        raise ValueError(f"max_pin_ttl must be > 0 seconds, got {config.max_pin_ttl!r}")
    for name in ("max_frame_bytes", "max_request_bytes", "rpc_send_buffer_bytes"):
        if getattr(config, name) is not None and getattr(config, name) < 1024:
            raise ValueError(f"{name} must be at least 1024")
    if not config.stored_response_ttl > 0:
        raise ValueError("stored_response_ttl must be > 0 seconds, "
                         f"got {config.stored_response_ttl!r}")
    if not config.chat_template_timeout > 0:
        raise ValueError("chat_template_timeout must be > 0 seconds, "
                         f"got {config.chat_template_timeout!r}")
    for name in ("max_client_backlog", "http_stream_backlog", "chat_template_threads",
                 "max_pending_chat_renders", "http_fd_reserve", "max_stored_responses",
                 "max_stored_response_bytes"):
        require_positive(config, name)
    if config.http_max_connections is not None:
        require_positive(config, "http_max_connections")
    for name in ("http_header_timeout", "http_body_timeout", "http_idle_timeout"):
        if not getattr(config, name) > 0:
            raise ValueError(f"{name} must be > 0 seconds, got {getattr(config, name)!r}")
    if not config.watchdog_timeout > 0:
        raise ValueError(f"watchdog_timeout must be > 0, got {config.watchdog_timeout!r}")
    if not config.worker_restart_window >= 0:
        raise ValueError("worker_restart_window must be >= 0 seconds, "
                         f"got {config.worker_restart_window!r}")
    if config.log_level.lower() not in ("debug", "info", "warning", "error"):
        raise ValueError(
            f"log_level must be debug, info, warning or error, got {config.log_level!r}")


def check_lora_name(name: object) -> str:
    if not isinstance(name, str) or not LORA_NAME.fullmatch(name):
        raise ValueError(f"a LoRA adapter name is 1-128 letters, digits and _.:@/- "
                         f"(starting with a letter or digit), got {name!r}")
    return name


def parse_lora_paths(entries: list[Any] | dict[str, str] | None) -> dict[str, str]:
    """`lora_paths` as names to paths, from each form SGLang takes: a dict `{NAME: PATH}`
    (its Engine's), or a list whose entries are `NAME=PATH`, a bare `PATH` (named after
    its directory), or SGLang's adapter reference `{"lora_name", "lora_path", "pinned"}`
    (a dict, or its JSON text as SGLang's --lora-paths takes it). ValueError naming a bad
    or repeated entry, and `pinned` other than false (adapters here are unloaded least
    recently used first)."""
    if isinstance(entries, dict):
        entries = [{"lora_name": name, "lora_path": path} for name, path in entries.items()]
    elif entries is not None and not isinstance(entries, list):
        raise ValueError(f"lora_paths is a list of NAME=PATH entries or a dict of names to "
                         f"paths, got {type(entries).__name__}")
    named: dict[str, str] = {}
    for entry in entries or []:
        name, path = _lora_entry(entry)
        if name in named:
            raise ValueError(f"lora_paths names the adapter {name!r} twice")
        named[check_lora_name(name)] = path
    return named


def _lora_entry(entry: Any) -> tuple[str, str]:
    """One `lora_paths` entry's (name, path)."""
    if isinstance(entry, str) and entry.lstrip().startswith("{"):
        try:
            entry = json.loads(entry)
        except ValueError as e:
            raise ValueError(f"lora_paths entry {entry[:200]!r} is not JSON: {e}") from None
    if isinstance(entry, dict):
        unknown = set(entry) - {"lora_name", "lora_path", "pinned"}
        if unknown or not {"lora_name", "lora_path"} <= set(entry):
            raise ValueError(f"a lora_paths entry as an object has lora_name, lora_path and "
                             f"optionally pinned, got the keys {sorted(entry)}")
        if entry.get("pinned", False) is not False:
            raise ValueError("lora_paths: pinned is not supported: adapters are unloaded "
                             "least recently used first past --max-loaded-loras")
        if not isinstance(entry["lora_path"], str):
            raise ValueError(f"lora_paths: the lora_path of {entry['lora_name']!r} is a path")
        return entry["lora_name"], entry["lora_path"]
    if not isinstance(entry, str):
        raise ValueError(f"a lora_paths entry is NAME=PATH, a path or an object, got {entry!r}")
    name, eq, path = entry.partition("=")
    return (name, path) if eq else (Path(entry).name, entry)


def check_lora(config: Any) -> None:
    parse_lora_paths(config.lora_paths)  # ValueError naming a bad entry
    for name in ("max_loras_per_batch", "max_loaded_loras"):
        require_positive(config, name)
    if config.max_lora_rank is not None:
        require_positive(config, "max_lora_rank")
    if config.max_loaded_loras < config.max_loras_per_batch:
        raise ValueError(f"max_loaded_loras ({config.max_loaded_loras}) must be at least "
                         f"max_loras_per_batch ({config.max_loras_per_batch})")
    unknown = set(config.lora_target_modules or ()) - set(LORA_TARGETS) - {"all"}
    if unknown:
        raise ValueError(f"lora_target_modules: unknown {sorted(unknown)}; known: "
                         f"{', '.join(LORA_TARGETS)} or all")
