"""The demo trainer's ``--snapshot-blocks`` (apps/demo/_trainer.py): blocks of steps
alternately without and with snapshots, off, on, on, off, for the bench's on/off
throughput; snapshots are taken only in the blocks that take them."""

from __future__ import annotations

import asyncio

import pytest

from turnpoint.apps.demo._trainer import (
    build_parser,
    first_snapshot_phase,
    prompt_of,
    snapshot_in_blocks,
    snapshots_on_in_block,
)

_WAIT_S = 10.0


def test_the_blocks_go_off_on_on_off() -> None:
    sides = [snapshots_on_in_block(block) for block in range(8)]
    assert sides == [False, True, True, False, False, True, True, False]
    # Every pair of neighbours (0 and 1, 2 and 3, ...) has one block of each side.
    assert all(sides[b] != sides[b + 1] for b in range(0, 8, 2))


def test_the_first_snapshot_of_a_block_falls_at_a_phase_that_moves_block_to_block() -> None:
    phases = [first_snapshot_phase(block) for block in range(1, 41)]
    assert all(0.0 <= phase < 1.0 for phase in phases)
    # Spread over the interval: every tenth of it holds some of forty blocks' phases.
    assert {int(phase * 10) for phase in phases} == set(range(10))


async def test_snapshots_are_taken_in_the_blocks_with_snapshots_on_only() -> None:
    size = 2
    step = 0
    taken: list[int] = []
    took = asyncio.Event()

    async def snapshot_now() -> None:
        taken.append(step // size)
        took.set()

    async def advance_to(new_step: int) -> None:
        nonlocal step
        step = new_step
        stepped.set()

    async def snapshots(count: int) -> None:
        for _ in range(count):
            took.clear()
            await asyncio.wait_for(took.wait(), _WAIT_S)

    stepped = asyncio.Event()
    stop = asyncio.Event()
    task = asyncio.create_task(
        snapshot_in_blocks(
            snapshot_now, lambda: step, stepped, stop, block_steps=size, interval_s=0.01
        )
    )
    await advance_to(2)  # block 1: on
    await snapshots(2)
    await advance_to(4)  # block 2: on
    await snapshots(1)
    for off in (6, 8):  # blocks 3 and 4: off
        await advance_to(off)
    await advance_to(10)  # block 5: on
    await snapshots(1)
    stop.set()
    stepped.set()
    await asyncio.wait_for(task, _WAIT_S)
    assert {1, 2, 5} <= set(taken)
    assert all(snapshots_on_in_block(block) for block in taken), taken


@pytest.mark.parametrize("blocks", ["0", "-2", "two"])
def test_a_block_of_no_steps_is_refused(blocks: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--topology", "t.json", "--out", "out", "--snapshot-blocks", blocks]
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert "--snapshot-blocks" in capsys.readouterr().err
    assert build_parser().parse_args([*argv[:-1], "2"]).snapshot_blocks == 2


def test_with_a_prompt_cycle_every_block_of_groups_plays_the_same_prompts() -> None:
    assert [prompt_of(group, None) for group in range(40)] == list(range(40))
    cycle = 16
    blocks = [
        [prompt_of(group, cycle) for group in range(b * cycle, (b + 1) * cycle)] for b in range(3)
    ]
    assert blocks[0] == blocks[1] == blocks[2] == list(range(cycle))
    argv = ["--topology", "t.json", "--out", "out", "--prompt-cycle"]
    assert build_parser().parse_args([*argv, "16"]).prompt_cycle == 16
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "0"])
