"""Trainer anchor: torch distributed checkpoint in one process, digest-checked."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from turnpoint.trainer import AnchorError
from turnpoint.trainer.advanced import AnchorWriter, load_anchor, save_anchor
from turnpoint.trainer.storage.layout import tree_digest
from turnpoint.trainer.storage.manifest import ANCHOR_DIR, AnchorRef

# Single-process DCP says it assumes a single process; that is what we ask of it.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(5, 4)).pow(2).sum().backward()
        optimizer.step()
    return model, optimizer


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    return _trained(seed=99)


def _snapshot_of(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
    params = {name: value.detach().clone() for name, value in model.state_dict().items()}
    state = {
        index: {key: value.clone() for key, value in entry.items()}
        for index, entry in optimizer.state_dict()["state"].items()
    }
    return params, state


def _assert_restored(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    expected: tuple[dict[str, torch.Tensor], dict[int, dict[str, torch.Tensor]]],
) -> None:
    params, state = _snapshot_of(model, optimizer)
    assert params.keys() == expected[0].keys()
    for name in params:
        assert torch.equal(params[name], expected[0][name]), name
    assert state.keys() == expected[1].keys()
    for index in state:
        for key in state[index]:
            assert torch.equal(state[index][key], expected[1][index][key]), (index, key)


def test_save_perturb_load_restores_everything(tmp_path: Path) -> None:
    model, optimizer = _trained(seed=1)
    saved = _snapshot_of(model, optimizer)
    ref = save_anchor(tmp_path, model, optimizer, step=41, data_loader={"epoch": 2, "index": 7})
    assert ref.path == ANCHOR_DIR
    assert ref.sha256 == tree_digest(tmp_path / ANCHOR_DIR)

    # Train on: the live model and optimizer drift away from the anchor.
    optimizer.zero_grad()
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)

    state = load_anchor(tmp_path, model, optimizer, expected=ref)
    assert state.step == 41
    assert state.data_loader == {"epoch": 2, "index": 7}
    _assert_restored(model, optimizer, saved)


def test_load_into_a_fresh_model_and_optimizer(tmp_path: Path) -> None:
    model, optimizer = _trained(seed=1)
    saved = _snapshot_of(model, optimizer)
    ref = save_anchor(tmp_path, model, optimizer, step=3)
    new_model, new_optimizer = _fresh()
    state = load_anchor(tmp_path, new_model, new_optimizer, expected=ref)
    assert state.step == 3
    assert state.data_loader is None
    _assert_restored(new_model, new_optimizer, saved)


def test_async_save_captures_state_at_start(tmp_path: Path) -> None:
    model, optimizer = _trained(seed=2)
    saved = _snapshot_of(model, optimizer)
    writer = AnchorWriter()
    assert not writer.pending
    writer.start(tmp_path, model, optimizer, step=5, data_loader=[1, 2])
    # Mutating right after start() must not reach the anchor: start() copied the state.
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(-3.0)
    # A second save must not start while the first is pending.
    with pytest.raises(RuntimeError, match="still pending"):
        writer.start(tmp_path / "other", model, optimizer, step=6)
    ref = writer.wait()
    assert writer.done()
    with pytest.raises(RuntimeError, match="no anchor save is pending"):
        writer.wait()
    new_model, new_optimizer = _fresh()
    state = load_anchor(tmp_path, new_model, new_optimizer, expected=ref)
    assert (state.step, state.data_loader) == (5, [1, 2])
    _assert_restored(new_model, new_optimizer, saved)


async def test_wait_async(tmp_path: Path) -> None:
    model, optimizer = _trained(seed=3)
    writer = AnchorWriter()
    writer.start(tmp_path, model, optimizer, step=1)
    ref = await writer.wait_async()
    assert ref.sha256 == await asyncio.to_thread(tree_digest, tmp_path / ANCHOR_DIR)


def test_model_only_anchor(tmp_path: Path) -> None:
    model, _ = _trained(seed=4)
    expected = {name: value.clone() for name, value in model.state_dict().items()}
    ref = save_anchor(tmp_path, model, None, step=0)
    new_model, _ = _fresh()
    load_anchor(tmp_path, new_model, None, expected=ref)
    for name, value in new_model.state_dict().items():
        assert torch.equal(value, expected[name])
    # An anchor without optimizer state cannot restore an optimizer.
    with pytest.raises(AnchorError, match="cannot load the trainer anchor"):
        load_anchor(tmp_path, *_fresh(), expected=ref)


def test_missing_anchor(tmp_path: Path) -> None:
    with pytest.raises(AnchorError, match="no trainer anchor in"):
        load_anchor(tmp_path, *_fresh())


def test_corrupt_anchor_is_caught_by_digest(tmp_path: Path) -> None:
    model, optimizer = _trained(seed=5)
    ref = save_anchor(tmp_path, model, optimizer, step=1)
    data_file = next(p for p in (tmp_path / ANCHOR_DIR).iterdir() if p.suffix == ".distcp")
    raw = bytearray(data_file.read_bytes())
    raw[-10] ^= 0xFF
    data_file.write_bytes(bytes(raw))
    new_model, new_optimizer = _fresh()
    before = _snapshot_of(new_model, new_optimizer)
    with pytest.raises(AnchorError, match="is corrupt: digest") as caught:
        load_anchor(tmp_path, new_model, new_optimizer, expected=ref)
    assert caught.value.path == str(tmp_path / ANCHOR_DIR)
    # Nothing was installed from the corrupt anchor.
    _assert_restored(new_model, new_optimizer, before)


def test_truncated_anchor_without_digest_still_fails_clearly(tmp_path: Path) -> None:
    model, optimizer = _trained(seed=6)
    save_anchor(tmp_path, model, optimizer, step=1)
    for path in (tmp_path / ANCHOR_DIR).iterdir():
        if path.suffix == ".distcp":
            path.write_bytes(b"")
    with pytest.raises(AnchorError, match="cannot load the trainer anchor"):
        load_anchor(tmp_path, *_fresh())


def test_anchor_of_another_architecture(tmp_path: Path) -> None:
    model, optimizer = _trained(seed=7)
    ref = save_anchor(tmp_path, model, optimizer, step=1)
    other = torch.nn.Linear(3, 3)
    with pytest.raises(AnchorError, match="cannot load the trainer anchor"):
        load_anchor(tmp_path, other, torch.optim.SGD(other.parameters(), lr=0.1), expected=ref)


def test_anchor_is_never_rewritten(tmp_path: Path) -> None:
    model, optimizer = _trained(seed=8)
    save_anchor(tmp_path, model, optimizer, step=1)
    with pytest.raises(AnchorError, match="already holds an anchor"):
        save_anchor(tmp_path, model, optimizer, step=2)


def test_bad_trainer_values(tmp_path: Path) -> None:
    model, optimizer = _trained(seed=9)
    with pytest.raises(ValueError, match="step must be"):
        save_anchor(tmp_path, model, optimizer, step=-1)
    with pytest.raises(ValueError, match="plain JSON"):
        save_anchor(tmp_path, model, optimizer, step=1, data_loader={"x": float("nan")})


def test_digest_mismatch_with_wrong_reference(tmp_path: Path) -> None:
    model, optimizer = _trained(seed=10)
    save_anchor(tmp_path, model, optimizer, step=1)
    with pytest.raises(AnchorError, match="is corrupt"):
        load_anchor(tmp_path, *_fresh(), expected=AnchorRef(sha256="0" * 64))


def test_the_distributed_anchor_needs_a_process_group() -> None:
    # Across ranks: tests/e2e/test_multirank_anchor.py (real processes on gloo).
    from turnpoint.trainer import DistributedAnchor

    model, optimizer = _fresh()
    with pytest.raises(RuntimeError, match="init"):
        DistributedAnchor(model, optimizer, step=lambda: 0)


def test_an_anchor_costs_one_fsync_per_file_and_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DCP syncs its own files unless told not to; the writer syncs the tree after, so
    each file and directory of the anchor is synced exactly once (spec 7.4, step 1)."""
    synced: list[int] = []
    real_fsync = os.fsync

    def counting(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting)
    model, optimizer = _trained(seed=3)
    save_anchor(tmp_path, model, optimizer, step=1)
    directories = [path for path in (tmp_path / ANCHOR_DIR).rglob("*") if path.is_dir()]
    files = [path for path in (tmp_path / ANCHOR_DIR).rglob("*") if path.is_file()]
    assert files
    assert len(synced) == len(files) + len(directories) + 1


def test_a_save_and_a_load_print_no_single_process_warning(tmp_path: Path) -> None:
    # DCP warns on every save and load without a process group, one of them from its
    # save thread; the anchor is single-process by design, so a trainer's log must not
    # carry the line every snapshot. A process of its own: what a user's stderr shows.
    script = f"""
import torch
from turnpoint.trainer.advanced import AnchorWriter, load_anchor
model = torch.nn.Linear(2, 2)
writer = AnchorWriter()
writer.start({str(tmp_path)!r}, model, None, step=1)
writer.wait()
load_anchor({str(tmp_path)!r}, model, None)
print("saved and loaded")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "saved and loaded"
    assert "torch.distributed is disabled" not in done.stderr, done.stderr
