"""A torch-free worker whose "KV cache" records what was computed, and a reference for it.

`FakeWorker.forward` does what the real worker does with a ForwardBatch, minus the model:

* The persistent batch: it keeps each sequence's block table across steps, as the real
  worker does (`worker/seq_rows.py`), from `batch.ended` and `batch.table_edits` alone;
  positions and slots follow from the lengths and those tables. A table edit the
  scheduler forgot shows up as a read of stale or unwritten KV.
* KV writes: every new token's slot (from its sequence's table) gets a value naming the token
  and its position, `token * POS_RADIX + position`, plus, in a parallel array, the hash
  of the whole sequence up to and including it (a real layer's KV at position p is a
  function of tokens 0..p, not of token p alone). `batch.block_copies` (copy-on-write, if
  the batch has that field) are applied first, whole blocks.
* KV reads: each sequence reads back its whole context, positions 0..kv_len-1, through its
  block table, the way attention does. A slot never written, a slot naming another
  position, or a slot whose stored prefix hash disagrees with the tokens read before it
  (right token, wrong history: some other sequence's KV) fails an assertion on the spot.
* Overlap scheduling: `launch` runs a step and `collect` returns its result, in order, so
  a step can be sent before the result of the one before is taken. A placeholder input
  token is filled in from the token the worker kept for its sequence the step before
  (`keep_tokens`), as the real worker does on the device; a placeholder with no such token
  fails an assertion.
* The disk tier: `kv_store` copies whole blocks (slots and hashes) into `files`, first,
  `kv_load` copies them back into other blocks (an entry in `corrupted`, never stored, or
  stored under another key fails, as a damaged file does), `kv_drop` forgets them. So
  KV that comes back from "disk" is checked like any other.
* Sampling: the next token is a hash of the context as read from the fake KV (and of
  seed and step unless greedy), mod the vocabulary. So a sequence that read stale or
  foreign KV samples a different token than `expected_output`, which computes the same
  function from the prompt alone.

Logprobs are deterministic floats of (context hash, target token), so prompt and output
logprobs can be compared exactly too (`expected_input_logprobs`, `Expected`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from radixserve.messages import (PLACEHOLDER, BeamParams, ForwardBatch, ForwardResult,
                                 SamplingEdit, SamplingParams, SeqLogprobs, SeqOutput,
                                 SeqSampling, TableEdit, TopLogprobs, WorkerInfo)
from radixserve.config import EngineConfig
from radixserve.scheduler.beam import BeamCandidates, BeamSearch
from radixserve.scheduler.scheduler import Scheduler
from radixserve.worker.seq_rows import Sampling

POS_RADIX = 1_000_003
"""Slot value = token * POS_RADIX + position (positions stay far below this)."""
UNWRITTEN = -1
_MOD = (1 << 61) - 1
_MASK = (1 << 64) - 1


def extend_hash(h: int, token: int) -> int:
    """Rolling hash of a token sequence: the hash of `seq + [token]` from that of `seq`."""
    return (h * 1_000_000_007 + token + 1) % _MOD


def context_hash(tokens: Sequence[int]) -> int:
    h = 0
    for t in tokens:
        h = extend_hash(h, t)
    return h


def _mix(*xs: int) -> int:
    """Deterministic 64-bit mixing of a few ints (splitmix64 finaliser per input)."""
    z = 0x9E3779B97F4A7C15
    for x in xs:
        z = (z ^ (x & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        z = (z ^ (z >> 31)) * 0x94D049BB133111EB & _MASK
        z ^= z >> 29
    return z


def sample_token(h: int, greedy: bool, seed: int, step: int, vocab: int) -> int:
    """The token sampled after a context with hash `h`: greedy depends on the context only,
    seeded sampling also on (seed, step), like the real sampler's counter-based RNG."""
    return _mix(h) % vocab if greedy else _mix(h, seed, step, 1) % vocab


def token_logprob(h: int, token: int) -> float:
    """log p(token | context with hash h): any consistent negative float will do."""
    return -(_mix(h, token, 2) % 100_000) / 10_000


def top_logprobs(h: int, n: int, vocab: int) -> TopLogprobs:
    ids = sorted(range(vocab), key=lambda t: (token_logprob(h, t), -t), reverse=True)[:n]
    return TopLogprobs(token_ids=ids, logprobs=[token_logprob(h, t) for t in ids])


def is_greedy(temperature: float, top_k: int) -> bool:
    return temperature < 1e-6 or top_k == 1  # SamplingParams.greedy


