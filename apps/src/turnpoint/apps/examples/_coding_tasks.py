"""The coding environment's tasks (pure): a program with a bug, a visible check and the
hidden test that scores it (:mod:`._coding` serves them in sandboxes)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

SOLUTION: Final = "solution.py"
CHECK: Final = "check.py"


@dataclass(frozen=True)
class CodingTask:
    """A program with a bug, a visible check and the hidden test that scores it."""

    name: str
    source: str
    check: str
    hidden_test: str
    fixed: str  # a correct solution: what a perfect agent writes


TASKS: Final = (
    CodingTask(
        "add",
        "def add(a, b):\n    return a - b\n",
        "from solution import add\nassert add(1, 1) == 2, add(1, 1)\nprint('ok')\n",
        "from solution import add\nassert add(2, 3) == 5\nassert add(-4, 4) == 0\n",
        "def add(a, b):\n    return a + b\n",
    ),
    CodingTask(
        "maximum",
        "def maximum(xs):\n    best = 0\n    for x in xs:\n        if x > best:\n"
        "            best = x\n    return best\n",
        "from solution import maximum\nassert maximum([1, 3, 2]) == 3\nprint('ok')\n",
        "from solution import maximum\nassert maximum([-3, -1, -2]) == -1\n"
        "assert maximum([5]) == 5\n",
        "def maximum(xs):\n    return max(xs)\n",
    ),
    CodingTask(
        "reverse_words",
        "def reverse_words(text):\n    return text[::-1]\n",
        "from solution import reverse_words\nassert reverse_words('a') == 'a'\nprint('ok')\n",
        "from solution import reverse_words\nassert reverse_words('ab cd') == 'cd ab'\n"
        "assert reverse_words('one two three') == 'three two one'\n",
        "def reverse_words(text):\n    return ' '.join(reversed(text.split(' ')))\n",
    ),
)
BY_NAME: Final = {task.name: task for task in TASKS}


def task_of(task: Mapping[str, Any]) -> CodingTask:
    """The task an episode's ``{"seed": n}`` (or ``{"task": name}``) names."""
    if "task" in task:
        return BY_NAME[str(task["task"])]
    seed = task["seed"]
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    return TASKS[seed % len(TASKS)]
