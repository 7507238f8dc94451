"""The torch backend's reads over the virtual layout's per-slot views
(`worker/virtual_kv.py`): no gather.

Each sequence's past is a contiguous run of its slot's view, so SDPA reads it in place:
decodes are one batched call per run of consecutive slots the step uses (padded to the
longest context there and masked; no call reads a slot that holds none of the batch),
prefill chunks one call each. Tree attention keeps its plan (`worker/cascade.py`) and the
torch backend's merge: a group's shared run is the same contiguous token range in every
member's view (the same physical blocks, mapped into each), so the shared-run pass reads
it from one member's view, once for the group, and the members' own parts are the rest of
their views.

`k_cache`, `v_cache` here are a layer's views over all slots (`KVLayout.layers`),
`[num_slots, slot_tokens, num_kv_heads, head_dim]`, and the metadata's `slot_mapping`
indexes them flat (slot * slot_tokens + position), so the backend's KV store writes
through the views. (The Triton backend reads the same memory as blocks back to back,
`KVLayout.block_layers` and `KVLayout.contiguous`.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.kernels import reference
from radixserve.worker.attention.base import AttentionMetadata
from radixserve.worker.attention.cascade_split import CascadeSplit, SeqSubset
from radixserve.worker.attention.reads import Attended, KVReads


@dataclass
class SlotRun:
    """Decodes in consecutive slots `lo .. hi-1`: one SDPA call over those slots' views,
    keys `first .. last-1`, padded to the longest and masked."""

    lo: int
    hi: int
    members: torch.Tensor
    """`[hi-lo]` int64: the decode batch's rows, in slot order."""
    in_order: bool
    """`members` is the whole batch in its order (no gather of queries, no scatter)."""
    first: int
    last: int
    starts: torch.Tensor
    """`[hi-lo]`: each member's first key (0, or the end of its shared runs)."""
    kv_lens: torch.Tensor

    def mask(self, window: int | None) -> torch.Tensor:
        """Additive `[hi-lo, 1, 1, last-first]`: each member's keys."""
        pos = torch.arange(self.first, self.last)[None, :]
        lower = self.starts[:, None] if window is None else \
            torch.maximum(self.starts, self.kv_lens - window)[:, None]
        valid = (pos >= lower) & (pos < self.kv_lens[:, None])
        return reference.additive_mask(valid, torch.float32)[:, None, None, :]


def slot_runs(slots: list[int], starts: torch.Tensor, kv_lens: torch.Tensor) -> list[SlotRun]:
    """A batch of decodes cut into runs of consecutive slots: each run one call, and no
    call reads a slot that holds none of the batch."""
    order = sorted(range(len(slots)), key=slots.__getitem__)
    runs, i = [], 0
    while i < len(order):
        j = i + 1
        while j < len(order) and slots[order[j]] == slots[order[j - 1]] + 1:
            j += 1
        members = torch.tensor(order[i:j], dtype=torch.long)
        run_starts, run_kv = starts[members].long(), kv_lens[members].long()
        runs.append(SlotRun(slots[order[i]], slots[order[j - 1]] + 1, members,
                            order[i:j] == list(range(len(slots))), int(run_starts.min()),
                            int(run_kv.max()), run_starts, run_kv))
        i = j
    return runs


