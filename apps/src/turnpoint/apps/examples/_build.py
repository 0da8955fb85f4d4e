"""Build participant runtimes for ``turnpoint serve``: an example Gym server, or your own
participant named ``module:attribute``."""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from turnpoint.participant_sdk import (
    Agent,
    ParticipantRuntime,
    PolicyModel,
    ResourcesServer,
    RuntimeConfig,
    SnapshotStore,
)
from turnpoint.participant_sdk.testing import StoreFaults


@dataclass(frozen=True)
class ExampleSpec:
    """What an example participant needs beyond its kind: peers and files."""

    instance: str
    # A directory or a storage URL (docs/spec.md section 8.12).
    root: Path | str
    # What an agent presents to its policy and resources: the data-plane credential when
    # the deployment has one (docs/spec.md section 10.2).
    token: str | None = None
    policy_address: str | None = None
    # The policy's OpenAI endpoint (http://host:port/v1): what an opaque agent's relay
    # forwards to; on a model, whether to serve one (docs/spec.md section 12).
    policy_openai: str | None = None
    openai_port: int | None = None
    resources: dict[str, str] = field(default_factory=dict)
    group_size: int = 4
    verifier_log: Path | None = None
    # The policy appends every generation it streams here (the demo's token audit).
    generation_log: Path | None = None
    seed: int = 0
    # A model that takes no generation before the trainer's first weights (a
    # replacement healed in place, docs/spec.md section 7.15).
    await_weights: bool = False
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
    # Serve RestoreRunning (docs/spec.md section 4.16); off, it must be fresh to restore.
    restore_running: bool = True
    # The coding environment's sandboxes and their snapshots (docs/spec.md section 5.7.5);
    # None: ``<root>/sandboxes/<instance>`` when the snapshot root is a directory.
    sandbox_root: Path | None = None

    def sandboxes(self) -> Path:
        """Where this participant's sandboxes and their snapshots live."""
        if self.sandbox_root is not None:
            return self.sandbox_root
        if isinstance(self.root, Path) or "://" not in self.root:
            return Path(self.root) / "sandboxes" / self.instance
        raise ValueError(
            "sandboxes live on this machine, but the snapshot root is a storage URL: "
            "give --sandbox-root DIR"
        )


EXAMPLES: dict[str, tuple[str, ...]] = {
    "model": ("tiny-policy",),
    "resources": ("guess", "guess-group", "counter", "blackjack", "workplace", "coding"),
    "agent": ("guess", "play", "opaque"),
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
    config = RuntimeConfig(
        default_lease_s=spec.lease_s,
        restore_running=spec.restore_running,
        await_weights=spec.await_weights,
    )
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
    if kind == "resources" and example == "coding":
        from turnpoint.apps.examples._coding import CodingTools

        coding = CodingTools.on_disk(
            spec.sandboxes(), spec.instance, VerifierLog(spec.verifier_log)
        )
        closers.append(coding.aclose)
        runtime = ParticipantRuntime(spec.instance, store, resources=coding, config=config)
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
            cut_generations=spec.cut_generations,
        )
        closers.append(player.aclose)
        return ParticipantRuntime(spec.instance, store, agent=player, config=config), closers
    if kind == "agent" and example == "opaque":
        if not spec.policy_openai or not spec.resources:
            raise ValueError(
                "the opaque agent needs --policy-openai URL (the policy's OpenAI endpoint) "
                "and --resources ENV=ADDRESS (one per environment it serves)"
            )
        from turnpoint.apps.examples._opaque_guess import OpaqueGuessAgent

        opaque = OpaqueGuessAgent(
            spec.policy_openai, spec.resources, spec.token, temperature=spec.temperature
        )
        closers.append(opaque.aclose)
        return ParticipantRuntime(spec.instance, store, agent=opaque, config=config), closers
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


Participant = Agent | ResourcesServer | PolicyModel
_KINDS = (Agent, ResourcesServer, PolicyModel)


class ParticipantReferenceError(ValueError):
    """``module:attribute`` does not name a participant ``turnpoint serve`` can host."""


def load_participant(reference: str) -> Participant:
    """The participant ``module:attribute`` names: an instance of :class:`Agent`,
    :class:`ResourcesServer` or :class:`PolicyModel`, a class of one (constructed
    without arguments) or a function returning one (called without arguments).

    The current directory is searched first, as ``python -m`` does, so a module next to
    where the command runs is found.
    """
    module_name, sep, attribute = reference.partition(":")
    if not sep or not module_name or not attribute:
        raise ParticipantReferenceError(
            f"a participant is named module:attribute (for example my_env:Dealer), "
            f"got {reference!r}"
        )
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ParticipantReferenceError(f"cannot import {module_name!r}: {error}") from None
    found: object = module
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise ParticipantReferenceError(f"module {module_name!r} has no {attribute!r}")
        found = getattr(found, part)
    if isinstance(found, _KINDS):
        return found
    if inspect.isclass(found) and not issubclass(found, _KINDS):
        raise ParticipantReferenceError(_not_a_participant(reference, found))
    if not callable(found):
        raise ParticipantReferenceError(_not_a_participant(reference, found))
    # Your constructor's own errors surface as they are, traceback and all.
    made = found()
    if not isinstance(made, _KINDS):
        raise ParticipantReferenceError(_not_a_participant(reference, made))
    return made


def _not_a_participant(reference: str, found: object) -> str:
    return (
        f"{reference} is {found!r}: not an Agent, ResourcesServer or PolicyModel (from "
        "turnpoint.participant_sdk), nor a class or function that makes one"
    )


def kind_of(participant: Participant) -> str:
    """The kind ``turnpoint serve`` reports for a participant: agent, resources or model."""
    if isinstance(participant, Agent):
        return "agent"
    if isinstance(participant, ResourcesServer):
        return "resources"
    return "model"


def build_participant(
    participant: Participant, spec: ExampleSpec
) -> tuple[ParticipantRuntime, list[Callable[[], Awaitable[None]]]]:
    """Your own participant as a runtime, plus what to close after it (its ``aclose``)."""
    store = SnapshotStore(
        spec.root, faults=StoreFaults.from_spec(spec.faults) if spec.faults else None
    )
    config = RuntimeConfig(
        default_lease_s=spec.lease_s,
        restore_running=spec.restore_running,
        await_weights=spec.await_weights,
    )
    if isinstance(participant, Agent):
        runtime = ParticipantRuntime(spec.instance, store, agent=participant, config=config)
    elif isinstance(participant, ResourcesServer):
        runtime = ParticipantRuntime(spec.instance, store, resources=participant, config=config)
    else:
        runtime = ParticipantRuntime(spec.instance, store, model=participant, config=config)
    closers: list[Callable[[], Awaitable[None]]] = []
    aclose = getattr(participant, "aclose", None)
    if aclose is not None and inspect.iscoroutinefunction(aclose):
        closers.append(aclose)
    return runtime, closers
