"""Policy model servers: generations under admission control.

A Gym policy server subclasses :class:`PolicyModel` and implements :meth:`generate` as an
async generator of :class:`GenerateChunk`. While a checkpoint holds admission, new
generations wait (held, not counted as in flight) until resume; generations already
streaming finish, and the server is ready when none streams. A model that sets
:attr:`PolicyModel.can_cut` instead cuts each streaming generation whose caller accepts
cuts at its next token boundary (docs/spec.md section 5.5): the stream ends with a chunk
whose ``cut`` is set, and the caller continues from prompt plus prefix after resume.
Retiring an episode stops its running generation before the retire replies. A model holds no episode state, so it exports nothing, and a
restore into a server that already served a generation is refused.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import itertools
from collections import OrderedDict
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId
from turnpoint.protocol import EpisodeState, ParticipantKind, RecoveryMode

from ._core import WorkKey
from ._shared import Shared, invalid_record
from ._store_format import Record

SLOT = "generate"
# UpdateWeights request ids remembered for replay: a trainer pushes one version at a
# time and retries only its latest, so a few suffice (docs/spec.md section 5.4 item 4).
UPDATES_REMEMBERED = 64


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0
    # The caller records a cut and continues it (docs/spec.md section 5.5).
    accept_cut: bool = False


@dataclass(frozen=True, slots=True)
class GenerateChunk:
    """Tokens generated since the previous chunk; ``done`` on the last one.

    ``cut`` is set only on the last chunk of a generation a checkpoint cut before it
    ended on its own; ``prefix_length`` is then the number of tokens the whole stream
    carried (docs/spec.md section 5.5).
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    done: bool
    weights_version: int
    cut: bool = False
    prefix_length: int = 0


class PolicyModel(abc.ABC):
    """What a Gym policy server implements (the module docstring says how).

    Example::

        class TinyPolicyServer(PolicyModel):
            def __init__(self, policy: TinyPolicy) -> None:
                self.policy = policy

            async def generate(self, episode, request):
                generator = torch.Generator().manual_seed(request.seed)
                tokens = self.policy.iter_generate(
                    request.prompt_token_ids, request.max_new_tokens, request.temperature, generator
                )
                for sampled in tokens:
                    yield GenerateChunk((sampled.token,), (sampled.logprob,), False,
                                        self.policy.weights_version)
                    await asyncio.sleep(0)  # let other generations interleave
                yield GenerateChunk((), (), True, self.policy.weights_version)
    """

    environment: ClassVar[str] = ""
    # docs/spec.md section 5.5. True promises that (1) every chunk but the last carries
    # tokens and a chunk not ``done`` means at least one more token follows (the chunk
    # with the generation's last token is ``done``), and (2) the SDK may stop iterating
    # ``generate`` between two chunks (it closes the generator) without harm. The SDK
    # then cuts generations whose caller accepts cuts when a checkpoint closes admission.
    can_cut: ClassVar[bool] = False
    # What the model can take, if it says: the SDK refuses a prompt with a token at or
    # above ``vocab_size``, or whose length plus ``max_new_tokens`` passes
    # ``max_context_tokens``, with INVALID_ARGUMENT before ``generate`` runs.
    vocab_size: ClassVar[int | None] = None
    max_context_tokens: ClassVar[int | None] = None

    @abc.abstractmethod
    def generate(
        self, episode: EpisodeId, request: GenerateRequest
    ) -> AsyncGenerator[GenerateChunk, None]:
        """Stream one generation."""

    async def update_weights(self, weights_version: int, state: bytes) -> int:
        """Install new weights (the trainer's weight sync); return the installed version.

        Called outside the admission gate: a model that must not swap weights under a
        streaming generation waits for its own generations to finish first.
        """
        raise TurnpointError(
            Reason.NOT_FOUND, f"{type(self).__name__} does not take weight updates"
        )

    async def admission_closed(self) -> None:
        """A checkpoint closed admission (a failure makes the prepare fail and reopen)."""
        return None

    async def admission_opened(self) -> None:
        """Admission reopened; may come without a preceding close (after a restore)."""
        return None


