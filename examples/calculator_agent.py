"""A multi-turn agent with a tool: the model may use a calculator before it answers.

The protocol is plain text, so it works with any chat model (no tool-calling support needed):
the model replies `CALC: <expression>` to use the calculator, and gets `RESULT: <value>` back as
the next user message; it replies `ANSWER: <number>` when done. Anything else gets a reminder of
the protocol. At most AGENT_MAX_TURNS model calls.

The agent can check its own work (it has a calculator), so it scores itself: reward 1 for the
right answer, else 0, posted to AGENTSTREAM_REWARD_URL with its rollout token.

Task input: {"expression": "12*7+3"} (the question asked is "What is 12*7+3?"), or
{"question": ..., "expression": ...}.
Environment: OPENAI_BASE_URL, OPENAI_API_KEY (read by the SDK), AGENTSTREAM_TASK,
AGENTSTREAM_REWARD_URL, AGENTSTREAM_MODEL (else the first model listed).
"""

from __future__ import annotations

import ast
import json
import math
import operator
import os
import re
import sys
from collections.abc import Callable
from typing import Any, cast

import httpx
from openai import OpenAI, OpenAIError
from openai.types.chat import ChatCompletionMessageParam

SYSTEM = ("You can use a calculator. To use it, reply with exactly one line: CALC: <expression>. "
          "When you know the answer, reply with exactly one line: ANSWER: <number>.")
CALL = re.compile(r"CALC:\s*([^\n]{1,200})")
ANSWER = re.compile(r"ANSWER:\s*(-?\d+(?:\.\d+)?)")
REMINDER = "Reply with CALC: <expression> or ANSWER: <number>."


class CalculatorError(ValueError):
    pass


_OPERATORS: dict[type[ast.AST], Callable[..., Any]] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
              ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> float:
    """Arithmetic only (numbers, + - * / // % **, parentheses); anything else is an error."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"cannot parse {expression!r}") from None

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return cast(float, node.value)  # an int stays exact until the end
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            negated: float = _OPERATORS[type(node.op)](value(node.operand))
            return negated
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise CalculatorError("exponent too large")
            try:
                combined: float = _OPERATORS[type(node.op)](left, right)
                return combined
            except (ZeroDivisionError, OverflowError) as exc:
                raise CalculatorError(str(exc)) from None
        raise CalculatorError(f"only arithmetic is allowed, not {type(node).__name__}")

    result = value(tree.body)
    try:
        result = float(result)
    except (OverflowError, TypeError):  # a huge integer, or a complex power of a negative number
        raise CalculatorError("the result is not a representable real number") from None
    if not math.isfinite(result):
        raise CalculatorError("the result is not a finite real number")
    return result


def solve(client: OpenAI, model: str, question: str, max_turns: int, max_tokens: int) -> tuple[float | None, int, int]:
    """Run the tool loop; return (answer or None, model calls made, calculator uses)."""
    messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": SYSTEM},
                                                  {"role": "user", "content": question}]
    tool_uses = 0
    for turn in range(1, max_turns + 1):
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=1.0)
        text = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        if answer := ANSWER.search(text):
            return float(answer.group(1)), turn, tool_uses
        if call := CALL.search(text):
            tool_uses += 1
            try:
                observation = f"RESULT: {calculate(call.group(1)):g}"
            except CalculatorError as exc:
                observation = f"ERROR: {exc}"
        else:
            observation = REMINDER
        messages.append({"role": "user", "content": observation})
    return None, max_turns, tool_uses


def post_reward(value: float, details: dict[str, Any]) -> None:
    response = httpx.post(os.environ["AGENTSTREAM_REWARD_URL"], json={"value": value, "details": details},
                          headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}, timeout=30)
    response.raise_for_status()


def main() -> int:
    with open(os.environ["AGENTSTREAM_TASK"]) as file:
        task = json.load(file)
    expression = str(task["expression"])
    question = str(task.get("question") or f"What is {expression}?")
    expected = calculate(expression)
    client = OpenAI()
    try:
        model = os.environ.get("AGENTSTREAM_MODEL") or client.models.list().data[0].id
        answer, turns, tool_uses = solve(client, model, question, int(os.environ.get("AGENT_MAX_TURNS", "4")),
                                         int(os.environ.get("AGENT_MAX_TOKENS", "48")))
    except OpenAIError as exc:
        print(f"the model call failed: {exc}", file=sys.stderr)
        return 1
    correct = answer is not None and math.isclose(answer, expected, rel_tol=1e-6, abs_tol=1e-9)
    details = {"answer": answer, "expected": expected, "turns": turns, "tool_uses": tool_uses}
    try:
        post_reward(1.0 if correct else 0.0, details)
    except httpx.HTTPError as exc:  # an unrecorded reward is a failed attempt: let the controller retry it
        print(f"could not post the reward: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"reward": 1.0 if correct else 0.0, **details}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
