"""The clients without a server: a call to an address where nothing listens fails within
seconds, naming the address, instead of waiting its whole timeout."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from radixserve.client import AsyncClient, Client, ServerError


@pytest.fixture
def closed_address() -> str:
    with socket.socket() as s:  # a port nothing listens on once it is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"tcp://127.0.0.1:{port}"


def test_a_client_to_a_closed_port_fails_within_seconds(closed_address: str) -> None:
    started = time.monotonic()
    with Client(closed_address) as client, pytest.raises(ServerError) as failed:
        client.generate("Hi", {"max_new_tokens": 1})
    assert time.monotonic() - started < 10
    assert failed.value.code == "disconnected" and closed_address in failed.value.message


def test_an_async_client_to_a_closed_port_fails_within_seconds(closed_address: str) -> None:
    async def main() -> tuple[float, ServerError]:
        started = time.monotonic()
        async with AsyncClient(closed_address) as client:
            with pytest.raises(ServerError) as failed:
                async for _ in await client.generate("Hi", stream=True):
                    pass
        return time.monotonic() - started, failed.value

    took, error = asyncio.run(main())
    assert took < 10 and error.code == "disconnected" and closed_address in error.message
