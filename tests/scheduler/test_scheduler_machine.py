"""The Scheduler driven by a fake worker that checks KV content, under random workloads.

`FakeWorker` (fake_worker.py) keeps a pool of slots that name (token, position, prefix
hash) and samples from what a sequence actually reads back through its block table, so
any KV the scheduler mismanages (a block freed while used, a wrong cached prefix, a lost
chunk, a table pointing at someone else's block) shows up as an assertion in the worker
or as an output that differs from `expected_output`, computed from the prompt alone.

`Harness` owns one Scheduler + FakeWorker and checks every RequestUpdate as it arrives;
the hypothesis machine adds requests (shared prefixes, long multi-chunk prompts, n > 1,
greedy and seeded, logprobs, EOS and stop ids), aborts, steps and flushes on a pool small
enough that eviction and retraction happen all the time. With `overlap` the steps go
through the engine's own loop (`EngineCore`, scheduler/overlap.py): each step is scheduled
while the one before is in flight, and the outputs must still equal the reference.
"""

from __future__ import annotations

import functools
import random
import tempfile
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixserve.config import EngineConfig
from radixserve.messages import (BeamParams, RequestUpdate, SamplingParams, TokenizedRequest,
                                 WorkerInfo)
from radixserve.scheduler.core import EngineCore
from radixserve.scheduler.scheduler import OverloadedError, Scheduler
from radixserve.front_door.requests import validate_request
from radixserve.speculative.drafter import Drafter
from tests.scheduler.fake_worker import (Expected, FakeWorker, context_hash, expected_beams,
                                         expected_input_logprobs, expected_output,
                                         extend_hash, is_greedy, one_sequence_step,
                                         sample_token)

VOCAB = 32
EOS_IDS = [0, 1]  # 1 in 16 sampled tokens is an EOS: many requests stop early
CONTEXT_LENGTH = 4096
BLOCK_BYTES = 64
"""What a block's KV "weighs" for the disk tier's size limit."""
DRAIN_STEPS = 20_000


# ---------------------------------------------------------------------- update routing
# Outputs are named (rid, index) in every update; these functions are the one place the
# harness maps updates and queued samples to its own records.

def sample_key(update: RequestUpdate) -> tuple[str, int]:
    """Which queued sample an update belongs to."""
    return update.rid, update.index


def queued_keys(request: TokenizedRequest) -> list[tuple[str, int]]:
    """The keys (as `sample_key` returns them) of the samples add_request just queued."""
    return [(request.rid, i) for i in range(request.num_outputs)]


def sample_seed(scheduler: Scheduler, request: TokenizedRequest, index: int) -> int:
    """The seed sample `index` samples with: `seed + index` for a seeded request, else the
    one the scheduler drew for it."""
    if request.sampling.seed is not None:
        return request.sampling.seed + index
    return scheduler.groups[request.rid].seqs[index].seed


