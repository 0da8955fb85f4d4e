"""A small ReAct-style harness that knows nothing of turnpoint: it speaks the OpenAI API
through the ``openai`` package, as any harness would (docs/spec.md section 12.8).

Run as a script by :class:`~turnpoint.server.openai_api.OpaqueAgent`: the client reads
``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` (the relay and the episode's credential), the
task comes as JSON in ``TURNPOINT_TASK`` (``low``, ``high``, ``target``, ``max_turns``,
``seed``; ``HARNESS_TEMPERATURE`` overrides the temperature, as a user tuning their
harness would). Each step the model reasons and acts (a guess, its first digit), the harness's
one tool observes (``higher``, ``lower``, ``correct`` or ``invalid``), and the
observation goes back as a ``tool`` message. The tool is an HTTP service reached through
the relay when ``TURNPOINT_TOOLS_URL`` says where (``POST <url>/observe`` with the same
API key), else this script's own :func:`observe`. The last line printed is the
transcript. It imports nothing of turnpoint on purpose.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request

from openai import OpenAI


def observe(action: str, target: int) -> str:
    """The tool: compare the first digit the model emitted with the target."""
    guess = next((int(word) for word in action.split() if word.isdigit()), None)
    if guess is None:
        return "invalid"
    if guess == target:
        return "correct"
    return "higher" if guess < target else "lower"


def call_tool(tools_url: str, action: str, target: int, step: int) -> str:
    """The tool over HTTP, as a harness calls any tool: JSON in, JSON out."""
    request = urllib.request.Request(
        f"{tools_url}/observe",
        data=json.dumps({"action": action, "target": target, "step": step}).encode(),
        headers={
            "Content-Type": "application/json",
            "Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}",
        },
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=60.0) as answer:
        return str(json.loads(answer.read())["observation"])


def main() -> int:
    task = json.loads(os.environ["TURNPOINT_TASK"])
    client = OpenAI(max_retries=0, timeout=60.0)
    messages = [{"role": "user", "content": f"range {task['low']} {task['high']}"}]
    for step in range(int(task["max_turns"])):
        reply = client.chat.completions.create(
            model=os.environ["OPENAI_MODEL"],
            messages=messages,  # type: ignore[arg-type]
            max_completion_tokens=int(task.get("max_tokens", 4)),
            temperature=float(os.environ.get("HARNESS_TEMPERATURE", task.get("temperature", 0))),
            seed=int(task.get("seed", 0)) + step,
        )
        action = reply.choices[0].message.content or ""
        tools_url = os.environ.get("TURNPOINT_TOOLS_URL")
        target = int(task["target"])
        observation = (
            call_tool(tools_url, action, target, step) if tools_url else observe(action, target)
        )
        messages.append({"role": "assistant", "content": action})
        messages.append({"role": "tool", "content": observation})
        if observation == "correct":
            break
    print(json.dumps({"messages": messages}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
