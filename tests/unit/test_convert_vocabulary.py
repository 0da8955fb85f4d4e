"""The protocol vocabulary converts in the core, both ways, for servers and trainer alike."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from turnpoint import convert
from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId
from turnpoint.protocol import (
    ArtifactRef,
    Blocker,
    CompletionReceipt,
    EpisodeState,
    Fence,
    Phase,
    ReadinessReport,
    RecoveryLevel,
)
from turnpoint.server import _convert as server_convert
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import types_pb2

EPISODE = EpisodeId("r1", 2)
RECEIPT = CompletionReceipt(EPISODE, "rcpt-1")
ARTIFACT = ArtifactRef("agent-0/records-" + "ab" * 32 + ".jsonl", "ab" * 32, 10, 2)


def test_enums_map_by_name_both_ways() -> None:
    number = convert.enum_to_proto(types_pb2.Phase, Phase.PREPARED)
    assert number == types_pb2.PHASE_PREPARED
    assert convert.enum_from_proto(types_pb2.Phase, Phase, number, "phase") is Phase.PREPARED
    assert convert.enum_from_proto(types_pb2.RecoveryLevel, RecoveryLevel, 0, "level") is None


def test_an_unknown_enum_value_is_invalid_argument() -> None:
    with pytest.raises(TurnpointError) as caught:
        convert.enum_from_proto(types_pb2.Phase, Phase, 999, "phase")
    assert caught.value.reason is Reason.INVALID_ARGUMENT


def test_fence_round_trip_and_an_absent_fence() -> None:
    fence = Fence("coord-1", 7)
    message = convert.fence_to_proto(fence)
    assert convert.fence_from_proto(message, present=True) == fence
    assert convert.fence_from_proto(types_pb2.Fence(), present=False) == Fence("", 0)


def test_receipt_and_artifact_round_trip() -> None:
    assert convert.receipt_from_proto(convert.receipt_to_proto(RECEIPT)) == RECEIPT
    assert convert.artifact_from_proto(convert.artifact_to_proto(ARTIFACT)) == ARTIFACT
    assert convert.artifacts_from_proto([convert.artifact_to_proto(ARTIFACT)]) == [ARTIFACT]


def test_a_bad_artifact_is_invalid_argument() -> None:
    message = convert.artifact_to_proto(ARTIFACT)
    message.path = "../escape"
    with pytest.raises(TurnpointError) as caught:
        convert.artifact_from_proto(message)
    assert caught.value.reason is Reason.INVALID_ARGUMENT


def test_readiness_round_trip() -> None:
    report = ReadinessReport(
        ready=False,
        blocker_count=3,
        blockers=(
            Blocker(EPISODE, EpisodeState.COMPLETED_UNACKED, RECEIPT, "waiting for ack"),
            Blocker(EpisodeId("r2", 0), EpisodeState.RUNNING),
        ),
        counts=MappingProxyType({EpisodeState.RUNNING: 1, EpisodeState.COMPLETED_UNACKED: 1}),
        restarts=(EpisodeId("r3", 1),),
    )
    assert convert.readiness_from_proto(convert.readiness_to_proto(report)) == report


def test_the_servicers_convert_the_vocabulary_with_the_core_conversions() -> None:
    # One conversion table, shared with the trainer: the servicers use the core's
    # functions themselves and the server keeps no copy (or re-export) of its own.
    from turnpoint.server import _control, _data

    for module, names in (
        (
            _control,
            (
                "artifact_from_proto",
                "artifact_to_proto",
                "artifacts_from_proto",
                "enum_to_proto",
                "fence_from_proto",
                "readiness_to_proto",
            ),
        ),
        (_data, ("enum_from_proto", "enum_to_proto", "receipt_from_proto", "receipt_to_proto")),
    ):
        for name in names:
            assert getattr(module, name) is getattr(convert, name)
            assert not hasattr(server_convert, name)


def test_episodes_added_in_place_are_the_ones_built_one_by_one_in_order() -> None:
    episodes = [EpisodeId("b", 2), EpisodeId("a", 0), EpisodeId("a.b_c-1", 7)]
    added = pb.CommitResponse()
    convert.add_episodes(added.exported, episodes)
    built = pb.CommitResponse(exported=[convert.episode_to_proto(e) for e in episodes])
    assert added == built
    assert convert.episodes_from_proto(added.exported, "exported", 10) == episodes
