"""fork: a 300-token shared system prompt, forked 4 ways. The prefix is committed once,
every branch's request reports it cached, and each branch's output equals the same
conversation run alone."""

from __future__ import annotations

import radixserve.lang as sgl

SYSTEM = " ".join(
    f"Rule {i}: answer briefly, be polite, cite the library handbook section {i} when it "
    f"applies, and never invent opening hours." for i in range(1, 16))
QUESTIONS = ["Where can I print?", "How long is a loan?", "Can I bring food?",
             "Is there wifi?"]
GREEDY = dict(max_tokens=8, temperature=0)


@sgl.function
def forked(s, questions):
    s += sgl.system(SYSTEM)
    branches = s.fork(len(questions))
    for branch, q in zip(branches, questions):
        branch += sgl.user(q)
        branch += sgl.assistant(sgl.gen("answer", **GREEDY))
    branches.join()
    s["branch_meta"] = [b.get_meta_info("answer") for b in branches]
    first = branches[0].stream_executor
    s["prefix_text"] = first.text_[:first.fork_start_pos]


@sgl.function
def alone(s, question):
    s += sgl.system(SYSTEM)
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", **GREEDY))


def test_fork_branches_hit_the_committed_prefix(fresh, tokenizer, engine):
    state = forked.run(questions=QUESTIONS)
    assert state.error() is None
    prefix_len = len(tokenizer.encode(state["prefix_text"]))
    assert prefix_len >= 300
    page = engine.info.page_size
    for meta in state["branch_meta"]:
        assert meta["cached_tokens"] >= prefix_len // page * page, (meta, prefix_len)
    assert fresh.stats()["requests"] == 1 + len(QUESTIONS)  # one commit, then the branches
    # gather_variable: the branches' answers, in branch order
    answers = state["answer"]
    assert len(answers) == len(QUESTIONS)
    for q, answer in zip(QUESTIONS, answers):
        assert alone.run(question=q)["answer"] == answer


def test_branches_append_and_concatenate(backend):
    @sgl.function
    def two(s):
        s += "Count:"
        forks = s.fork(2)
        forks += lambda i: f" {i + 1}"
        forks.join(mode="concate_and_append")

    assert two.run().text() == "Count: 1 2"
