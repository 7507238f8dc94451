"""A caller's code run by the server (issue 25, class 3): `chat_template_kwargs` carries
template variables only. A template of the caller's (`chat_template`), or any argument of
`apply_chat_template` itself, is refused by name before anything renders; rendering runs
off the HTTP event loop within a time and a queue bound."""

from __future__ import annotations

import asyncio
import copy
import time

import pytest

from radixserve.model.loader import load_tokenizer
from radixserve.chat import prompt
from radixserve.chat.errors import ChatError
from radixserve.chat.templates import TemplateRenderer, template_variables
from tests.server.survival import assert_survived, baseline

MODEL = "smollm2-135m"
CALLERS_TEMPLATE = "{{ 'CALLERS-TEMPLATE-RAN' }}{{ raise_exception('CALLERS-TEMPLATE-RAN') }}"


def chat(http, **extra):
    return http.post("/v1/chat/completions", json={
        "model": MODEL, "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": "Hi"}], **extra})


@pytest.mark.parametrize("key", ["chat_template", "tokenize", "tools", "documents",
                                 "add_generation_prompt", "tokenizer_kwargs", "messages",
                                 "bos_token", "continue_final_message", "return_dict"])
def test_a_template_or_renderer_argument_is_refused_by_name(http, rpc, key):
    before = baseline(rpc)
    value = CALLERS_TEMPLATE if key == "chat_template" else True
    started = time.monotonic()
    r = chat(http, chat_template_kwargs={key: value})
    assert time.monotonic() - started < 30
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == f"chat_template_kwargs.{key}"
    assert key in error["message"] and "CALLERS-TEMPLATE-RAN" not in error["message"]
    assert_survived(rpc, before)


def test_a_template_variable_still_works(http, rpc):
    plain = chat(http)
    assert plain.status_code == 200, plain.text
    r = chat(http, chat_template_kwargs={"enable_thinking": False, "today": "Monday"})
    assert r.status_code == 200, r.text
    # SmolLM2's template reads neither: the same prompt, the same greedy answer.
    assert r.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]


def test_variables_reach_the_models_template_and_nothing_else_does(model_dir):
    tok = copy.deepcopy(load_tokenizer(model_dir))
    tok.chat_template = ("{% for m in messages %}{{ greeting }} {{ m['content'] }}"
                         "{% endfor %}")
    variables = template_variables({"greeting": "Ahoy"}, tok)
    text = prompt.render(tok, [{"role": "user", "content": "Hi"}], None, **variables)
    assert text == "Ahoy Hi"
    for key in ("chat_template", "tokenize", "eos_token", "not an identifier"):
        with pytest.raises(ChatError) as e:
            template_variables({key: "x"}, tok)
        assert e.value.status == 400 and e.value.param == f"chat_template_kwargs.{key}"


def test_a_slow_render_is_bounded_and_leaves_the_loop_free():
    renderer = TemplateRenderer(threads=1, max_pending=2, timeout=0.5)

    async def scenario() -> None:
        slow = asyncio.ensure_future(renderer.render(time.sleep, 3))
        ticks = 0
        while not slow.done():  # the loop keeps running while the render takes its time
            await asyncio.sleep(0.05)
            ticks += 1
        with pytest.raises(ChatError) as e:
            slow.result()
        assert e.value.status == 400 and "chat_template_timeout" in e.value.message
        assert ticks >= 5
        # The one thread is still busy with the slow render: a second waits in the queue
        # (its time counts there too), a third is past max_pending and refused at once.
        queued = asyncio.ensure_future(renderer.render(lambda: "ok"))
        await asyncio.sleep(0)
        with pytest.raises(ChatError) as e:
            await renderer.render(lambda: "ok")
        assert e.value.status == 503 and "max_pending_chat_renders" in e.value.message
        with pytest.raises(ChatError):
            await queued
        await asyncio.sleep(3)  # the slow render is over: the pool serves again
        assert await renderer.render(lambda: "ok") == "ok"

    try:
        asyncio.run(scenario())
    finally:
        renderer.close()


def test_every_parameter_of_apply_chat_template_is_refused(model_dir):
    """Read from this transformers' signature, so none of its parameters slips through."""
    import inspect

    from radixserve.chat.templates import reserved_names

    tok = load_tokenizer(model_dir)
    params = inspect.signature(tok.apply_chat_template).parameters
    named = {n for n, p in params.items() if p.kind is not p.VAR_KEYWORD}
    assert named and named <= reserved_names(tok)
