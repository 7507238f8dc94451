"""The batch the worker keeps across steps: each running sequence's block table, held under
the id the scheduler gave it (`scheduler/worker_rows.py` is the scheduler's account of it).

A step message (`ForwardBatch`) says only what changed: sequences `ended`, then
`table_edits` (a new sequence's table, appended blocks, a copy-on-write tail). `SeqRows`
applies them, to a device tensor of rows the kernels gather from and to host lists the
host-side planners read (tree attention's plan, the virtual layout's mapping). `StepSeqs`
is one step's view of it: the sequences' rows, their positions and KV slots, computed on
the device from the lengths and the rows, so nothing in a step is sized by the context.

With overlap scheduling a row also keeps, on the device, the token its sequence sampled
last (`ForwardBatch.keep_tokens`), which the next step's placeholder reads
(`StepSeqs.input_ids`): the host never waits for it.
"""

from __future__ import annotations

import functools
from itertools import accumulate

import torch

from radixserve.messages import ForwardBatch, SeqLogprobs, SeqSampling, TableEdit


class SeqRows:
    """Every sequence the scheduler placed here and has not ended: a row of `tables`
    (`[capacity, width]` int32 on the device, grown on demand) and a host copy."""

    def __init__(self, device: torch.device, width: int = 64, capacity: int = 64) -> None:
        self.device = device
        self.tables = torch.zeros(capacity, width, dtype=torch.int32, device=device)
        """Row r: its sequence's block ids from entry 0; past them, stale ids of blocks
        that exist (never read unmasked), so a padded gather stays in the pool."""
        self.last_token = torch.zeros(capacity, dtype=torch.long, device=device)
        """Row r: the token its sequence sampled last, where a step asked to keep it."""
        self.row_of: dict[int, int] = {}
        self.host: dict[int, list[int]] = {}
        self.penalty_history: dict[int, tuple[list[int] | None, list[int]]] = {}
        """Per sequence with a penalty: its prompt (the repetition penalty's) and outputs,
        as the step messages sent them piece by piece (`SeqSampling.output_start`)."""
        self._free = list(range(capacity))[::-1]

    def apply(self, batch: ForwardBatch) -> None:
        """`batch.ended` (or, with `reset_rows`, every sequence) forgotten, then its
        `table_edits` applied: one device write."""
        for seq in list(self.row_of) if batch.reset_rows else batch.ended:
            self.forget(seq)
        if not batch.table_edits:
            return
        rows: list[int] = []
        cols: list[int] = []
        values: list[int] = []
        for edit in batch.table_edits:
            table = self.host.get(edit.seq)
            if table is None:
                table = self.host[edit.seq] = []
                self.row_of[edit.seq] = self._take_row()
            if edit.start > len(table):
                raise ValueError(f"a table edit of sequence {edit.seq} starts at entry "
                                 f"{edit.start}, past the {len(table)} the worker holds")
            del table[edit.start:]
            table.extend(edit.blocks)
            rows += [self.row_of[edit.seq]] * len(edit.blocks)
            cols.extend(range(edit.start, len(table)))
            values.extend(edit.blocks)
        if cols and max(cols) >= self.tables.shape[1]:
            grown = max(max(cols) + 1, 2 * self.tables.shape[1])
            self.tables = torch.nn.functional.pad(self.tables, (0, grown - self.tables.shape[1]))
        index = torch.tensor([rows, cols, values], dtype=torch.long).to(self.device)
        self.tables.index_put_((index[0], index[1]), index[2].int())

    def forget(self, seq: int) -> None:
        """Drop `seq`'s row (a no-op for one never placed)."""
        if (row := self.row_of.pop(seq, None)) is not None:
            del self.host[seq]
            self._free.append(row)
        self.penalty_history.pop(seq, None)

    def complete_penalties(self, batch: ForwardBatch) -> None:
        """Each sampled sequence with a penalty given its whole prompt and outputs again,
        from what this row keeps plus what the step sent."""
        for seq, s in zip(batch.seqs, batch.sample):
            if s is None or s.output_ids is None:
                continue
            prompt, outputs = self.penalty_history.setdefault(seq, (s.prompt_ids, []))
            if s.output_start > len(outputs):
                raise ValueError(f"sequence {seq}'s outputs are sent from {s.output_start}, "
                                 f"past the {len(outputs)} the worker holds")
            del outputs[s.output_start:]
            outputs += s.output_ids
            s.prompt_ids, s.output_ids = prompt, list(outputs)

    def _take_row(self) -> int:
        if not self._free:  # twice the rows; the new ones zero, as at the start
            n = self.tables.shape[0]
            self.tables = torch.nn.functional.pad(self.tables, (0, 0, 0, n))
            self.last_token = torch.nn.functional.pad(self.last_token, (0, n))
            self._free = list(range(n, 2 * n))[::-1]
        return self._free.pop()

    def step(self, batch: ForwardBatch, page_size: int) -> StepSeqs:
        """The step's sequences (already applied) as its kernels address them."""
        try:
            rows = [self.row_of[s] for s in batch.seqs]
        except KeyError as e:
            raise ValueError(f"sequence {e.args[0]} has no table in the worker") from None
        return StepSeqs(self, batch, rows, page_size)


