"""The example Gym servers the tests and the demo run, written against the participant SDK.

- :class:`TinyPolicyServer` (MODEL): samples from :class:`TinyPolicy` token by token and
  takes the trainer's weight syncs.
- :class:`GuessTools` (RESOURCES, environment ``guess``): the ``check`` tool and a
  per-sibling verifier; sessions are exported, so rollouts continue at turn level.
- :class:`GroupGuessTools` (RESOURCES, environment ``guess-group``): the same tool and a
  group-scored verifier (each sibling's verify waits for all N siblings), declared
  ``REPLAY``.
- :class:`GuessAgent` (AGENT): the multi-turn episode: each turn one generation and one
  tool call, then a sealed boundary; finally a verify.
- :class:`PlayAgent` (AGENT): the same shape for the counter, Blackjack and the
  workplace (:mod:`._plays`, :mod:`._environments`).

The shape that keeps checkpoints cheap: the agent seals a boundary as soon as it accepts
an episode (turn 0), and every call it makes after a boundary (``ctx.seed``, the turn's
``ctx.generate`` and ``ctx.call``, ``ctx.verify``) is a parked call, so the episode counts
as parked at that boundary while it waits on servers that a checkpoint holds closed. Each
such call is safe to issue again after a restore: seeding is idempotent, the generation is
saved with the boundary, and a tool call or verify re-sent with its key is answered from
the session's reply record (docs/spec.md section 6.12), so the tool runs once.

The resources servers log every tool execution (``tools`` lines of their log) and the
history of executions each session applied, which the demo's audit checks: each call
applied once, and the reply the agent trained with the one the tool gave.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import pickle
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import grpc

from turnpoint._keepalive import data_channel
from turnpoint._status import error_from_rpc
from turnpoint.apps.examples._task import (
    MAX_NEW_TOKENS_PER_TURN,
    VOCAB_SIZE,
    Reply,
    Task,
    Token,
    ToolSession,
    Turn,
    encode_context,
    episode_answer,
    group_rewards,
    is_finished,
    per_sibling_reward,
    tool_call,
)
from turnpoint.auth import auth_metadata
from turnpoint.convert import episode_to_proto
from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId
from turnpoint.participant_sdk import (
    Agent,
    EpisodeContext,
    GenerateChunk,
    GenerateRequest,
    GenerationRequest,
    ParticipantError,
    PolicyModel,
    RecoveryMode,
    ResourcesServer,
    Verdict,
    VerifyMode,
)
from turnpoint.server import ResourcesClient, generate_chunk_from_proto
from turnpoint.v1 import (
    policy_service_pb2,
    policy_service_pb2_grpc,
)

if TYPE_CHECKING:
    from turnpoint.apps.examples._policy_model import TinyPolicy
    from turnpoint.v1.policy_service_pb2_grpc import PolicyServiceAsyncStub


GUESS = "guess"
GUESS_GROUP = "guess-group"


def new_policy(seed: int = 0) -> TinyPolicy:
    """The demo's policy, identical in the policy server and the trainer for one seed."""
    # torch is imported by the policy only: agents and resources servers start without it.
    from turnpoint.apps.examples._policy_model import TinyPolicy

    return TinyPolicy(VOCAB_SIZE, eos_token=int(Token.EOS), seed=seed)


