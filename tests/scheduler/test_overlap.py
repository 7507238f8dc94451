"""Overlap scheduling (scheduler/overlap.py) against the plain loop, over the FakeWorker.

The engine's own loop (`EngineCore`) serves the same requests with overlap on and off: every
output has the same tokens and ends at the same point and for the same reason (EOS, stop
ids, stop strings, max_new_tokens, aborts mid-flight), through parallel samples, shared
prefixes, logprobs and retraction in a pool too small for the load; and with overlap on,
each step is really built while the one before is in flight. (The state machine in
test_scheduler_machine.py also runs with overlap, against its reference.)
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from radixserve.config import EngineConfig
from radixserve.messages import RequestUpdate, SamplingParams, TokenizedRequest, WorkerInfo
from radixserve.scheduler.batch import plan_seq
from radixserve.scheduler.core import EngineCore
from radixserve.scheduler.overlap import RunAhead, runs_ahead
from radixserve.scheduler.request import SeqGroup
from radixserve.scheduler.scheduler import Scheduler
from tests.scheduler.fake_worker import FakeWorker, expected_output

VOCAB = 32
EOS = [0, 1]


def letters(ids: list[int], *, skip_special_tokens: bool = False,
            spaces_between_special_tokens: bool = True) -> str:
    """A decoder for stop strings: token t is the letter `a + t % 26`."""
    return "".join(chr(ord("a") + t % 26) for t in ids)


def info(num_blocks: int, page_size: int, device: str = "cpu") -> WorkerInfo:
    return WorkerInfo(model_path="fake", num_blocks=num_blocks, page_size=page_size,
                      context_length=1024, vocab_size=VOCAB, eos_token_ids=EOS, device=device,
                      dtype="float32", kv_pool_bytes=0)


@dataclass
class Served:
    """What one run of `serve` gave: each output's tokens and finish reason, by (rid,
    index), and the run's counters."""

    outputs: dict[tuple[str, int], tuple[list[int], dict]]
    stats: dict
    worker: FakeWorker


def serve(requests: list[TokenizedRequest], overlap: bool, *, num_blocks: int = 256,
          page_size: int = 4, chunk: int = 32, max_running: int = 8,
          abort_after: dict[str, int] | None = None, waves: int = 1) -> Served:
    """Serve `requests` to the end with an `EngineCore` over a FakeWorker, queued in
    `waves` (each a few steps after the one before), aborting each rid of `abort_after`
    once its first output has that many tokens."""
    config = EngineConfig(page_size=page_size, max_total_tokens=num_blocks * page_size,
                          chunked_prefill_size=chunk, max_running_requests=max_running,
                          debug_invariants=True, init_new_token_ratio=0.2,
                          min_new_token_ratio=0.0, new_token_ratio_decay=0.02)
    worker_info = info(num_blocks, page_size)
    scheduler = Scheduler(config, worker_info, decode=letters, overlap=overlap)
    worker = FakeWorker(num_blocks, page_size, VOCAB)
    core = EngineCore(scheduler, worker, worker_info)
    outputs: dict[tuple[str, int], tuple[list[int], dict]] = {}
    tokens: dict[tuple[str, int], list[int]] = {}
    pending = dict(abort_after or {})
    per_wave = -(-len(requests) // waves)
    steps = 0
    while requests or core.has_work:
        if requests and steps % 5 == 0:
            for request in requests[:per_wave]:
                core.submit(request)
            requests = requests[per_wave:]
        update: RequestUpdate
        for update in core.step():
            key = (update.rid, update.index)
            tokens.setdefault(key, []).extend(update.new_token_ids)
            if update.finish_reason is not None:
                assert key not in outputs, f"{key} finished twice"
                outputs[key] = (tokens[key], dict(update.finish_reason))
        for rid, after in list(pending.items()):
            if len(tokens.get((rid, 0), ())) >= after:
                core.abort(rid)
                del pending[rid]
        steps += 1
        assert steps < 20_000, "not idle"
    stats = scheduler.stats()
    assert stats["running"] == stats["waiting"] == 0 and stats["locked_blocks"] == 0
    assert stats["free_blocks"] + stats["evictable_blocks"] == num_blocks, "blocks lost"
    return Served(outputs, stats, worker)


def workload(seed: int, count: int = 40) -> list[TokenizedRequest]:
    """Requests over a few shared prefixes: greedy and seeded, n of 1 to 3, EOS and
    ignore_eos, stop ids, stop strings, max_new_tokens of 1 to 30, logprobs."""
    rng = random.Random(seed)
    systems = [[rng.randrange(VOCAB) for _ in range(rng.choice([8, 20, 40]))] for _ in range(3)]
    out = []
    for k in range(count):
        prompt = rng.choice(systems) + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))]
        sampling = SamplingParams(
            max_new_tokens=rng.choice([1, 2, 5, 12, 30]), temperature=rng.choice([0.0, 0.8]),
            seed=rng.choice([None, k]), n=rng.choice([1, 1, 2, 3]), ignore_eos=rng.random() < 0.4,
            stop_token_ids=[rng.randrange(2, VOCAB)] if rng.random() < 0.3 else None,
            stop=[letters([rng.randrange(VOCAB) for _ in range(rng.choice([1, 1, 2]))])]
            if rng.random() < 0.3 else None)
        logprobs = rng.random() < 0.3
        out.append(TokenizedRequest(rid=f"r{k}", input_ids=prompt, sampling=sampling,
                                    return_logprob=logprobs, top_logprobs_num=2 * logprobs,
                                    logprob_start_len=0 if logprobs else -1))
    return out


