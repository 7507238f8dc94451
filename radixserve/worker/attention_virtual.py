"""Attention over the virtual layout's per-slot views (`worker/virtual_kv.py`): no gather.

Each sequence's past is a contiguous run of its slot's view, so SDPA reads it in place:
decodes are one batched call over the range of slots the step uses (padded to the longest
context and masked, unused slots of the range computed and dropped), prefill chunks one
call each. Tree attention keeps its plan (`worker/cascade.py`) and its merge, inherited
from the torch backend: a group's shared run is the same contiguous token range in every
member's view (the same physical blocks, mapped into each), so the shared-run pass reads
it from one member's view, once for the group, and the members' own parts are the rest of
their views. Only where the keys are read from differs from `TorchAttentionBackend`.

`k_cache`, `v_cache` here are a layer's views over all slots, `[num_slots, slot_tokens,
num_kv_heads, head_dim]`, and the metadata's `slot_mapping` indexes them flat (slot *
slot_tokens + position), so the inherited KV store writes through the views.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.kernels import reference
from radixserve.worker.attention import (AttentionBackend, AttentionMetadata, CascadeSplit,
                                         SeqSubset, TorchAttentionBackend)


@dataclass
class SlotDecode:
    """A batch of decodes as one call over slots `lo .. hi-1`, keys `first .. last-1`."""

    lo: int
    hi: int
    rows: torch.Tensor
    """`[B]` int64: each sequence's row among the slots of the range."""
    dense: bool
    """The sequences are exactly the range's slots, in order (no scatter, no gather)."""
    first: int
    last: int
    starts: torch.Tensor
    """`[B]`: each sequence's first key (0, or the end of its shared runs)."""
    kv_lens: torch.Tensor

    @classmethod
    def of(cls, slots: list[int], starts: torch.Tensor, kv_lens: torch.Tensor) -> "SlotDecode":
        lo, hi = min(slots), max(slots) + 1
        return cls(lo, hi, torch.tensor(slots, dtype=torch.long) - lo,
                   slots == list(range(lo, hi)), int(starts.min()), int(kv_lens.max()),
                   starts.long(), kv_lens.long())

    def mask(self, window: int | None) -> torch.Tensor:
        """Additive `[hi-lo, 1, 1, last-first]`: each sequence's keys; a slot of the range
        without a sequence sees its first key only (its row is dropped)."""
        pos = torch.arange(self.first, self.last)[None, :]
        lower = self.starts[:, None] if window is None else \
            torch.maximum(self.starts, self.kv_lens - window)[:, None]
        valid = torch.zeros(self.hi - self.lo, self.last - self.first, dtype=torch.bool)
        valid[:, 0] = True
        valid[self.rows] = (pos >= lower) & (pos < self.kv_lens[:, None])
        return reference.additive_mask(valid, torch.float32)[:, None, None, :]


class VirtualAttentionBackend(TorchAttentionBackend):
    """The torch backend's step (store, plain and tree attention, merge) with every key
    read from the slots' views."""

    def begin_forward(self, meta: AttentionMetadata) -> None:
        AttentionBackend.begin_forward(self, meta)
        if meta.slots is None:
            raise ValueError("the virtual layout's attention needs the step's slots")
        self.split = split = CascadeSplit(meta)
        plan = meta.cascade
        own = torch.tensor(plan.own_start if plan else [0] * meta.num_seqs)
        self.slots = slots = meta.slots
        self.decodes: dict[str, SlotDecode] = {}
        self._masks: dict[tuple[str, int | None], torch.Tensor] = {}
        for name, s in (("plain", split.decode), ("own", split.own_decode)):
            if s is not None:
                seqs = s.seqs.tolist()
                self.decodes[name] = SlotDecode.of([slots[i] for i in seqs], own[s.seqs],
                                                   meta.kv_lens[s.seqs])
        page = meta.page_size
        self.runs = [[(slots[run.seqs[0]], run.block_start * page,
                       (run.block_start + len(run.blocks)) * page) for run in level]
                     for level in (plan.levels if plan else [])]
        """Per level and run: the slot whose view it is read from, and its token range."""

    def _decode(self, q, k_cache, v_cache, subset: SeqSubset, name: str, scale: float,
                return_lse: bool = False):
        d = self.decodes[name]
        key = (name, self.window)
        if key not in self._masks:
            self._masks[key] = d.mask(self.window)
        batch, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        qg = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim).float()
        if not d.dense:
            qg = qg.new_zeros((d.hi - d.lo, *qg.shape[1:])).index_copy_(0, d.rows, qg)
        k = k_cache[d.lo:d.hi, d.first:d.last].transpose(1, 2).float()
        v = v_cache[d.lo:d.hi, d.first:d.last].transpose(1, 2).float()
        out, lse = reference.attend(qg, k, v, scale, mask=self._masks[key])
        if not d.dense:
            out, lse = out[d.rows], lse[d.rows]
        out = out.reshape(batch, num_heads, head_dim)
        if return_lse:
            return out, lse.reshape(batch, num_heads)
        return out.to(q.dtype)

    def _extend(self, q, k_cache, v_cache, subset: SeqSubset, scale: float,
                return_lse: bool = False):
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
            window = self.window
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

    def _shared_runs(self, q, k_cache, v_cache, level: int, scale: float):
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
