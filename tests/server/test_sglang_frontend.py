"""SGLang's own frontend (`import sglang as sgl`, its `RuntimeEndpoint` over HTTP) drives the
server, and every program gives, greedy, what radixserve's own DSL gives for the same
program (over RPC, on the same server): gen with stop / regex / dtype, select with each
choices method, fork/join, run_batch, streaming, roles, json_schema."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

import radixserve.lang as rsgl
from tests.conftest import require
from tests.server.conftest import API_KEY

sglang = require("sglang")

IP = r"((25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)\.){3}(25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)"
METHODS = ("token_length_normalized", "greedy_token_selection",
           "unconditional_likelihood_normalized")
PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}


def programs(sgl) -> SimpleNamespace:
    """The same programs, written once, in either frontend's `sgl`."""

    @sgl.function
    def qa(s, question):
        s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=12, stop="\n")

    @sgl.function
    def constrained(s):
        s += "Q: What is the IP address of the Google DNS servers?\nA: "
        s += sgl.gen("ip", max_tokens=16, regex=IP)
        s += "\nQ: How many legs does a spider have?\nA: "
        s += sgl.gen("legs", max_tokens=4, dtype=int)

    @sgl.function
    def pick(s, method):
        s += "The capital of France is"
        s += sgl.select("city", choices=[" Paris", " London", " Berlin"],
                        choices_method=getattr(sgl, method))
        s += ". The sky is"
        s += sgl.gen("colour", choices=[" blue", " green"], choices_method=getattr(sgl, method))

    @sgl.function
    def tips(s):
        s += "Here are two tips for staying healthy: 1. Balanced Diet. 2. Regular Exercise.\n"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"Now, expand tip {i + 1} into a sentence:\n"
            f += sgl.gen("tip", max_tokens=8, stop="\n")
        forks.join()
        s += "Tip 1:" + forks[0]["tip"] + "\nTip 2:" + forks[1]["tip"] + "\nIn short,"
        s += sgl.gen("summary", max_tokens=6)

    @sgl.function
    def chat(s, question):
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=8))

    @sgl.function
    def person(s):
        s += "Describe a person as JSON: "
        s += sgl.gen("json", max_tokens=40, json_schema=json.dumps(PERSON))

    return SimpleNamespace(qa=qa, constrained=constrained, pick=pick, tips=tips, chat=chat,
                           person=person)


SG = programs(sglang)
RS = programs(rsgl)


@pytest.fixture(scope="module")
def sglang_backend(http_runtime):
    # The model path names no template SGLang knows; SmolLM2 speaks ChatML.
    return sglang.RuntimeEndpoint(http_runtime.http_url, api_key=API_KEY,
                                  chat_template_name="chatml")


@pytest.fixture(scope="module")
def ours(http_runtime):
    endpoint = rsgl.RuntimeEndpoint(http_runtime.rpc_address, timeout=300, api_key=API_KEY)
    yield endpoint
    endpoint.shutdown()


def run_both(program: str, backend, ours, **kwargs):
    theirs = getattr(SG, program).run(backend=backend, temperature=0, **kwargs)
    mine = getattr(RS, program).run(backend=ours, temperature=0, **kwargs)
    assert theirs.error() is None, theirs.error()
    assert mine.error() is None, mine.error()
    return theirs, mine


def test_endpoint_reads_model_and_server_info(sglang_backend, http_runtime):
    assert sglang_backend.get_model_name() == sglang_backend.model_info["model_path"]
    info = sglang_backend.get_server_info()
    assert info["model_path"] == sglang_backend.get_model_name()
    sglang_backend.flush_cache()


def test_gen_with_stop(sglang_backend, ours):
    theirs, mine = run_both("qa", sglang_backend, ours, question="What is the capital of Italy?")
    assert theirs["answer"] == mine["answer"] and "\n" not in theirs["answer"]
    assert theirs.text() == mine.text()


def test_regex_and_dtype_int(sglang_backend, ours):
    theirs, mine = run_both("constrained", sglang_backend, ours)
    assert re.fullmatch(IP, theirs["ip"]), theirs["ip"]
    assert theirs["ip"] == mine["ip"]
    assert re.fullmatch(r"[-+]?[0-9]+", theirs["legs"]), theirs["legs"]
    assert theirs["legs"] == mine["legs"]


@pytest.mark.parametrize("method", METHODS)
def test_select_with_each_choices_method(sglang_backend, ours, method):
    theirs, mine = run_both("pick", sglang_backend, ours, method=method)
    assert theirs["city"] == mine["city"] and theirs["colour"] == mine["colour"]
    assert theirs.text() == mine.text()
    if method == "unconditional_likelihood_normalized":  # each choice's tokens, from the start
        unconditional = theirs.get_meta_info("city")["unconditional_token_logprobs"]
        assert all(rows[0][0] is None and len(rows) > 1 for rows in unconditional)


def test_fork_and_join(sglang_backend, ours):
    theirs, mine = run_both("tips", sglang_backend, ours)
    assert theirs["tip"] == mine["tip"]  # join gathers each branch's variable
    assert theirs["summary"] == mine["summary"] and theirs.text() == mine.text()


def test_run_batch_of_8(sglang_backend, ours):
    questions = [{"question": f"What is {a} plus {a + 1}?"} for a in range(8)]
    theirs = SG.qa.run_batch(questions, backend=sglang_backend, temperature=0)
    mine = RS.qa.run_batch(questions, backend=ours, temperature=0)
    assert [s["answer"] for s in theirs] == [s["answer"] for s in mine]


def test_streaming_text_iter(sglang_backend, ours):
    kwargs = dict(question="Name a primary colour.", stream=True)
    theirs = SG.qa.run(backend=sglang_backend, temperature=0, **kwargs)
    pieces = list(theirs.text_iter())
    mine = RS.qa.run(backend=ours, temperature=0, **kwargs)
    assert "".join(pieces) == theirs.text() == "".join(mine.text_iter())
    assert theirs["answer"] == mine["answer"]


def test_roles(sglang_backend, ours):
    theirs, mine = run_both("chat", sglang_backend, ours, question="Say hello.")
    assert theirs.text() == mine.text()
    assert theirs.messages() == mine.messages()


def test_json_schema(sglang_backend, ours):
    theirs, mine = run_both("person", sglang_backend, ours)
    answer = json.loads(theirs["json"])
    assert set(answer) >= {"name", "age"} and isinstance(answer["age"], int)
    assert theirs["json"] == mine["json"]
