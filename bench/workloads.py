"""The benchmark workloads: token-level requests built deterministically from a seed.

Five shapes, each with size presets (`tiny` for tests, `quick` < 3 minutes per workload on
the 2-core machine, `full`):

- `shared_prefix`: G groups x P prompts, a system prompt of S tokens per group, a question of
  Q tokens, O output tokens (SGLang bench_serving's generated-shared-prefix shape);
- `multi_turn`: C conversations of T turns under one chat system prompt; every turn
  resends the whole history (earlier prompts and the model's own replies) plus a new user
  message of U tokens;
- `few_shot`: one long few-shot prefix of S tokens and many short questions;
- `agent`: a system prompt with tool descriptions (S tokens) and a task, then turns that
  append the model's output (a tool call) and a tool result of U tokens;
- `no_sharing`: distinct prompts of the shared-prefix prompts' length (the control: the
  cache cannot help and must not hurt).

A request of a conversation names its `parent`: its prompt is the parent's prompt, the
parent's generated output, then its own `segment`. Runners therefore run a workload in
waves (all requests whose parents are done), so the history is the model's real output.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Mapping

Encode = Callable[[str], list[int]]
"""Text to token ids without special tokens added (chat markers in the text still map)."""

WORDS = ("river market engine quiet silver window garden theory simple yellow travel history "
         "signal forest number paper mountain kitchen planet orange library music careful "
         "winter bridge science animal ocean village summer energy letter morning pattern "
         "circle friend machine island school voice people sudden harbor lantern copper "
         "meadow rocket puzzle shadow thunder velvet crystal compass desert galaxy").split()


@dataclass(frozen=True)
class Request:
    rid: str
    segment: tuple[int, ...]
    """Tokens this request appends: the whole prompt when `parent` is None."""
    output_tokens: int
    group: int
    """Shared-prefix group, or conversation."""
    turn: int = 0
    parent: str | None = None
    """The request whose prompt + output this request's prompt extends."""
    prefix_key: str | None = None
    """Name of the prefix this request declares shared with others (hand-rolled reuse)."""
    shared_len: int = 0
    """Length of that prefix: `prompt[:shared_len]` is the same for every request of the key."""


@dataclass(frozen=True)
class Workload:
    name: str
    preset: str
    seed: int
    settings: Mapping[str, int]
    requests: tuple[Request, ...] = field(repr=False)

    def waves(self) -> list[list[Request]]:
        """Requests grouped by dependency depth, each wave in arrival order."""
        depth: dict[str, int] = {}
        waves: list[list[Request]] = []
        for req in self.requests:
            d = 0 if req.parent is None else depth[req.parent] + 1
            depth[req.rid] = d
            while len(waves) <= d:
                waves.append([])
            waves[d].append(req)
        return waves

    def prompt(self, req: Request, prompts: Mapping[str, list[int]],
               outputs: Mapping[str, list[int]]) -> list[int]:
        """The full prompt of `req` given its parent's prompt and output (if any)."""
        if req.parent is None:
            return list(req.segment)
        return prompts[req.parent] + outputs[req.parent] + list(req.segment)

    @property
    def num_requests(self) -> int:
        return len(self.requests)


class _Text:
    """Deterministic filler text of an exact token length."""

    def __init__(self, rng: random.Random, encode: Encode) -> None:
        self.rng, self.encode = rng, encode

    def tokens(self, n: int, lead: str = " ") -> list[int]:
        ids: list[int] = []
        while len(ids) < n:
            ids = self.encode(lead + " ".join(self.rng.choice(WORDS) for _ in range(2 * n + 4)))
        return ids[:n]


PRESETS: dict[str, dict[str, dict[str, int]]] = {
    "shared_prefix": {
        "tiny": dict(groups=2, per_group=2, system_tokens=40, question_tokens=8, output_tokens=4),
        "quick": dict(groups=4, per_group=8, system_tokens=256, question_tokens=16,
                      output_tokens=32),
        "full": dict(groups=8, per_group=8, system_tokens=1000, question_tokens=32,
                     output_tokens=64),
    },
    "multi_turn": {
        "tiny": dict(conversations=2, turns=2, system_tokens=24, user_tokens=8, output_tokens=4),
        "quick": dict(conversations=4, turns=3, system_tokens=128, user_tokens=32,
                      output_tokens=32),
        "full": dict(conversations=8, turns=6, system_tokens=256, user_tokens=64,
                     output_tokens=64),
    },
    "few_shot": {
        "tiny": dict(prefix_tokens=48, questions=4, question_tokens=6, output_tokens=3),
        "quick": dict(prefix_tokens=512, questions=16, question_tokens=16, output_tokens=8),
        "full": dict(prefix_tokens=1500, questions=64, question_tokens=24, output_tokens=16),
    },
    "agent": {
        "tiny": dict(agents=2, turns=3, system_tokens=40, task_tokens=8, tool_tokens=8,
                     output_tokens=4),
        "quick": dict(agents=2, turns=4, system_tokens=384, task_tokens=32, tool_tokens=64,
                      output_tokens=16),
        "full": dict(agents=4, turns=8, system_tokens=1024, task_tokens=64, tool_tokens=128,
                     output_tokens=32),
    },
    "no_sharing": {
        # Same prompt length as the shared-prefix preset (system + question), no sharing.
        "tiny": dict(prompts=4, prompt_tokens=48, output_tokens=4),
        "quick": dict(prompts=8, prompt_tokens=272, output_tokens=32),
        "full": dict(prompts=16, prompt_tokens=1032, output_tokens=64),
    },
}

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


