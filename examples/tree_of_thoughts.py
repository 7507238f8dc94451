"""Tree of thoughts: propose several approaches in parallel branches (fork), let the model
judge them (select), then answer along the chosen one. The question is prefilled once and
every branch reads it from the radix cache.

    python examples/tree_of_thoughts.py                 # in-process Engine
    python examples/tree_of_thoughts.py --server tcp://127.0.0.1:30001
"""

from __future__ import annotations

import radixserve.lang as sgl
from _common import backend_from_args, report

QUESTION = ("A shop sells pens at 3 for 2 dollars. How much do 12 pens cost? "
            "Think about it step by step.")
STYLES = ["Reason with unit prices.", "Reason by counting groups of three.",
          "Reason with a table of quantities."]


@sgl.function
def tree_of_thoughts(s, question, n=3):
    s += sgl.system("You are a careful tutor who explains briefly.")
    s += sgl.user(question)
    branches = s.fork(n)
    for i, b in enumerate(branches):
        b += sgl.assistant(STYLES[i % len(STYLES)] + " " + sgl.gen("thought", max_tokens=48,
                                                                   temperature=0.7))
    branches.join()
    s += sgl.user("Here are three approaches:\n" + "\n".join(
        f"({i + 1}) {t}" for i, t in enumerate(s["thought"])) + "\nWhich one is best?")
    s += sgl.assistant("The best approach is (" + sgl.select(
        "best", choices=[str(i + 1) for i in range(n)]) + ").")
    best = s["thought"][int(s["best"]) - 1]
    s += sgl.user(f"Using approach: {best}\nGive the final answer in one sentence.")
    s += sgl.assistant(sgl.gen("answer", max_tokens=32, temperature=0))


def main() -> None:
    backend, _ = backend_from_args(__doc__)
    state = tree_of_thoughts.run(question=QUESTION)
    for i, thought in enumerate(state["thought"]):
        print(f"thought {i + 1}: {thought.strip()}\n")
    print(f"chosen: ({state['best']})\nanswer: {state['answer'].strip()}")
    report(backend)
    backend.shutdown()


if __name__ == "__main__":
    main()
