"""The batch the worker keeps across steps: each running sequence's state, held under the
id the scheduler gave it, piece by piece. Each piece here applies what the scheduler's
piece of the same name sends (`scheduler/worker_rows.py` states the contract, one diff and
one reset for all of them):

- `BlockTable`: the sequence's block table, from `table_edits` (a new sequence's table,
  appended blocks, a copy-on-write tail), to a device tensor of rows the kernels gather
  from and to host lists the host-side planners read (tree attention's plan, the virtual
  layout's mapping);
- `Sampling`: its sampling parameters, sent once, and the output index it samples at
  next, from which each step's `SeqSampling`s are put together (`StepSeqs.sample`);
- `PenaltyTokens`: the prompt and outputs its penalties count, sent piece by piece;
- `KeptToken`: with overlap scheduling, on the device, the token it sampled last
  (`ForwardBatch.keep_tokens`), which the next step's placeholder reads
  (`StepSeqs.input_ids`): the host never waits for it.

A piece is applied only in a step that carries its part, so a step without penalties or
new blocks pays nothing for them. `StepSeqs` is one step's view of them: the sequences'
rows, their positions and KV slots, computed on the device from the lengths and the rows,
so nothing in a step is sized by the context.
"""

from __future__ import annotations

import functools
from itertools import accumulate

import torch

from radixserve.messages import (ForwardBatch, RowSampling, SamplingEdit, SeqLogprobs,
                                 SeqSampling, TableEdit)
from radixserve.worker.attention.base import SeqKinds
from radixserve.worker.staging import to_device


class BlockTable:
    """Each sequence's block table: a row of `tables` (`[capacity, width]` int32 on the
    device, grown on demand) and a host copy."""

    def __init__(self, device: torch.device, width: int, capacity: int) -> None:
        self.tables = torch.zeros(capacity, width, dtype=torch.int32, device=device)
        """Row r: its sequence's block ids from entry 0; past them, stale ids of blocks
        that exist (never read unmasked), so a padded gather stays in the pool."""
        self.host: dict[int, list[int]] = {}

    def grow(self, capacity: int) -> None:
        """There are `capacity` rows now (doubled): the new ones zero, as at the start."""
        self.tables = torch.nn.functional.pad(self.tables,
                                              (0, 0, 0, capacity - self.tables.shape[0]))

    def apply(self, batch: ForwardBatch, rows: SeqRows) -> None:
        """The table edits (a step with some), in order: one device write. A sequence's
        first edit places it in a row."""
        row_ids: list[int] = []
        cols: list[int] = []
        values: list[int] = []
        for edit in batch.table_edits:
            table = self.host.get(edit.seq)
            if table is None:
                table = self.host[edit.seq] = []
                rows.place(edit.seq)
            if edit.start > len(table):
                raise ValueError(f"a table edit of sequence {edit.seq} starts at entry "
                                 f"{edit.start}, past the {len(table)} the worker holds")
            del table[edit.start:]
            table.extend(edit.blocks)
            row_ids += [rows.row_of[edit.seq]] * len(edit.blocks)
            cols.extend(range(edit.start, len(table)))
            values.extend(edit.blocks)
        if cols and max(cols) >= self.tables.shape[1]:
            grown = max(max(cols) + 1, 2 * self.tables.shape[1])
            self.tables = torch.nn.functional.pad(self.tables, (0, grown - self.tables.shape[1]))
        index = to_device([row_ids, cols, values], rows.device)
        self.tables.index_put_((index[0], index[1]), index[2].int())


class Sampling:
    """Per sequence: its sampling parameters (`ForwardBatch.sampling_edits`) and the output
    index it samples at next, one more after each step that samples it."""

    def __init__(self) -> None:
        self.params: dict[int, RowSampling] = {}
        self.steps: dict[int, int] = {}

    def apply(self, batch: ForwardBatch) -> list[SeqSampling | None]:
        """The step's sampling per sequence (None: `unsampled`), from what the rows keep
        and what the step adds (`sample_steps`)."""
        for edit in batch.sampling_edits:
            self.params[edit.seq] = edit.params
        unsampled = set(batch.unsampled)
        extras = {x.i: x for x in batch.sample_steps}
        sample: list[SeqSampling | None] = []
        for i, seq in enumerate(batch.seqs):
            if i in unsampled:
                sample.append(None)
                continue
            extra = extras.get(i)
            step = extra.step if extra is not None and extra.step >= 0 else self.steps.get(seq)
            params = self.params.get(seq)
            if params is None or step is None:
                raise ValueError(f"sequence {seq} samples, but its row holds no sampling")
            self.steps[seq] = step + 1
            sample.append(SeqSampling.of(params, step, extra))
        return sample

    def forget(self, seq: int) -> None:
        self.params.pop(seq, None)
        self.steps.pop(seq, None)