class TinyPolicyServer(PolicyModel):
    """Streams tokens from a :class:`TinyPolicy`; swaps weights only between generations.

    It can cut (docs/spec.md section 5.5): one token per chunk, the chunk with the last
    token ``done``, and closing the stream between tokens is harmless.
    """

    can_cut = True
    vocab_size = VOCAB_SIZE
    # The GRU has no window of its own; this bounds what one generation may hold.
    max_context_tokens = 16_384

    def __init__(
        self,
        policy: TinyPolicy,
        *,
        token_delay_s: float = 0.0,
        log: VerifierLog | None = None,
        name: str = "policy",
    ) -> None:
        if not token_delay_s >= 0:
            raise ValueError(f"token_delay_s must be >= 0, got {token_delay_s}")
        self.policy = policy
        # The demo's token audit: one line per generation streamed (see _log_generation).
        self._log = log or VerifierLog(None)
        self._name = name
        self._ids = f"{name}-{os.getpid()}-{secrets.token_hex(3)}"
        # The decode time of a real model per token: long generations for the demo.
        self._token_delay_s = token_delay_s
        self._streaming = 0
        self._swapping = False
        self._changed = asyncio.Condition()
        self.generations = 0

    async def generate(
        self, episode: EpisodeId, request: GenerateRequest
    ) -> AsyncGenerator[GenerateChunk, None]:
        import torch  # loaded with the policy already

        # The SDK refused prompts outside the vocabulary (``vocab_size``) already.
        async with self._changed:
            await self._changed.wait_for(lambda: not self._swapping)
            self._streaming += 1
        produced: list[int] = []
        finished = False
        started = time.time()
        self.generations += 1
        request_id = f"{self._ids}-{self.generations}"
        try:
            version = self.policy.weights_version
            generator = torch.Generator().manual_seed(request.seed)
            # No torch.no_grad() around the loop: a grad mode held across a yield
            # leaks into whatever else runs on this thread; iter_generate turns
            # gradients off inside each step itself.
            tokens = self.policy.iter_generate(
                request.prompt_token_ids,
                request.max_new_tokens,
                request.temperature,
                generator,
            )
            for count, sampled in enumerate(tokens, start=1):
                last = sampled.token == self.policy.eos_token or count == request.max_new_tokens
                # Counted once handed to the stream: a cut (the stream closed at the
                # next yield) carries every token yielded before it.
                produced.append(sampled.token)
                finished = last
                yield GenerateChunk((sampled.token,), (sampled.logprob,), last, version)
                if last:
                    return
                # Let other generations interleave (and stand in for a model's decode step).
                await asyncio.sleep(self._token_delay_s)
            finished = True
            yield GenerateChunk((), (), True, version)
        finally:
            self._log_generation(request_id, episode, request, produced, finished, started)
            async with self._changed:
                self._streaming -= 1
                self._changed.notify_all()

    def _log_generation(
        self,
        request_id: str,
        episode: EpisodeId,
        request: GenerateRequest,
        tokens: Sequence[int],
        finished: bool,
        started: float,
    ) -> None:
        """One line per generation, written as its stream ends (cut, stopped or finished).

        ``finished`` is true when the generation ended on its own (end of text or its
        budget); false when it was cut at a checkpoint or stopped. A kill of this
        process loses only the generations still streaming, whose callers never got a
        whole stream either.
        """
        self._log.write(
            policy=self._name,
            request_id=request_id,
            rollout_id=episode.rollout_id,
            attempt=episode.attempt,
            prompt=list(request.prompt_token_ids),
            tokens=list(tokens),
            finished=finished,
            t_start=started,
            t_end=time.time(),
        )

    async def update_weights(self, weights_version: int, state: bytes) -> int:
        async with self._changed:
            self._swapping = True
            try:
                await self._changed.wait_for(lambda: self._streaming == 0)
                try:
                    self.policy.load_state_bytes(state)
                except (
                    ValueError,
                    RuntimeError,
                    EOFError,
                    KeyError,
                    TypeError,
                    pickle.UnpicklingError,
                ) as error:
                    # Bad input from the caller, not a broken server: say so, typed,
                    # without quoting what torch made of the bytes.
                    raise ParticipantError(
                        Reason.INVALID_ARGUMENT,
                        "state is not a TinyPolicy weight payload",
                        {"field": "state", "exception": type(error).__name__},
                    ) from None
                self.policy.weights_version = weights_version
            finally:
                self._swapping = False
                self._changed.notify_all()
        return self.policy.weights_version


@contextlib.contextmanager
def _bad_input(field: str) -> Iterator[None]:
    """The caller's data did not fit the environment: INVALID_ARGUMENT, not a crash."""
    try:
        yield
    except (ValueError, TypeError, KeyError, OverflowError) as error:
        raise ParticipantError(
            Reason.INVALID_ARGUMENT,
            f"{field} does not fit the guess environment ({type(error).__name__})",
            {"field": field},
        ) from None


