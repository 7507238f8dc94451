"""Replicas for the router tests: tiny random models (the real tokenizer), small pools."""

from __future__ import annotations

import atexit
import functools
import random
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from radixserve.server.runtime import Runtime
from radixserve.tenants import ensure_secret_file
from tests.factories import tiny_model_dir
from tests.server.conftest import assert_server_idle

PAGE = 16
REPLICA_TOKENS = 512
"""Each replica's KV pool: the prefixes of about two groups beside a running request, so
that where a group's requests go decides whether its prefix stays cached."""


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models")


def system_prompt(group: int) -> str:
    """A long shared prefix per group (~160 tokens), unlike every other group's from the
    first token on."""
    rng = random.Random(group)
    words = ["alpha", "river", "stone", "cloud", "maple", "ember", "quartz", "delta", "harbor",
             "lumen", "sable", "tundra", "violet", "willow", "zephyr", "cobalt"]
    return f"Group {group} rules: " + " ".join(rng.choice(words) for _ in range(150)) + "\n"


def workload(groups: int = 6, per_group: int = 8, seed: int = 0) -> list[tuple[int, str]]:
    """(group, prompt) pairs: each group's system prompt plus a question of its own, in a
    shuffled order (interleaved users, not one group after another)."""
    items = [(g, system_prompt(g) + f"User {i}: question {g * 100 + i}?\n")
             for g in range(groups) for i in range(per_group)]
    random.Random(seed).shuffle(items)
    return items


@functools.cache
def fleet_secret() -> str:
    """One cache secret file for every replica and router of the session: a router finds
    cached prefixes only with its replicas' secret."""
    directory = tempfile.mkdtemp(prefix="radixserve-test-fleet-")
    atexit.register(shutil.rmtree, directory, True)
    return str(ensure_secret_file(Path(directory)))


def start_replicas(model, count: int, **options) -> list[Runtime]:
    """`count` servers, one after another: not from a pool's threads, because a server's
    process dies with the thread that started it (PR_SET_PDEATHSIG is per thread)."""
    options = {"max_total_tokens": REPLICA_TOKENS, "page_size": PAGE,
               "debug_invariants": True, "cache_secret_file": fleet_secret(), **options}
    return [Runtime(str(model), **options) for _ in range(count)]


def assert_replicas_idle(runtimes: list[Runtime], **client_options) -> None:
    """The server fixtures' idle check (`assert_server_idle`) on each replica, directly:
    `client_options` carry the key that may flush there."""
    for rt in runtimes:
        assert_server_idle(rt.rpc_address, **client_options)


def stop_all(runtimes: list[Runtime]) -> None:
    with ThreadPoolExecutor(max(1, len(runtimes))) as pool:
        list(pool.map(lambda rt: rt.shutdown(), runtimes))
