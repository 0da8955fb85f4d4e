"""docs/typescript.md shows the counter example as ts/examples holds it (the TypeScript
test runs those files; this keeps the guide from drifting from them). Here, not in
``npm test``: the package's tests need ts/ alone."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("example", ["counter.ts", "counter-serve.ts"])
def test_the_guide_shows_the_counter_example_as_it_is(example: str) -> None:
    guide = (REPO / "docs" / "typescript.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```ts\n(.*?)```", guide, flags=re.DOTALL)
    code = (REPO / "ts" / "examples" / example).read_text(encoding="utf-8")
    assert code in blocks, f"docs/typescript.md shows ts/examples/{example} as it is"
