"""What every attack test checks after its attack: the server is the same server (no
process restarted), still answers a greedy reference request exactly as before, and
every KV block is free after a flush (issue 25)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.client import Client
from tests.server.conftest import assert_idle_and_all_free

REFERENCE_PROMPT = "The capital of France is"
REFERENCE_PARAMS = {"max_new_tokens": 8, "temperature": 0}


@dataclass(frozen=True)
class Baseline:
    """Taken before the attack: the server's process ids and its greedy reference answer."""

    pids: dict[str, int]
    output_ids: list[int]


def baseline(client: Client, **call: Any) -> Baseline:
    """`call` carries what the reference request needs (an api_key, ...)."""
    out = client.generate(prompt=REFERENCE_PROMPT, sampling_params=REFERENCE_PARAMS, **call)
    return Baseline(client.health()["pids"], out["output_ids"])


def assert_survived(client: Client, before: Baseline, operator: Client | None = None,
                    **call: Any) -> None:
    """Same processes, the same greedy answer, and (through `operator`, a client holding
    the operator key where one is configured; else `client`) nothing running and every
    block free after a flush."""
    assert client.health()["pids"] == before.pids, "a server process was restarted"
    out = client.generate(prompt=REFERENCE_PROMPT, sampling_params=REFERENCE_PARAMS, **call)
    assert out["output_ids"] == before.output_ids
    assert_idle_and_all_free(operator or client)
