"""The persistent batch's protocol (`scheduler/worker_rows.py` -> `worker/seq_rows.py`): a
step tells the worker only what changed, so a running batch that gained no block sends no
block table, and a step's message does not grow with the context. Exactness through
eviction, retraction, forks, beams, speculation and the disk tier is the state machine's
(`test_scheduler_machine.py`), whose FakeWorker keeps its tables from these messages alone.
"""

from __future__ import annotations

import ast
from pathlib import Path

import msgspec

import radixserve

from radixserve.config import EngineConfig
from radixserve.messages import ForwardBatch, LoraFill, LoraInfo, SamplingParams
from radixserve.scheduler.loras import LoraRegistry
from radixserve.scheduler.worker_rows import AdapterSlot, WorkerRows
from tests.scheduler.test_scheduler_machine import Harness, filler

PAGE = 16


def run(prompt_len: int, n_requests: int, new_tokens: int, shared: bool = False,
        sampling: SamplingParams | None = None) -> tuple[Harness, list[ForwardBatch]]:
    """Serve `n_requests` prompts of `prompt_len` tokens (one prompt for all when
    `shared`) to the end, greedily unless `sampling` says, recording each step message
    the worker gets."""
    h = Harness(num_blocks=2048, page_size=PAGE, chunk=8192, max_running=n_requests)
    sent: list[ForwardBatch] = []
    forward = h.worker.forward
    h.worker.forward = lambda batch: (sent.append(batch), forward(batch))[1]  # type: ignore[method-assign]
    sampling = sampling or SamplingParams(max_new_tokens=new_tokens, temperature=0.0,
                                          ignore_eos=True)
    for i in range(n_requests):
        h.submit(f"r{i}", filler(0 if shared else i, prompt_len), sampling)
    h.final_check()
    return h, sent


def decode_steps(sent: list[ForwardBatch]) -> list[ForwardBatch]:
    return [b for b in sent if b.q_lens and all(q == 1 for q in b.q_lens)]


def test_a_decode_step_sends_only_the_blocks_it_starts() -> None:
    """Every decode step's table edits are exactly the sequences whose new token opens a
    block, one block each; the rest of the batch sends no table entry."""
    h, sent = run(prompt_len=1000, n_requests=6, new_tokens=70)
    steps = decode_steps(sent)
    assert len(steps) >= 60
    quiet = 0
    for b in steps:
        opening = {seq for seq, kv in zip(b.seqs, b.kv_lens) if (kv - 1) % PAGE == 0}
        assert {e.seq for e in b.table_edits} == opening
        assert all(len(e.blocks) == 1 for e in b.table_edits)
        quiet += not b.table_edits
    assert quiet >= len(steps) * (PAGE - 2) / PAGE  # most steps: no table at all
    # Over the whole run each block was sent once: the prompt's, then one per new block.
    blocks = -(-(1000 + 70) // PAGE)
    assert h.worker.table_entries_sent == 6 * blocks


def test_shared_prompts_send_each_table_once() -> None:
    """Requests on one cached prompt: each is told its table when it starts, once."""
    h, sent = run(prompt_len=700, n_requests=4, new_tokens=20, shared=True)
    first = {}
    for b in sent:
        for e in b.table_edits:
            first.setdefault(e.seq, e)
    assert len(first) == 4 and all(e.start == 0 for e in first.values())
    assert h.worker.table_entries_sent == 4 * -(-(700 + 20) // PAGE)


def test_the_step_message_does_not_grow_with_the_context() -> None:
    """A decode step of 8 sequences costs the same bytes at 100 tokens of context as at
    3,000 (integers a byte or two longer), where a block table per step would have grown
    thirty-fold."""
    encoder = msgspec.msgpack.Encoder()

    def quiet_bytes(prompt_len: int) -> float:
        _, sent = run(prompt_len=prompt_len, n_requests=8, new_tokens=24)
        sizes = [len(encoder.encode(b)) for b in decode_steps(sent) if not b.table_edits]
        assert sizes
        return sum(sizes) / len(sizes)

    short, long = quiet_bytes(100), quiet_bytes(3000)
    assert long - short <= 3 * 8, (short, long)
    assert long < 1000, long


def test_a_failed_step_makes_the_worker_forget_every_row() -> None:
    """After a step the worker failed (what it holds unknown), the next step resets its
    rows and places the surviving sequences anew with their whole tables."""
    h = Harness(num_blocks=256, page_size=PAGE, chunk=4096, max_running=4)
    sent: list[ForwardBatch] = []
    forward = h.worker.forward
    h.worker.forward = lambda batch: (sent.append(batch), forward(batch))[1]  # type: ignore[method-assign]
    sampling = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    h.submit("a", filler(1, 100), sampling)
    for _ in range(3):
        h.step()
    h.step(fail=True)  # "a" ends with an error
    h.submit("b", filler(2, 90), sampling)
    h.step()
    assert sent[-1].reset_rows and [e.start for e in sent[-1].table_edits] == [0]
    assert sent[0].reset_rows and not any(b.reset_rows for b in sent[1:-1])
    h.final_check()


def test_a_decode_step_carries_no_sampling() -> None:
    """Sampling parameters are the rows': each sequence's are sent once, on its first
    sampled step, and the worker counts its output index; so a steady decode step names no
    sampling at all, and its message is a few bytes per sequence (it was ~90 with each
    sequence's parameters in every step)."""
    sampling = SamplingParams(max_new_tokens=24, temperature=0.7, top_p=0.9, seed=11,
                              ignore_eos=True)
    _, sent = run(prompt_len=200, n_requests=32, new_tokens=24, sampling=sampling)
    assert sum(len(b.sampling_edits) for b in sent) == 32
    steady = [b for b in decode_steps(sent) if len(b.seqs) == 32 and not b.sampling_edits]
    assert len(steady) >= 20
    for b in steady:
        assert not b.sample_steps and not b.unsampled
        assert len(msgspec.msgpack.encode(b)) <= 16 * len(b.seqs) + 512


def test_penalty_tokens_are_sent_once() -> None:
    """A request with penalties: its prompt goes to the worker once, and each output token
    once (the worker keeps them), however long the output grows."""
    h = Harness(num_blocks=256, page_size=PAGE, chunk=4096, max_running=2)
    sent: list[ForwardBatch] = []
    forward = h.worker.forward
    h.worker.forward = lambda batch: (sent.append(batch), forward(batch))[1]  # type: ignore[method-assign]
    sampling = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True,
                              repetition_penalty=1.3, frequency_penalty=0.5)
    h.submit("a", filler(3, 300), sampling)
    h.final_check()
    samples = [s for b in sent for s in b.sample_steps]
    assert len(samples) == 40
    assert sum(s.prompt_ids is not None for s in samples) == 1
    # Step k sends output k - 1, the one sampled last, from where the worker's copy ends.
    assert [s.output_start for s in samples] == [0, *range(39)]
    assert [len(s.output_ids or []) for s in samples] == [0] + [1] * 39


MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse"}
"""The list methods that change a list in place."""


def test_a_block_table_changes_through_splice_alone() -> None:
    """The worker's account relies on `KVManager.splice` marking every write to a table:
    no other code assigns to a `block_table`, its entries, or mutates it in place."""
    root = Path(radixserve.__file__).parent
    writes = []
    for path in root.rglob("*.py"):
        module = ast.parse(path.read_text())
        for cls in ast.walk(module):  # splice itself is the one writer
            if isinstance(cls, ast.ClassDef):
                cls.body = [f for f in cls.body
                            if not (isinstance(f, ast.FunctionDef) and f.name == "splice")]
        for node in ast.walk(module):
            targets: list[ast.expr] = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [
                    node.target]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr in MUTATORS:
                    targets = [node.func.value]
            for t in targets:
                for e in ast.walk(t):  # a tuple's elements and a subscript's value too
                    if isinstance(e, ast.Attribute) and e.attr == "block_table":
                        writes.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not writes, f"block tables written around KVManager.splice: {writes}"


def test_a_reset_fills_the_adapter_slots_again() -> None:
    """The adapter slots are part of what a failed step leaves unknown: the step after it
    fills every slot in use again, as well as resetting the rows."""
    loras = LoraRegistry(EngineConfig(max_loras_per_batch=3), [
        LoraInfo(name=name, path=name, fingerprint=name, rank=8, target_modules=[])
        for name in ("a", "b")])
    rows = WorkerRows([AdapterSlot(loras)])

    def step() -> ForwardBatch:
        batch = ForwardBatch(seqs=[], input_ids=[], q_lens=[], kv_lens=[], logprobs=[])
        rows.start_step([], batch)
        return batch

    assert loras.claim_slot("a", []) == 0 and loras.claim_slot("b", []) == 1
    assert step().lora_fills == [LoraFill(0, "a"), LoraFill(1, "b")]
    assert step().lora_fills == []
    rows.forget_all()
    batch = step()
    assert batch.reset_rows and batch.lora_fills == [LoraFill(0, "a"), LoraFill(1, "b")]
