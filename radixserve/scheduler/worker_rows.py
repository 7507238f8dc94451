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

from itertools import count

from radixserve.messages import TableEdit
from radixserve.scheduler.kv_handle import UNCHANGED
from radixserve.scheduler.request import Req


class WorkerRows:
    def __init__(self) -> None:
        self._ids = count()
        self.rows: dict[Req, tuple[int, int]] = {}
        """Each sequence the worker keeps a row for: its id there, and how many entries
        of its table the worker holds as they are now."""

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
        return reset, [self.rows.pop(req)[0] for req in gone]

    def place(self, req: Req, needs: int) -> tuple[int, TableEdit | None]:
        """`req`'s id in the worker (a new row on its first step there), and what the
        worker must learn for the first `needs` entries of its table to be right (None:
        it has them), recorded as sent."""
        seq, held = self.rows.get(req) or (next(self._ids), 0)
        h = req.kv
        start = min(held, h.table_changed_from, len(h.block_table))
        if start >= needs:
            self.rows[req] = (seq, held)
            return seq, None
        # Entries past `held` are sent when needed; changes below it lowered the mark.
        self.rows[req] = (seq, needs)
        h.table_changed_from = UNCHANGED
        return seq, TableEdit(seq, start, h.block_table[start:needs])
