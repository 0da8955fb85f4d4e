"""What a conformance run found: one result per check, as a table or as JSON.

Pure: no grpc, no asyncio. The runner fills a :class:`ConformanceReport`; the command
renders it with :func:`render_table` or :func:`report_to_json` and exits with
:meth:`ConformanceReport.exit_code`.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass, field


class Outcome(enum.Enum):
    PASS = "pass"
    FAIL = "fail"
    SKIP = "skip"


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One check's verdict. ``detail`` says what was verified, what broke, or why skipped."""

    name: str
    section: str
    outcome: Outcome
    detail: str
    seconds: float = 0.0


@dataclass
class ConformanceReport:
    """Every check's verdict for one target, and what the run left on the target."""

    target: str
    instance: str = ""
    kind: str = ""
    coordinator_id: str = ""
    epoch: int = 0
    results: list[CheckResult] = field(default_factory=list)
    left_behind: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        counted = {outcome.value: 0 for outcome in Outcome}
        for result in self.results:
            counted[result.outcome.value] += 1
        return counted

    def failed(self) -> list[str]:
        return [r.name for r in self.results if r.outcome is Outcome.FAIL]

    def result(self, name: str) -> CheckResult:
        for result in self.results:
            if result.name == name:
                return result
        raise KeyError(name)

    def exit_code(self) -> int:
        """1 when any check failed, else 0 (usage errors exit 2 before a report exists)."""
        return 1 if self.failed() else 0


_MARKS = {Outcome.PASS: "pass", Outcome.FAIL: "FAIL", Outcome.SKIP: "skip"}


def render_line(result: CheckResult) -> str:
    """One progress line, printed as each check finishes."""
    return (
        f"  {_MARKS[result.outcome]:<4}  {result.name:<22} section {result.section:<10} "
        f"({result.seconds:.2f} s)"
    )


def _wrap(text: str, width: int) -> list[str]:
    words = text.split()
    lines: list[str] = []
    line = ""
    for word in words:
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    lines.append(line)
    return lines


def render_table(report: ConformanceReport, *, detail_width: int = 72) -> str:
    """The summary: one row per check (name, section, result, detail), then the counts."""
    rows: Sequence[tuple[str, str, str, str]] = [
        (r.name, r.section, _MARKS[r.outcome], r.detail) for r in report.results
    ]
    headers = ("check", "section", "result", "detail")
    name_w = max([len(headers[0]), *(len(row[0]) for row in rows)])
    section_w = max([len(headers[1]), *(len(row[1]) for row in rows)])
    result_w = len(headers[2])
    out = [
        f"turnpoint conformance: {report.target} ({report.kind or 'unknown kind'} "
        f"{report.instance or '?'}) as coordinator {report.coordinator_id} "
        f"epoch {report.epoch}",
        "",
        f"{headers[0]:<{name_w}}  {headers[1]:<{section_w}}  {headers[2]:<{result_w}}  "
        f"{headers[3]}",
        f"{'-' * name_w}  {'-' * section_w}  {'-' * result_w}  {'-' * detail_width}",
    ]
    indent = " " * (name_w + section_w + result_w + 6)
    for name, section, mark, detail in rows:
        first, *rest = _wrap(detail, detail_width)
        out.append(f"{name:<{name_w}}  {section:<{section_w}}  {mark:<{result_w}}  {first}")
        out.extend(f"{indent}{line}" for line in rest)
    counts = report.counts()
    out.append("")
    out.append(f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped")
    if report.left_behind:
        out.append("")
        out.append("left on the target:")
        out.extend(f"  - {item}" for item in report.left_behind)
    return "\n".join(out)


def report_to_json(report: ConformanceReport) -> str:
    document = {
        "target": report.target,
        "instance": report.instance,
        "kind": report.kind,
        "coordinator_id": report.coordinator_id,
        "epoch": report.epoch,
        "checks": [
            {
                "name": r.name,
                "section": r.section,
                "result": r.outcome.value,
                "detail": r.detail,
                "seconds": round(r.seconds, 3),
            }
            for r in report.results
        ],
        "counts": report.counts(),
        "left_behind": report.left_behind,
    }
    return json.dumps(document, indent=2)
