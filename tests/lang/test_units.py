"""The DSL without a model: expressions, the choice methods, roles, errors, streaming, on a
scripted backend that records what it is asked."""

from __future__ import annotations

import threading
import time

import pytest

import radixserve.lang as sgl
from radixserve.lang.backends import Backend
from radixserve.chat.role_template import RoleTemplate
from radixserve.lang.ir import ExprList, Gen, Text


class ScriptedBackend(Backend):
    """Answers each gen with `reply(prompt)`; records prompts and commits."""

    def __init__(self, reply=lambda prompt: "ok", delay: float = 0.0) -> None:
        super().__init__()
        self.chat_template = RoleTemplate.chatml()
        self.reply, self.delay = reply, delay
        self.prompts: list[str] = []
        self.commits: list[str] = []
        self.concurrent = self.max_concurrent = 0
        self._guard = threading.Lock()

    def _generate(self, prompt=None, sampling_params=None, **kwargs):
        with self._guard:
            self.concurrent += 1
            self.max_concurrent = max(self.max_concurrent, self.concurrent)
        time.sleep(self.delay)
        with self._guard:
            self.concurrent -= 1
        if sampling_params.get("max_new_tokens") == 0:
            self.commits.append(prompt)
            text = ""
        else:
            self.prompts.append(prompt)
            text = self.reply(prompt)
        return {"text": text, "output_ids": [], "meta_info": {
            "prompt_tokens": len(prompt), "cached_tokens": 0, "completion_tokens": 1,
            "finish_reason": {"type": "length"}, "sampling_params": sampling_params}}


def test_expressions_compose_flat():
    expr = "a" + sgl.gen("x") + "b" + sgl.gen("y")
    assert isinstance(expr, ExprList)
    assert [type(e) for e in expr.items] == [Text, Gen, Text, Gen]
    with pytest.raises(TypeError):
        sgl.gen("x") + 3  # type: ignore[operator]


def test_gen_settings_inherit_and_override():
    be = ScriptedBackend()

    @sgl.function
    def prog(s):
        s += "Q:" + sgl.gen("a", max_tokens=3) + sgl.gen("b", temperature=0.5, dtype=int)

    state = prog.run(backend=be, temperature=0.1, max_new_tokens=7)
    a, b = state.get_meta_info("a")["sampling_params"], state.get_meta_info("b")["sampling_params"]
    assert (a["max_new_tokens"], a["temperature"]) == (3, 0.1)
    assert (b["max_new_tokens"], b["temperature"]) == (7, 0.5)
    assert b["regex"] == sgl.REGEX_INT and b["stop"] == [" ", "\n"]
    assert state.text() == "Q:okok"


def test_choice_methods_on_known_logprobs():
    rows = [[[-1.0, 1, None], [-1.0, 2, None]], [[-0.5, 3, None], [-3.0, 4, None]]]
    means = [-1.0, -1.75]
    common = dict(choices=["a", "b"], normalized_prompt_logprobs=means,
                  input_token_logprobs=rows, output_token_logprobs=[[], []])
    assert sgl.token_length_normalized(**common).decision == "a"
    assert sgl.greedy_token_selection(**common).decision == "b"  # -0.5 beats -1.0 first
    uncond = [[[None, 1, None], [-0.5, 2, None]], [[None, 3, None], [-3.5, 4, None]]]
    d = sgl.unconditional_likelihood_normalized(**common, unconditional_token_logprobs=uncond)
    assert d.meta_info["scores"] == [-0.75, 0.0] and d.decision == "b"


def test_roles_use_the_template_and_default_system():
    be = ScriptedBackend()
    be.chat_template.default_system_prompt = "Be nice."

    @sgl.function
    def chat(s):
        s += sgl.user("hi")
        s += sgl.assistant(sgl.gen("a"))

    state = chat.run(backend=be)
    assert state.text() == ("<|im_start|>system\nBe nice.<|im_end|>\n<|im_start|>user\nhi"
                            "<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n")
    assert [m["content"] for m in state.messages()] == ["Be nice.", "hi", "ok"]


def test_fork_commits_once_and_runs_branches_concurrently():
    be = ScriptedBackend(delay=0.2)

    @sgl.function
    def prog(s):
        s += "shared prefix"
        forks = s.fork(4)
        forks += sgl.gen("v")
        forks.join()

    state = prog.run(backend=be)
    assert be.commits == ["shared prefix"]
    assert state["v"] == ["ok"] * 4
    assert be.max_concurrent == 4


def test_errors_stay_in_their_state():
    be = ScriptedBackend()

    @sgl.function
    def prog(s, fail):
        s += "x" + sgl.gen("v")
        if fail:
            raise RuntimeError("boom")

    states = prog.run_batch([{"fail": False}, {"fail": True}, {"fail": False}], backend=be)
    assert [type(s.error()) for s in states] == [type(None), RuntimeError, type(None)]
    assert states[1]["v"] == "ok"  # what ran before the error is kept
    with pytest.raises(RuntimeError, match="boom"):
        prog.run(fail=True, backend=be)


def test_var_scope_and_text_iter_without_stream():
    be = ScriptedBackend()

    @sgl.function
    def prog(s):
        with s.var_scope("part"):
            s += "a" + sgl.gen("g")
        s += "!"

    state = prog.run(backend=be)
    assert state["part"] == "aok" and list(state.text_iter()) == ["aok!"]


def test_text_iter_of_a_variable_the_program_appends_later():
    """With stream=True the program runs on its own thread: a reader may ask for a gen's
    text before the program has appended it, and still gets it (not a KeyError)."""
    be = ScriptedBackend(reply=lambda prompt: "streamed")

    @sgl.function
    def late(s):
        time.sleep(0.2)
        s += "Q:" + sgl.gen("answer")

    assert "".join(late.run(backend=be, stream=True).text_iter("answer")) == "streamed"
    with pytest.raises(KeyError, match="nothing"):
        list(late.run(backend=be, stream=True).text_iter("nothing"))


def test_missing_backend_and_bad_programs():
    sgl.set_default_backend(ScriptedBackend())
    try:
        with pytest.raises(TypeError, match="'s'"):
            sgl.function(lambda x: None)
        with pytest.raises(ValueError):
            sgl.select("x", choices=[])
        with pytest.raises(ValueError, match="dtype"):
            sgl.gen("x", dtype=list).params.resolved()
    finally:
        from radixserve.lang.backends import _default
        _default[0] = None
    with pytest.raises(ValueError, match="backend"):
        sgl.function(lambda s: None).run()
