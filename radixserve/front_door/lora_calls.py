"""The front door's side of LoRA adapters (radixserve/lora/, scheduler/loras.py).

- The operator's load and unload are checked before the scheduler sees them: the name is
  one a request and an OpenAI `model` can say (`config_checks.LORA_NAME`), and not one of
  the base model's names (which `model` means as the base); a load's `lora_path` is an
  existing directory on the server's machine, made absolute (the worker reads it; the
  path is the operator's, as `--lora-paths`' are).
- The list shows each adapter's path to the operator only (`LoraRegistry.describe` reads
  it from the caller's scope: every namespace for the operator, the tenant's otherwise).
- The adapters loaded now are followed here (the worker's at start, then each load's and
  unload's answer, with the adapters a load unloaded to make room), so a generate call
  naming an adapter that is not loaded is refused whole before any of its requests is
  queued. The scheduler refuses such a request too, one by one (an unload may overtake
  this check), and it stays the authority.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec

from radixserve.config import ServerConfig
from radixserve.config_checks import check_lora_name
from radixserve.messages import (CacheScope, Caller, ControlOp, ControlReply, LoadLoraCall,
                                 LorasCall, UnloadLoraCall, WorkerInfo)
from radixserve.tenants import tenant_namespace_prefix

LoraCall = LoadLoraCall | UnloadLoraCall | LorasCall
NO_LORA = "this server serves no LoRA adapters (start it with --lora-paths or --enable-lora)"


def base_model_names(config: ServerConfig) -> set[str]:
    """What an OpenAI `model` may say to mean the base model (as the HTTP server reads it):
    no adapter may be loaded under one of these."""
    return {n for n in (config.model, config.served_model_name, Path(config.model).name,
                        "default") if n}


def adapter_dir(path: str) -> str:
    """A load's `lora_path` as the worker gets it: absolute (relative paths are the server's
    working directory's), an existing directory; ValueError naming what is wrong."""
    if not path or "\x00" in path:
        raise ValueError("lora_path must be the path of a PEFT adapter's directory")
    where = os.path.abspath(path)
    try:
        is_dir = Path(where).is_dir()
    except (OSError, ValueError) as e:  # a name too long for the file system, ...
        raise ValueError(f"lora_path {path[:200]!r} cannot be read: {e}") from None
    if not is_dir:
        raise ValueError(f"lora_path {path[:200]!r} is not a directory on the server (a PEFT "
                         "LoRA adapter's: adapter_config.json and adapter_model.safetensors)")
    return where


class LoraCalls:
    """A server's load, unload and list calls, and the adapters it has loaded now."""

    def __init__(self, config: ServerConfig, secret: bytes) -> None:
        self.reserved = base_model_names(config)
        self.secret = secret
        self.loaded: set[str] | None = None
        """The adapters loaded now; None: LoRA serving is off (or the server not ready)."""
        self.pending: dict[int, LoadLoraCall | UnloadLoraCall] = {}
        """Loads and unloads sent to the scheduler, by their control id."""

    def ready(self, info: WorkerInfo) -> None:
        """The scheduler is (again) ready: its worker holds `info.loras` (a restarted one
        holds `--lora-paths`' adapters only), and what was in flight is gone."""
        self.loaded = None if info.loras is None else {a.name for a in info.loras}
        self.pending.clear()

    def control(self, call: LoraCall, tenant: str, operator: bool) -> tuple[ControlOp, Caller]:
        """The operation for the scheduler (its key dropped) and its caller; ValueError
        naming what is wrong with a load's or an unload's name or path."""
        caller = Caller() if operator else Caller(
            scope=CacheScope(tenant_namespace_prefix(tenant, self.secret), False))
        if isinstance(call, LorasCall):
            return msgspec.structs.replace(call, api_key=None), caller
        try:
            name = check_lora_name(call.lora_name)
        except ValueError as e:
            raise ValueError(f"lora_name: {e}") from None
        if isinstance(call, UnloadLoraCall):
            return msgspec.structs.replace(call, api_key=None), caller
        if name in self.reserved:
            raise ValueError(f"lora_name {name!r} is a name of the base model (an OpenAI "
                             f"`model` saying it means the base): choose another")
        return (msgspec.structs.replace(call, lora_path=adapter_dir(call.lora_path),
                                        api_key=None), caller)

    def sent(self, control_id: int, op: Any) -> None:
        if isinstance(op, (LoadLoraCall, UnloadLoraCall)):
            self.pending[control_id] = op

    def answered(self, reply: ControlReply) -> None:
        """A control reply from the scheduler: a load's or an unload's changes the list."""
        op = self.pending.pop(reply.call_id, None)
        if op is None or reply.error is not None or self.loaded is None:
            return
        if isinstance(op, LoadLoraCall):
            unloaded = reply.payload.get("unloaded")
            self.loaded.difference_update(unloaded if isinstance(unloaded, list) else [])
            self.loaded.add(op.lora_name)
        else:
            self.loaded.discard(op.lora_name)

    def check(self, lora_name: str | list[str | None] | None) -> None:
        """A generate call's adapters (one, or one per prompt) are all loaded; ValueError
        naming the first that is not, and those that are."""
        names = lora_name if isinstance(lora_name, list) else [lora_name]
        for i, name in enumerate(names):
            if name is None:
                continue
            field = "lora_name" if not isinstance(lora_name, list) else f"lora_name[{i}]"
            if self.loaded is None:
                raise ValueError(f"{field} {name[:128]!r}: {NO_LORA}")
            if name not in self.loaded:
                raise ValueError(f"{field}: unknown LoRA adapter {name[:128]!r}; loaded: "
                                 f"{', '.join(sorted(self.loaded)) or 'none'}")