class StepSeqs:
    """One step's sequences: their lengths (host), and on the device their offsets in the
    flat token stream, lengths, rows, positions and KV slots (paged-pool ids)."""

    def __init__(self, rows: SeqRows, batch: ForwardBatch, row_ids: list[int],
                 page_size: int) -> None:
        self._rows, self.batch, self.page_size = rows, batch, page_size
        self.seqs, self.q_lens, self.kv_lens = batch.seqs, batch.q_lens, batch.kv_lens
        self.q_start_host = [0, *accumulate(self.q_lens)]
        self.num_tokens = self.q_start_host[-1]
        for seq, kv in zip(self.seqs, self.kv_lens):
            if -(-kv // page_size) > len(rows.host[seq]):
                raise ValueError(f"sequence {seq}'s table does not cover its {kv} tokens")
        b = len(row_ids)
        # One copy to the device for everything per sequence.
        packed = torch.tensor([*self.q_start_host, *self.q_lens, *self.kv_lens, *row_ids,
                               *batch.placeholders, *batch.keep_tokens],
                              dtype=torch.int32).to(rows.device)
        self.q_start = packed[:b + 1]
        self.q_lens_t = packed[b + 1:2 * b + 1]
        self.kv_lens_t = packed[2 * b + 1:3 * b + 1]
        self.rows = packed[3 * b + 1:4 * b + 1].long()
        p = 4 * b + 1 + len(batch.placeholders)
        self._placeholders, self._keep = packed[4 * b + 1:p].long(), packed[p:].long()
        self.positions = token_positions(self.q_start, self.q_lens_t, self.kv_lens_t,
                                         self.num_tokens)
        self.width = max(-(-kv // page_size) for kv in self.kv_lens)

    def input_ids(self) -> torch.Tensor:
        """`[T]` int64 on the device: the step's new tokens, each placeholder replaced by
        the token its sequence's row kept (`ForwardBatch.placeholders`, each the one new
        token of its sequence)."""
        ids = torch.tensor(self.batch.input_ids, dtype=torch.long).to(self._rows.device)
        if self.batch.placeholders:
            seqs = self._placeholders
            ids[self.q_start[seqs].long()] = self._rows.last_token[self.rows[seqs]]
        return ids

    def keep_tokens(self, tokens: torch.Tensor) -> None:
        """The tokens sampled for `ForwardBatch.keep_tokens` (`[K]` on the device, in that
        order) kept in their rows, for the next step's placeholders."""
        self._rows.last_token[self.rows[self._keep]] = tokens

    def block_tables(self) -> torch.Tensor:
        """`[B, width]` int32 on the device: each sequence's blocks, as many as its
        longest context needs (past a sequence's own, stale ids: never read unmasked)."""
        return self._rows.tables[self.rows, :self.width]

    def slot_mapping(self) -> torch.Tensor:
        """`[T]` int64 on the device: each new token's KV slot in the paged pool."""
        seq_of_token = torch.repeat_interleave(self.rows, self.q_lens_t.long(),
                                               output_size=self.num_tokens)
        page = self.positions // self.page_size
        block = self._rows.tables[seq_of_token, page].long()
        return block * self.page_size + self.positions % self.page_size

    def host_tables(self) -> list[list[int]]:
        """Each sequence's table as the host holds it, in O(batch): past its context it may
        hold stale entries (tree attention's planner reads only blocks before the new
        tokens)."""
        return [self._rows.host[s] for s in self.seqs]

    @functools.cached_property
    def context_tables(self) -> list[list[int]]:
        """Each sequence's blocks that its context covers, on the host: O(context), paid
        only by the virtual layout, which maps them."""
        page = self.page_size
        return [t[:-(-kv // page)] for t, kv in zip(self.host_tables(), self.kv_lens)]


def token_positions(q_start: torch.Tensor, q_lens: torch.Tensor, kv_lens: torch.Tensor,
                    num_tokens: int) -> torch.Tensor:
    """`[T]` int64: each new token's position, `kv_len - q_len + i` for the i-th new token
    of its sequence, on the lengths' device without a host sync."""
    q = q_lens.long()
    first = torch.repeat_interleave(kv_lens.long() - q - q_start[:-1].long(), q,
                                    output_size=num_tokens)
    return first + torch.arange(num_tokens, device=q_lens.device)


def whole_tables_step(tables: list[list[int]], input_ids: list[int], q_lens: list[int],
                      kv_lens: list[int], sample: list[SeqSampling | None],
                      logprobs: list[SeqLogprobs | None],
                      block_copies: list[tuple[int, int]] | None = None) -> ForwardBatch:
    """A step that tells the worker every sequence's table whole, as sequences 0.., after
    forgetting every other: how a worker is driven without a scheduler (its start-up
    measurements, benchmarks, tests)."""
    seqs = list(range(len(tables)))
    return ForwardBatch(seqs=seqs, input_ids=input_ids, q_lens=q_lens, kv_lens=kv_lens,
                        reset_rows=True,
                        table_edits=[TableEdit(s, 0, t) for s, t in zip(seqs, tables)],
                        block_copies=block_copies or [], sample=sample, logprobs=logprobs)