def check_request(model: PolicyModel, request: GenerateRequest) -> None:
    """Refuse what no model can take (no prompt, no token to generate) and what this
    one says it cannot (docs/spec.md section 5.5): a caller's mistake is
    INVALID_ARGUMENT naming the field, never a hook's crash."""
    prompt = request.prompt_token_ids
    if not prompt:
        raise _bad("a generation needs a prompt: prompt_token_ids is empty", "prompt_token_ids")
    if request.max_new_tokens < 1:
        raise _bad("max_new_tokens must be at least 1", "max_new_tokens")
    if min(prompt) < 0:
        raise _bad("prompt_token_ids must be >= 0", "prompt_token_ids")
    vocab = model.vocab_size
    if vocab is not None and max(prompt) >= vocab:
        raise _bad(
            f"prompt_token_ids must be below the vocabulary size {vocab}, got {max(prompt)}",
            "prompt_token_ids",
            vocab,
        )
    context = model.max_context_tokens
    if context is not None and len(prompt) + request.max_new_tokens > context:
        raise _bad(
            f"the prompt's {len(prompt)} tokens plus max_new_tokens {request.max_new_tokens} "
            f"pass the model's context of {context} tokens",
            "max_new_tokens",
            context,
        )


def _bad(message: str, field: str, limit: int | None = None) -> TurnpointError:
    metadata = {"field": field} if limit is None else {"field": field, "limit": str(limit)}
    return TurnpointError(Reason.INVALID_ARGUMENT, message, metadata)


class _End:
    """Marks the end of a pumped generation (normal, failed or stopped)."""

    def __init__(self, error: BaseException | None = None, stopped: bool = False) -> None:
        self.error = error
        self.stopped = stopped