class VerifierLog:
    """Append-only JSON lines for the demo's audit: every reward a verifier returned, and
    every generation the policy streamed.

    Each line is flushed before :meth:`write` returns, so a kill of the writer loses
    none; ``fsync`` (the verifier's default) also survives the machine going down.
    """

    def __init__(self, path: str | Path | None, *, fsync: bool = True) -> None:
        self._path = Path(path) if path else None
        self._fsync = fsync

    def write(self, **entry: Any) -> None:
        if self._path is None:
            return
        line = json.dumps(entry, sort_keys=True) + "\n"
        with self._path.open("a", encoding="utf-8") as handle:
            handle.write(line)
            handle.flush()
            if self._fsync:
                os.fsync(handle.fileno())


class ToolExecutions:
    """The demo's audit of tool effects, on a resources server's side: every execution
    of a tool that changes a session gets an id unique in the run and one ``tools`` line
    in the server's log (its turn and its reply); the session keeps the ids it applied,
    in order, exports them with itself and names them in its verifier line.
    """

    def __init__(self, name: str, log: VerifierLog) -> None:
        self._name = name
        self._log = log
        self._prefix = f"{name}-{os.getpid()}-{secrets.token_hex(3)}"
        self.count = 0

    def applied(self, episode: EpisodeId, turn: int, reply: str, **detail: Any) -> str:
        """Log one execution just applied to ``episode``'s session; returns its id."""
        self.count += 1
        execution = f"{self._prefix}-{self.count}"
        self._log.write(
            tools=self._name,
            execution=execution,
            rollout_id=episode.rollout_id,
            attempt=episode.attempt,
            turn=turn,
            reply=reply,
            t=time.time(),
            **detail,
        )
        return execution


class FileGate:
    """A testing hold: every :meth:`wait` returns only once ``path`` exists.

    ``turnpoint serve --hold-calls-until FILE`` (and the demo's
    ``--hold-tools-after-restart FILE``) put one in front of a guess server's tool calls:
    each call stays in flight, so a snapshot's prepare waits for it and names it as its
    blocker, until the test creates the file. Polled, in a thread: nothing notifies a
    process that a file appeared. Once open it stays open.
    """

    POLL_S: ClassVar[float] = 0.02

    def __init__(self, path: Path) -> None:
        self.path = path
        self._open = False

    async def wait(self) -> None:
        while not self._open:
            self._open = await asyncio.to_thread(self.path.exists)
            if not self._open:
                await asyncio.sleep(self.POLL_S)


