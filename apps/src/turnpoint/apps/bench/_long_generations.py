"""``turnpoint bench --long-generations``: admission-closed seconds per snapshot while
long generations stream, with token-prefix cutting (docs/spec.md section 5.5) and
without it, at several generation lengths.

Two participants on loopback gRPC, each its own server: a policy whose every token costs
``token_delay_s`` (an ``asyncio.sleep`` standing in for a model's decode step) and an
agent whose rollouts generate turn after turn of ``tokens`` tokens each. The real
coordinator (:class:`~turnpoint.trainer.Checkpointing`) takes snapshots while every
rollout is mid-generation; its report's ``admission_closed_s`` is the figure. Without
cutting, a prepare waits for the longest generation in flight to end, so the figure
grows with the length; with cutting, the policy stops each generation at its next token
and the agent saves the prefix, so it should not.

The agent checks every finished generation against the tokens the policy streams for
each absolute position (a deterministic function), so a token generated twice or lost
across a cut shows up as a mismatch: the run's exactly-once audit over tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from turnpoint.apps.bench._options import positive_ints

LENGTHS: Final = (50, 200, 800)
TOKEN_DELAY_S: Final = 0.005
SNAPSHOTS: Final = 5
ROLLOUTS: Final = 4
# docs/spec.md section 5.5 (the must-have): with cutting, the figure at every
# length stays within this much plus one token's time of the shortest length's figure.
SLACK_S: Final = 0.05


@dataclass(frozen=True, slots=True)
class LongGenerationRow:
    """One point: ``tokens`` per generation, cutting on or off, the snapshots' figures."""

    tokens: int
    cut: bool
    admission_closed_s: tuple[float, ...]
    published: int
    generations: int
    continued: int
    mismatches: int

    @property
    def median_s(self) -> float:
        return statistics.median(self.admission_closed_s) if self.admission_closed_s else 0.0

    @property
    def max_s(self) -> float:
        return max(self.admission_closed_s, default=0.0)

    def to_json(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "cut": self.cut,
            "admission_closed_s": list(self.admission_closed_s),
            "admission_closed_median_s": self.median_s,
            "admission_closed_max_s": self.max_s,
            "snapshots_published": self.published,
            "generations_finished": self.generations,
            "generations_continued_after_a_cut": self.continued,
            "token_mismatches": self.mismatches,
        }


async def measure_long_generations(
    root: Path,
    lengths: Sequence[int] = LENGTHS,
    *,
    token_delay_s: float = TOKEN_DELAY_S,
    snapshots: int = SNAPSHOTS,
    rollouts: int = ROLLOUTS,
    progress: Callable[[str], None] = lambda _: None,
) -> list[LongGenerationRow]:
    # The participants and the coordinator load grpc and torch: only when measuring.
    from turnpoint.apps.bench._long_generation_parts import measure_one

    rows: list[LongGenerationRow] = []
    for tokens in lengths:
        for cut in (False, True):
            progress(
                f"long generations: {tokens} tokens x {token_delay_s * 1000:g} ms, "
                f"{'with' if cut else 'without'} cutting, {snapshots} snapshots"
            )
            where = root / f"{tokens}-{'cut' if cut else 'wait'}"
            rows.append(
                LongGenerationRow(
                    **await measure_one(
                        where,
                        tokens,
                        cut=cut,
                        token_delay_s=token_delay_s,
                        snapshots=snapshots,
                        rollouts=rollouts,
                    )
                )
            )
    return rows


def must_have(rows: Sequence[LongGenerationRow], token_delay_s: float) -> dict[str, Any]:
    """With cutting, no length's median exceeds the shortest's + 50 ms + one token."""
    cutting = sorted((row for row in rows if row.cut), key=lambda row: row.tokens)
    if not cutting:
        return {"held": None}
    bound = cutting[0].median_s + SLACK_S + token_delay_s
    worst = max(row.median_s for row in cutting)
    return {
        "bound_s": bound,
        "worst_median_with_cutting_s": worst,
        "held": worst <= bound,
        "token_mismatches": sum(row.mismatches for row in rows),
    }


