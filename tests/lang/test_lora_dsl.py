"""The DSL's LoRA argument without a model: run()'s `lora_name` reaches every call the
program makes (gens, a fork's committed prefix, a select's commit and scoring), a gen's
own overrides it for that gen, and without one no call names an adapter (a runtime
without LoRA takes them). tests/server/test_lora_server.py runs it on a real server."""

from __future__ import annotations

import threading

import radixserve.lang as sgl
from radixserve.chat.role_template import RoleTemplate
from radixserve.lang.backends import Backend


class Chars:
    """A tokenizer of one token per character."""

    @staticmethod
    def encode(text: str) -> list[int]:
        return [ord(c) for c in text]


class Recording(Backend):
    """Records each generate call's kind and adapter; answers "ok", or logprobs for select."""

    def __init__(self) -> None:
        super().__init__()
        self.chat_template = RoleTemplate.chatml()
        self.tokenizer = Chars()
        self.calls: list[tuple[str, str | None]] = []
        self._guard = threading.Lock()

    def _generate(self, prompt=None, sampling_params=None, input_ids=None, **kwargs):
        zero = sampling_params.get("max_new_tokens") == 0
        kind = "score" if kwargs.get("return_logprob") else "commit" if zero else "gen"
        with self._guard:
            self.calls.append((kind, kwargs.get("lora_name", "-")))
        batch = input_ids if input_ids and isinstance(input_ids[0], list) else None
        if batch is None:
            n = len(prompt if prompt is not None else input_ids)
            return {"text": "" if zero else "ok", "output_ids": [], "meta_info": {
                "prompt_tokens": n, "cached_tokens": 0, "completion_tokens": 0 if zero else 1}}
        start = kwargs["logprob_start_len"]
        return [{"text": "", "output_ids": [], "meta_info": {
            "prompt_tokens": len(ids), "cached_tokens": 0, "completion_tokens": 0,
            "input_token_logprobs": [[-1.0 - (t % 3), t, None] for t in ids[start:]]}}
            for ids in batch]


@sgl.function
def program(s):
    s += "Q: pick" + sgl.gen("a", max_tokens=2)
    s += sgl.gen("b", max_tokens=2, lora_name="other")
    s += sgl.select("c", choices=[" x", " yz"])
    left, right = s.fork(2)
    left += sgl.gen("d", max_tokens=2)
    right += sgl.gen("e", max_tokens=2)
    left.sync()
    right.sync()


def test_runs_lora_reaches_every_call_and_a_gens_overrides_it():
    backend = Recording()
    state = program.run(backend=backend, lora_name="mine")
    assert state.error() is None, state.error()
    kinds = {kind for kind, _ in backend.calls}
    assert kinds == {"gen", "commit", "score"}, backend.calls
    assert [a for k, a in backend.calls if k == "gen"].count("other") == 1
    assert all(a == "mine" for k, a in backend.calls if k != "gen" or a != "other"), \
        backend.calls


def test_no_lora_names_no_adapter():
    backend = Recording()
    program.run(backend=backend)
    assert {a for k, a in backend.calls if k != "gen"} == {"-"}
    assert sorted({a for _, a in backend.calls}) == ["-", "other"]


def test_run_batch_takes_it_too():
    backend = Recording()
    states = program.run_batch([{}, {}], backend=backend, lora_name="mine")
    assert all(s.error() is None for s in states)
    assert {a for k, a in backend.calls if k != "gen"} == {"mine"}
