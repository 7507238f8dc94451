"""select against brute force: each prefix + choice scored by transformers (fp32), under
every choices_method; same choice, scores within 1e-4."""

from __future__ import annotations

import pytest

import radixserve.lang as sgl
from radixserve.lang.scoring import choice_tokens

TOL = 1e-4
PREFIX = ("Decide whether each review is positive or negative.\n"
          "Review: The food was wonderful and the staff were kind.\nLabel: positive\n"
          "Review: Cold soup, rude waiter, never again.\nLabel: negative\n"
          "Review: I would happily come back every week.\nLabel:")
CHOICES = [" positive", " negative", " neutral", " mixed feelings overall"]
METHODS = [sgl.token_length_normalized, sgl.greedy_token_selection,
           sgl.unconditional_likelihood_normalized]


def brute_force(hf, tokenizer, prefix: str, choices: list[str], method) -> tuple[str, list]:
    """Score each choice's tokens with transformers; decide as the method defines."""
    _, fulls, starts = choice_tokens(tokenizer, prefix, choices)
    per_choice, uncond = [], []
    for full, start in zip(fulls, starts):
        lp = hf.logprobs(full)
        per_choice.append([float(lp[p - 1, full[p]]) for p in range(start, len(full))])
        own = full[start:]
        lp0 = hf.logprobs(own)
        uncond.append([0.0] + [float(lp0[p - 1, own[p]]) for p in range(1, len(own))])
    means = [sum(x) / len(x) for x in per_choice]
    if method is sgl.unconditional_likelihood_normalized:
        scores = [sum(c - u for c, u in zip(cs, us)) / len(cs)
                  for cs, us in zip(per_choice, uncond)]
    else:
        scores = means
    if method is sgl.greedy_token_selection:
        width = max(map(len, per_choice))
        rows = [r + [sum(r) / len(r)] * (width - len(r)) for r in per_choice]
        alive = list(range(len(rows)))
        for j in range(width):
            best = max(rows[i][j] for i in alive)
            alive = [i for i in alive if rows[i][j] == best]
            if len(alive) == 1:
                break
        return choices[alive[0]], means
    return choices[max(range(len(scores)), key=lambda i: (scores[i], -i))], scores


@pytest.mark.parametrize("method", METHODS, ids=repr)
def test_select_matches_transformers(backend, hf, tokenizer, method):
    @sgl.function
    def classify(s):
        s += PREFIX + sgl.select("label", choices=CHOICES, choices_method=method)

    state = classify.run()
    meta = state.get_meta_info("label")
    want, want_scores = brute_force(hf, tokenizer, PREFIX, CHOICES, method)
    assert state["label"] == want
    got_scores = meta["normalized_prompt_logprobs"] if meta["scores"] is None else meta["scores"]
    assert max(abs(a - b) for a, b in zip(got_scores, want_scores)) < TOL, (got_scores, want_scores)
    assert state.text() == PREFIX + want


def test_choice_boundaries_follow_the_tokenizer(tokenizer):
    # "Label: " + "yes" tokenizes as "Label:" + " yes": the choice's tokens start at the
    # space, inside the text prefix; "Label:" + " yes" keeps the prefix's tokens.
    prefix_ids, fulls, starts = choice_tokens(tokenizer, "Label: ", ["yes"])
    assert starts[0] < len(prefix_ids)
    assert tokenizer.decode(fulls[0][starts[0]:]) == " yes"
    prefix_ids, fulls, starts = choice_tokens(tokenizer, "Label:", [" yes"])
    assert starts[0] == len(prefix_ids)


def test_select_uses_the_cached_prefix(fresh, tokenizer):
    @sgl.function
    def classify(s):
        s += PREFIX + sgl.select("label", choices=CHOICES)

    classify.run()
    stats = fresh.stats()
    assert stats["requests"] == 1 + len(CHOICES)  # the commit, then one batch of choices
    prefix_len = len(tokenizer.encode(PREFIX))
    page = 16
    # each choice re-reads the prefix from the cache up to the page before its first token
    assert stats["cached_tokens"] >= len(CHOICES) * ((prefix_len - 1) // page * page)


def test_select_with_temperature_samples_by_score(backend):
    @sgl.function
    def classify(s, temp):
        s += PREFIX + sgl.select("label", choices=[" positive", " negative"], temperature=temp)

    greedy = classify.run(temp=0.0)
    gap = abs(greedy.get_meta_info("label")["scores"][0]
              - greedy.get_meta_info("label")["scores"][1])
    assert gap > 0.05
    # a temperature far below the score gap samples the best choice every time
    assert classify.run(temp=gap / 100)["label"] == greedy["label"]