def one_sequence_step(seq: int, tokens: Sequence[int], table: list[int], start: int = 0,
                      copies: Sequence[tuple[int, int]] = ()) -> ForwardBatch:
    """A greedy step of sequence `seq` alone over `tokens[start:]`, telling the worker its
    whole `table` (and `copies` to make first)."""
    greedy = SeqSampling(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, seed=0, step=0)
    return ForwardBatch(seqs=[seq], input_ids=list(tokens[start:]), q_lens=[len(tokens) - start],
                        kv_lens=[len(tokens)], table_edits=[TableEdit(seq, 0, table)],
                        block_copies=list(copies), sampling_edits=[SamplingEdit(seq, greedy.row())],
                        sample_steps=[greedy.step_part(0)], logprobs=[None])


class FakeWorker:
    def __init__(self, num_blocks: int, page_size: int, vocab: int) -> None:
        self.num_blocks, self.page_size, self.vocab = num_blocks, page_size, vocab
        n = num_blocks * page_size
        assert n < POS_RADIX
        self.kv = [UNWRITTEN] * n
        """Per slot: token * POS_RADIX + position, or UNWRITTEN."""
        self.kv_hash = [0] * n
        """Per slot: context_hash of the sequence's tokens 0..position (inclusive)."""
        self.files: dict[int, tuple[int, list[int], list[int]]] = {}
        """The disk tier's entries: (key, slots, hashes) of their blocks, in order."""
        self.corrupted: set[int] = set()
        self.steps = 0
        self.tokens_written = 0
        self.tokens_read = 0
        self.block_copies = 0
        self.drafted = self.accepted = 0
        """Speculative decoding: draft tokens verified, and accepted."""
        self.tables: dict[int, list[int]] = {}
        """The persistent batch: each sequence's block table, by the scheduler's id."""
        self.table_entries_sent = 0
        """Block ids received in table edits, over all steps."""
        self.sampling = Sampling()
        """The persistent batch: each sequence's sampling (the worker's own piece)."""
        self.kept: dict[int, int] = {}
        """Overlap scheduling: each sequence's token kept for a placeholder (`keep_tokens`)."""
        self.placeholders = 0
        """Placeholder tokens filled in, over all steps."""
        self.launched: deque[ForwardResult | Exception] = deque()
        """Steps launched and not collected: their results, or why they failed."""
        self.fail_next = False
        """Fail the next step launched (nothing of it runs); the steps after it fail too
        until one resets the rows, as a crashed worker's state is unknown."""
        self.broken = False

    # ------------------------------------------------------------------ KV

    def _copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        ps = self.page_size
        for src, dst in pairs:
            assert 0 <= src < self.num_blocks and 0 <= dst < self.num_blocks, (src, dst)
            s, d = src * ps, dst * ps
            self.kv[d:d + ps] = self.kv[s:s + ps]
            self.kv_hash[d:d + ps] = self.kv_hash[s:s + ps]
            self.block_copies += 1

    def _disk_transfers(self, batch: ForwardBatch) -> list[int]:
        """Stores, then loads, then drops, before anything else: the worker's order."""
        ps = self.page_size
        for t in getattr(batch, "kv_store", ()):
            kv, hashes = [], []
            for b in t.blocks:
                kv += self.kv[b * ps:(b + 1) * ps]
                hashes += self.kv_hash[b * ps:(b + 1) * ps]
            self.files[t.entry] = (t.key, kv, hashes)
        failed = []
        for t in getattr(batch, "kv_load", ()):
            file = self.files.get(t.entry)
            if (file is None or t.entry in self.corrupted or file[0] != t.key
                    or len(file[1]) != len(t.blocks) * ps):
                failed.append(t.entry)
                continue
            for i, b in enumerate(t.blocks):
                self.kv[b * ps:(b + 1) * ps] = file[1][i * ps:(i + 1) * ps]
                self.kv_hash[b * ps:(b + 1) * ps] = file[2][i * ps:(i + 1) * ps]
        for entry in getattr(batch, "kv_drop", ()):
            self.files.pop(entry, None)
        return failed

    def _slot(self, table: Sequence[int], pos: int, seq: int) -> int:
        ps = self.page_size
        page = pos // ps
        assert page < len(table), (
            f"seq {seq}: position {pos} is past its block table ({len(table)} blocks of {ps})")
        block = table[page]
        assert 0 <= block < self.num_blocks, f"seq {seq}: block {block} out of range"
        return block * ps + pos % ps

    def read_context(self, table: Sequence[int], kv_len: int,
                     seq: int = -1) -> tuple[list[int], list[int]]:
        """Tokens 0..kv_len-1 as the KV holds them, and the prefix hashes h[0..kv_len]
        (h[k] hashes tokens[:k]). Asserts every slot is written, by this position, and
        with this history."""
        kv, kv_hash = self.kv, self.kv_hash
        tokens, hashes = [], [0]
        h = 0
        for pos in range(kv_len):
            slot = self._slot(table, pos, seq)
            v = kv[slot]
            assert v != UNWRITTEN, (
                f"seq {seq}: reads never-written KV at position {pos} (slot {slot}, "
                f"block {table[pos // self.page_size]})")
            token, written_pos = divmod(v, POS_RADIX)
            assert written_pos == pos, (
                f"seq {seq}: KV slot {slot} read as position {pos} holds position "
                f"{written_pos} (token {token}): stale or foreign block "
                f"{table[pos // self.page_size]}")
            h = extend_hash(h, token)
            assert kv_hash[slot] == h, (
                f"seq {seq}: KV slot {slot} at position {pos} (token {token}) was computed "
                f"after a different prefix than the one this sequence reads: foreign KV in "
                f"block {table[pos // self.page_size]}")
            tokens.append(token)
            hashes.append(h)
        self.tokens_read += kv_len
        return tokens, hashes

    # ------------------------------------------------------------------ forward

    def _apply_rows(self, batch: ForwardBatch) -> list[list[int]]:
        """`ended` forgotten, then the table edits applied; the step's tables, by seq."""
        if batch.reset_rows:
            self.tables.clear()
            self.kept.clear()
            self.sampling = Sampling()
        for seq in [] if batch.reset_rows else batch.ended:
            assert seq in self.tables, f"seq {seq} ended but was never placed"
            del self.tables[seq]
            self.kept.pop(seq, None)
            self.sampling.forget(seq)
        for edit in batch.table_edits:
            table = self.tables.setdefault(edit.seq, [])
            assert 0 <= edit.start <= len(table), f"seq {edit.seq}: edit past its table"
            table[edit.start:] = edit.blocks
            self.table_entries_sent += len(edit.blocks)
        assert len(set(batch.seqs)) == len(batch.seqs), "a sequence twice in one step"
        missing = [seq for seq in batch.seqs if seq not in self.tables]
        assert not missing, f"seqs {missing} have no table in the worker"
        return [self.tables[seq] for seq in batch.seqs]

    def forward(self, batch: ForwardBatch) -> ForwardResult:
        self.launch(batch)
        return self.collect()

    def launch(self, batch: ForwardBatch) -> None:
        """Run the step now; its result waits for `collect` (see `fail_next`)."""
        if batch.reset_rows:
            self.broken = False
        if self.fail_next or self.broken:
            self.fail_next, self.broken = False, True
            self.launched.append(RuntimeError("fake worker failure"))
            return
        self.launched.append(self._run(batch))

    def collect(self) -> ForwardResult:
        outcome = self.launched.popleft()
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def _inputs(self, batch: ForwardBatch) -> list[int]:
        """The step's new tokens, each placeholder filled in from the token kept for its
        sequence the step before."""
        ids = list(batch.input_ids)
        starts = [0]
        for q_len in batch.q_lens:
            starts.append(starts[-1] + q_len)
        for i in batch.placeholders:
            seq = batch.seqs[i]
            assert batch.q_lens[i] == 1 and ids[starts[i]] == PLACEHOLDER, (
                f"seq {seq}: a placeholder that is not its one new token")
            assert seq in self.kept, f"seq {seq}: a placeholder, but no token was kept for it"
            ids[starts[i]] = self.kept.pop(seq)
            self.placeholders += 1
        return ids

    def _run(self, batch: ForwardBatch) -> ForwardResult:
        self.steps += 1
        nseq = len(batch.q_lens)
        for name in ("seqs", "kv_lens", "logprobs"):
            assert len(getattr(batch, name)) == nseq, f"batch.{name} has the wrong length"
        total = sum(batch.q_lens)
        assert len(batch.input_ids) == total
        tables = self._apply_rows(batch)
        sample = self.sampling.apply(batch)
        input_ids = self._inputs(batch)
        slots = [self._slot(table, pos, i)
                 for i, (table, q_len, kv_len) in enumerate(zip(tables, batch.q_lens,
                                                                 batch.kv_lens))
                 for pos in range(kv_len - q_len, kv_len)]
        assert len(set(slots)) == total, "two new tokens write one KV slot"
        failed = self._disk_transfers(batch)
        self._copy_blocks(getattr(batch, "block_copies", None) or [])

        # 1. Writes. A token's KV depends on its whole prefix: the cached part is read
        # from the fake KV (as attention would), the rest is this chunk's own tokens.
        offset = 0
        for i, (q_len, kv_len) in enumerate(zip(batch.q_lens, batch.kv_lens)):
            assert q_len >= 1, f"seq {i}: empty chunk"
            start = kv_len - q_len
            table = tables[i]
            _, hashes = self.read_context(table, start, i)
            h = hashes[-1]
            for j in range(q_len):
                k = offset + j
                token = input_ids[k]
                assert 0 <= token < self.vocab, f"seq {i}: token {token} outside the vocabulary"
                slot = slots[k]
                h = extend_hash(h, token)
                self.kv[slot] = token * POS_RADIX + start + j
                self.kv_hash[slot] = h
            offset += q_len
            self.tokens_written += q_len

        # 2. Reads and outputs: each sequence attends over positions 0..kv_len-1.
        outputs = [SeqOutput() for _ in batch.q_lens]
        offset = 0
        for i, (q_len, kv_len) in enumerate(zip(batch.q_lens, batch.kv_lens)):
            start = kv_len - q_len
            tokens, hashes = self.read_context(tables[i], kv_len, i)
            mine = input_ids[offset:offset + q_len]
            assert tokens[start:] == mine, (
                f"seq {i}: its new tokens were overwritten in the same step (another "
                f"sequence of the batch writes the same blocks)")
            offset += q_len
            lp = batch.logprobs[i]
            if lp is not None and lp.input_targets:
                # Row r of this chunk (position start + r) scores the token after it.
                rows = range(lp.input_start, lp.input_start + len(lp.input_targets))
                assert 0 <= rows.start and rows.stop <= q_len, f"seq {i}: logprob rows {rows}"
                outputs[i].input_logprobs = [
                    token_logprob(hashes[start + r + 1], t)
                    for r, t in zip(rows, lp.input_targets)]
                if lp.top_n > 0:
                    outputs[i].input_top = [
                        top_logprobs(hashes[start + r + 1], lp.top_n, self.vocab) for r in rows]
            s = sample[i]
            if s is None:
                continue
            out, greedy = outputs[i], is_greedy(s.temperature, s.top_k)
            if s.draft:
                self._verify(s, hashes, kv_len, out, lp if lp is not None and lp.output else None)
                continue
            h = hashes[kv_len]
            out.next_token = sample_token(h, greedy, s.seed, s.step, self.vocab)
            # Parallel samples forking here: the same row, once per fork seed, as their step 0.
            out.fork_tokens = [sample_token(h, greedy, seed, 0, self.vocab)
                               for seed in s.fork_seeds]
            if lp is not None and lp.output:
                out.output_logprob = token_logprob(h, out.next_token)
                out.fork_logprobs = [token_logprob(h, t) for t in out.fork_tokens]
                if lp.top_n > 0:
                    out.output_top = top_logprobs(h, lp.top_n, self.vocab)
                    out.fork_top = [out.output_top] * len(out.fork_tokens)
        for i in batch.keep_tokens:
            s = sample[i]
            assert s is not None and not s.draft and not s.fork_seeds, f"seq {i}: kept, not plain"
            self.kept[batch.seqs[i]] = outputs[i].next_token
        return ForwardResult(outputs=outputs, kv_failed=failed)

    def _verify(self, s: SeqSampling, hashes: list[int], kv_len: int, out: SeqOutput,
                lp: SeqLogprobs | None) -> None:
        """Speculative rows, as the real sampler keeps them: draft tokens while each is
        the token this worker samples there (from the KV it read, drafts included), then
        its own. So a speculative run yields exactly the tokens single steps would."""
        greedy, k = is_greedy(s.temperature, s.top_k), len(s.draft)
        self.drafted += k
        tokens, contexts = [], []
        for i, draft in enumerate([*s.draft, None]):
            h = hashes[kv_len - k + i]  # after the sequence's last token and i drafts
            token = sample_token(h, greedy, s.seed, s.step + i, self.vocab)
            tokens.append(token)
            contexts.append(h)
            if token != draft:
                break
        self.accepted += len(tokens) - 1
        out.next_token, out.spec_tokens = tokens[0], tokens[1:]
        if lp is not None:
            values = [token_logprob(h, t) for h, t in zip(contexts, tokens)]
            out.output_logprob, out.spec_logprobs = values[0], values[1:]
            if lp.top_n > 0:
                tops = [top_logprobs(h, lp.top_n, self.vocab) for h in contexts]
                out.output_top, out.spec_top = tops[0], tops[1:]


