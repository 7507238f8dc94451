"""Three replicas behind the router: cache affinity per group, hit rates against one
server and against round-robin, rebalancing a hot group, the APIs passing through."""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter, defaultdict

import httpx
import msgspec
import pytest
import zmq

from radixserve.client import Client, ServerError
from radixserve.router.runtime import RouterRuntime
from radixserve.server.runtime import Runtime
from tests.conftest import require
from tests.router.conftest import (PAGE, REPLICA_TOKENS, assert_replicas_idle, fleet_secret,
                                  start_replicas, stop_all, system_prompt, workload)
from tests.server.conftest import assert_server_idle

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def replicas(tiny):
    runtimes = start_replicas(tiny, 3, served_model_name="fleet-model")
    yield runtimes
    try:
        assert_replicas_idle(runtimes)
    finally:
        stop_all(runtimes)


@pytest.fixture(scope="module")
def single(tiny):
    """One server with the fleet's memory: the hit rate the router should keep."""
    with Runtime(str(tiny), max_total_tokens=3 * REPLICA_TOKENS, page_size=PAGE) as rt:
        yield rt
        assert_server_idle(rt.rpc_address)


def start_router(replicas, **options) -> RouterRuntime:
    return RouterRuntime(replica=[r.rpc_address for r in replicas],
                         cache_secret_file=fleet_secret(), **options)


def flush_all(replicas) -> None:
    for rt in replicas:
        with Client(rt.rpc_address, timeout=60) as c:
            assert c.flush_cache()["flushed"]


def run_workload(address: str, items) -> list[dict]:
    """The items one after another (so hit rates do not depend on timing)."""
    with Client(address, timeout=120) as c:
        return [c.generate(prompt, GREEDY) for _, prompt in items]