def same_outputs(off: Served, on: Served) -> None:
    assert on.outputs.keys() == off.outputs.keys()
    for key, (tokens, reason) in off.outputs.items():
        assert on.outputs[key] == (tokens, reason), (
            f"{key}: {on.outputs[key]} with overlap, {(tokens, reason)} without")


@pytest.mark.parametrize("seed", [0, 1])
def test_the_same_outputs_with_and_without_overlap(seed: int) -> None:
    """A roomy pool: every finish reason, parallel samples, shared prefixes, logprobs."""
    requests = workload(seed)
    off, on = serve(requests, overlap=False), serve(requests, overlap=True)
    same_outputs(off, on)
    reasons = {(r["type"], type(r.get("matched"))) for _, r in off.outputs.values()}
    assert {("length", type(None)), ("stop", int), ("stop", str)} <= reasons, reasons
    assert on.worker.placeholders > 0 and off.worker.placeholders == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_the_same_outputs_under_memory_pressure(page_size: int) -> None:
    """A pool that cannot hold the load, in waves: requests are retracted while their
    step is in flight (the step's token dropped, sampled again when they resume)."""
    requests = workload(7, count=48)
    run = dict(num_blocks=96 // page_size, page_size=page_size, chunk=16, max_running=6,
               waves=4)
    off, on = serve(requests, overlap=False, **run), serve(requests, overlap=True, **run)
    same_outputs(off, on)
    assert off.stats["retractions"] > 0 and on.stats["retractions"] > 0


def test_aborts_mid_flight_end_at_the_same_token() -> None:
    """A request aborted once it has k tokens ends with exactly those k, with overlap too
    (its step in flight is dropped), whether it was decoding or far from done."""
    requests = [TokenizedRequest(rid=f"a{k}", input_ids=[3 + k, 4, 5, 6] * (1 + k % 3),
                                 sampling=SamplingParams(max_new_tokens=40, temperature=0.8,
                                                         seed=k, ignore_eos=True))
                for k in range(8)]
    abort_after = {f"a{k}": 1 + 3 * k for k in range(0, 8, 2)}
    off = serve(requests, overlap=False, abort_after=abort_after)
    on = serve(requests, overlap=True, abort_after=abort_after)
    same_outputs(off, on)
    for rid, after in abort_after.items():
        tokens, reason = on.outputs[(rid, 0)]
        assert reason["type"] == "abort" and len(tokens) == after, (rid, tokens, reason)


def test_a_step_is_built_while_the_one_before_runs() -> None:
    """With overlap, a decode's next step is scheduled, built and launched before the
    result of the step it follows is folded in; without, each step is folded first."""
    def events(overlap: bool) -> list[str]:
        config = EngineConfig(page_size=4, max_total_tokens=256, chunked_prefill_size=64)
        worker_info = info(64, 4)
        scheduler = Scheduler(config, worker_info, overlap=overlap)
        worker = FakeWorker(64, 4, VOCAB)
        log: list[str] = []
        for owner, name in ((scheduler, "schedule"), (scheduler, "process_result"),
                            (worker, "launch"), (worker, "collect")):
            real = getattr(owner, name)
            setattr(owner, name, lambda *a, _real=real, _name=name: (log.append(_name),
                                                                     _real(*a))[1])
        core = EngineCore(scheduler, worker, worker_info)
        core.submit(TokenizedRequest(rid="r", input_ids=[5, 6, 7], sampling=SamplingParams(
            max_new_tokens=6, temperature=0, ignore_eos=True)))
        while core.has_work:
            core.step()
        return log

    plain = events(overlap=False)
    assert plain[:4] == ["schedule", "launch", "collect", "process_result"]
    assert plain.count("launch") == 6
    overlapped = events(overlap=True)
    # The first step is launched, then the second scheduled and launched before the
    # first is collected: from then on the worker always holds the next step.
    assert overlapped[:6] == ["schedule", "launch", "schedule", "launch", "collect",
                              "process_result"]
    assert overlapped.count("launch") == 6  # no extra step: the last token is known ahead
    launched = 0
    for name in overlapped:
        launched += {"launch": 1, "collect": -1}.get(name, 0)
        assert 0 <= launched <= 2
    steps = [i for i, name in enumerate(overlapped) if name == "schedule"]
    in_flight = sum(overlapped[:i].count("launch") > overlapped[:i].count("collect")
                    for i in steps)
    assert in_flight == len(steps) - 1  # every schedule but the first, with a step running