# ---------------------------------------------------------------------- the reference

@dataclass
class Expected:
    """What a request must produce, computed from its prompt alone."""

    output_ids: list[int]
    finish_reason: dict
    output_logprobs: list[float] = field(default_factory=list)
    score: float | None = None
    """A beam's score (beam search only)."""


def expected_output(prompt: Sequence[int], sampling: SamplingParams, seed: int,
                    max_new_tokens: int | None = None, eos_ids: Collection[int] = (),
                    vocab: int = 0) -> Expected:
    """The tokens FakeWorker + a correct scheduler generate for this request, its finish
    reason (length, stop token, EOS; no stop strings: the tests run without a decoder),
    and its output logprobs."""
    assert vocab > 0
    max_new = sampling.max_new_tokens if max_new_tokens is None else max_new_tokens
    greedy = is_greedy(sampling.temperature, sampling.top_k)
    stop_ids = set(sampling.stop_token_ids or ())
    h = context_hash(prompt)
    out: list[int] = []
    logprobs: list[float] = []
    if max_new <= 0:
        return Expected([], {"type": "length", "length": max_new})
    while True:
        token = sample_token(h, greedy, seed, len(out), vocab)
        out.append(token)
        logprobs.append(token_logprob(h, token))
        h = extend_hash(h, token)
        if len(out) >= max_new:
            return Expected(out, {"type": "length", "length": max_new}, logprobs)
        if token in stop_ids or (not sampling.ignore_eos and token in eos_ids):
            return Expected(out, {"type": "stop", "matched": token}, logprobs)