class GuessTools(ResourcesServer):
    """The ``check`` tool and a per-sibling verifier, with exported sessions.

    With a ``hold`` (:class:`FileGate`, testing only), every tool call first waits for it.
    """

    recovery_mode: ClassVar[RecoveryMode] = RecoveryMode.EXPORTED
    verify_mode: ClassVar[VerifyMode] = VerifyMode.WAIT
    environment: ClassVar[str] = GUESS

    def __init__(
        self, name: str = "tools", log: VerifierLog | None = None, *, hold: FileGate | None = None
    ) -> None:
        self.name = name
        # Every reward returned and every tool execution (the demo's audit reads both).
        self.log = log or VerifierLog(None)
        self.hold = hold
        # Per episode: the task, the tool session after each call applied (the first
        # entry before any), and the id of each execution applied, in order.
        self.sessions: dict[EpisodeId, dict[str, Any]] = {}
        self.executions = ToolExecutions(name, self.log)

    async def seed(self, episode: EpisodeId, task: Mapping[str, Any]) -> None:
        if not isinstance(task.get("task"), Mapping):
            raise ParticipantError(
                Reason.INVALID_ARGUMENT,
                "a guess session is seeded with its task",
                {"field": "task"},
            )
        with _bad_input("task"):
            Task.from_dict(task["task"])
            int(task.get("sibling_index", 0))
        if episode not in self.sessions:
            self.sessions[episode] = {
                "task": dict(task["task"]),
                "prompt_group_id": str(task.get("prompt_group_id", "")),
                "sibling_index": int(task.get("sibling_index", 0)),
                "history": [ToolSession().to_dict()],
                "executions": [],
            }

    def _session(self, episode: EpisodeId) -> dict[str, Any]:
        session = self.sessions.get(episode)
        if session is None:
            raise ParticipantError(
                Reason.NOT_FOUND, f"no session for {episode}", {"episode": str(episode)}
            )
        return session

    async def call(
        self, episode: EpisodeId, tool: str, arguments: Mapping[str, Any]
    ) -> Mapping[str, Any]:
        """Apply one ``check`` to the session: not idempotent (each call counts against
        the task's turn budget), so a call must run once; the SDK's reply record makes a
        re-sent call (docs/spec.md section 6.12) answer without coming here."""
        if self.hold is not None:
            await self.hold.wait()
        if tool != "check":
            return {"error": f"unknown tool {tool!r}"}
        session = self._session(episode)
        task = Task.from_dict(session["task"])
        with _bad_input("arguments"):
            guess = arguments.get("guess")
            guess = int(guess) if guess is not None else None
            # The agent's turn, for the audit only: the tool applies calls in order.
            turn = int(arguments.get("turn", len(session["executions"])))
        before = ToolSession.from_dict(session["history"][-1])
        result = tool_call(task, before, {"guess": guess})
        session["history"].append(result.session.to_dict())
        execution = self.executions.applied(episode, turn, result.reply.value, guess=guess)
        session["executions"].append(execution)
        return {"reply": result.reply.value}

    async def verify(self, episode: EpisodeId, answer: Mapping[str, Any]) -> Verdict:
        session = self._session(episode)
        with _bad_input("answer"):
            guesses = _guesses(answer)
        reward = per_sibling_reward(Task.from_dict(session["task"]), guesses)
        self.log.write(
            verifier=self.name,
            rollout_id=episode.rollout_id,
            attempt=episode.attempt,
            reward=reward,
            executions=list(session["executions"]),
        )
        return Verdict(reward, {"verifier": self.name})

    async def close(self, episode: EpisodeId) -> None:
        self.sessions.pop(episode, None)

    async def export_sessions(
        self, episodes: Sequence[EpisodeId]
    ) -> Mapping[EpisodeId, Mapping[str, Any]]:
        return {e: json.loads(json.dumps(self.sessions[e])) for e in episodes if e in self.sessions}

    def validate_session(self, episode: EpisodeId, state: Mapping[str, Any]) -> None:
        Task.from_dict(state["task"])
        for item in state["history"]:
            ToolSession.from_dict(item)
        executions = state["executions"]
        if not isinstance(executions, list) or len(executions) != len(state["history"]) - 1:
            raise ValueError("a guess session names one execution per call it applied")

    async def restore_session(
        self, saved: EpisodeId, episode: EpisodeId, state: Mapping[str, Any]
    ) -> None:
        self.sessions[episode] = json.loads(json.dumps(dict(state)))

    async def retire_session(self, episode: EpisodeId) -> None:
        self.sessions.pop(episode, None)


