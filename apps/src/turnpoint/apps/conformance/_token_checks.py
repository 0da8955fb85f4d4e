"""The token-prefix check: a policy model that lists the token level cuts generations
the way docs/spec.md section 5.5 says.

Only a model that lists ``RECOVERY_LEVEL_TOKEN`` in Describe is checked; a model that
does not never cuts (section 5.4) and the check is skipped. An agent that lists it is
only checked by ``describe``: what it records is inside its own snapshot.
"""

from __future__ import annotations

import asyncio

import grpc

from turnpoint.v1 import policy_service_pb2, types_pb2

from ._kit import HOLD_LEASE_S, CheckFailed, CheckSkipped, Kit, episode, require
from ._rules import phase_name
from ._wire import wire_error


def _generate(
    kit: Kit, e: types_pb2.EpisodeId
) -> grpc.aio.UnaryStreamCall[
    policy_service_pb2.GenerateRequest, policy_service_pb2.GenerateResponse
]:
    return kit.target.policy.Generate(
        policy_service_pb2.GenerateRequest(
            request_id=kit.rid("generate-cut"),
            episode=e,
            prompt_token_ids=list(kit.workload.prompt_token_ids),
            max_new_tokens=kit.workload.max_new_tokens,
            accept_cut=True,
        ),
        timeout=kit.episode_bound_s,
        metadata=kit.target.metadata,
    )


def _stream_problems(chunks: list[policy_service_pb2.GenerateResponse]) -> list[str]:
    problems: list[str] = []
    if not chunks or not chunks[-1].done:
        problems.append("the stream did not end with a done message")
        return problems
    if any(c.done for c in chunks[:-1]):
        problems.append("a message after the done one")
    if any(c.HasField("cut") for c in chunks[:-1]):
        problems.append("a cut on a message other than the last")
    last = chunks[-1]
    total = sum(len(c.token_ids) for c in chunks)
    if last.HasField("cut") and last.cut.prefix_length != total:
        problems.append(f"cut.prefix_length {last.cut.prefix_length}, but {total} tokens streamed")
    return problems


async def check_token_cut(kit: Kit) -> str:
    """Section 5.5 items 1 to 3: a cuttable Generate while admission is closed is cut at
    once with no tokens; one streaming when a prepare closes admission ends at a token
    boundary (cut, its prefix_length the tokens streamed) or on its own, and the prepare
    becomes ready."""
    cuts = types_pb2.RECOVERY_LEVEL_TOKEN in kit.description.supported_levels
    if not kit.hosts_model:
        raise CheckSkipped("not a policy model (an agent's cuts stay in its own snapshot)")
    if not cuts:
        raise CheckSkipped("the model does not list RECOVERY_LEVEL_TOKEN: it never cuts")
    done: list[str] = []
    checkpoint = kit.checkpoint_id()
    await kit.prepare(checkpoint, lease_s=HOLD_LEASE_S)
    try:
        call = _generate(kit, episode(kit.rollout("closed-cut"), 0))
        try:
            chunks = await asyncio.wait_for(_collect(call), kit.episode_bound_s)
        except grpc.aio.AioRpcError as error:
            raise CheckFailed(f"Generate while closed: {wire_error('Generate', error)}") from None
        require(
            len(chunks) == 1
            and chunks[0].done
            and chunks[0].HasField("cut")
            and chunks[0].cut.prefix_length == 0
            and not chunks[0].token_ids,
            "a Generate accepting cuts while admission was closed was not answered at once "
            "with a cut of no tokens (section 5.5 item 3)",
        )
        done.append("closed: cut of 0 tokens at once")
    finally:
        await kit.resume(checkpoint)
    call = _generate(kit, episode(kit.rollout("streaming-cut"), 0))
    stream = call.__aiter__()
    chunks = [await asyncio.wait_for(anext(stream), kit.episode_bound_s)]
    checkpoint = kit.checkpoint_id()
    try:
        prepared = await kit.prepare(checkpoint, lease_s=HOLD_LEASE_S)
        chunks.extend([c async for c in stream])
        while prepared.phase != types_pb2.PHASE_PREPARED:
            prepared = await kit.prepare(checkpoint, lease_s=HOLD_LEASE_S)
            require(
                prepared.phase in (types_pb2.PHASE_PREPARED, types_pb2.PHASE_PREPARING),
                f"Prepare answered {phase_name(prepared.phase)}",
            )
    finally:
        await kit.resume(checkpoint)
    problems = _stream_problems(chunks)
    require(not problems, "a generation a prepare reached: " + "; ".join(problems))
    cut = chunks[-1].HasField("cut")
    done.append(
        f"streaming: cut after {chunks[-1].cut.prefix_length} tokens"
        if cut
        else "streaming: ended on its own before the cut"
    )
    return "; ".join(done)


async def _collect(
    call: grpc.aio.UnaryStreamCall[
        policy_service_pb2.GenerateRequest, policy_service_pb2.GenerateResponse
    ],
) -> list[policy_service_pb2.GenerateResponse]:
    return [chunk async for chunk in call]
