"""Programs written as SGLang's frontend docs write them, with `import sglang as sgl`
replaced by `import radixserve.lang as sgl` and nothing else changed (only max_tokens
kept small for this machine)."""

from __future__ import annotations

import re

import radixserve.lang as sgl


@sgl.function
def multi_turn_question(s, question_1, question_2):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question_1)
    s += sgl.assistant(sgl.gen("answer_1", max_tokens=8))
    s += sgl.user(question_2)
    s += sgl.assistant(sgl.gen("answer_2", max_tokens=8))


@sgl.function
def tool_use(s, question):
    s += "To answer this question: " + question + ". "
    s += "I need to use a " + sgl.gen("tool", choices=["calculator", "search engine"]) + ". "
    if s["tool"] == "calculator":
        s += "The math expression is" + sgl.gen("expression", max_tokens=6)
    elif s["tool"] == "search engine":
        s += "The key word to search is" + sgl.gen("word", max_tokens=6)


@sgl.function
def tip_suggestion(s):
    s += (
        "Here are two tips for staying healthy: "
        "1. Balanced Diet. 2. Regular Exercise.\n\n"
    )
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"Now, expand tip {i+1} into a paragraph:\n"
        f += sgl.gen("detailed_tip", max_tokens=8, stop="\n\n")  # verbatim, f-string too
    s += "Tip 1:" + forks[0]["detailed_tip"] + "\n"
    s += "Tip 2:" + forks[1]["detailed_tip"] + "\n"
    s += "In summary" + sgl.gen("summary", max_tokens=6)


@sgl.function
def regular_expression_gen(s):
    s += "Q: What is the IP address of the Google DNS servers?\n"
    s += "A: " + sgl.gen(
        "answer",
        temperature=0,
        regex=r"((25[0-5]|2[0-4]\d|[01]?\d\d?).){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)",
    )


@sgl.function
def text_qa(s, question):
    s += "Q: " + question + "\n"
    s += "A:" + sgl.gen("answer", stop="\n", max_tokens=8)


@sgl.function
def chat_with_role_blocks(s, question):
    with s.user():
        s += question
    with s.assistant():
        s += sgl.gen("answer", max_tokens=8)


def test_multi_turn_and_messages(backend):
    state = multi_turn_question.run(
        question_1="What is the capital of the United States?",
        question_2="List two local attractions.",
        temperature=0,
    )
    roles = [m["role"] for m in state.messages()]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert state.messages()[2]["content"] == state["answer_1"]
    assert state.text() == backend.tokenizer.apply_chat_template(state.messages(), tokenize=False)


def test_streaming(backend):
    state = multi_turn_question.run(
        question_1="What is the capital of the United States?",
        question_2="List two local attractions.",
        temperature=0,
        stream=True,
    )
    pieces = [out for out in state.text_iter()]
    assert "".join(pieces) == state.text()
    again = multi_turn_question.run(question_1="What is the capital of France?",
                                    question_2="And its river?", temperature=0, stream=True)
    answer = [out for out in again.text_iter("answer_1")]
    assert len(answer) > 1, "the in-process Engine streams a gen piece by piece"
    assert "".join(answer) == again["answer_1"]
    assert again.error() is None  # waits for the program's end: nothing left running


def test_tool_use_select(backend):
    state = tool_use.run(question="What is 32 * 7?", temperature=0)
    assert state["tool"] in ("calculator", "search engine")
    assert ("expression" in state) == (state["tool"] == "calculator")


def test_fork_tips(backend):
    state = tip_suggestion.run(temperature=0)
    text = state.text()
    assert "Tip 1:" in text and "Tip 2:" in text and isinstance(state["summary"], str)


def test_regex(backend):
    state = regular_expression_gen.run()
    assert re.fullmatch(r"((25[0-5]|2[0-4]\d|[01]?\d\d?).){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)",
                        state["answer"])


def test_run_batch_and_role_blocks(backend):
    states = text_qa.run_batch(
        [{"question": "What is the capital of the United Kingdom?"},
         {"question": "What is the capital of France?"},
         {"question": "What is the capital of Japan?"}],
        progress_bar=True, temperature=0,
    )
    for s in states:  # (a stop string in the token that also hits max_tokens stays: length wins)
        if s.get_meta_info("answer")["finish_reason"]["type"] == "stop":
            assert "\n" not in s["answer"]
    state = chat_with_role_blocks.run(question="Say hi.", temperature=0)
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant"]
