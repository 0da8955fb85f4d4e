"""The torch-free trainer anchor: bytes and a step, durable, checked before install."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.fsyncs import record_fsyncs
from turnpoint.trainer import AnchorError, FileAnchorSource, file_anchor_loader


async def test_an_anchor_written_is_read_back_with_its_step(tmp_path: Path) -> None:
    state = {"step": 7, "weights": b"\x00\x01weights"}
    source = FileAnchorSource(step=lambda: state["step"], state=lambda: state["weights"])
    written = await source.write(tmp_path)
    assert written.step == 7 and source.step == 7
    state["step"], state["weights"] = 9, b"later"  # the anchor holds what was written
    installed: list[tuple[bytes, int]] = []
    load = file_anchor_loader(lambda data, step: installed.append((data, step)))
    assert load(tmp_path, written.ref) == 7
    assert installed == [(b"\x00\x01weights", 7)]


async def test_a_flipped_byte_installs_nothing(tmp_path: Path) -> None:
    written = await FileAnchorSource(step=lambda: 3, state=lambda: b"abc").write(tmp_path)
    (tmp_path / written.ref.path / "state.bin").write_bytes(b"abd")
    installed: list[int] = []
    load = file_anchor_loader(lambda _data, step: installed.append(step))
    with pytest.raises(AnchorError, match="corrupt"):
        load(tmp_path, written.ref)
    assert installed == []


async def test_a_missing_anchor_is_an_anchor_error(tmp_path: Path) -> None:
    written = await FileAnchorSource(step=lambda: 3, state=lambda: b"abc").write(tmp_path)
    with pytest.raises(AnchorError, match="cannot read"):
        file_anchor_loader(lambda _d, _s: None)(tmp_path / "elsewhere", written.ref)


async def test_state_that_is_not_bytes_is_refused(tmp_path: Path) -> None:
    source = FileAnchorSource(step=lambda: 1, state=lambda: "text")  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match="not bytes"):
        await source.write(tmp_path)


async def test_the_anchor_is_durable_before_it_is_returned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced = record_fsyncs(monkeypatch)
    written = await FileAnchorSource(step=lambda: 1, state=lambda: b"x").write(tmp_path)
    anchor = tmp_path / written.ref.path
    # Each file and the directory once (docs/spec.md section 8.8); publication syncs the
    # directories above it.
    assert sorted(synced) == sorted(
        [str(anchor / "state.bin"), str(anchor / "anchor.json"), str(anchor)]
    )
