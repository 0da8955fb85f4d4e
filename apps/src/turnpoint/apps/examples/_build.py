"""Build the example Gym servers as participant runtimes (what ``turnpoint serve`` runs)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from turnpoint.participant_sdk import ParticipantRuntime, RuntimeConfig, SnapshotStore
from turnpoint.participant_sdk.testing import StoreFaults


@dataclass(frozen=True)
class ExampleSpec:
    """What an example participant needs beyond its kind: peers and files."""

    instance: str
    # A directory or a storage URL (docs/spec.md section 8.12).
    root: Path | str
    token: str | None = None
    policy_address: str | None = None
    resources: dict[str, str] = field(default_factory=dict)
    group_size: int = 4
    verifier_log: Path | None = None
    # The policy appends every generation it streams here (the demo's token audit).
    generation_log: Path | None = None
    seed: int = 0
    faults: str = ""
    lease_s: float = 60.0
    temperature: float = 1.0
    turn_delay_s: float = 0.0
    # docs/spec.md section 5.5: the policy's time per token, and agents that let the
    # policy cut their generations at a checkpoint.
    token_delay_s: float = 0.0
    cut_generations: bool = False
    # Testing: the guess servers hold every tool call until this file exists.
    hold_calls_until: Path | None = None


EXAMPLES: dict[str, tuple[str, ...]] = {
    "model": ("tiny-policy",),
    "resources": ("guess", "guess-group", "counter", "blackjack", "workplace"),
    "agent": ("guess", "play"),
}


def build_example(
    kind: str, example: str, spec: ExampleSpec
) -> tuple[ParticipantRuntime, list[Callable[[], Awaitable[None]]]]:
    """One of the example participants as a runtime, plus what to close after it."""
    if spec.hold_calls_until is not None and not (
        kind == "resources" and example in ("guess", "guess-group")
    ):
        raise ValueError("only the guess and guess-group resources servers hold their calls")
    # Imported here: the examples pull in torch, which `turnpoint serve --help` should not.
    from turnpoint.apps.examples._participants import (
        FileGate,
        GroupGuessTools,
        GuessAgent,
        GuessTools,
        PlayAgent,
        TinyPolicyServer,
        VerifierLog,
        new_policy,
    )

    store = SnapshotStore(
        spec.root, faults=StoreFaults.from_spec(spec.faults) if spec.faults else None
    )
    config = RuntimeConfig(default_lease_s=spec.lease_s)
    closers: list[Callable[[], Awaitable[None]]] = []
    if kind == "model" and example == "tiny-policy":
        model = TinyPolicyServer(
            new_policy(spec.seed),
            token_delay_s=spec.token_delay_s,
            # Flushed, not fsynced: one line per generation must not stall the stream.
            log=VerifierLog(spec.generation_log, fsync=False),
            name=spec.instance,
        )
        return ParticipantRuntime(spec.instance, store, model=model, config=config), closers
    if kind == "resources" and example in ("guess", "guess-group"):
        log = VerifierLog(spec.verifier_log)
        hold = FileGate(spec.hold_calls_until) if spec.hold_calls_until is not None else None
        resources = (
            GuessTools(spec.instance, log, hold=hold)
            if example == "guess"
            else GroupGuessTools(spec.instance, log, group_size=spec.group_size, hold=hold)
        )
        runtime = ParticipantRuntime(spec.instance, store, resources=resources, config=config)
        return runtime, closers
    if kind == "resources" and example in ("counter", "blackjack", "workplace"):
        from turnpoint.apps.examples._environments import build_environment

        served = build_environment(example, spec.instance, VerifierLog(spec.verifier_log))
        runtime = ParticipantRuntime(spec.instance, store, resources=served, config=config)
        return runtime, closers
    if kind == "agent" and example == "play":
        if not spec.policy_address or not spec.resources:
            raise ValueError(
                "the play agent needs --policy ADDRESS and --resources ENV=ADDRESS "
                "(one per environment it serves: counter, blackjack, workplace)"
            )
        player = PlayAgent(
            spec.policy_address,
            spec.resources,
            spec.token,
            temperature=spec.temperature,
            turn_delay_s=spec.turn_delay_s,
        )
        closers.append(player.aclose)
        return ParticipantRuntime(spec.instance, store, agent=player, config=config), closers
    if kind == "agent" and example == "guess":
        if not spec.policy_address or not spec.resources:
            raise ValueError(
                "the guess agent needs --policy ADDRESS and --resources ENV=ADDRESS "
                "(one per environment it serves)"
            )
        agent = GuessAgent(
            spec.policy_address,
            spec.resources,
            spec.token,
            temperature=spec.temperature,
            turn_delay_s=spec.turn_delay_s,
            cut_generations=spec.cut_generations,
        )
        closers.append(agent.aclose)
        return ParticipantRuntime(spec.instance, store, agent=agent, config=config), closers
    known = ", ".join(EXAMPLES.get(kind, ()))
    raise ValueError(f"no example {example!r} for kind {kind!r}; choose one of: {known}")