class PenaltyTokens:
    """Per sequence with a penalty: its prompt (the repetition penalty's) and outputs, as
    the step messages sent them piece by piece (`StepSampling.output_start`)."""

    def __init__(self) -> None:
        self.history: dict[int, tuple[list[int] | None, list[int]]] = {}

    def apply(self, batch: ForwardBatch, sample: list[SeqSampling | None]) -> None:
        """Each `penalized` sequence's sampling given its whole prompt and outputs again,
        from what it keeps plus what the step sent."""
        sent = {x.i: x for x in batch.sample_steps}
        for i in batch.penalized:
            seq, s, x = batch.seqs[i], sample[i], sent.get(i)
            if s is None or x is None or x.output_ids is None:
                raise ValueError(f"sequence {seq} is penalized but sends no output tokens")
            prompt, outputs = self.history.setdefault(seq, (x.prompt_ids, []))
            if x.output_start > len(outputs):
                raise ValueError(f"sequence {seq}'s outputs are sent from {x.output_start}, "
                                 f"past the {len(outputs)} the worker holds")
            del outputs[x.output_start:]
            outputs += x.output_ids
            s.prompt_ids, s.output_ids = prompt, list(outputs)


class KeptToken:
    """Row r: the token its sequence sampled last, where a step asked to keep it
    (`StepSeqs.keep_tokens`), for the next step's placeholder (`StepSeqs.input_ids`). A
    placeholder only ever follows a keep of its own sequence, so nothing is forgotten."""

    def __init__(self, device: torch.device, capacity: int) -> None:
        self.last = torch.zeros(capacity, dtype=torch.long, device=device)

    def grow(self, capacity: int) -> None:
        self.last = torch.nn.functional.pad(self.last, (0, capacity - self.last.shape[0]))


class SeqRows:
    """Every sequence the scheduler placed here and has not ended, in a row of its own,
    with each piece of its state."""

    def __init__(self, device: torch.device, width: int = 64, capacity: int = 64) -> None:
        self.device = device
        self.table = BlockTable(device, width, capacity)
        self.sampling = Sampling()
        self.penalties = PenaltyTokens()
        self.kept = KeptToken(device, capacity)
        self.row_of: dict[int, int] = {}
        self._free = list(range(capacity))[::-1]

    def apply(self, batch: ForwardBatch) -> list[SeqSampling | None]:
        """`batch.ended` (or, with `reset_rows`, every sequence) forgotten, then the pieces
        the step changes applied; returns the step's sampling per sequence (`Sampling`)."""
        for seq in list(self.row_of) if batch.reset_rows else batch.ended:
            self.forget(seq)
        if batch.table_edits:
            self.table.apply(batch, self)
        sample = self.sampling.apply(batch)
        if batch.penalized:
            self.penalties.apply(batch, sample)
        return sample

    def place(self, seq: int) -> None:
        """A row for the new sequence `seq` (twice the rows when none is free)."""
        if not self._free:
            n = len(self.row_of)
            self.table.grow(2 * n)
            self.kept.grow(2 * n)
            self._free = list(range(n, 2 * n))[::-1]
        self.row_of[seq] = self._free.pop()

    def forget(self, seq: int) -> None:
        """Drop `seq`'s row and what every piece keeps of it by its id (a no-op for one
        never placed; a row's device entries are overwritten by its next sequence's)."""
        if (row := self.row_of.pop(seq, None)) is not None:
            self._free.append(row)
        self.table.host.pop(seq, None)
        self.sampling.forget(seq)
        self.penalties.history.pop(seq, None)

    def step(self, batch: ForwardBatch, sample: list[SeqSampling | None],
             page_size: int) -> StepSeqs:
        """The step's sequences (already applied: `sample` is `apply`'s) as its kernels
        address them."""
        try:
            rows = [self.row_of[s] for s in batch.seqs]
        except KeyError as e:
            raise ValueError(f"sequence {e.args[0]} has no table in the worker") from None
        return StepSeqs(self, batch, sample, rows, page_size)


