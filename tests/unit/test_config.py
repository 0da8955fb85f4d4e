"""CoordinatorConfig: typed, strict, and every error says what to change."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pydantic
import pytest

from turnpoint.ids import EpisodeId
from turnpoint.trainer import ConfigError, CoordinatorConfig, Rollout, RolloutClientSettings
from turnpoint.trainer.config import ConfigSection
from turnpoint.trainer.rollouts.attempts import Attempt
from turnpoint.trainer.rollouts.run_stream import run_request
from turnpoint.v1 import types_pb2


def test_defaults_follow_the_protocol(tmp_path: Path) -> None:
    config = CoordinatorConfig(snapshot_root=tmp_path)
    assert config.control_timeout_s == 60.0
    assert config.reply_grace_s == 5.0
    assert config.renew_interval_s == 10.0
    assert config.lease_s > 2 * config.renew_interval_s
    assert config.prepare_timeout_s == 60.0
    assert config.max_consecutive_failures == 3
    assert config.keep_snapshots == 2
    assert config.target_level == "turn"
    assert config.resume_attempts == 2
    assert config.resume_retry_pause_s == 1.0
    assert config.rollout_budget_s is None
    assert config.weights_change == "keep"
    assert config.snapshot_root == tmp_path


def test_derived_defaults_follow_the_timeout_given(tmp_path: Path) -> None:
    config = CoordinatorConfig.from_mapping(
        {"snapshot_root": str(tmp_path), "control_timeout_s": 3}
    )
    assert config.reply_grace_s == 3.0  # min(timeout, 5)
    assert config.renew_interval_s == 1.0  # min(timeout / 3, 10)
    assert config.lease_s == 3.0
    assert config.prepare_timeout_s == 3.0


def test_explicit_values_beat_derived_defaults(tmp_path: Path) -> None:
    config = CoordinatorConfig.from_mapping(
        {
            "snapshot_root": str(tmp_path),
            "control_timeout_s": 3,
            "reply_grace_s": 0.5,
            "renew_interval_s": 0.25,
            "lease_s": 2.0,
            "prepare_timeout_s": 9.0,
        }
    )
    assert (config.reply_grace_s, config.renew_interval_s, config.lease_s) == (0.5, 0.25, 2.0)
    assert config.prepare_timeout_s == 9.0


def test_unknown_key_names_the_nearest_valid_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        CoordinatorConfig.from_mapping({"snapshot_root": str(tmp_path), "snapshot_intervl": 5})
    assert str(caught.value) == (
        "unknown key 'snapshot_intervl': did you mean 'snapshot_interval_s'?"
    )
    (problem,) = caught.value.problems
    assert problem.path == "snapshot_intervl"
    assert problem.suggestion == "snapshot_interval_s"


def test_unknown_key_without_near_match_lists_the_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'zzz'; valid keys here: .*lease_s"):
        CoordinatorConfig(snapshot_root=tmp_path, zzz=1)  # type: ignore[call-arg]


def test_direct_construction_raises_config_error_not_pydantic() -> None:
    with pytest.raises(ConfigError, match="missing required key 'snapshot_root'"):
        CoordinatorConfig()  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="did you mean 'keep_snapshots'"):
        CoordinatorConfig.model_validate({"snapshot_root": "x", "keep_snapshot": 3})


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        CoordinatorConfig.from_mapping(
            {
                "snapshot_root": str(tmp_path),
                "keep_snapshots": 0,
                "lease_sec": 1,
                "max_consecutive_failures": True,
            }
        )
    assert set(caught.value.keys) == {"keep_snapshots", "lease_sec", "max_consecutive_failures"}
    text = str(caught.value)
    assert "3 configuration problems" in text
    assert "keep_snapshots: Input should be greater than or equal to 1 (got 0)" in text
    assert "did you mean 'lease_s'" in text


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (
            {"lease_s": 20.0},
            r"lease_s \(20\) must exceed 2 \* renew_interval_s \(20\).*raise lease_s",
        ),
        ({"reply_grace_s": 61.0}, r"reply_grace_s \(61\) must not exceed control_timeout_s \(60\)"),
        (
            {"control_timeout_s": 5.0, "renew_interval_s": 6.0, "lease_s": 100.0},
            r"renew_interval_s \(6\) must not exceed control_timeout_s \(5\)",
        ),
        ({"keep_snapshots": 0}, r"keep_snapshots: Input should be greater than or equal to 1"),
        (
            {"target_level": "episode"},
            r"target_level: Input should be 'token', 'turn', 'sibling' or",
        ),
        ({"control_timeout_s": float("inf")}, r"control_timeout_s: Input should be a finite"),
        ({"control_timeout_s": "60"}, r"control_timeout_s: Input should be a valid number"),
        ({"rollout_budget_s": 0}, r"rollout_budget_s: Input should be greater than 0"),
        ({"weights_change": "Rerun"}, r"weights_change: Input should be 'keep' or 'rerun'"),
        ({"weights_change": None}, r"weights_change: Input should be 'keep' or 'rerun'"),
    ],
)
def test_rules_say_what_to_change(
    tmp_path: Path, settings: dict[str, object], expected: str
) -> None:
    with pytest.raises(ConfigError, match=expected):
        CoordinatorConfig.from_mapping({"snapshot_root": str(tmp_path), **settings})


def test_weights_change_reaches_every_run_as_the_wire_value(tmp_path: Path) -> None:
    """docs/spec.md section 5.5 item 7: the config decides; the rollout client sends it."""
    config = CoordinatorConfig.from_mapping(
        {"snapshot_root": str(tmp_path), "weights_change": "rerun"}
    )
    assert config.weights_change == "rerun"
    settings = RolloutClientSettings(weights_change=config.weights_change)
    spec = Rollout("r-1", "g-1", 0, 1, "env", {"x": 1}, "agent-0")
    attempt = Attempt(spec, EpisodeId("r-1", 0), "agent-0", budget_s=None, request_id="run-1")
    assert run_request(attempt, None, settings.weights_change).weights_change == (
        types_pb2.WEIGHTS_CHANGE_RERUN
    )
    assert run_request(attempt, None, "keep").weights_change == types_pb2.WEIGHTS_CHANGE_KEEP
    # A client built without a config leaves it unset: the agent's own setting applies.
    assert run_request(attempt).weights_change == types_pb2.WEIGHTS_CHANGE_UNSPECIFIED
    with pytest.raises(ValueError, match="weights_change"):
        RolloutClientSettings(weights_change="sometimes")  # type: ignore[arg-type]


def test_config_is_frozen(tmp_path: Path) -> None:
    config = CoordinatorConfig(snapshot_root=tmp_path)
    with pytest.raises(pydantic.ValidationError):
        config.lease_s = 1.0


class _Retention(ConfigSection):
    keep: int = 2
    max_age_s: float = 10.0

    def _rule_violations(self) -> list[str]:
        if self.keep > 5:
            return [f"keep ({self.keep}) must be at most 5: lower keep"]
        return []


class _Outer(ConfigSection):
    name: str = "x"
    retention: _Retention = _Retention()
    optional_retention: _Retention | None = None


def test_nested_unknown_key_names_full_path() -> None:
    with pytest.raises(ConfigError) as caught:
        _Outer.model_validate({"retention": {"max_age": 3}})
    assert str(caught.value) == (
        "unknown key 'retention.max_age': did you mean 'retention.max_age_s'?"
    )
    with pytest.raises(ConfigError, match=r"did you mean 'optional_retention\.keep'"):
        _Outer.model_validate({"optional_retention": {"kep": 3}})


def test_nested_rule_names_its_section() -> None:
    with pytest.raises(ConfigError) as caught:
        _Outer.model_validate({"retention": {"keep": 9}})
    assert str(caught.value) == "in 'retention': keep (9) must be at most 5: lower keep"
    # The section alone reports the same rule without a path.
    with pytest.raises(ConfigError, match=r"^keep \(9\) must be at most 5"):
        _Retention(keep=9)


def test_from_json_file_resolves_relative_root(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.json"
    path.write_text(json.dumps({"snapshot_root": "snaps", "keep_snapshots": 4}))
    config = CoordinatorConfig.from_file(path)
    assert config.snapshot_root == tmp_path / "snaps"
    assert config.keep_snapshots == 4


def test_from_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.toml"
    path.write_text(
        f'snapshot_root = "{tmp_path / "abs"}"\ntarget_level = "sibling"\nresume_attempts = 3\n'
    )
    config = CoordinatorConfig.from_file(path)
    assert config.snapshot_root == tmp_path / "abs"
    assert config.target_level == "sibling"
    assert config.resume_attempts == 3


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('snapshot_root = "s"\nsnapshot_intervl = 3\n')
    with pytest.raises(ConfigError) as caught:
        CoordinatorConfig.from_file(path)
    assert str(caught.value) == (
        f"{path}: unknown key 'snapshot_intervl': did you mean 'snapshot_interval_s'?"
    )
    assert caught.value.source == str(path)


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("c.toml", "snapshot_root = ", "invalid TOML"),
        ("c.json", "{", "invalid JSON"),
        ("c.json", '{"keep_snapshots": 1, "keep_snapshots": 2}', "'keep_snapshots' appears twice"),
        ("c.json", "[1]", "top level must be an object"),
        ("c.yaml", "a: 1", "unsupported file type '.yaml'"),
    ],
)
def test_bad_files(tmp_path: Path, name: str, text: str, expected: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=expected):
        CoordinatorConfig.from_file(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        CoordinatorConfig.from_file(tmp_path / "absent.toml")


def test_config_error_pickles() -> None:
    with pytest.raises(ConfigError) as caught:
        CoordinatorConfig.from_mapping({"snapshot_root": "x", "lease": 1})
    copy = pickle.loads(pickle.dumps(caught.value))
    assert str(copy) == str(caught.value)
    assert copy.problems == caught.value.problems
