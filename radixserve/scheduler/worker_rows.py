"""The scheduler's account of the batch the worker keeps (`worker/seq_rows.py`): which
sequences the worker holds a row for, under which id, and what it holds of each.

The contract for worker-side state. Each piece the worker keeps per sequence is declared
once here, as a `RowPiece` whose `account` knows what the worker holds of it (in `Row`)
and writes into the step only what it lacks, and once in `worker/seq_rows.py`, under the
same name, as the piece that applies it:

============== ========================== ============================ ===============
piece          the worker holds ...       the step sends               worker's apply
============== ========================== ============================ ===============
BlockTable     each sequence's blocks     `table_edits`                `BlockTable`
Sampling       its sampling parameters    `sampling_edits`, a          `Sampling`
               and output index           `StepSampling`'s `step` where
                                          it is not the next one
PenaltyTokens  prompt and outputs         `penalized`, `StepSampling`  `PenaltyTokens`
                                          `prompt_ids`/`output_ids`
KeptToken      its last sampled token     `placeholders` (the keep:    `KeptToken`
               (overlap scheduling)       `RunAhead.launched`)
AdapterSlot    the adapters in its slots  `lora_fills`, `lora_slots`   `LoraSlots`
============== ========================== ============================ ===============

One diff: a row whose sequence is no longer running is `ended`, and the worker forgets
every piece of it. One reset: after a step the worker failed (`forget_all`) the next step
says `reset_rows`, the worker forgets every row, and every piece starts again from a fresh
`Row`, which holds nothing (and sends again what it keeps outside the rows: `reset`).
Pieces of a feature that is off are not in the step's path: `WorkerRows.of` picks them
once, from the config; the sampling pieces run only for a sequence the step samples, and
penalties (a request's) only for one that has them. A step's cost here follows the
sequences and what changed, never the context length.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import count

from radixserve.messages import (PLACEHOLDER, ForwardBatch, RowSampling, SamplingEdit,
                                 TableEdit, WorkerInfo)
from radixserve.scheduler.kv_handle import UNCHANGED
from radixserve.scheduler.loras import LoraRegistry
from radixserve.scheduler.request import Req


@dataclass
class Row:
    """What the worker holds of one sequence, as far as the scheduler knows."""

    seq: int
    """Its id there."""
    entries: int = 0
    """Entries of its block table the worker holds as they are now."""
    outputs: int = -1
    """Output tokens the worker keeps for its penalties (-1: not its prompt either)."""
    step: int = -1
    """The output index the worker samples it at next unless told (-1: it holds no
    sampling parameters for it)."""


class RowPiece:
    """One piece of the worker's per-sequence state, the scheduler's side."""

    def reset(self) -> None:
        """What the worker holds is unknown (`WorkerRows.forget_all`): send it all again.
        What is kept per row needs nothing here: every row starts again, fresh."""

    def begin(self, batch: ForwardBatch) -> None:
        """Once per step, before its sequences: what the step sends for all of them (run
        only for a piece that overrides it)."""

    def account(self, req: Req, i: int, row: Row, batch: ForwardBatch) -> None:
        """Write into `batch` what the worker lacks of this piece for `req` (its `i`-th
        sequence, already in `batch.seqs`, `input_ids`, `kv_lens`, and `unsampled` or
        `sample_steps`), and record
        in `row` that the worker holds it once the step has run."""
        raise NotImplementedError


class BlockTable(RowPiece):
    """The entries of the sequence's block table its step reads. What changed in a table
    is the KV manager's to say: `KVManager.splice` lowers `table_changed_from`, and this
    account raises it again once the change is sent."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size

    def account(self, req: Req, i: int, row: Row, batch: ForwardBatch) -> None:
        needs = -(-batch.kv_lens[i] // self.page_size)
        h = req.kv
        start = min(row.entries, h.table_changed_from, len(h.block_table))
        if start >= needs:
            return
        # Entries past `entries` are sent when needed; changes below it lowered the mark.
        row.entries = needs
        h.table_changed_from = UNCHANGED
        batch.table_edits.append(TableEdit(row.seq, start, h.block_table[start:needs]))


class Sampling(RowPiece):
    """A sampled sequence's parameters, sent once (its row holds them until it ends), and
    the output index it samples at: the worker counts one per step that samples the row,
    so only a step after another that sampled more (a verified draft) or none tells it. Run
    only for a sampled sequence."""

    def account(self, req: Req, i: int, row: Row, batch: ForwardBatch) -> None:
        if row.step < 0:
            sp = req.sampling
            batch.sampling_edits.append(SamplingEdit(row.seq, RowSampling(
                sp.temperature, sp.top_p, sp.top_k, sp.min_p, req.seed,
                sp.frequency_penalty, sp.presence_penalty, sp.repetition_penalty,
                req.group.logit_bias)))
        if row.step != req.sampled:
            batch.step_sampling(i).step = req.sampled
        row.step = req.sampled + 1


class PenaltyTokens(RowPiece):
    """The tokens a sampled sequence's penalties count: the prompt (the repetition
    penalty's) on its first step in the worker, then only the outputs it has not been sent
    (`StepSampling.output_start` on). Run only for a sampled sequence with penalties."""

    def account(self, req: Req, i: int, row: Row, batch: ForwardBatch) -> None:
        sampling = batch.step_sampling(i)
        if row.outputs < 0 and req.sampling.repetition_penalty != 1.0:
            sampling.prompt_ids = req.input_ids
        sampling.output_start = max(row.outputs, 0)
        sampling.output_ids = req.output_ids[sampling.output_start:]
        row.outputs = len(req.output_ids)
        batch.penalized.append(i)


class KeptToken(RowPiece):
    """Overlap scheduling: a sequence whose last token is still `behind` (sampled by a step
    in flight) sends a placeholder, which the worker fills from the token it kept. Which
    tokens it keeps is `RunAhead.launched`'s (scheduler/overlap.py)."""

    def account(self, req: Req, i: int, row: Row, batch: ForwardBatch) -> None:
        if req.behind:  # a decode: its one new token (no draft runs ahead)
            batch.placeholders.append(i)
            batch.input_ids.append(PLACEHOLDER)


class AdapterSlot(RowPiece):
    """LoRA: the adapters filled into device slots for the step, and each sequence's slot
    (-1: the base model). The slots are the worker's, not a row's: a reset fills every one
    in use again."""

    def __init__(self, loras: LoraRegistry) -> None:
        self.loras = loras

    def reset(self) -> None:
        self.loras.refill()

    def begin(self, batch: ForwardBatch) -> None:
        batch.lora_fills = self.loras.take_fills()

    def account(self, req: Req, i: int, row: Row, batch: ForwardBatch) -> None:
        name = req.lora
        batch.lora_slots.append(-1 if name is None else self.loras.slots.index(name))


class WorkerRows:
    def __init__(self, pieces: list[RowPiece]) -> None:
        """`pieces`: those every step's sequences run through, in order (`of`); a sampled
        sequence's run through `sampling` too, and `penalties` where it has them."""
        self.pieces = pieces
        self.begins = [p.begin for p in pieces if type(p).begin is not RowPiece.begin]
        """The pieces' `begin`, of those that have one."""
        self.sampling = Sampling()
        self.penalties = PenaltyTokens()
        self._ids = count()
        self.rows: dict[Req, Row] = {}
        """Each sequence the worker keeps a row for."""

        self.unknown = True
        """Whether what the worker holds is unknown (at the start, after its start-up
        steps; after a step it failed): the next step tells it to forget every row, and
        every sequence is placed anew."""

    @classmethod
    def of(cls, info: WorkerInfo, loras: LoraRegistry, overlap: bool) -> WorkerRows:
        """The rows of a scheduler of `info`'s worker: the block table always (and sampling
        for each sampled sequence), the others where their feature is on (LoRA serving,
        overlap scheduling: `RunAhead`)."""
        pieces: list[RowPiece] = [BlockTable(info.page_size)]
        if overlap:
            pieces.append(KeptToken())
        if loras.enabled:
            pieces.append(AdapterSlot(loras))
        return cls(pieces)

    def forget_all(self) -> None:
        """After a step the worker failed: nothing it holds can be relied on."""
        self.rows.clear()
        self.unknown = True
        for piece in self.pieces:
            piece.reset()

    def start_step(self, running: list[Req], batch: ForwardBatch) -> None:
        """The diff before a step's sequences: `batch` resets every row first where what
        the worker holds is unknown, and ends the rows of sequences no longer `running`
        (finished, retracted, dropped), forgotten here too."""
        batch.reset_rows, self.unknown = self.unknown, False
        alive = set(running)
        gone = [req for req in self.rows if req not in alive]
        batch.ended = [self.rows.pop(req).seq for req in gone]
        for begin in self.begins:
            begin(batch)

    def account(self, req: Req, i: int, batch: ForwardBatch, sample: bool) -> None:
        """`req`, the step's `i`-th sequence (already in `batch.input_ids`, `kv_lens`, and
        `unsampled` or `sample_steps`), which the step samples if `sample`: its row's id
        into `batch.seqs` (a new row, which holds nothing, on its first step), and every
        piece's change."""
        row = self.rows.get(req)
        if row is None:
            row = self.rows[req] = Row(next(self._ids))
        batch.seqs.append(row.seq)
        for piece in self.pieces:
            piece.account(req, i, row, batch)
        if sample:
            self.sampling.account(req, i, row, batch)
            if req.sampling.has_penalties:
                self.penalties.account(req, i, row, batch)