def test_what_needs_its_token_on_the_host_waits_for_the_fold() -> None:
    """`runs_ahead`: a plain decode runs ahead of its sampled token; a constrained one, one
    with penalties, one that speculates, a beam search, a prompt whose samples fork from its
    first token, and one whose pending token is its last wait for the fold."""
    def seq(rid: str, sampling: SamplingParams, **request):
        req = TokenizedRequest(rid=rid, input_ids=[5, 6, 7], sampling=sampling, **request)
        group = SeqGroup.of(req, random.Random(0), EOS)
        return plan_seq(group.seqs[0], 3)  # the prompt, sampling its first token

    plain = SamplingParams(max_new_tokens=8, temperature=0)
    assert runs_ahead(seq("plain", plain), "off")
    constrained = seq("grammar", plain)
    constrained.req.grammar = object()  # type: ignore[assignment]
    assert not runs_ahead(constrained, "off")
    assert not runs_ahead(seq("penalty", SamplingParams(max_new_tokens=8,
                                                        frequency_penalty=0.5)), "off")
    assert not runs_ahead(seq("spec", plain), "lookup")
    assert not runs_ahead(seq("spec", SamplingParams(max_new_tokens=8, speculative="tree")),
                          "off")
    from radixserve.messages import BeamParams
    assert not runs_ahead(seq("beam", plain, beam=BeamParams(width=2)), "off")
    assert not runs_ahead(seq("samples", SamplingParams(max_new_tokens=8, n=3)), "off")
    assert not runs_ahead(seq("last", SamplingParams(max_new_tokens=1)), "off")


def test_penalties_are_served_one_fold_at_a_time() -> None:
    """Penalties count the outputs: such a request never sends a placeholder, and still
    ends as without overlap."""
    request = TokenizedRequest(rid="p", input_ids=[5, 6, 7], sampling=SamplingParams(
        max_new_tokens=10, temperature=0, ignore_eos=True, presence_penalty=0.5))
    off, on = serve([request], overlap=False), serve([request], overlap=True)
    same_outputs(off, on)
    assert on.worker.placeholders == 0


def test_on_by_default_on_cuda_only() -> None:
    """Off on the CPU (nothing of it is made), on for a CUDA worker unless disabled; an
    explicit choice wins."""
    config, kv = EngineConfig(), Scheduler(EngineConfig(), info(16, 4)).cache.kv
    assert RunAhead.of(config, info(16, 4, "cpu"), kv, None) is None
    assert RunAhead.of(config, info(16, 4, "cuda:0"), kv, None) is not None
    off = EngineConfig(disable_overlap_schedule=True)
    assert RunAhead.of(off, info(16, 4, "cuda"), kv, None) is None
    assert RunAhead.of(config, info(16, 4, "cpu"), kv, True) is not None
    assert Scheduler(config, info(16, 4)).overlap is None


def test_a_failed_step_in_flight_leaves_nothing_cached() -> None:
    """A request that stops at the fold of step N is already in step N+1, which writes its
    stop token's KV; when N+1 then fails, that KV was never written, and must not have
    been cached when the request ended (`RunAhead.settle`): a later request that
    continues the same tokens computes it, and reads only what was written."""
    config = EngineConfig(page_size=1, max_total_tokens=64, chunked_prefill_size=64,
                          debug_invariants=True)
    worker_info = info(64, 1)
    scheduler = Scheduler(config, worker_info, overlap=True)
    worker = FakeWorker(64, 1, VOCAB)
    core = EngineCore(scheduler, worker, worker_info)
    prompt = [5, 6, 7, 8]
    greedy = expected_output(prompt, SamplingParams(max_new_tokens=3, temperature=0), 0,
                             vocab=VOCAB).output_ids
    core.submit(TokenizedRequest(rid="a", input_ids=prompt, sampling=SamplingParams(
        max_new_tokens=20, temperature=0, stop_token_ids=[greedy[2]])))
    done: dict[str, list[int]] = {}
    steps = 0
    while core.has_work:
        steps += 1
        worker.fail_next = steps == 4  # the step sent while the stop token's step folds
        for u in core.step():
            done[u.rid] = done.get(u.rid, []) + u.new_token_ids
    assert done["a"][-1] == greedy[2] and scheduler.counters["finished"] == 1
    # B continues A's tokens: its prefix comes from the tree, and must hold only KV
    # that was written (the FakeWorker fails any read of an unwritten slot).
    follow = prompt + greedy + [9]
    sampling = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    core.submit(TokenizedRequest(rid="b", input_ids=follow, sampling=sampling))
    while core.has_work:
        for u in core.step():
            done[u.rid] = done.get(u.rid, []) + u.new_token_ids
            assert u.finish_reason is None or u.finish_reason["type"] == "length", u
    assert done["b"] == expected_output(follow, sampling, 0, vocab=VOCAB).output_ids