def expected_beams(prompt: Sequence[int], beam: BeamParams, sampling: SamplingParams,
                   eos_ids: Collection[int], vocab: int) -> list[Expected]:
    """The beams (best first) a correct scheduler returns for a beam search over FakeWorker:
    the same selection, fed each beam's top logprobs computed from its own tokens."""
    stops = set(sampling.stop_token_ids or ()) | (set() if sampling.ignore_eos else set(eos_ids))
    search = BeamSearch(beam.width, sampling.max_new_tokens, beam.length_penalty,
                        beam.early_stopping, eos_ids=stops)
    while not search.done:
        tops = [top_logprobs(context_hash([*prompt, *tokens]), search.candidates_per_beam, vocab)
                for tokens in search.running]
        search.step([BeamCandidates(t.token_ids, t.logprobs) for t in tops])
    return [Expected(h.output_ids, {"type": "stop", "matched": h.matched} if h.finish_reason
                     == "stop" else {"type": "length", "length": sampling.max_new_tokens},
                     score=h.score) for h in search.finish()]


def expected_input_logprobs(prompt: Sequence[int], logprob_start_len: int) -> list[float | None]:
    """Prompt logprobs from `logprob_start_len` on: position p's entry scores prompt[p]
    given prompt[:p]; position 0 has no context and reads None."""
    out: list[float | None] = []
    h = 0
    for p, t in enumerate(prompt):
        if p >= logprob_start_len:
            out.append(None if p == 0 else token_logprob(h, t))
        h = extend_hash(h, t)
    return out


def fake_scheduler(num_blocks: int, page_size: int, vocab_size: int, chunked_prefill_size: int,
                   **config: object) -> tuple[Scheduler, FakeWorker]:
    """A Scheduler over a pool of `num_blocks` (invariants checked every step) and the
    FakeWorker that serves it, for the scheduler tests that need no model."""
    cfg = EngineConfig(page_size=page_size, max_total_tokens=num_blocks * page_size,
                       chunked_prefill_size=chunked_prefill_size, debug_invariants=True,
                       **config)
    info = WorkerInfo(model_path="fake", num_blocks=num_blocks, page_size=page_size,
                      context_length=1024, vocab_size=vocab_size, eos_token_ids=[0],
                      device="cpu", dtype="float32", kv_pool_bytes=0)
    return Scheduler(cfg, info), FakeWorker(num_blocks, page_size, vocab_size)
