"""The scheduler's account of the batch the worker keeps (`worker/seq_rows.py`): which
sequences the worker holds a row for, under which id, and how much of each one's block
table it has. A step tells the worker only what changed (`ForwardBatch.table_edits`,
`ended`), so an unchanged running batch sends no block table at all.

What changed in a table is the KV manager's to say: every write to a handle's
`block_table` lowers its `table_changed_from` (scheduler/kv.py), and this account raises
it again once the change is sent. The cost of a step here follows the sequences and the
entries that changed, never the context length.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import count

from radixserve.messages import SeqSampling, TableEdit
from radixserve.scheduler.kv_handle import UNCHANGED
from radixserve.scheduler.request import Req


@dataclass
class Row:
    """What the worker holds of one sequence."""

    seq: int
    """Its id there."""
    entries: int = 0
    """Entries of its block table the worker holds as they are now."""
    outputs: int = -1
    """Output tokens the worker keeps for its penalties (-1: not its prompt either)."""


class WorkerRows:
    def __init__(self) -> None:
        self._ids = count()
        self.rows: dict[Req, Row] = {}
        """Each sequence the worker keeps a row for."""

        self.unknown = True
        """Whether what the worker holds is unknown (at the start, after its start-up
        steps; after a step it failed): the next step tells it to forget every row, and
        every sequence is placed anew."""

    def forget_all(self) -> None:
        """After a step the worker failed: nothing it holds can be relied on."""
        self.rows.clear()
        self.unknown = True

    def start_step(self, running: list[Req]) -> tuple[bool, list[int]]:
        """Whether the worker must forget every row first, and the rows of sequences no
        longer running (finished, retracted, dropped), forgotten here too."""
        reset, self.unknown = self.unknown, False
        alive = set(running)
        gone = [req for req in self.rows if req not in alive]
        return reset, [self.rows.pop(req).seq for req in gone]

    def place(self, req: Req, needs: int) -> tuple[int, TableEdit | None]:
        """`req`'s id in the worker (a new row on its first step there), and what the
        worker must learn for the first `needs` entries of its table to be right (None:
        it has them), recorded as sent."""
        row = self.rows.get(req)
        if row is None:
            row = self.rows[req] = Row(next(self._ids))
        h = req.kv
        start = min(row.entries, h.table_changed_from, len(h.block_table))
        if start >= needs:
            return row.seq, None
        # Entries past `entries` are sent when needed; changes below it lowered the mark.
        row.entries = needs
        h.table_changed_from = UNCHANGED
        return row.seq, TableEdit(row.seq, start, h.block_table[start:needs])

    def penalty_tokens(self, req: Req, s: SeqSampling) -> None:
        """`s` (a placed sequence's, with penalties) carries what the worker lacks of the
        tokens they count: the prompt on its first step there, then only the outputs it
        has not been sent (`output_start` on), recorded as sent."""
        row = self.rows[req]
        if row.outputs < 0 and req.sampling.repetition_penalty != 1.0:
            s.prompt_ids = req.input_ids
        s.output_start = max(row.outputs, 0)
        s.output_ids = req.output_ids[s.output_start:]
        row.outputs = len(req.output_ids)
