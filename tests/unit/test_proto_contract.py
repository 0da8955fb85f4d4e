"""The turnpoint.v1 contract: every service and RPC present, lint clean, breaking guarded."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor

from turnpoint.v1 import (
    checkpoint_control_service_pb2,
    policy_service_pb2,
    resources_service_pb2,
    rollout_service_pb2,
)

ROOT = Path(__file__).resolve().parents[2]

EXPECTED = {
    "turnpoint.v1.CheckpointControlService": (
        checkpoint_control_service_pb2,
        {
            "Describe": (False, False),
            "Prepare": (False, False),
            "Renew": (False, False),
            "Commit": (False, False),
            "Resume": (False, False),
            "Restore": (False, False),
            "RestoreRunning": (False, False),
            "Retire": (False, False),
            "Forget": (False, False),
            "GetStatus": (False, False),
            "WatchBoundaries": (False, True),
            "ControlSession": (True, True),
        },
    ),
    "turnpoint.v1.RolloutService": (
        rollout_service_pb2,
        {"Run": (False, True), "Acknowledge": (False, False)},
    ),
    "turnpoint.v1.PolicyService": (
        policy_service_pb2,
        {"Generate": (False, True), "UpdateWeights": (False, False)},
    ),
    "turnpoint.v1.ResourcesService": (
        resources_service_pb2,
        {
            "SeedSession": (False, False),
            "Call": (False, False),
            "Verify": (False, False),
            "CloseSession": (False, False),
        },
    ),
}

MUTATING = {
    "Prepare",
    "Renew",
    "Commit",
    "Resume",
    "Restore",
    "RestoreRunning",
    "Retire",
    "Forget",
    "Run",
    "Acknowledge",
    "Generate",
    "UpdateWeights",
    "SeedSession",
    "Call",
    "Verify",
    "CloseSession",
}


def _buf() -> str:
    local = Path(sys.executable).parent / "buf"
    found = str(local) if local.exists() else shutil.which("buf")
    assert found, "the buf CLI comes with the dev extra (buf-bin)"
    return found


@pytest.mark.parametrize("service_name", sorted(EXPECTED))
def test_service_has_every_rpc_with_its_streaming_shape(service_name: str) -> None:
    module, rpcs = EXPECTED[service_name]
    service = module.DESCRIPTOR.services_by_name[service_name.rsplit(".", 1)[1]]
    found = {m.name: (m.client_streaming, m.server_streaming) for m in service.methods}
    assert found == rpcs


def test_every_mutating_request_has_a_request_id() -> None:
    for module, _ in EXPECTED.values():
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                if method.name in MUTATING:
                    assert "request_id" in method.input_type.fields_by_name, method.full_name


def test_every_response_carries_a_header() -> None:
    for module, _ in EXPECTED.values():
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                if method.name == "ControlSession":
                    continue  # its responses wrap the unary responses, which carry it
                field = method.output_type.fields_by_name.get("header")
                assert field is not None, method.full_name
                assert field.message_type.full_name == "turnpoint.v1.ResponseHeader"


def test_control_session_carries_every_unary_control_operation() -> None:
    file = checkpoint_control_service_pb2.DESCRIPTOR
    service = file.services_by_name["CheckpointControlService"]
    unary = {
        m.input_type.full_name: m.output_type.full_name
        for m in service.methods
        if not m.client_streaming and not m.server_streaming
    }
    request = file.message_types_by_name["ControlSessionRequest"]
    response = file.message_types_by_name["ControlSessionResponse"]
    carried_requests = {
        f.message_type.full_name
        for f in request.oneofs_by_name["operation"].fields
        if f.type == descriptor.FieldDescriptor.TYPE_MESSAGE
    }
    carried_responses = {f.message_type.full_name for f in response.oneofs_by_name["result"].fields}
    # Every unary operation, plus the cancel of one sent earlier (docs/spec.md 3.2 item 9).
    assert carried_requests == set(unary) | {"turnpoint.v1.ControlSessionCancel"}
    assert set(unary.values()) <= carried_responses
    assert "turnpoint.v1.ControlError" in carried_responses


def test_buf_lint_and_format_are_clean() -> None:
    lint = subprocess.run([_buf(), "lint"], cwd=ROOT, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = subprocess.run(
        [_buf(), "format", "--diff", "--exit-code"], cwd=ROOT, capture_output=True, text=True
    )
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_buf_breaking_catches_a_renumbered_field(tmp_path: Path) -> None:
    before = tmp_path / "before"
    after = tmp_path / "after"
    for target in (before, after):
        shutil.copytree(ROOT / "proto", target / "proto")
        shutil.copy(ROOT / "buf.yaml", target / "buf.yaml")
    types = after / "proto" / "turnpoint" / "v1" / "types.proto"
    text = types.read_text()
    assert "int32 attempt = 2;" in text
    types.write_text(text.replace("int32 attempt = 2;", "int32 attempt = 3;"))

    unchanged = subprocess.run(
        [_buf(), "breaking", str(before), "--against", str(before)],
        capture_output=True,
        text=True,
    )
    assert unchanged.returncode == 0, unchanged.stdout + unchanged.stderr
    broken = subprocess.run(
        [_buf(), "breaking", str(after), "--against", str(before)],
        capture_output=True,
        text=True,
    )
    assert broken.returncode != 0
    assert "attempt" in broken.stdout + broken.stderr


RELEASED = ROOT / "proto" / "released" / "turnpoint.v1.json"


def test_the_contract_is_compatible_with_the_released_baseline() -> None:
    """The committed image of the released contract, not only the previous commit, is
    what buf breaking guards: a break spread over two commits still fails."""
    check = subprocess.run(
        [_buf(), "breaking", str(ROOT), "--against", str(RELEASED)],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_released_baseline_catches_a_break_made_in_steps(tmp_path: Path) -> None:
    """A field renumbered, however many commits it took (remove it in one, add it back
    under another number in the next), fails against the released image."""
    work = tmp_path / "work"
    shutil.copytree(ROOT / "proto", work / "proto")
    shutil.copy(ROOT / "buf.yaml", work / "buf.yaml")
    types = work / "proto" / "turnpoint" / "v1" / "types.proto"
    text = types.read_text()
    types.write_text(text.replace("int32 attempt = 2;", "int32 attempt = 3;"))
    broken = subprocess.run(
        [_buf(), "breaking", str(work), "--against", str(RELEASED)],
        capture_output=True,
        text=True,
    )
    assert broken.returncode != 0
    assert "attempt" in broken.stdout + broken.stderr


def test_generated_code_is_up_to_date() -> None:
    check = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr
