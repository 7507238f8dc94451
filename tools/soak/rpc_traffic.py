"""RPC traffic: `Client` threads and `AsyncClient` tasks (greedy and sampled calls, plain
and streamed, aborts by rid, abandoned streams, invalid requests)."""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from typing import Callable, Iterator

from tools.soak.invalid import invalid_rpc_call
from tools.soak.state import Soak
from radixserve.client import AsyncClient, Client, ServerError


# -- RPC: Client threads -------------------------------------------------------------------
def rpc_thread(soak: Soak, client: Client, seed: int) -> None:
    rng = random.Random(seed)
    actions: list[tuple[Callable[[Soak, Client, random.Random], None], float]] = [
        (rpc_greedy, 4), (rpc_greedy_stream, 3), (rpc_sampled, 3), (rpc_sampled_stream, 2),
        (rpc_abort, 1.5), (rpc_invalid, 1)]
    fns, weights = zip(*actions)
    while soak.running():
        time.sleep(soak.backoff_s())
        fn = rng.choices(fns, weights)[0]
        soak.begin()
        try:
            fn(soak, client, rng)
        except Exception as e:
            soak.client_bug(f"rpc.{fn.__name__}", e)


def _server_failure(soak: Soak, kind: str, e: BaseException) -> None:
    if isinstance(e, ServerError):
        soak.fail(kind, e.code, e.message)
    elif isinstance(e, TimeoutError):
        soak.fail(kind, "no_answer", str(e))
    else:
        raise e


def rpc_greedy(soak: Soak, client: Client, rng: random.Random) -> None:
    case = soak.case(rng)
    prompt = {"prompt": case.text} if rng.random() < 0.3 else {"input_ids": case.ids}
    try:
        r = client.generate(**prompt, sampling_params=case.params, timeout=soak.args.call_timeout)
    except (ServerError, TimeoutError) as e:
        return _server_failure(soak, "rpc.greedy", e)
    if r["meta_info"]["prompt_tokens"] != len(case.ids):
        return soak.fail("rpc.greedy", "bad_answer", f"prompt_tokens {r['meta_info']}")
    soak.record_greedy("rpc.greedy", case, r["output_ids"], r["meta_info"]["finish_reason"])


def _read_rpc_stream(stream: Iterator[dict], stop_after: int | None = None
                     ) -> tuple[list[int], dict | None]:
    """Token ids of the chunks, and the final result (None if we stopped early)."""
    ids: list[int] = []
    for n, item in enumerate(stream):
        if "final" in item:
            return ids, item["final"]
        ids.extend(item["token_ids"])
        if stop_after is not None and n + 1 >= stop_after:
            return ids, None
    raise RuntimeError("the stream ended without a final result")


def rpc_greedy_stream(soak: Soak, client: Client, rng: random.Random) -> None:
    case = soak.case(rng)
    kind = "rpc.greedy_stream"
    try:
        ids, final = _read_rpc_stream(client.generate(
            input_ids=case.ids, sampling_params=case.params, stream=True,
            timeout=soak.args.call_timeout))
    except (ServerError, TimeoutError) as e:
        return _server_failure(soak, kind, e)
    assert final is not None
    if ids != final["output_ids"]:
        return soak.record_greedy(kind, case, ids, "chunks differ from the result")
    soak.record_greedy(kind, case, final["output_ids"], final["meta_info"]["finish_reason"])


def rpc_sampled(soak: Soak, client: Client, rng: random.Random) -> None:
    params = soak.sampled_params(rng)
    if rng.random() < 0.15:
        params["n"] = 2
    try:
        r = client.generate(input_ids=soak.sampled_prompt(rng), sampling_params=params,
                            timeout=soak.args.call_timeout)
    except (ServerError, TimeoutError) as e:
        return _server_failure(soak, "rpc.sampled", e)
    soak.check_sampled("rpc.sampled", r, params)


def rpc_sampled_stream(soak: Soak, client: Client, rng: random.Random) -> None:
    params = soak.sampled_params(rng)
    stream = client.generate(input_ids=soak.sampled_prompt(rng), sampling_params=params,
                             stream=True, timeout=soak.args.call_timeout)
    try:
        ids, final = _read_rpc_stream(stream)
    except (ServerError, TimeoutError) as e:
        return _server_failure(soak, "rpc.sampled_stream", e)
    assert final is not None
    if ids != final["output_ids"]:
        return soak.fail("rpc.sampled_stream", "bad_answer", "chunks differ from the result")
    soak.check_sampled("rpc.sampled_stream", final, params)


def rpc_abort(soak: Soak, client: Client, rng: random.Random) -> None:
    """A greedy call aborted by rid mid-flight: from another thread while a plain call
    waits, or between a stream's chunks. It ends aborted with a prefix of its answer, or
    complete if it finished first."""
    case = soak.case(rng)
    rid = f"soak-abort-{uuid.uuid4().hex}"
    kind = "rpc.abort_stream" if rng.random() < 0.5 else "rpc.abort"

    def abort() -> None:
        soak.begin()
        try:
            client.abort(rid)
            soak.record("rpc.abort_call", "completed")
        except (ServerError, TimeoutError) as e:
            _server_failure(soak, "rpc.abort_call", e)

    try:
        if kind == "rpc.abort":
            timer = threading.Timer(rng.uniform(0.05, 3.0), abort)
            timer.start()
            try:
                r = client.generate(input_ids=case.ids, sampling_params=case.params, rid=rid,
                                    timeout=soak.args.call_timeout)
            finally:
                timer.join()
        else:
            stream = client.generate(input_ids=case.ids, sampling_params=case.params, rid=rid,
                                     stream=True, timeout=soak.args.call_timeout)
            ids, final = _read_rpc_stream(stream, stop_after=rng.randint(1, 4))
            abort()
            if final is None:
                more, final = _read_rpc_stream(stream)
                ids += more
            assert final is not None
            if ids != final["output_ids"]:
                return soak.fail(kind, "bad_answer", "chunks differ from the result")
            r = final
    except (ServerError, TimeoutError) as e:
        return _server_failure(soak, kind, e)
    soak.record_greedy(kind, case, r["output_ids"], r["meta_info"]["finish_reason"],
                       aborted_ok=True)


def rpc_invalid(soak: Soak, client: Client, rng: random.Random) -> None:
    call = invalid_rpc_call(soak, rng)
    try:
        client.generate(**call, timeout=soak.args.call_timeout)
    except ServerError as e:
        if e.code == "invalid_request":
            return soak.record("rpc.invalid", "refused")
        return soak.fail("rpc.invalid", e.code, e.message)
    except TimeoutError as e:
        return soak.fail("rpc.invalid", "no_answer", str(e))
    soak.fail("rpc.invalid", "invalid_accepted", repr(call)[:200])


# -- RPC: AsyncClient tasks ----------------------------------------------------------------
def async_thread(soak: Soak, tasks: int, seed: int) -> None:
    async def main() -> None:
        client = AsyncClient(soak.rpc_address, timeout=soak.args.call_timeout,
                             api_key=soak.key(1))
        try:
            await asyncio.gather(*(async_loop(soak, client, random.Random(seed + i))
                                   for i in range(tasks)))
        finally:
            await client.close()

    asyncio.run(main())


async def async_loop(soak: Soak, client: AsyncClient, rng: random.Random) -> None:
    timeout = soak.args.call_timeout
    while soak.running():
        await asyncio.sleep(soak.backoff_s())
        soak.begin()
        action = rng.choices(["greedy", "stream", "sampled", "abort", "abandon", "invalid"],
                             [4, 3, 2, 1.5, 1, 1])[0]
        kind = f"async.{action}"
        case = soak.case(rng)
        try:
            if action == "greedy":
                r = await client.generate(input_ids=case.ids, sampling_params=case.params,
                                          timeout=timeout)
                soak.record_greedy(kind, case, r["output_ids"], r["meta_info"]["finish_reason"])
            elif action == "stream":
                ids: list[int] = []
                final = None
                async for item in client.generate_stream(
                        input_ids=case.ids, sampling_params=case.params, timeout=timeout):
                    if "final" in item:
                        final = item["final"]
                    else:
                        ids.extend(item["token_ids"])
                assert final is not None
                if ids != final["output_ids"]:
                    soak.fail(kind, "bad_answer", "chunks differ from the result")
                else:
                    soak.record_greedy(kind, case, final["output_ids"],
                                       final["meta_info"]["finish_reason"])
            elif action == "sampled":
                params = soak.sampled_params(rng)
                r = await client.generate(input_ids=soak.sampled_prompt(rng),
                                          sampling_params=params, timeout=timeout)
                soak.check_sampled(kind, r, params)
            elif action == "abort":
                rid = f"soak-async-abort-{uuid.uuid4().hex}"
                task = asyncio.ensure_future(client.generate(
                    input_ids=case.ids, sampling_params=case.params, rid=rid, timeout=timeout))
                await asyncio.sleep(rng.uniform(0.05, 3.0))
                soak.begin()
                try:
                    await client.abort(rid)
                    soak.record("async.abort_call", "completed")
                except (ServerError, TimeoutError) as e:
                    _server_failure(soak, "async.abort_call", e)
                r = await task
                soak.record_greedy(kind, case, r["output_ids"], r["meta_info"]["finish_reason"],
                                   aborted_ok=True)
            elif action == "abandon":  # leave a stream after a chunk or two: it is aborted
                gen = client.generate_stream(input_ids=case.ids, sampling_params=case.params,
                                             timeout=timeout)
                try:
                    got = 0
                    async for item in gen:
                        got += 1
                        if "final" in item or got >= rng.randint(1, 3):
                            break
                finally:
                    await gen.aclose()
                soak.record(kind, "disconnected")
            else:
                call = invalid_rpc_call(soak, rng)
                try:
                    await client.generate(**call, timeout=timeout)
                    soak.fail(kind, "invalid_accepted", repr(call)[:200])
                except ServerError as e:
                    if e.code == "invalid_request":
                        soak.record(kind, "refused")
                    else:
                        soak.fail(kind, e.code, e.message)
        except (ServerError, TimeoutError) as e:
            _server_failure(soak, kind, e)
        except Exception as e:
            soak.client_bug(kind, e)