class SlotReads(KVReads):
    """Every key read in place from the slots' views."""

    def begin(self, meta: AttentionMetadata, split: CascadeSplit) -> None:
        if meta.slots is None:
            raise ValueError("the virtual layout's attention needs the step's slots")
        self.meta, self.split = meta, split
        plan = meta.cascade
        own = torch.tensor(plan.own_start if plan else [0] * meta.num_seqs)
        self.slots = slots = meta.slots
        self.decodes: dict[str, list[SlotRun]] = {}
        self._masks: dict[tuple[str, int | None], list[torch.Tensor]] = {}
        for name, s in (("plain", split.decode), ("own", split.own_decode)):
            if s is not None:
                self.decodes[name] = slot_runs([slots[i] for i in s.seqs.tolist()],
                                               own[s.seqs], meta.kv_lens[s.seqs])
        page = meta.page_size
        self.runs = [[(slots[run.seqs[0]], run.block_start * page,
                       (run.block_start + len(run.blocks)) * page) for run in level]
                     for level in (plan.levels if plan else [])]
        """Per level and run: the slot whose view it is read from, and its token range."""

    def decode(self, q, k_cache, v_cache, subset: SeqSubset, name: str, scale: float,
               window: int | None, return_lse: bool = False) -> Attended:
        runs = self.decodes[name]
        key = (name, window)
        if key not in self._masks:
            self._masks[key] = [run.mask(window) for run in runs]
        batch, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        qg = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim).float()
        if runs[0].in_order:  # one run, the batch in slot order: all views, no copies
            out, lse = self._attend_run(qg, k_cache, v_cache, runs[0], self._masks[key][0], scale)
        else:
            out = qg.new_empty(qg.shape)
            lse = qg.new_empty(qg.shape[:3])
            for run, mask in zip(runs, self._masks[key]):
                out[run.members], lse[run.members] = self._attend_run(
                    qg[run.members], k_cache, v_cache, run, mask, scale)
        out = out.reshape(batch, num_heads, head_dim)
        if return_lse:
            return out, lse.reshape(batch, num_heads)
        return out.to(q.dtype)

    @staticmethod
    def _attend_run(qg, k_cache, v_cache, run: SlotRun, mask: torch.Tensor, scale: float):
        k = k_cache[run.lo:run.hi, run.first:run.last].transpose(1, 2).float()
        v = v_cache[run.lo:run.hi, run.first:run.last].transpose(1, 2).float()
        return reference.attend(qg, k, v, scale, mask=mask)

    def extend(self, q, k_cache, v_cache, subset: SeqSubset, scale: float,
               window: int | None, return_lse: bool = False) -> Attended:
        tokens = q[subset.tokens]
        out = torch.empty(tokens.shape, dtype=torch.float32 if return_lse else q.dtype)
        lse_out = torch.empty(tokens.shape[:2], dtype=torch.float32) if return_lse else None
        offsets = subset.q_start.tolist()
        kv_abs = self.meta.kv_lens[subset.seqs].tolist()
        for b, (seq, own_len) in enumerate(zip(subset.seqs.tolist(), subset.kv_lens.tolist())):
            lo, hi = offsets[b], offsets[b + 1]
            kv = kv_abs[b]
            start = kv - own_len  # past the shared runs, or 0
            slot = self.slots[seq]
            k = k_cache[slot, start:kv].transpose(0, 1)[None].float()  # [1, Hkv, S, D]
            v = v_cache[slot, start:kv].transpose(0, 1)[None].float()
            qb = tokens[lo:hi].transpose(0, 1)[None]
            prefix = own_len - (hi - lo)
            if prefix == 0 and (window is None or window >= kv):
                o, lse = reference.attend(qb, k, v, scale, causal=True)
            else:
                rows = torch.arange(hi - lo)[:, None] + (kv - (hi - lo))
                keys = torch.arange(start, kv)[None, :]
                mask = keys <= rows
                if window is not None:
                    mask &= keys > rows - window
                o, lse = reference.attend(qb, k, v, scale, mask=mask)
            out[lo:hi] = o[0].transpose(0, 1)
            if return_lse:
                lse_out[lo:hi] = lse[0].transpose(0, 1)
        return (out, lse_out) if return_lse else out

    def shared_runs(self, q, k_cache, v_cache, level: int, scale: float):
        """As `reference.cascade_level_attention`, each run read in place from one
        member's view."""
        t = self.split.levels[level]
        num_heads, head_dim = q.shape[1:]
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        packed = q[t.rows].view(-1, num_kv_heads, group, head_dim).transpose(0, 1).float()
        outs, lses = [], []
        for g, (slot, first, last) in enumerate(self.runs[level]):
            lo, hi = t.row_offsets[g], t.row_offsets[g + 1]
            k = k_cache[slot, first:last].transpose(0, 1)[None].float()
            v = v_cache[slot, first:last].transpose(0, 1)[None].float()
            o, lse = reference.attend(packed[None, :, lo:hi].flatten(2, 3), k, v, scale)
            outs.append(o.view(num_kv_heads, hi - lo, group, head_dim))
            lses.append(lse.view(num_kv_heads, hi - lo, group))
        rows = len(t.rows)
        o = torch.cat(outs, 1).transpose(0, 1).reshape(rows, num_heads, head_dim)
        return o, torch.cat(lses, 1).transpose(0, 1).reshape(rows, num_heads)