def filler(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


# ---------------------------------------------------------------------- harness

@dataclass
class Sample:
    key: str
    rid: str
    prompt: list[int]
    request: TokenizedRequest
    expected: Expected
    input_ref: list[float | None] | None
    tokens: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    finish: dict | None = None
    abort_requested: bool = False
    abort_pending: bool = False
    """abort() was called while this sample was live: the next schedule() must end it."""
    updates: int = 0


class OracleDrafter(Drafter):
    """Drafts what the fake worker will sample next (a function of the tokens, seed and
    step), each token wrong with probability `wrong`: long accepted runs, and rejections
    anywhere in them, so stops, limits and KV roll-back inside a run all happen."""

    def __init__(self, max_draft: int, wrong: float, seed: int) -> None:
        super().__init__("lookup", max_draft, None)
        self.wrong, self.rng = wrong, random.Random(seed)

    def _source(self, d, req, n: int) -> list[int]:
        h = context_hash(req.tokens(0, req.seq_len))
        greedy = is_greedy(req.sampling.temperature, req.sampling.top_k)
        draft = []
        for i in range(n):
            token = sample_token(h, greedy, req.seed, len(req.output_ids) + i, VOCAB)
            if self.rng.random() < self.wrong:
                token = (token + self.rng.randrange(1, VOCAB)) % VOCAB
            draft.append(token)
            h = extend_hash(h, token)
        return draft


class Harness:
    """One Scheduler and FakeWorker; every update is checked as it arrives."""

    def __init__(self, *, num_blocks: int, page_size: int, chunk: int, max_running: int,
                 max_queued: int = 4096, policy: str = "lpm", prefix_cache: bool = True,
                 ratio: tuple[float, float, float] = (0.7, 0.1, 0.002),
                 disk_blocks: int | None = None, speculative: str = "off",
                 overlap: bool = False) -> None:
        """`disk_blocks`: a disk tier of that many blocks (in a temporary directory, for
        its index; the KV itself is the fake worker's). `speculative`: a mode of the
        engine's, or `oracle` (`OracleDrafter`). `overlap`: overlap scheduling, the steps
        driven by an `EngineCore` (else by hand, each folded before the next)."""
        init, low, decay = ratio
        self._disk_dir = tempfile.TemporaryDirectory() if disk_blocks is not None else None
        self.config = EngineConfig(
            page_size=page_size, max_total_tokens=num_blocks * page_size,
            chunked_prefill_size=chunk, max_running_requests=max_running,
            max_queued_requests=max_queued, schedule_policy=policy,  # type: ignore[arg-type]
            enable_prefix_cache=prefix_cache, init_new_token_ratio=init,
            min_new_token_ratio=low, new_token_ratio_decay=decay, debug_invariants=True,
            kv_disk_dir=self._disk_dir.name if self._disk_dir else None,
            kv_disk_size=(disk_blocks or 0) * BLOCK_BYTES,
            speculative="lookup" if speculative == "oracle" else speculative)  # type: ignore[arg-type]
        self.config.validate()
        self.info = WorkerInfo(model_path="fake-model", num_blocks=num_blocks, page_size=page_size,
                               context_length=CONTEXT_LENGTH, vocab_size=VOCAB,
                               eos_token_ids=EOS_IDS, device="cpu", dtype="float32",
                               kv_pool_bytes=num_blocks * BLOCK_BYTES, kv_fingerprint="fake",
                               prefill_seconds_per_token=1.0)  # loading always pays
        self.scheduler = Scheduler(self.config, self.info, overlap=overlap)
        if speculative == "oracle":
            self.scheduler.spec.drafter = OracleDrafter(self.config.speculative_num_draft_tokens,
                                                   wrong=0.15, seed=num_blocks)
        self.worker = FakeWorker(num_blocks, page_size, VOCAB)
        self.core = EngineCore(self.scheduler, self.worker, self.info) if overlap else None
        self.num_blocks = num_blocks
        self.capacity = num_blocks * page_size
        self.samples: dict[str, Sample] = {}
        self.requests: dict[str, list[str]] = {}
        self.steps = 0
        self.failed_steps = 0
        self.rejected = 0

    # -- requests ----------------------------------------------------------------------
    def _invalid(self, req: TokenizedRequest) -> str | None:
        n = len(req.input_ids)
        if n == 0:
            return "empty prompt"
        if n + req.sampling.max_new_tokens > min(self.capacity, CONTEXT_LENGTH):
            return "longer than the pool"
        if req.logprob_start_len < -1 or req.logprob_start_len >= n:
            return "logprob_start_len out of range"
        if req.num_outputs > self.config.max_running_requests:
            return "n or beam width > max_running_requests"
        if req.num_outputs > self.config.max_queued_requests:
            return "n or beam width > max_queued_requests"
        return None

    def submit(self, rid: str, prompt: list[int], sampling: SamplingParams, *,
               return_logprob: bool = False, logprob_start_len: int = -1,
               top_n: int = 0, beam: BeamParams | None = None,
               namespace: str | None = None) -> list[tuple[str, int]] | None:
        """Queue a request (in cache `namespace`); None when the scheduler (rightly)
        refuses it."""
        req = TokenizedRequest(rid=rid, input_ids=prompt, sampling=sampling, beam=beam,
                               namespace=namespace,
                               return_logprob=return_logprob,
                               logprob_start_len=logprob_start_len, top_logprobs_num=top_n)
        invalid = self._invalid(req)
        queued = sum(r.group.queued_width for r in self.scheduler.waiting)
        overloaded = queued + req.num_outputs > self.config.max_queued_requests
        try:
            validate_request(req, self.info, self.config)  # the edge's check, as every caller's
            self.scheduler.add_request(req)
        except ValueError as e:
            assert invalid is not None, f"valid request {rid} refused: {e}"
            self.rejected += 1
            return None
        except OverloadedError:
            assert invalid is None and overloaded, f"request {rid} refused as overloaded"
            self.rejected += 1
            return None
        assert invalid is None, f"request {rid} accepted though invalid ({invalid})"
        assert not overloaded, f"request {rid} accepted past max_queued_requests"
        keys = queued_keys(req)
        input_ref = (expected_input_logprobs(prompt, logprob_start_len)
                     if return_logprob and logprob_start_len >= 0 else None)
        beams = (expected_beams(prompt, beam, sampling, EOS_IDS, VOCAB) if beam is not None
                 else None)
        for i, key in enumerate(keys):
            assert key not in self.samples
            if beams is not None:
                exp = beams[i]
            else:
                exp = expected_output(prompt, sampling, sample_seed(self.scheduler, req, i),
                                      eos_ids=EOS_IDS, vocab=VOCAB)
            # The prompt's logprobs come once per request, with its first output's updates.
            self.samples[key] = Sample(key, rid, prompt, req, exp, input_ref if i == 0 else None)
        self.requests[rid] = keys
        return keys

    def live(self, rid: str) -> list[Sample]:
        return [s for k in self.requests[rid] if (s := self.samples[k]).finish is None]

    def abort(self, rid: str) -> None:
        for s in self.live(rid):
            s.abort_requested = s.abort_pending = True
        self.scheduler.abort(rid)

    # -- steps -------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.core.has_work if self.core is not None else self.scheduler.has_work

    def step(self, fail: bool = False) -> bool:
        """schedule + forward + process_result; False once idle. With `fail`, the worker
        "crashes" on the batch instead (nothing written) and the scheduler fails it."""
        pending = [s for s in self.samples.values() if s.abort_pending]
        if self.core is not None:
            return self._overlapped_step(pending, fail)
        batch, updates = self.scheduler.schedule()
        self._collect(updates)
        for s in pending:
            assert s.finish is not None and s.finish["type"] == "abort", (
                f"{s.key}: abort() was not applied by the next schedule() (finish {s.finish})")
            s.abort_pending = False
        if batch is None:
            st_ = self.scheduler.stats()
            assert st_["waiting"] == 0 and st_["running"] == 0, (
                f"schedule() made no batch with {st_['waiting']} waiting and "
                f"{st_['running']} running: stuck")
            return False
        self.steps += 1
        if fail:
            updates = self.scheduler.fail_batch(batch, "fake worker failure")
            ended = {(u.rid, u.index) for u in updates}
            assert all((seq.req.rid, seq.req.index) in ended for seq in batch.seqs), \
                "fail_batch left a sequence out"
            for u in updates:
                self.samples[sample_key(u)].abort_requested = True
            self._collect(updates)
            self.failed_steps += 1
            return True
        result = self.worker.forward(batch.forward)
        self._collect(self.scheduler.process_result(batch, result))
        return True

    def _overlapped_step(self, pending: list[Sample], fail: bool) -> bool:
        """One `EngineCore.step`: launch the next step, fold the one before. With `fail`
        the worker fails the next step it is sent (and the step sent behind it)."""
        if not self.core.has_work:
            return False
        if fail:
            self.worker.fail_next = True
            self.failed_steps += 1
        updates = self.core.step()
        for u in updates:
            reason = u.finish_reason or {}
            if reason.get("type") == "abort" and "fake worker failure" in reason["message"]:
                self.samples[sample_key(u)].abort_requested = True
        self._collect(updates)
        for s in pending:
            assert s.finish is not None and s.finish["type"] == "abort", (
                f"{s.key}: abort() was not applied by the next schedule() (finish {s.finish})")
            s.abort_pending = False
        self.steps += 1
        return True

    def drain(self, max_steps: int = DRAIN_STEPS) -> None:
        for _ in range(max_steps):
            if not self.has_work:
                return
            self.step()
        live = [s.key for s in self.samples.values() if s.finish is None]
        raise AssertionError(f"not idle after {max_steps} steps; unfinished: {live[:10]}")

    def _collect(self, updates: list[RequestUpdate]) -> None:
        for u in updates:
            key = sample_key(u)
            s = self.samples.get(key)
            assert s is not None, f"update for {key!r}, which was never queued"
            assert s.finish is None, f"{key} answered again after finishing ({s.finish}): {u}"
            s.updates += 1
            exp = s.expected
            beam = s.request.beam is not None
            # A beam is answered once, whole, when its search ends; a sample token by token
            # (a speculative step's accepted run at once).
            assert beam or len(u.new_token_ids) <= 1 + self.config.speculative_num_draft_tokens * (
                self.config.speculative != "off"), u
            assert not beam or u.finish_reason is not None, u
            s.tokens.extend(u.new_token_ids)
            assert s.tokens == exp.output_ids[:len(s.tokens)], (
                f"{key}: output {s.tokens} diverges from the reference {exp.output_ids} "
                f"(prompt of {len(s.prompt)}): it computed from wrong KV")
            assert u.prompt_tokens == len(s.prompt), u
            assert u.completion_tokens == len(s.tokens), (u, s.tokens)
            assert 0 <= u.cached_tokens < len(s.prompt), u
            finished = u.finish_reason is not None
            aborted = finished and u.finish_reason["type"] == "abort"
            if s.request.return_logprob:
                assert len(u.output_logprobs) == len(u.new_token_ids), u
                s.output_logprobs.extend(u.output_logprobs)
                assert s.output_logprobs == exp.output_logprobs[:len(s.output_logprobs)], (
                    f"{key}: output logprobs {s.output_logprobs} != {exp.output_logprobs}")
                if s.request.top_logprobs_num:
                    assert len(u.output_top) == len(u.new_token_ids), u
                    assert all(len(t.token_ids) == s.request.top_logprobs_num for t in u.output_top)
                if s.input_ref is not None and u.new_token_ids and len(s.tokens) == 1:
                    assert u.input_logprobs is not None, (
                        f"{key}: first token without prompt logprobs")
                if u.input_logprobs is not None:
                    assert s.input_ref is not None, f"{key}: prompt logprobs nobody asked for"
                    got = list(u.input_logprobs)  # the update aliases the Req's list
                    if aborted:
                        assert got == s.input_ref[:len(got)], (key, got, s.input_ref)
                    else:
                        assert got == s.input_ref, (
                            f"{key}: prompt logprobs {got} != reference {s.input_ref}")
                    s.input_logprobs = got
            else:
                assert not u.output_logprobs and u.input_logprobs is None, u
            if finished:
                s.finish = dict(u.finish_reason)
                if aborted:
                    assert s.abort_requested, f"{key} aborted though nobody asked: {s.finish}"
                else:
                    assert s.finish == exp.finish_reason, (
                        f"{key}: finished {s.finish} after {s.tokens}, reference "
                        f"{exp.finish_reason} after {exp.output_ids}")
                    assert s.tokens == exp.output_ids
                    assert u.score == exp.score, (key, u.score, exp.score)
                    if s.input_ref is not None:
                        assert s.input_logprobs == s.input_ref, f"{key}: prompt logprobs never sent"

    # -- checks ------------------------------------------------------------------------
    def check_now(self) -> None:
        self.scheduler.check_invariants()
        if not self.has_work:
            self.check_idle()

    def check_idle(self) -> None:
        s = self.scheduler.stats()
        assert s["waiting"] == 0 and s["running"] == 0, s
        assert s["locked_blocks"] == 0, f"{s['locked_blocks']} blocks locked while idle"
        assert s["free_blocks"] + s["evictable_blocks"] == self.num_blocks, (
            f"idle block leak: free {s['free_blocks']} + evictable {s['evictable_blocks']} "
            f"!= {self.num_blocks}")
        assert all(x.finish is not None for x in self.samples.values())

    def flush(self) -> None:
        s = self.scheduler.stats()
        busy = s["waiting"] or s["running"]
        flushed = self.scheduler.flush_cache()
        assert flushed == (not busy), f"flush_cache() -> {flushed} with {s['waiting']} " \
                                      f"waiting, {s['running']} running"
        if flushed:
            s = self.scheduler.stats()
            assert s["free_blocks"] == self.num_blocks, f"block leak after flush: {s}"
            assert s["evictable_blocks"] == 0 and s["cached_tokens"] == 0, s

    def final_check(self) -> None:
        """Idle: every sample finished exactly once, correctly; all blocks come back."""
        self.drain()
        self.check_now()
        self.check_idle()
        for s in self.samples.values():
            assert s.finish is not None, f"{s.key} never finished"
            if s.finish["type"] != "abort":
                assert s.tokens == s.expected.output_ids, s.key
        assert self.scheduler.stats()["finished"] == len(self.samples), (
            "finish count disagrees with the samples queued")
        self.flush()


# ---------------------------------------------------------------------- state machine

def guarded(method):
    """Mark the machine broken while `method` runs, so that teardown (which hypothesis
    runs even after a failure) does not drain a broken scheduler and mask the error."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        self.ok = False
        method(self, *args, **kwargs)
        self.ok = True
    return wrapper


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.h: Harness | None = None
        self.bases: list[list[int]] = []
        self.next_rid = 0
        self.ok = True  # False once a rule raised: teardown then leaves that error be

    @initialize(page_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(24, 64),
                chunk=st.integers(8, 32), max_running=st.integers(2, 6),
                max_queued=st.sampled_from([64, 64, 64, 8]),
                policy=st.sampled_from(["lpm", "fcfs"]),
                prefix_cache=st.sampled_from([True, True, True, False]),
                ratio=st.sampled_from([(0.7, 0.1, 0.002), (0.2, 0.0, 0.02), (0.0, 0.0, 0.0),
                                       (0.0, 0.0, 0.0)]),
                bases=st.lists(st.tuples(st.integers(0, 7), st.integers(1, 60)),
                               min_size=1, max_size=4),
                disk=st.sampled_from([None, None, 8, 200]),
                speculative=st.sampled_from(["off", "off", "lookup", "tree", "oracle", "oracle"]),
                overlap=st.booleans())
    @guarded
    def setup(self, page_size, num_blocks, chunk, max_running, max_queued, policy,
              prefix_cache, ratio, bases, disk=None, speculative="off", overlap=False) -> None:
        """`disk`: a disk tier of that many blocks (a small one drops entries often);
        `overlap`: overlap scheduling (`Harness`)."""
        self.h = Harness(num_blocks=num_blocks, page_size=page_size, chunk=chunk,
                         max_running=max_running, max_queued=max_queued, policy=policy,
                         prefix_cache=prefix_cache, ratio=ratio,
                         disk_blocks=disk if prefix_cache else None, speculative=speculative,
                         overlap=overlap)
        cap = self.h.capacity
        # Base prefixes up to 60% of the pool: a few requests on them fill it.
        self.bases = [filler(seed, max(1, pct * cap // 100)) for seed, pct in bases]

    @rule(base=st.integers(0, 3), cut=st.integers(0, 100),
          long=st.sampled_from([0, 0, 0, 10, 20, 35, 50, 120]), long_seed=st.integers(0, 2),
          suffix=st.lists(st.integers(0, VOCAB - 1), max_size=6), copies=st.integers(1, 3),
          max_new=st.integers(0, 40), n=st.sampled_from([1, 1, 1, 2, 3, 4]),
          temperature=st.sampled_from([0.0, 0.8]), top_k=st.sampled_from([-1, -1, 1]),
          seed=st.none() | st.integers(0, 1000), ignore_eos=st.booleans(),
          stop=st.none() | st.integers(0, VOCAB - 1),
          logprob=st.sampled_from([None, None, -1, 0, 1, 3, 9, 40]),
          top_n=st.sampled_from([0, 0, 2]), namespace=st.sampled_from([None, None, "a", "b"]))
    @guarded
    def add(self, base, cut, long, long_seed, suffix, copies, max_new, n, temperature, top_k,
            seed, ignore_eos, stop, logprob, top_n, namespace) -> None:
        """`copies` requests that differ in their last token (one burst, shared prefixes),
        in one cache namespace (tenants: the same prompts in several namespaces)."""
        h = self.h
        b = self.bases[base % len(self.bases)]
        # `long` is a share of the pool: prompts of many chunks, some too long to accept.
        prompt = (b[:cut * len(b) // 100] + filler(100 + long_seed, long * h.capacity // 100)
                  + suffix)
        if logprob is not None and 0 < logprob < 40:
            logprob = min(logprob, len(prompt) - 1)  # 40 may lie past the prompt: refused
        sampling = SamplingParams(max_new_tokens=min(max_new, h.capacity // 3),
                                  temperature=temperature, top_k=top_k,
                                  seed=seed, ignore_eos=ignore_eos, n=n,
                                  stop_token_ids=None if stop is None else [stop])
        for c in range(copies):
            rid = f"r{self.next_rid}"
            self.next_rid += 1
            h.submit(rid, prompt + [c] * (c > 0), sampling, return_logprob=logprob is not None,
                     logprob_start_len=-1 if logprob is None else logprob,
                     top_n=top_n if logprob is not None else 0, namespace=namespace)

    @precondition(lambda self: self.h is not None and bool(self.h.requests))
    @rule(base=st.integers(0, 3), cut=st.integers(0, 100),
          suffix=st.lists(st.integers(0, VOCAB - 1), max_size=6), width=st.integers(1, 4),
          max_new=st.integers(1, 12), length_penalty=st.sampled_from([1.0, 0.0, 2.0]),
          early_stopping=st.sampled_from([False, True, "never"]), ignore_eos=st.booleans(),
          namespace=st.sampled_from([None, "a"]))
    @guarded
    def add_beam_search(self, base, cut, suffix, width, max_new, length_penalty,
                        early_stopping, ignore_eos, namespace) -> None:
        """A beam search: its beams fork, copy on write, park until their siblings have
        run the step, get retracted with their step done, and drop out."""
        h = self.h
        b = self.bases[base % len(self.bases)]
        rid = f"r{self.next_rid}"
        self.next_rid += 1
        h.submit(rid, b[:cut * len(b) // 100] + suffix or [1],
                 SamplingParams(max_new_tokens=min(max_new, h.capacity // 3),
                                temperature=0.0, ignore_eos=ignore_eos),
                 beam=BeamParams(width=width, length_penalty=length_penalty,
                                 early_stopping=early_stopping), namespace=namespace)

    @rule(i=st.integers(0, 10_000), live_only=st.booleans())
    @guarded
    def abort(self, i, live_only) -> None:
        """Abort a request (waiting, mid-prefill, decoding), or one already finished."""
        h = self.h
        rids = [r for r in h.requests if h.live(r)] if live_only else list(h.requests)
        if rids:
            h.abort(rids[i % len(rids)])

    @rule()
    @guarded
    def abort_unknown(self) -> None:
        self.h.scheduler.abort("no-such-request")  # must produce no update

    @rule(k=st.integers(1, 24))
    @guarded
    def step(self, k) -> None:
        for _ in range(k):
            if not self.h.step():
                break

    @rule(roll=st.integers(0, 3))
    @guarded
    def failed_step(self, roll) -> None:
        """Now and then the worker fails a step: its requests end, the rest go on."""
        if roll == 0:
            self.h.step(fail=True)

    @rule()
    @guarded
    def flush(self) -> None:
        self.h.flush()

    @rule(i=st.integers(0, 10_000))
    @guarded
    def corrupt_disk_entry(self, i) -> None:
        """A disk file goes bad: its next load fails, and the request recomputes."""
        files = sorted(self.h.worker.files)
        if files:
            self.h.worker.corrupted.add(files[i % len(files)])

    @invariant()
    @guarded
    def consistent(self) -> None:
        if self.h is not None:
            self.h.check_now()

    def teardown(self) -> None:
        if self.h is not None and self.ok:
            self.h.final_check()


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(
    max_examples=150, stateful_step_count=80, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])


def test_prefixes_held_for_waiting_samples_do_not_stall_the_queue() -> None:
    """A case the machine found: two requests of n = 2 in a pool of 24 one-token blocks
    with a disk tier, retracted and reloaded until nothing runs and the queue's head does
    not fit beside the prefix loaded and held for the other; the holds must go (the step
    once returned no batch with both waiting, and the requests never finished)."""
    machine = SchedulerMachine()
    machine.setup(page_size=1, num_blocks=24, chunk=8, max_running=2, max_queued=64,
                  policy="lpm", prefix_cache=True, ratio=(0.7, 0.1, 0.002), bases=[(0, 34)],
                  disk=200)
    machine.add(base=0, copies=2, cut=100, ignore_eos=True, logprob=None, long=0,
                long_seed=0, max_new=7, n=2, namespace=None, seed=None, stop=None,
                suffix=[0] * 6, temperature=0.8, top_k=-1, top_n=0)
    machine.h.drain()
    assert machine.h.scheduler.stats()["disk_loads"] >= 1
    machine.teardown()


# ---------------------------------------------------------------------- fixed workload

@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
def test_mixed_workload_matches_reference(page_size: int, overlap: bool) -> None:
    """A fixed workload on a pool that cannot hold it: shared prefixes, multi-chunk
    prompts, n > 1, seeded and greedy, logprobs, EOS and ignore_eos, aborts mid-prefill.
    Every output equals the reference and the pool really was short."""
    num_blocks = 128 // page_size
    h = Harness(num_blocks=num_blocks, page_size=page_size, chunk=16, max_running=5,
                ratio=(0.2, 0.0, 0.02), overlap=overlap)
    rng = random.Random(page_size)
    system = [filler(s, 24) for s in range(3)]
    to_abort = []
    for wave in range(6):
        for j in range(8):
            k = wave * 8 + j
            prompt = (system[k % 3][:rng.choice([8, 16, 24])]
                      + filler(1000 + k % 5, rng.choice([0, 6, 40]))
                      + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6))])
            greedy = k % 3 == 0
            sampling = SamplingParams(max_new_tokens=rng.choice([4, 12, 30]),
                                      temperature=0.0 if greedy else 0.8,
                                      seed=None if k % 7 == 0 else k, n=1 + (k % 4 == 1) * 2,
                                      ignore_eos=k % 2 == 0)
            lp = [None, -1, 0, 5][k % 4]
            assert h.submit(f"w{k}", prompt, sampling, return_logprob=lp is not None,
                            logprob_start_len=-1 if lp is None else lp,
                            top_n=2 if k % 8 == 3 else 0)
            if k % 6 == 5:
                to_abort.append(f"w{k}")
        for _ in range(6 + wave):
            h.step()
        if to_abort:
            h.abort(to_abort.pop(0))  # often mid-prefill: its prompt is a few chunks long
        h.check_now()
    h.final_check()
    stats = h.scheduler.stats()
    assert stats["retractions"] > 0, stats
    assert stats["evicted_tokens"] > 0, stats
    assert stats["aborted"] > 0, stats
    assert stats["prompt_cached_tokens"] > 0, stats
    done = [s for s in h.samples.values() if s.finish["type"] != "abort"]
    assert len(done) > 40 and any(s.finish["type"] == "stop" for s in done)
    assert any(s.finish["type"] == "length" for s in done)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
def test_beam_searches_and_samples_in_a_short_pool_match_the_reference(page_size: int,
                                                                       overlap: bool) -> None:
    """Beam searches of every width next to sampled requests, on a pool that cannot hold
    them all: beams fork and copy on write, are retracted (after their step, or before),
    fork from retracted parents, and still return exactly the reference's beams."""
    h = Harness(num_blocks=48 // page_size, page_size=page_size, chunk=16, max_running=6,
                ratio=(0.05, 0.0, 0.02), overlap=overlap)
    system = filler(7, 20)
    for k in range(12):
        prompt = system[:8 + k % 3 * 6] + filler(50 + k, 1 + k % 4)
        if k % 3:
            h.submit(f"b{k}", prompt, SamplingParams(max_new_tokens=6 + k % 5, temperature=0.0,
                                                     ignore_eos=k % 2 == 0),
                     beam=BeamParams(width=1 + k % 4, length_penalty=[1.0, 0.0, 2.0][k % 3],
                                     early_stopping=[False, True, "never"][k % 3]))
        else:
            h.submit(f"s{k}", prompt, SamplingParams(max_new_tokens=10, temperature=0.8, seed=k,
                                                     n=2))
        h.step()
    h.final_check()
    stats = h.scheduler.stats()
    # (with overlap, a decode that does not fit waits for the step in flight to fold
    # rather than retract anything: with 1-token pages that is enough for this load)
    assert stats["retractions"] > 0 or (overlap and page_size == 1), stats
    assert stats["copied_blocks"] > 0 or page_size == 1, stats  # 1-token pages: never part-full
    beams = [s for s in h.samples.values() if s.request.beam is not None]
    assert len(beams) == sum(1 + k % 4 for k in range(12) if k % 3)
    assert all(s.finish["type"] != "abort" for s in beams)


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_retraction_mid_prefill_with_prompt_logprobs(page_size: int) -> None:
    """Three long decodes fill the pool while a 32-token prompt that wants its logprobs is
    mid-prefill: it is retracted with part of its prompt logprobs computed (at the time of
    writing), and must end with each of them exactly once."""
    h = Harness(num_blocks=64 // page_size, page_size=page_size, chunk=8, max_running=4,
                ratio=(0.0, 0.0, 0.0))
    for i in range(3):
        h.submit(f"d{i}", filler(i, 6),
                 SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True))
    h.step()
    h.step()
    (key,) = h.submit("lp", filler(9, 32), SamplingParams(max_new_tokens=4, temperature=0.8,
                                                          seed=5, ignore_eos=True),
                      return_logprob=True, logprob_start_len=0)
    h.final_check()
    assert h.scheduler.stats()["retractions"] > 0
    s = h.samples[key]
    assert s.input_logprobs == s.input_ref and len(s.input_ref) == 32
    assert s.output_logprobs == s.expected.output_logprobs