def all_at_once(call, prompts: list[str]) -> list:
    """`call(prompt)` for every prompt, each from its own thread, all in flight together."""
    results: list = [None] * len(prompts)

    def one(i: int) -> None:
        results[i] = call(prompts[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def hit_rate(results: list[dict]) -> float:
    cached = sum(r["meta_info"]["cached_tokens"] for r in results)
    return cached / sum(r["meta_info"]["prompt_tokens"] for r in results)


class TestCacheAware:
    def test_groups_stick_to_a_replica_and_keep_the_single_servers_hit_rate(
            self, replicas, single):
        items = workload()
        flush_all(replicas)
        with start_router(replicas) as router:
            routed = run_workload(router.rpc_address, items)
        flush_all(replicas)
        with start_router(replicas, policy="round_robin") as router:
            round_robin = run_workload(router.rpc_address, items)
        alone = run_workload(single.rpc_address, items)

        by_group: dict[int, Counter] = defaultdict(Counter)
        for (group, _), result in zip(items, routed):
            by_group[group][result["meta_info"]["replica"]] += 1
        for group, counts in by_group.items():
            assert counts.most_common(1)[0][1] >= 0.9 * sum(counts.values()), (group, counts)
        assert len({c.most_common(1)[0][0] for c in by_group.values()}) == 3, \
            "the groups are spread over the replicas"
        rates = {"cache_aware": hit_rate(routed), "round_robin": hit_rate(round_robin),
                 "single": hit_rate(alone)}
        assert rates["cache_aware"] >= 0.9 * rates["single"], rates
        assert rates["cache_aware"] >= 2 * rates["round_robin"], rates
        # Greedy outputs do not depend on where a request ran.
        assert [r["output_ids"] for r in routed] == [r["output_ids"] for r in alone]
        assert [r["output_ids"] for r in round_robin] == [r["output_ids"] for r in alone]

    def test_a_burst_of_one_group_lands_on_one_replica(self, replicas):
        """All at once, before any of them is cached: the routed prefix counts at once."""
        flush_all(replicas)
        prompts = [system_prompt(7) + f"Burst {i}?\n" for i in range(8)]
        with start_router(replicas) as router, Client(router.rpc_address, timeout=120) as c:
            results = c.generate(prompts, [GREEDY] * len(prompts))
            singles = all_at_once(lambda p: c.generate(p, GREEDY), prompts)
        assert len({r["meta_info"]["replica"] for r in results}) == 1, "a batch is one call"
        assert len({r["meta_info"]["replica"] for r in singles}) == 1, \
            [r["meta_info"]["replica"] for r in singles]

    def test_a_hot_group_spreads_once_imbalanced_and_outputs_are_unchanged(
            self, replicas, single):
        flush_all(replicas)
        long = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
        prompts = [system_prompt(8) + f"Hot {i}?\n" for i in range(12)]
        with start_router(replicas, balance_abs_threshold=2, balance_rel_threshold=1.5) as router:
            with Client(router.rpc_address, timeout=300) as c:
                results = all_at_once(lambda p: c.generate(p, long), prompts)
                reasons = c.workers()["routed_by_reason"]
        where = Counter(r["meta_info"]["replica"] for r in results)
        assert len(where) >= 2, where
        assert reasons.get("rebalance", 0) > 0, reasons
        with Client(single.rpc_address, timeout=300) as c:
            expected = [c.generate(p, long)["output_ids"] for p in prompts]
        assert [r["output_ids"] for r in results] == expected


@pytest.fixture(scope="module")
def router(replicas):
    with start_router(replicas) as rt:
        yield rt


class TestThroughTheRouter:
    def test_streaming_and_abort_pass_through(self, router, replicas):
        with Client(router.rpc_address, timeout=120) as c:
            chunks = list(c.generate("Hello there", GREEDY, stream=True))
            whole = c.generate("Hello there", GREEDY)
            assert chunks[-1]["final"]["output_ids"] == whole["output_ids"]
            assert "".join(ch.get("text", "") for ch in chunks[:-1]) == whole["text"]
            assert whole["meta_info"]["replica"] in [r.rpc_address for r in replicas]
            stream = c.generate("Count forever:", {**GREEDY, "max_new_tokens": 400},
                                stream=True)
            next(stream)
            stream.close()  # abandoned: the router passes the abort on
        body = {"text": "Count on:", "stream": True,
                "sampling_params": {**GREEDY, "max_new_tokens": 400}}
        with httpx.stream("POST", router.http_url + "/generate", json=body, timeout=60) as r:
            assert next(r.iter_lines()).startswith("data: ")
        # The HTTP client went away mid-stream: the router's HTTP server aborted it.
        for rt in replicas:
            with Client(rt.rpc_address, timeout=60) as direct:
                for _ in range(100):
                    if direct.stats()["running"] == 0:
                        break
                    threading.Event().wait(0.1)
                assert direct.stats()["running"] == 0

    def test_bad_input_gets_the_servers_error(self, router, replicas):
        bad = {"temperature": -1}
        with Client(router.rpc_address) as via, Client(replicas[0].rpc_address) as direct:
            with pytest.raises(ServerError) as routed:
                via.generate("x", bad)
            with pytest.raises(ServerError) as served:
                direct.generate("x", bad)
            assert (routed.value.code, routed.value.message) == (
                served.value.code, served.value.message)
            assert via.generate("x", GREEDY)["meta_info"]["completion_tokens"] == 8
        body = {"text": "x", "sampling_params": bad}
        routed_http = httpx.post(router.http_url + "/generate", json=body, timeout=60)
        assert routed_http.status_code == 400, routed_http.text

    def test_openai_client_and_fleet_calls(self, router, replicas, tiny):
        openai = require("openai")
        client = openai.OpenAI(base_url=router.http_url + "/v1", api_key="none")
        reply = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
            temperature=0)
        assert reply.choices[0].message.content is not None
        # The router answers to the replicas' served name, as each replica does.
        assert "fleet-model" in [m.id for m in client.models.list().data]
        assert client.completions.create(model="fleet-model", prompt="Hi", max_tokens=2,
                                         temperature=0).choices[0].text is not None
        assert httpx.get(router.http_url + "/health").json() == {"status": "ok"}
        workers = httpx.get(router.http_url + "/list_workers").json()["workers"]
        assert {w["url"] for w in workers} == {r.rpc_address for r in replicas}
        assert all(w["state"] == "ok" and w["view_synced"] for w in workers)
        with Client(router.rpc_address) as c:
            stats = c.stats()
            assert stats["num_blocks"] == sum(s["num_blocks"] for s in stats["replicas"].values())
            assert c.model_info()["router"]["replicas"] == 3
            with pytest.raises(ServerError, match="replica's call"):
                c.start_profile()
            # Pins and the cache view are of one replica's tree (docs/router.md).
            for call in (lambda: c.pin_prefix("x"), lambda: c.unpin_prefix("x"), c.cache_info):
                with pytest.raises(ServerError, match="replica's call") as refused:
                    call()
                assert refused.value.code == "invalid_request"
        assert httpx.get(router.http_url + "/cache").status_code == 400

    def test_a_restarted_router_rebuilds_its_view_from_the_replicas(self, replicas):
        flush_all(replicas)
        prompt = system_prompt(9) + "Where was I?\n"
        with start_router(replicas) as first, Client(first.rpc_address, timeout=120) as c:
            home = c.generate(prompt, GREEDY)["meta_info"]["replica"]
        with start_router(replicas) as second, Client(second.rpc_address, timeout=120) as c:
            again = c.generate(system_prompt(9) + "And now?\n", GREEDY)
            assert again["meta_info"]["replica"] == home
            assert again["meta_info"]["cached_tokens"] >= PAGE * 8
            assert c.workers()["routed_by_reason"] == {"cache_hit": 1}


def test_a_replica_that_does_not_answer_is_a_clear_error():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(RuntimeError, match=f"{address}.*did not answer"):
        RouterRuntime(replica=[address], model="smollm2-135m", replica_timeout=2)


def test_sglang_frontend_and_radixserve_lang_through_the_router(router, replicas):
    """SGLang's own frontend (over the router's HTTP) and radixserve.lang (over its RPC)
    run the same programs, fork included, as radixserve.lang does on one replica."""
    sglang = require("sglang")
    import radixserve.lang as rsgl
    from tests.server.test_sglang_frontend import programs

    theirs_programs, ours_programs = programs(sglang), programs(rsgl)
    backend = sglang.RuntimeEndpoint(router.http_url, chat_template_name="chatml")
    routed = rsgl.RuntimeEndpoint(router.rpc_address, timeout=300)
    direct = rsgl.RuntimeEndpoint(replicas[0].rpc_address, timeout=300)
    try:
        for name, kwargs in (("qa", {"question": "What is the capital of Italy?"}),
                             ("tips", {})):
            runs = [getattr(progs, name).run(backend=b, temperature=0, **kwargs)
                    for progs, b in ((theirs_programs, backend), (ours_programs, routed),
                                     (ours_programs, direct))]
            assert all(r.error() is None for r in runs), [r.error() for r in runs]
            assert runs[0].text() == runs[1].text() == runs[2].text()
    finally:
        routed.shutdown()
        direct.shutdown()


def test_deep_frames_from_a_client_or_a_replica_end_neither_the_router(router, replicas):
    """Issue 25, classes 1 and 2 through the router: a client's frame nested thousands deep
    is a decode error (msgspec raised RecursionError, which ended the loop), and so is a
    replica's: that replica is marked dead (its fault), the router serves on. A huge `n`
    is the replica's refusal; a huge batch the router's own, before it names a prompt."""
    from radixserve.messages import MAX_BATCH
    from tests.server.survival import assert_survived, baseline
    from tests.server.test_bounds import frame, nested
    from tests.server.test_fuzz import RawDealer

    with Client(router.rpc_address, timeout=120) as c:
        before = baseline(c)
        dealer = RawDealer(router.rpc_address)
        try:
            for f in (nested(5000), frame("sampling_params", nested(5000)),
                      frame("text", nested(100_000, "map"))):
                _, reply = dealer.answer(f)
                assert reply.code in ("malformed_frame", "invalid_request"), reply
            _, reply = dealer.answer(msgspec.msgpack.encode({
                "type": "generate", "call_id": 3, "text": "hi",
                "sampling_params": {"n": 10**9}}))
            assert reply.code == "invalid_request" and "sampling_params.n" in reply.message
            _, reply = dealer.answer(msgspec.msgpack.encode({  # before a rid per prompt
                "type": "generate", "call_id": 4, "input_ids": [[1]] * (MAX_BATCH + 1)}))
            assert reply.code == "invalid_request" and "a call may pass" in reply.message
        finally:
            dealer.close()
        ctx = zmq.Context()
        rogue = ctx.socket(zmq.ROUTER)
        port = rogue.bind_to_random_port("tcp://127.0.0.1")
        url = f"tcp://127.0.0.1:{port}"
        c.workers("add", url)
        try:
            assert rogue.poll(30_000), "the router never called the rogue replica"
            peer, *_ = rogue.recv_multipart()  # [peer, envelope, call]
            rogue.send_multipart([peer, nested(5000)])
            deadline = time.monotonic() + 30
            while {w["url"]: w for w in c.workers()["workers"]}[url]["state"] != "dead":
                assert time.monotonic() < deadline, "the rogue replica was not marked dead"
                time.sleep(0.1)
        finally:
            c.workers("remove", url)
            rogue.close(0)
            ctx.term()
        assert_survived(c, before)