class ModelHost:
    """Hosts one :class:`PolicyModel` behind the admission gate."""

    slot = SLOT
    record_key: str | None = None
    kind = ParticipantKind.MODEL
    recovery_mode = RecoveryMode.STATELESS

    def __init__(self, shared: Shared, model: PolicyModel) -> None:
        self._shared = shared
        self._model = model
        self._numbers = itertools.count(1)
        self._pumps: dict[WorkKey, asyncio.Task[None]] = {}
        # Generations a checkpoint may cut, each with the event that asks it to stop.
        self._cuts: dict[WorkKey, asyncio.Event] = {}
        # The weight sync's books: the version the last update installed (None before
        # any), and each recent request id's update, running or done, so that a retry
        # joins or replays it instead of installing twice.
        self._installed: int | None = None
        self._updates: OrderedDict[str, asyncio.Task[int]] = OrderedDict()
        self._update_lock = asyncio.Lock()

    def describe(self) -> Mapping[str, object]:
        return {
            "environment": self._model.environment,
            "cuts_generations": self._model.can_cut,
        }

    async def generate(
        self, episode: EpisodeId, request: GenerateRequest
    ) -> AsyncGenerator[GenerateChunk, None]:
        check_request(self._model, request)
        shared = self._shared
        if self._installed is None and shared.config.await_weights:
            # A replacement before the trainer's weights reach it: the agent asks again.
            raise TurnpointError(
                Reason.UNAVAILABLE,
                "this policy server has not received the trainer's weights yet",
                {"episode": str(episode)},
            )
        cuttable = request.accept_cut and self._model.can_cut
        async with shared.changing() as core:
            while True:
                core.check_attempt(episode)
                if core.admission_open or cuttable:
                    break
                # Held at the gate: not in the table, so it never blocks a prepare.
                await shared.wait_change()
            admitted = core.admission_open
            if admitted:
                key = WorkKey(episode, f"{SLOT}/{next(self._numbers)}")
                core.admit(key, EpisodeState.REQUEST_IN_FLIGHT, shared.now())
                queue: asyncio.Queue[GenerateChunk | _End] = asyncio.Queue()
                cut = asyncio.Event()
                if cuttable:
                    self._cuts[key] = cut
                pump = asyncio.create_task(self._pump(episode, request, queue, cut))
                self._pumps[key] = pump
        if not admitted:
            # docs/spec.md section 5.5 item 3: a cut of no tokens, answered at once. Its
            # caller blocks its own prepare until its stream ends, so holding it at the
            # gate would hold both checkpoints up.
            yield GenerateChunk((), (), True, 0, cut=True, prefix_length=0)
            return
        try:
            while True:
                item = await queue.get()
                if isinstance(item, GenerateChunk):
                    yield item
                    continue
                if item.stopped:
                    raise TurnpointError(
                        Reason.STALE_ATTEMPT,
                        f"the generation of {episode} was stopped by a retire",
                        {"episode": str(episode)},
                    )
                if item.error is not None:
                    raise item.error
                return
        finally:
            if not pump.done():
                pump.cancel()
                await asyncio.wait([pump])
            async with shared.changing() as core:
                self._pumps.pop(key, None)
                self._cuts.pop(key, None)
                core.remove(key, shared.now())

    async def _pump(
        self,
        episode: EpisodeId,
        request: GenerateRequest,
        queue: asyncio.Queue[GenerateChunk | _End],
        cut: asyncio.Event,
    ) -> None:
        end = _End()
        streamed = 0
        version = 0
        try:
            if cut.is_set():
                # Closed between admission and the first token: nothing was generated.
                queue.put_nowait(GenerateChunk((), (), True, 0, cut=True, prefix_length=0))
            else:
                stream = self._model.generate(episode, request)
                async with contextlib.aclosing(stream):
                    async for chunk in stream:
                        queue.put_nowait(chunk)
                        streamed += len(chunk.token_ids)
                        version = chunk.weights_version
                        # docs/spec.md section 5.5 item 2: a chunk not done means more
                        # tokens follow, so the generation is cut here, between tokens;
                        # one that ended on its own (or reached its budget) is not cut.
                        if cut.is_set() and not chunk.done and streamed < request.max_new_tokens:
                            queue.put_nowait(
                                GenerateChunk(
                                    (), (), True, version, cut=True, prefix_length=streamed
                                )
                            )
                            break
        except asyncio.CancelledError:
            end = _End(stopped=True)
        except Exception as error:  # noqa: BLE001 - handed to the caller's stream, not lost
            end = _End(error)
        queue.put_nowait(end)

    async def update_weights(self, weights_version: int, state: bytes, request_id: str = "") -> int:
        """docs/spec.md section 5.4 item 4: install once per request id and per version.

        A request id seen before joins its update if it still runs, and gets its answer
        if it succeeded (a failed one runs again). The update runs as a task of its own:
        a caller that goes away (a lost connection) does not stop an install half done,
        and its retry joins it. A version equal to the installed one is answered as
        installed without calling the model again; a lower one is refused.
        """
        if not request_id:
            return await asyncio.shield(self._start_install(weights_version, state))
        update = self._updates.get(request_id)
        if update is not None and update.done() and (update.cancelled() or update.exception()):
            update = None  # it failed: a retry tries again
        if update is None:
            update = self._start_install(weights_version, state)
            self._updates[request_id] = update
            self._updates.move_to_end(request_id)
            while len(self._updates) > UPDATES_REMEMBERED:
                oldest_id, oldest = next(iter(self._updates.items()))
                if not oldest.done():
                    break  # still running: a retry may yet join it
                del self._updates[oldest_id]
        return await asyncio.shield(update)

    def _start_install(self, weights_version: int, state: bytes) -> asyncio.Task[int]:
        update = asyncio.create_task(self._install(weights_version, state))
        # Its caller may be gone (the failure then reaches nobody): retrieve it here.
        update.add_done_callback(lambda done: done.cancelled() or done.exception())
        return update

    async def _install(self, weights_version: int, state: bytes) -> int:
        async with self._update_lock:
            installed = self._installed
            if installed is not None and weights_version == installed:
                return installed  # a re-push of what is installed: nothing to do
            if installed is not None and weights_version < installed:
                raise TurnpointError(
                    Reason.INVALID_ARGUMENT,
                    f"weights version {weights_version} is below the installed version {installed}",
                    {"field": "weights_version", "installed_version": str(installed)},
                )
            answered = await self._model.update_weights(weights_version, state)
            self._installed = weights_version
            return answered

    # ------------------------------------------------------------------ kind hooks

    async def admission_closed(self) -> None:
        for cut in self._cuts.values():
            cut.set()
        await self._model.admission_closed()

    async def admission_opened(self) -> None:
        await self._model.admission_opened()

    async def export(self, keys: Sequence[WorkKey]) -> list[Record]:
        return []

    def validate(self, record: Record) -> None:
        raise invalid_record(record, "a policy model restores no records")

    async def install(self, record: Record, episode: EpisodeId) -> WorkKey:
        raise invalid_record(record, "a policy model restores no records")

    async def stop(self, key: WorkKey) -> None:
        pump = self._pumps.get(key)
        if pump is not None and not pump.done():
            pump.cancel()
            await asyncio.wait([pump])

    async def aclose(self) -> None:
        tasks: list[asyncio.Task[Any]] = [
            *(pump for pump in self._pumps.values() if not pump.done()),
            *(update for update in self._updates.values() if not update.done()),
        ]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