def shared_prefix(encode: Encode, seed: int, groups: int, per_group: int, system_tokens: int,
                  question_tokens: int, output_tokens: int) -> list[Request]:
    rng = random.Random(seed)
    text = _Text(rng, encode)
    reqs = []
    for g in range(groups):
        system = text.tokens(system_tokens)
        for i in range(per_group):
            reqs.append(Request(f"sp-g{g}-q{i}", tuple(system + text.tokens(question_tokens)),
                                output_tokens, g, prefix_key=f"system-{g}",
                                shared_len=system_tokens))
    rng.shuffle(reqs)  # arrivals interleave the groups, as real traffic would
    return reqs


def multi_turn(encode: Encode, seed: int, conversations: int, turns: int, system_tokens: int,
               user_tokens: int, output_tokens: int) -> list[Request]:
    text = _Text(random.Random(seed), encode)
    system = encode(f"{IM_START}system\n") + text.tokens(system_tokens)
    user = encode(f"{IM_END}\n{IM_START}user\n")
    assistant = encode(f"{IM_END}\n{IM_START}assistant\n")
    reqs = []
    for turn in range(turns):  # listed turn by turn: arrival order within each wave
        for c in range(conversations):
            segment = user + text.tokens(user_tokens) + assistant
            if turn == 0:
                reqs.append(Request(f"mt-c{c}-t0", tuple(system + segment), output_tokens, c,
                                    prefix_key="system", shared_len=len(system)))
            else:
                reqs.append(Request(f"mt-c{c}-t{turn}", tuple(segment), output_tokens, c, turn,
                                    parent=f"mt-c{c}-t{turn - 1}"))
    return reqs


def few_shot(encode: Encode, seed: int, prefix_tokens: int, questions: int,
             question_tokens: int, output_tokens: int) -> list[Request]:
    text = _Text(random.Random(seed), encode)
    prefix: list[int] = []
    while len(prefix) < prefix_tokens:
        prefix += (encode("Question:") + text.tokens(12) + encode("\nAnswer:") + text.tokens(4)
                   + encode("\n\n"))
    prefix = prefix[:prefix_tokens]
    ask, answer = encode("\n\nQuestion:"), encode("\nAnswer:")
    return [Request(f"fs-q{i}", tuple(prefix + ask + text.tokens(question_tokens) + answer),
                    output_tokens, 0, prefix_key="shots", shared_len=prefix_tokens)
            for i in range(questions)]


def agent(encode: Encode, seed: int, agents: int, turns: int, system_tokens: int,
          task_tokens: int, tool_tokens: int, output_tokens: int) -> list[Request]:
    text = _Text(random.Random(seed), encode)
    system = encode(f"{IM_START}system\nYou can call these tools:\n") + text.tokens(system_tokens)
    user, tool = encode(f"{IM_END}\n{IM_START}user\n"), encode(f"{IM_END}\n{IM_START}tool\n")
    assistant = encode(f"{IM_END}\n{IM_START}assistant\n")
    reqs = []
    for turn in range(turns):
        for a in range(agents):
            if turn == 0:
                segment = system + user + text.tokens(task_tokens) + assistant
                reqs.append(Request(f"ag-a{a}-t0", tuple(segment), output_tokens, a,
                                    prefix_key="tools", shared_len=len(system)))
            else:
                segment = tool + text.tokens(tool_tokens) + assistant
                reqs.append(Request(f"ag-a{a}-t{turn}", tuple(segment), output_tokens, a, turn,
                                    parent=f"ag-a{a}-t{turn - 1}"))
    return reqs


def no_sharing(encode: Encode, seed: int, prompts: int, prompt_tokens: int,
               output_tokens: int) -> list[Request]:
    text = _Text(random.Random(seed), encode)
    return [Request(f"ns-{i}", tuple(text.tokens(prompt_tokens)), output_tokens, i)
            for i in range(prompts)]


GENERATORS: dict[str, Callable[..., list[Request]]] = {
    "shared_prefix": shared_prefix, "multi_turn": multi_turn, "few_shot": few_shot,
    "agent": agent, "no_sharing": no_sharing,
}
WORKLOADS = tuple(GENERATORS)


def shared_prefix_of(encode: Encode, shape: Mapping[str, int], seed: int = 0) -> list[Request]:
    """`shared_prefix` sized by a preset's `shape` (groups, per_group, system_tokens,
    question_tokens, output_tokens)."""
    return shared_prefix(encode, seed, groups=shape["groups"], per_group=shape["per_group"],
                         system_tokens=shape["system_tokens"],
                         question_tokens=shape["question_tokens"],
                         output_tokens=shape["output_tokens"])


def make_workload(name: str, preset: str, encode: Encode, seed: int = 0,
                  **overrides: int) -> Workload:
    """Build workload `name` at size `preset` (settings may be overridden one by one)."""
    settings = {**PRESETS[name][preset], **overrides}
    requests = GENERATORS[name](encode, seed, **settings)
    return Workload(name, preset, seed, settings, tuple(requests))


def prompts(n: int, prefix: int, own: int, seed: int = 0) -> list[list[int]]:
    """`n` token-id prompts sharing `prefix` random ids, each with `own` more (any
    tokenizer serves: the micro-benches feed ids, not text)."""
    rng = random.Random(seed)
    shared = [rng.randrange(100, 20000) for _ in range(prefix)]
    return [shared + [rng.randrange(100, 20000) for _ in range(own)] for _ in range(n)]


def greedy(new: int) -> dict[str, int | float | bool]:
    """Greedy sampling of exactly `new` tokens (EOS ignored: every engine does the same work)."""
    return {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}
