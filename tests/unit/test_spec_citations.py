"""Every citation in the code names a file and a section that exist.

The normative specification is docs/spec.md; docstrings and comments cite it as
"docs/spec.md section 4.8" (or "sections 5-7"). A citation of a document that is not in
the repository (the old PROTOCOL.md / REFERENCE.md), of a missing docs/ file, or of a
section the spec does not have fails here, so a reader can always follow one.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO / "docs" / "spec.md"
# Every Python file in the repository but the generated code.
_GENERATED = REPO / "core" / "src" / "turnpoint" / "v1"

_HEADING = re.compile(r"^#{2,4}\s+(\d+(?:\.\d+)*)\.?\s", re.MULTILINE)
_CITATION = re.compile(
    r"(?P<file>docs/[\w.-]+\.md)(?:\s+sections?\s+(?P<sections>\d+(?:\.\d+)*"
    r"(?:\s*(?:-|,|and)\s*\d+(?:\.\d+)*)*))?"
)
_EXTERNAL = re.compile(r"\b(?:PROTOCOL|REFERENCE|STYLE)\.md\b")


def spec_sections(text: str) -> set[str]:
    return set(_HEADING.findall(text))


def code_files() -> list[Path]:
    skip = {".venv", "node_modules", "build", ".git"}
    return [
        path
        for path in sorted(REPO.rglob("*.py"))
        if not skip & set(path.relative_to(REPO).parts) and _GENERATED not in path.parents
    ]


def broken_citations(text: str, where: str, sections: set[str]) -> list[str]:
    problems = []
    flat = re.sub(r"\s+", " ", text)  # citations may wrap across docstring lines
    for match in _EXTERNAL.finditer(flat):
        problems.append(f"{where}: cites {match.group(0)}, which is not in the repository")
    for match in _CITATION.finditer(flat):
        cited = REPO / match.group("file")
        if not cited.is_file():
            problems.append(f"{where}: cites {match.group('file')}, which does not exist")
            continue
        if match.group("sections") is None or cited != SPEC:
            continue
        for number in re.findall(r"\d+(?:\.\d+)*", match.group("sections")):
            if number not in sections:
                problems.append(f"{where}: cites docs/spec.md section {number}, which it lacks")
    return problems


def test_the_spec_has_numbered_sections() -> None:
    sections = spec_sections(SPEC.read_text(encoding="utf-8"))
    assert {str(n) for n in range(1, 11)} <= sections
    assert len(sections) > 40


def test_every_citation_in_the_code_names_a_section_that_exists() -> None:
    sections = spec_sections(SPEC.read_text(encoding="utf-8"))
    problems: list[str] = []
    cited = 0
    for path in code_files():
        if path == Path(__file__):
            continue
        text = path.read_text(encoding="utf-8")
        cited += len(_CITATION.findall(re.sub(r"\s+", " ", text)))
        problems += broken_citations(text, str(path.relative_to(REPO)), sections)
    assert problems == []
    assert cited > 50  # the docstrings do cite the spec


@pytest.mark.parametrize(
    ("text", "broken"),
    [
        ("see docs/spec.md section 4.8", False),
        ("docs/spec.md sections 5-7", False),
        ("docs/spec.md\n    section 7.4", False),
        ("see docs/spec.md section 4.99", True),
        ("see docs/spec.md sections 4 and 42", True),
        ("PROTOCOL.md section 7", True),
        ("see docs/nowhere.md", True),
    ],
)
def test_the_checker_catches_what_it_claims(text: str, broken: bool) -> None:
    sections = spec_sections(SPEC.read_text(encoding="utf-8"))
    assert bool(broken_citations(text, "probe", sections)) is broken