class StepSeqs:
    """One step's sequences: their lengths (host), and on the device their offsets in the
    flat token stream, lengths, rows, positions, KV slots (paged-pool ids), new tokens and
    logit rows."""

    def __init__(self, rows: SeqRows, batch: ForwardBatch, sample: list[SeqSampling | None],
                 row_ids: list[int], page_size: int) -> None:
        self._rows, self.batch, self.page_size = rows, batch, page_size
        self.sample = sample
        """Per sequence: how it samples this step, or None (`Sampling.apply`)."""
        self.seqs, self.q_lens, self.kv_lens = batch.seqs, batch.q_lens, batch.kv_lens
        self.q_start_host = [0, *accumulate(self.q_lens)]
        self.num_tokens = t = self.q_start_host[-1]
        for seq, kv in zip(self.seqs, self.kv_lens):
            if -(-kv // page_size) > len(rows.table.host[seq]):
                raise ValueError(f"sequence {seq}'s table does not cover its {kv} tokens")
        logit_rows = self._logit_rows()
        b, p, k = len(row_ids), len(batch.placeholders), len(batch.keep_tokens)
        decodes = [i for i, q in enumerate(self.q_lens) if q == 1]
        extends = [i for i, q in enumerate(self.q_lens) if q != 1]
        # One copy to the device for everything the step sends (token ids fit in int32).
        packed = to_device([*self.q_start_host, *self.q_lens, *self.kv_lens, *row_ids,
                            *batch.placeholders, *batch.keep_tokens, *decodes, *extends,
                            *batch.input_ids, *logit_rows], rows.device, torch.int32)
        self.q_start = packed[:b + 1]
        self.q_lens_t = packed[b + 1:2 * b + 1]
        self.kv_lens_t = packed[2 * b + 1:3 * b + 1]
        self.rows = packed[3 * b + 1:4 * b + 1].long()
        at = 4 * b + 1
        placeholders, self._keep = packed[at:at + p].long(), packed[at + p:at + p + k].long()
        at += p + k
        self.kinds = SeqKinds(packed[at:at + len(decodes)], packed[at + len(decodes):at + b])
        """The single-token and multi-token sequences, found on the host."""
        at += b
        self.input_ids = packed[at:at + t].long()
        """`[T]` int64: the step's new tokens, each placeholder replaced by the token its
        sequence's row kept (`ForwardBatch.placeholders`, each the one new token of its
        sequence)."""
        if p:
            self.input_ids[self.q_start[placeholders].long()] = rows.kept.last[
                self.rows[placeholders]]
        self.logit_rows = packed[at + t:].long()
        """`[R]` int64: the rows of the token stream whose logits the step reads
        (`_logit_rows`)."""
        # Each new token's position, `kv_len - q_len + i` for the i-th new token of its
        # sequence, without a host sync.
        q = self.q_lens_t.long()
        first = torch.repeat_interleave(self.kv_lens_t.long() - q - self.q_start[:-1].long(),
                                        q, output_size=t)
        self.positions = first + torch.arange(t, device=rows.device)
        self.width = -(-max(self.kv_lens) // page_size)

    def _logit_rows(self) -> list[int]:
        """Per sequence: its input-logprob rows, then its sampling row (with a draft, the
        rows that verify it too)."""
        batch = self.batch
        rows: list[int] = []
        for i, start in enumerate(self.q_start_host[:-1]):
            lp = batch.logprobs[i]
            if lp is not None and lp.input_targets:
                first = start + lp.input_start
                rows.extend(range(first, first + len(lp.input_targets)))
            s = self.sample[i]
            if s is not None:
                end = start + batch.q_lens[i]
                rows.extend(range(end - 1 - len(s.draft), end))
        return rows

    def keep_tokens(self, tokens: torch.Tensor) -> None:
        """The tokens sampled for `ForwardBatch.keep_tokens` (`[K]` on the device, in that
        order) kept in their rows, for the next step's placeholders."""
        self._rows.kept.last[self.rows[self._keep]] = tokens

    def block_tables(self) -> torch.Tensor:
        """`[B, width]` int32 on the device: each sequence's blocks, as many as its
        longest context needs (past a sequence's own, stale ids: never read unmasked)."""
        return self._rows.table.tables[self.rows, :self.width]

    def slot_mapping(self) -> torch.Tensor:
        """`[T]` int64 on the device: each new token's KV slot in the paged pool."""
        seq_of_token = torch.repeat_interleave(self.rows, self.q_lens_t.long(),
                                               output_size=self.num_tokens)
        page = self.positions // self.page_size
        block = self._rows.table.tables[seq_of_token, page].long()
        return block * self.page_size + self.positions % self.page_size

    def host_tables(self) -> list[list[int]]:
        """Each sequence's table as the host holds it, in O(batch): past its context it may
        hold stale entries (tree attention's planner reads only blocks before the new
        tokens)."""
        return [self._rows.table.host[s] for s in self.seqs]

    @functools.cached_property
    def context_tables(self) -> list[list[int]]:
        """Each sequence's blocks that its context covers, on the host: O(context), paid
        only by the virtual layout, which maps them."""
        page = self.page_size
        return [t[:-(-kv // page)] for t, kv in zip(self.host_tables(), self.kv_lens)]


def whole_tables_step(tables: list[list[int]], input_ids: list[int], q_lens: list[int],
                      kv_lens: list[int], sample: list[SeqSampling | None],
                      logprobs: list[SeqLogprobs | None],
                      block_copies: list[tuple[int, int]] | None = None) -> ForwardBatch:
    """A step that tells the worker every sequence's table and sampling whole, as
    sequences 0.., after forgetting every other: how a worker is driven without a
    scheduler (its start-up measurements, benchmarks, tests)."""
    seqs = list(range(len(tables)))
    return ForwardBatch(
        seqs=seqs, input_ids=input_ids, q_lens=q_lens, kv_lens=kv_lens, reset_rows=True,
        table_edits=[TableEdit(s, 0, t) for s, t in zip(seqs, tables)],
        block_copies=block_copies or [],
        sampling_edits=[SamplingEdit(i, s.row()) for i, s in enumerate(sample) if s is not None],
        unsampled=[i for i, s in enumerate(sample) if s is None],
        sample_steps=[s.step_part(i) for i, s in enumerate(sample) if s is not None],
        penalized=[i for i, s in enumerate(sample) if s is not None and s.output_ids is not None],
        logprobs=logprobs)