class GroupGuessTools(GuessTools):
    """Group-scored: each sibling's reward depends on all N answers of its prompt group.

    A verify waits until every sibling of the group has submitted, so it must be REPLAY:
    an in-flight verify never blocks a prepare, and after a restore it is simply asked
    again. A group's rewards, once computed, are kept (and exported with every session of
    the group), so a sibling that replays its verify after a restore gets the same reward
    even when its siblings finished before the snapshot.
    """

    verify_mode: ClassVar[VerifyMode] = VerifyMode.REPLAY
    group_scored: ClassVar[bool] = True
    environment: ClassVar[str] = GUESS_GROUP

    def __init__(
        self,
        name: str = "group-tools",
        log: VerifierLog | None = None,
        *,
        group_size: int,
        hold: FileGate | None = None,
    ) -> None:
        super().__init__(name, log, hold=hold)
        self.group_size = group_size  # type: ignore[misc]  # per instance, not per class
        self.groups: dict[str, dict[str, Any]] = {}
        self._submitted = asyncio.Condition()

    def _group(self, group_id: str) -> dict[str, Any]:
        return self.groups.setdefault(group_id, {"answers": {}, "rewards": None})

    async def verify(self, episode: EpisodeId, answer: Mapping[str, Any]) -> Verdict:
        session = self._session(episode)
        group_id = session["prompt_group_id"]
        sibling = str(session["sibling_index"])
        task = Task.from_dict(session["task"])
        async with self._submitted:
            group = self._group(group_id)
            if group["rewards"] is None:
                group["answers"][sibling] = list(_guesses(answer))
                if len(group["answers"]) >= self.group_size:
                    order = sorted(group["answers"], key=int)
                    rewards = group_rewards(task, [group["answers"][s] for s in order])
                    group["rewards"] = dict(zip(order, rewards, strict=True))
                self._submitted.notify_all()
            await self._submitted.wait_for(lambda: self._group(group_id)["rewards"] is not None)
            reward = float(self._group(group_id)["rewards"][sibling])
        self.log.write(
            verifier=self.name,
            rollout_id=episode.rollout_id,
            attempt=episode.attempt,
            reward=reward,
            executions=list(session["executions"]),
        )
        return Verdict(reward, {"verifier": self.name, "group": group_id})

    async def export_sessions(
        self, episodes: Sequence[EpisodeId]
    ) -> Mapping[EpisodeId, Mapping[str, Any]]:
        exported = dict(await super().export_sessions(episodes))
        for episode, state in exported.items():
            group = self.groups.get(state["prompt_group_id"])
            exported[episode] = {**state, "group": json.loads(json.dumps(group))}
        return exported

    def validate_session(self, episode: EpisodeId, state: Mapping[str, Any]) -> None:
        super().validate_session(episode, {k: v for k, v in state.items() if k != "group"})

    async def restore_session(
        self, saved: EpisodeId, episode: EpisodeId, state: Mapping[str, Any]
    ) -> None:
        plain = {k: v for k, v in state.items() if k != "group"}
        await super().restore_session(saved, episode, plain)
        group = state.get("group")
        if group and group.get("rewards") is not None:
            self.groups[plain["prompt_group_id"]] = json.loads(json.dumps(group))


def _guesses(answer: Mapping[str, Any]) -> list[int | None]:
    raw = answer.get("guesses", [])
    return [None if g is None else int(g) for g in raw]


def sampling_seed(rollout_id: str, turn: int, offset: int = 0) -> int:
    """The sampling seed of one generation: the rollout's turn, and the tokens already
    generated in it (a continuation after a cut).

    The same on every attempt and every process (a digest, not ``hash``, which Python
    salts per process): a restored attempt that asks a turn again samples what the lost
    one would have with the same weights, so the turn's keyed tool call is the same call.
    """
    digest = hashlib.sha256(f"{rollout_id}:{turn}:{offset}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


class _GymAgent(Agent):
    """What the example agents share: the policy server, whose generations go through
    ``ctx.generate``, and one :class:`~turnpoint.server.ResourcesClient` per environment,
    for ``ctx.seed``, ``ctx.call`` and ``ctx.verify``. Subclasses write ``run``.

    A turn's generation is seeded by :func:`sampling_seed` and saved with the boundary by
    ``ctx.generate``, so a restored attempt makes the turn's keyed tool call with the
    arguments the lost one had.
    """

    def __init__(
        self,
        policy_address: str,
        resources_addresses: Mapping[str, str],
        token: str | None,
        *,
        temperature: float = 1.0,
        turn_delay_s: float = 0.0,
        cut_generations: bool = False,
    ) -> None:
        if not turn_delay_s >= 0:
            raise ValueError(f"turn_delay_s must be >= 0, got {turn_delay_s}")
        # docs/spec.md section 5.5: generations go through ctx.generate, which lets the
        # policy cut them at a checkpoint (when this is set) and continues them from
        # their prefix.
        self.cuts_generations = cut_generations
        self._metadata = auth_metadata(token) if token else ()
        self._policy_channel = data_channel(policy_address)
        self._policy: PolicyServiceAsyncStub = policy_service_pb2_grpc.PolicyServiceStub(
            self._policy_channel
        )
        self._resources = {
            env: ResourcesClient(address, token=token)
            for env, address in resources_addresses.items()
        }
        self._temperature = temperature
        self._turn_delay_s = turn_delay_s

    async def _generate(
        self, ctx: EpisodeContext, context: Sequence[int], turn: int
    ) -> tuple[list[int], int]:
        """Turn ``turn``'s completion of ``context`` and the weights version that ended it.

        Through ``ctx.generate``: saved with the boundary once it finishes, so a restore
        after it (the tool call still to come) does not sample the turn again; cut at a
        checkpoint and continued when the agent ``cuts_generations`` (section 5.5).
        """
        episode = ctx.episode
        if self._turn_delay_s:
            # The latency of a real model or tool, parked at the boundary: every
            # snapshot cuts episodes mid-way instead of between them.
            await ctx.model_call(lambda: asyncio.sleep(self._turn_delay_s))

        def stream(request: GenerationRequest) -> AsyncIterator[GenerateChunk]:
            return self._stream(episode, turn, request)

        generation = await ctx.generate(context, MAX_NEW_TOKENS_PER_TURN, stream)
        version = generation.weights_versions[-1] if generation.weights_versions else 0
        return list(generation.token_ids), version

    async def _stream(
        self, episode: EpisodeId, turn: int, request: GenerationRequest
    ) -> AsyncIterator[GenerateChunk]:
        done = len(request.prompt_token_ids)
        call = self._policy.Generate(
            policy_service_pb2.GenerateRequest(
                request_id=f"gen-{episode.rollout_id}-{episode.attempt}-{turn}-{done}",
                episode=episode_to_proto(episode),
                prompt_token_ids=request.prompt_token_ids,
                max_new_tokens=request.max_new_tokens,
                temperature=self._temperature,
                seed=sampling_seed(episode.rollout_id, turn, done),
                accept_cut=request.accept_cut,
            ),
            metadata=self._metadata,
            timeout=120,
        )
        try:
            async for chunk in call:
                yield generate_chunk_from_proto(chunk)
        except grpc.aio.AioRpcError as error:
            raise _policy_error(error) from None

    async def aclose(self) -> None:
        await self._policy_channel.close(None)
        for client in self._resources.values():
            await client.aclose()


def _policy_error(error: grpc.aio.AioRpcError) -> Exception:
    """The typed error of a failed Generate: the policy's verdict, else UNAVAILABLE for
    a server unreachable (its process lost: ``ctx.generate`` waits for its
    replacement, docs/spec.md section 7.15), else the call's own error."""
    typed = error_from_rpc(error)
    if typed is not None:
        return typed
    if error.code() is grpc.StatusCode.UNAVAILABLE:
        return TurnpointError(
            Reason.UNAVAILABLE, f"the policy server is unreachable: {error.details()}"
        )
    return error


def _episode_output(
    task: Mapping[str, Any],
    turns: Sequence[Mapping[str, Any]],
    prompts: Sequence[Sequence[int]],
    versions: Sequence[int],
    answered: Sequence[int],
    reward: float,
) -> dict[str, Any]:
    """An example episode's result: what the demo trains on and audits."""
    return {
        "environment": str(task["environment"]),
        "prompt_group_id": str(task.get("prompt_group_id", "")),
        "sibling_index": int(task.get("sibling_index", 0)),
        "turns": list(turns),
        "prompts": [list(p) for p in prompts],
        "weights_versions": list(versions),
        # Per turn, the attempt that got its tool reply (the demo's audit of effects).
        "answered_in": list(answered),
        "reward": reward,
    }


class GuessAgent(_GymAgent):
    """Plays the guessing task against the policy server and the environment's resources.

    Its tool calls go through ``ctx.seed``, ``ctx.call`` and ``ctx.verify`` over a
    :class:`~turnpoint.server.ResourcesClient` per environment: keyed, retried, answered
    from the session's record when re-sent. Each turn's generation goes through
    ``ctx.generate``, which saves it with the boundary, so a restored attempt makes the
    turn's call with the same guess.
    """

    async def run(self, ctx: EpisodeContext, task: Mapping[str, Any]) -> Mapping[str, Any]:
        episode = ctx.episode
        prompt = Task.from_dict(task["task"])
        resources = self._resources[str(task["environment"])]
        saved = ctx.restored
        turns = [Turn.from_dict(t) for t in saved.state["turns"]] if saved else []
        versions: list[int] = list(saved.state.get("versions", [])) if saved else []
        answered: list[int] = list(saved.state.get("answered_in", [])) if saved else []
        if saved is None:
            # Boundary 0: the episode is accepted and owns nothing yet; everything after
            # it is a call that may be issued again after a restore.
            await ctx.boundary(0, {"turns": [], "versions": [], "answered_in": []})
        await ctx.seed(resources, {"group_size": 1, **task})
        while not is_finished(prompt, turns):
            completion, version = await self._generate(
                ctx, encode_context(prompt, turns), len(turns)
            )
            reply = await self._check(ctx, resources, len(turns), completion)
            turns.append(Turn(tuple(completion), reply))
            versions.append(version)
            answered.append(episode.attempt)
            await ctx.boundary(
                len(turns),
                {
                    "turns": [t.to_dict() for t in turns],
                    "versions": versions,
                    "answered_in": answered,
                },
            )
        guesses = list(episode_answer(turns))
        verdict = await ctx.verify(resources, {"guesses": guesses})
        prompts = [encode_context(prompt, turns[:k]) for k in range(len(turns))]
        turned = [t.to_dict() for t in turns]
        output = _episode_output(task, turned, prompts, versions, answered, verdict.reward)
        return {**output, "guesses": guesses}

    async def _check(
        self,
        ctx: EpisodeContext,
        resources: ResourcesClient,
        turn: int,
        completion: Sequence[int],
    ) -> Reply:
        guess = next(
            (t - int(Token.DIGIT_0) for t in completion if Token.DIGIT_0 <= t <= Token.DIGIT_9),
            None,
        )
        output = await ctx.call(resources, "check", {"guess": guess, "turn": turn})
        return Reply(output["reply"])


class PlayAgent(_GymAgent):
    """Plays the counter, Blackjack or the workplace (:mod:`._plays`) with the policy.

    Shaped like :class:`GuessAgent`, over the same connections: boundary 0 on acceptance,
    then each turn one ``ctx.generate`` and one keyed ``ctx.call``, then a sealed
    boundary; finally ``ctx.verify``. A call the resources server applied before a cut is
    answered from the session's reply record when a continued attempt sends it again
    (docs/spec.md section 6.12), so the environment deals no card twice.
    """

    async def run(self, ctx: EpisodeContext, task: Mapping[str, Any]) -> Mapping[str, Any]:
        from turnpoint.apps.examples._plays import PLAYS, Step, reply_text

        episode = ctx.episode
        environment = str(task["environment"])
        play, resources = PLAYS[environment], self._resources[environment]
        inner: Mapping[str, Any] = task["task"]
        saved = ctx.restored
        steps = [Step.from_dict(s) for s in saved.state["steps"]] if saved else []
        versions: list[int] = list(saved.state.get("versions", [])) if saved else []
        answered: list[int] = list(saved.state.get("answered_in", [])) if saved else []
        shown: Mapping[str, Any] = saved.state.get("shown", {}) if saved else {}
        last: Mapping[str, Any] = saved.state.get("last", {}) if saved else {}
        if saved is None:
            await ctx.boundary(
                0, {"steps": [], "versions": [], "answered_in": [], "shown": {}, "last": {}}
            )
        # The environment's own task, with the group fields the seed request carries.
        group = {k: task[k] for k in ("prompt_group_id", "sibling_index") if k in task}
        await ctx.seed(resources, {**inner, **group, "group_size": task.get("group_size", 1)})
        look = play.look(inner)
        if look is not None and not steps:
            # The turn-0 boundary's first keyed call; a read, so the record only saves
            # the server the work when it is re-sent.
            shown = await ctx.call(resources, *look)
        while not play.finished(steps):
            context = play.context(inner, shown, steps)
            completion, version = await self._generate(ctx, context, len(steps))
            tool, arguments = play.action(inner, completion, len(steps))
            last = await ctx.call(resources, tool, arguments)
            token = play.reply_token(inner, last)
            steps.append(Step(tuple(completion), tool, token, reply_text(last)))
            versions.append(version)
            answered.append(episode.attempt)
            state = {"steps": [s.to_dict() for s in steps], "versions": versions}
            await ctx.boundary(
                len(steps), {**state, "answered_in": answered, "shown": shown, "last": last}
            )
        prompts = [play.context(inner, shown, steps[:k]) for k in range(len(steps))]
        verdict = await ctx.verify(resources, play.answer(inner, last))
        turns = [s.to_dict() for s in steps]
        return _episode_output(task, turns, prompts, versions, answered, verdict.reward)
