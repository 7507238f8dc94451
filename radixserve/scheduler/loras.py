"""The scheduler's account of the LoRA adapters: which the worker holds (at most
`max_loaded_loras`, least recently used first), which device slot each running one has (at
most `max_loras_per_batch` adapters run in a step), and the loads and unloads in flight.

A request names its adapter; it is refused when the adapter is unknown (the error names the
loaded ones), and runs in the adapter's cache namespace (`tenants.adapter_namespace`, from
the adapter's fingerprint). It is admitted only once its adapter has a slot: its own, a free
one, or one whose adapter no running request uses (filled with the step,
`ForwardBatch.lora_fills`); otherwise it waits, and nothing running is disturbed. Loading
past `max_loaded_loras` unloads the least recently used adapter no unfinished request uses,
or is refused when every one is in use. Plain class: no sockets, no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import msgspec

from radixserve.config import EngineConfig
from radixserve.config_checks import check_lora_name
from radixserve.messages import LoraFill, LoraInfo, TokenizedRequest
from radixserve.tenants import adapter_namespace


class LoraRegistry:
    """The adapters: `bind` puts a request in its adapter's namespace (or refuses it),
    admission claims its slot, each step takes the slots' fills."""

    def __init__(self, config: EngineConfig, loaded: list[LoraInfo] | None) -> None:
        """`loaded`: the worker's adapters at start (`WorkerInfo.loras`); None: LoRA
        serving is off, and a request naming an adapter is refused."""
        self.enabled = loaded is not None
        self.adapters: OrderedDict[str, LoraInfo] = OrderedDict(
            (a.name, a) for a in loaded or [])
        """Least recently used first."""
        self.max_loaded = config.max_loaded_loras
        self.slots: list[str | None] = [None] * config.max_loras_per_batch
        self.fills: list[LoraFill] = []
        self.slot_fills = 0
        """Adapters loaded into a device slot so far."""
        self.loading: dict[str, list[LoraInfo]] = {}
        """Adapters being loaded, each with those unloaded to make room for it (put back
        if the load fails)."""

    # -- requests ---------------------------------------------------------------------
    def bind(self, request: TokenizedRequest) -> TokenizedRequest:
        """`request` in its adapter's cache namespace; ValueError when LoRA serving is off
        or the adapter is not loaded (naming those that are)."""
        if request.lora is None:
            return request
        name = request.lora[:128]
        if not self.enabled:
            raise ValueError(f"lora_name {name!r}: this server serves no LoRA adapters (start "
                             "it with --lora-paths or --enable-lora)")
        info = self.adapters.get(name)
        if info is None:
            state = " (being loaded)" if name in self.loading else ""
            raise ValueError(f"unknown LoRA adapter {name!r}{state}; loaded: "
                             f"{', '.join(self.adapters) or 'none'}")
        self.adapters.move_to_end(name)
        return msgspec.structs.replace(
            request, namespace=adapter_namespace(request.namespace, info.fingerprint))

    def name_of(self, fingerprint: str) -> str | None:
        """The name of the loaded adapter whose weights `fingerprint` names, if any."""
        return next((a.name for a in self.adapters.values() if a.fingerprint == fingerprint),
                    None)

    def claim_slot(self, name: str, running: Iterable[str | None]) -> int | None:
        """Claim the slot adapter `name` runs from: its own, else a free one, else the
        lowest whose adapter none of `running` (the running requests' adapters) uses, filled
        with the next step; None when every slot is busy (the request waits). A claimed
        slot stays the adapter's until another adapter claims it."""
        if name in self.slots:
            return self.slots.index(name)
        busy = set(running)
        free = [i for i, held in enumerate(self.slots) if held is None]
        free = free or [i for i, held in enumerate(self.slots) if held not in busy]
        if not free:
            return None
        self.slots[free[0]] = name  # the lowest: the CPU path computes slots 0 .. used - 1
        self.fills.append(LoraFill(free[0], name))
        self.slot_fills += 1
        return free[0]

    def refill(self) -> None:
        """What the worker's slots hold is unknown (a step failed, maybe before its fills
        ran): the next step fills every slot in use again."""
        self.fills = [LoraFill(i, name) for i, name in enumerate(self.slots) if name is not None]

    def take_fills(self) -> list[LoraFill]:
        """The fills since the last step's, for the next (`worker_rows.AdapterSlot`)."""
        fills, self.fills = self.fills, []
        return fills

    # -- loads and unloads (the operator's) --------------------------------------------
    def begin_load(self, name: str, in_use: set[str | None]) -> list[str]:
        """Room for loading `name`: the adapters it unloads (least recently used, none in
        `in_use`), forgotten now; ValueError when it is loaded or loading, or every
        adapter is in use."""
        if not self.enabled:
            raise ValueError("LoRA serving is off: start the server with --enable-lora or "
                             "--lora-paths")
        check_lora_name(name)
        if name in self.adapters or name in self.loading:
            raise ValueError(f"LoRA adapter {name!r} is already loaded: unload it first")
        room = self.max_loaded - len(self.adapters) - len(self.loading)
        idle = [a for a in self.adapters if a not in in_use]
        if room <= 0 and len(idle) < 1 - room:
            raise ValueError(f"max_loaded_loras ({self.max_loaded}) adapters are loaded or "
                             "loading and requests use every one: unload one, or wait")
        dropped = [self._forget(a) for a in idle[:max(0, 1 - room)]]
        self.loading[name] = dropped
        return [a.name for a in dropped]

    def end_load(self, name: str, info: LoraInfo | None) -> None:
        """The worker's answer: `info`, or None (refused: what it unloaded comes back)."""
        dropped = self.loading.pop(name)
        if info is not None:
            self.adapters[name] = info
        else:  # back where they were: least recently used
            self.adapters = OrderedDict([*((a.name, a) for a in dropped),
                                         *self.adapters.items()])

    def unload(self, name: str) -> None:
        """Forget `name` (the caller ends the requests that use it); ValueError when it is
        not loaded."""
        if name not in self.adapters:
            raise ValueError(f"unknown LoRA adapter {name!r}; loaded: "
                             f"{', '.join(self.adapters) or 'none'}")
        self._forget(name)

    def _forget(self, name: str) -> LoraInfo:
        self.slots = [None if held == name else held for held in self.slots]
        self.fills = [f for f in self.fills if f.name != name]
        return self.adapters.pop(name)

    def stats(self) -> dict[str, int]:
        return {"lora_adapters": len(self.adapters), "lora_slot_fills": self.slot_fills}

    def describe(self, operator: bool) -> list[dict]:
        return [{**msgspec.structs.asdict(a), **({} if operator else {"path": None})}
                for a in self.adapters.values()]
