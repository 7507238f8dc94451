"""An agent loop: the model picks an action (select), writes a calculator expression
(regex-constrained, so it always parses), Python evaluates it, and the result is fed back
as an observation, until the model chooses to answer. Each turn re-sends the growing
scratchpad, which the radix cache serves, so only the new lines are prefilled.

    python examples/agent_tool_loop.py                  # in-process Engine
    python examples/agent_tool_loop.py --server tcp://127.0.0.1:30001
"""

from __future__ import annotations

import ast
import operator

import radixserve.lang as sgl
from _common import backend_from_args, report

TASK = "A train travels 84 km per hour for 3 hours, then 60 km per hour for 2 hours. " \
       "How far does it travel in total?"
EXPRESSION = r"[0-9]{1,4}( ?[-+*/] ?[0-9]{1,4}){1,3}"
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv}


def calculator(expression: str) -> str:
    """The tool: +, -, *, / on numbers only (no eval)."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        raise ValueError(f"not arithmetic: {expression!r}")
    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (ValueError, ZeroDivisionError, SyntaxError) as e:
        return f"error: {e}"
    return f"{result:g}"


@sgl.function
def agent(s, task, max_steps=4):
    s += ("You solve problems with a calculator. Each step, choose an Action: 'calculate' "
          "to evaluate an arithmetic expression, or 'answer' once you know the result.\n\n")
    s += "Task: " + task + "\n"
    for step in range(max_steps):
        s += f"Action {step + 1}:" + sgl.select(f"action_{step}", choices=[" calculate", " answer"])
        if s[f"action_{step}"] == " answer" and step > 0:
            break
        s += "\nExpression: " + sgl.gen(f"expr_{step}", regex=EXPRESSION, max_tokens=16,
                                        temperature=0)
        s += f"\nObservation: {calculator(s[f'expr_{step}'])}\n"
    s += "\nFinal answer:" + sgl.gen("answer", max_tokens=24, stop="\n", temperature=0)


def main() -> None:
    backend, _ = backend_from_args(__doc__)
    state = agent.run(task=TASK)
    print(state.text())
    report(backend)
    backend.shutdown()


if __name__ == "__main__":
    main()