def render_plot(rows: Sequence[LongGenerationRow], path: Path, token_delay_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.2))
    for cut, label, colour in (
        (False, "without cutting", "#c0392b"),
        (True, "with cutting", "#2471a3"),
    ):
        points = sorted((row for row in rows if row.cut is cut), key=lambda row: row.tokens)
        if not points:
            continue
        xs = [row.tokens for row in points]
        axes.plot(
            xs, [row.median_s for row in points], "o-", color=colour, label=f"{label} (median)"
        )
        axes.fill_between(
            xs,
            [min(row.admission_closed_s, default=0.0) for row in points],
            [row.max_s for row in points],
            color=colour,
            alpha=0.15,
        )
    axes.plot(
        [row.tokens for row in rows if not row.cut],
        [row.tokens * token_delay_s for row in rows if not row.cut],
        ":",
        color="grey",
        label="one whole generation",
    )
    axes.set_xscale("log")
    axes.set_xlabel(f"tokens per generation ({token_delay_s * 1000:g} ms per token)")
    axes.set_ylabel("admission closed per snapshot (s)")
    axes.set_title("Snapshots during long generations: waiting vs cutting at a token")
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


_lengths = positive_ints("--generation-lengths", "50,200,800", "token counts")


def _delay(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError("the per-token delay must be > 0")
    return value


def add_long_generation_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--long-generations",
        action="store_true",
        help="instead: admission-closed seconds per snapshot while long generations "
        "stream, with token-prefix cutting and without, per generation length, and a plot",
    )
    parser.add_argument(
        "--generation-lengths",
        type=_lengths,
        default=LENGTHS,
        metavar="N,N,...",
        help="--long-generations: tokens per generation (default %(default)s)",
    )
    parser.add_argument(
        "--token-delay",
        type=_delay,
        default=TOKEN_DELAY_S,
        metavar="SECONDS",
        help="--long-generations: the stand-in model's time per token (default %(default)s)",
    )
    parser.add_argument(
        "--long-generations-plot",
        default="bench-long-generations.png",
        metavar="PNG",
        help="where --long-generations writes its plot (default: %(default)s)",
    )


def _progress(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


def render_rows(rows: Sequence[LongGenerationRow]) -> str:
    lines = [
        f"{'tokens':>7} {'cutting':>8} {'median s':>9} {'max s':>7} {'published':>9} "
        f"{'continued':>9} {'mismatches':>10}"
    ]
    for row in rows:
        lines.append(
            f"{row.tokens:>7} {'yes' if row.cut else 'no':>8} {row.median_s:>9.3f} "
            f"{row.max_s:>7.3f} {row.published:>9} {row.continued:>9} {row.mismatches:>10}"
        )
    return "\n".join(lines)


def long_generations_section(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Measure, plot, and return the JSON section and the text table (the default
    ``turnpoint bench`` run includes it; ``--long-generations`` runs it alone)."""
    lengths: tuple[int, ...] = args.generation_lengths
    delay: float = args.token_delay
    plot = Path(args.long_generations_plot)
    made_root = args.root is None
    root = Path(tempfile.mkdtemp(prefix="turnpoint-long-")) if made_root else Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    try:
        rows = asyncio.run(
            measure_long_generations(root, lengths, token_delay_s=delay, progress=_progress)
        )
    finally:
        if made_root:
            shutil.rmtree(root, ignore_errors=True)
    render_plot(rows, plot, delay)
    verdict = must_have(rows, delay)
    section = {
        "token_delay_s": delay,
        "rows": [row.to_json() for row in rows],
        "must_have": verdict,
        "plot": str(plot),
    }
    text = "\n".join(
        [
            f"Admission closed per snapshot while generations stream ({delay * 1000:g} ms/token)",
            render_rows(rows),
            f"must-have (with cutting, flat in length): {verdict}",
            f"plot: {plot}",
        ]
    )
    return section, text


def long_generations_failed(section: dict[str, Any]) -> bool:
    verdict = section["must_have"]
    return verdict.get("held") is False or bool(verdict.get("token_mismatches"))


def long_generations_command(args: argparse.Namespace) -> int:
    """``turnpoint bench --long-generations``: measure, print, plot."""
    try:
        section, text = long_generations_section(args)
    except (TimeoutError, OSError) as error:
        print(f"turnpoint bench: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"long_generations": section}, indent=2))
    else:
        print(text)
    if args.check and long_generations_failed(section):
        return 1
    return 0