def test_fake_worker_catches_a_swapped_block_table() -> None:
    """The checker has teeth: swap two of a running request's blocks (which the block
    accounting alone cannot notice) and the next forward reads misplaced KV."""
    h = Harness(num_blocks=32, page_size=2, chunk=8, max_running=2)
    h.submit("a", filler(5, 30), SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    for _ in range(4):
        h.step()
    req = h.scheduler.groups["a"].seqs[0]
    assert req.kv.kv_len >= 4 and len(req.kv.block_table) >= 2
    first, second = req.kv.block_table[:2]
    h.scheduler.cache.kv.splice(req.kv, 0, 2, [second, first])  # as the manager writes: sent on
    h.scheduler.check_invariants()  # the accounting is still fine...
    with pytest.raises(AssertionError, match="position"):
        h.step()  # ...but position 0 now reads the slot of position 2


def test_reference_is_what_an_unshared_run_produces() -> None:
    """expected_output agrees with FakeWorker on the simplest schedule (one request)."""
    h = Harness(num_blocks=64, page_size=1, chunk=64, max_running=1)
    sampling = SamplingParams(max_new_tokens=20, temperature=0.8, seed=3, stop_token_ids=[7])
    (key,) = h.submit("x", filler(9, 10), sampling)
    h.drain()
    s = h.samples[key]
    assert s.finish == s.expected.finish_reason and s.tokens == s.expected.output_ids
    assert len(s.tokens) >= 1


def test_fake_worker_catches_right_token_wrong_history() -> None:
    """A slot with the right token at the right position, computed after a different
    prefix, is foreign KV (a real layer's KV at p depends on tokens 0..p)."""
    w = FakeWorker(num_blocks=8, page_size=1, vocab=VOCAB)
    seqs = iter(range(100))

    def batch(tokens, table, start=0):
        return one_sequence_step(next(seqs), tokens, table, start)

    w.forward(batch([1, 2, 3], [0, 1, 2]))
    w.forward(batch([5, 2, 3], [3, 4, 5]))
    assert w.forward(batch([5, 2, 3, 4], [3, 4, 5, 6], start=3)).outputs[0].next_token >= 0
    with pytest.raises(AssertionError, match="different prefix"):
        w.forward(batch([5, 2, 3, 4], [3, 1, 2, 7], start=3))  # A's blocks for 1..2
    with pytest.raises(AssertionError, match="never-written"):
        w.forward(batch([5, 2, 3, 4], [3, 7, 5, 6], start=3))  # block 7: never written


def test_fake_worker_applies_block_copies_before_writes() -> None:
    """Copy-on-write: a fork whose batch carries `block_copies` reads the copied partial
    page; the same batch without the copy reads a never-written slot."""
    seqs = iter(range(100))

    def batch(tokens, table, start, copies=()):
        return one_sequence_step(next(seqs), tokens, table, start, copies)

    for copies, ok in (((), False), ([(1, 2)], True)):
        w = FakeWorker(num_blocks=4, page_size=2, vocab=VOCAB)
        w.forward(batch([1, 2, 3], [0, 1], 0))  # block 1 holds position 2 only
        fork = batch([1, 2, 3, 7], [0, 2], 3, copies)  # writes position 3 into a copy
        if ok:
            w.forward(fork)
            assert w.block_copies == 1 and w.read_context([0, 2], 4)[0] == [1, 2, 3, 7]
        else:
            with pytest.raises(AssertionError, match="never-written"):
                w.forward(fork)


# ---------------------------------------------------------------------- known bugs

def test_abort_reaches_only_its_own_request() -> None:
    h = Harness(num_blocks=64, page_size=1, chunk=16, max_running=4)
    sampling = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    h.submit("job", filler(1, 6), sampling)
    h.submit("job:1", filler(2, 6), sampling)
    h.abort("job")
    h.final_check()  # 'job:1' ends with an abort nobody asked for


def test_sample_names_do_not_collide_with_client_rids() -> None:
    h = Harness(num_blocks=64, page_size=1, chunk=16, max_running=4)
    h.submit("a", filler(1, 6), SamplingParams(max_new_tokens=4, temperature=0.0, n=2))
    h.submit("a:0", filler(2, 6), SamplingParams(max_new_tokens=4, temperature=0.0))
    h.final_check()


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("copies,n", [(2, 2), (3, 3)])
def test_a_failed_step_caches_none_of_its_requests_kv(copies: int, n: int,
                                                       overlap: bool) -> None:
    """Found by the machine: a step the worker fails never ran its planned block copies
    (a kept partial block, a copy-on-write tail), so caching the failed requests' KV then
    handed a later request blocks that hold no valid tokens. With overlap the step sent
    behind the failed one fails too."""
    state = SchedulerMachine()
    state.setup(page_size=4, num_blocks=24 if n == 2 else 35, chunk=8 if n == 2 else 16,
                max_running=2 if n == 2 else 4, max_queued=64, policy="lpm",
                prefix_cache=True, ratio=(0.7, 0.1, 0.002), bases=[(0, 36 if n == 2 else 46)],
                overlap=overlap)
    state.add(base=0, copies=copies, cut=25 if n == 2 else 30, ignore_eos=False,
              logprob=None, long=10, long_seed=0, max_new=2, n=n, namespace=None, seed=None,
              stop=None, suffix=[] if n == 2 else [0, 0, 0, 0], temperature=0.0, top_k=-1,
              top_n=0)
    for method, arg in (("step", 3), ("failed_step", 0), ("step", 1)):
        getattr(state, method)(arg)
        state.consistent()
    state.teardown()


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
def test_speculative_runs_match_the_reference(page_size: int, overlap: bool) -> None:
    """Drafts that are mostly right (`OracleDrafter`) in a pool too small for the
    workload: accepted runs, rejections mid-run, stop ids and EOS inside a run,
    max_new_tokens cutting a run, logprobs of every kept token; outputs equal the
    reference (single steps), and rejected drafts leave no block behind."""
    h = Harness(num_blocks=96 // page_size, page_size=page_size, chunk=16, max_running=4,
                ratio=(0.2, 0.0, 0.02), speculative="oracle", overlap=overlap)
    for k in range(24):
        sampling = SamplingParams(max_new_tokens=[5, 17, 30][k % 3],
                                  temperature=0.0 if k % 2 else 0.8, seed=k,
                                  ignore_eos=k % 4 == 0, n=1 + (k % 5 == 2),
                                  stop_token_ids=[k % VOCAB] if k % 3 == 1 else None)
        lp = [None, -1, 0][k % 3]
        assert h.submit(f"s{k}", filler(k % 4, 20) + [k % VOCAB], sampling,
                        return_logprob=lp is not None, logprob_start_len=-1 if lp is None else lp,
                        top_n=2 if k % 6 == 1 else 0)
        h.step()
        h.check_now()
    h.final_check()
    stats = h.scheduler.stats()
    assert stats["spec_accepted_tokens"] > stats["spec_steps"] > 0, stats
    assert stats["spec_draft_tokens"] > stats["spec_accepted_tokens"], stats
    assert stats["retractions"] > 0 or stats["evicted_tokens"] > 0, stats
