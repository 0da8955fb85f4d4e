/**
 * The data-plane servicers: RolloutService (agents) and ResourcesService (resources).
 * Thin adapters over the runtime like the control servicer (turnpoint.server._data).
 */
import { create } from "@bufbuild/protobuf";
import { Metadata } from "@grpc/grpc-js";

import type { RunEvent } from "../agent.js";
import { invalidArgument } from "../errors.js";
import * as resources from "../gen/turnpoint/v1/resources_service_pb.js";
import * as rollout from "../gen/turnpoint/v1/rollout_service_pb.js";
import type { ParticipantRuntime } from "../runtime.js";
import {
  checkListLength,
  durationFromSeconds,
  enumValue,
  episodeFromProto,
  episodeToProto,
  fenceFromProto,
  headerToProto,
  receiptFromProto,
  receiptToProto,
  secondsFromDuration,
  structFromJson,
  structToJson,
  timestampFromSeconds,
} from "./convert.js";
import type { Door, Implementation } from "./door.js";

/** Initial metadata a Run sends once the participant owns the attempt (section 6.1 item 2). */
export const ACCEPTED_METADATA_KEY = "turnpoint-accepted";
/** Sent with it: the incarnation that accepted, which every re-attach names (section 6.5 item 5). */
export const INCARNATION_METADATA_KEY = "turnpoint-incarnation";
/** The longest data-plane request id (docs/spec.md section 2.8), as the Python servicer. */
const MAX_REQUEST_ID = 256;

/** A Call's or Verify's request id, bounded: the key of its reply record (section 6.12). */
function dataRequestId(value: string): string {
  if (value.length > MAX_REQUEST_ID) {
    throw invalidArgument(`request_id is longer than ${MAX_REQUEST_ID} characters`, { field: "request_id", limit: String(MAX_REQUEST_ID) });
  }
  return value;
}

export function rolloutImplementation(runtime: ParticipantRuntime, door: Door, open: boolean): Implementation {
  const service = rollout.RolloutService;
  const header = (): ReturnType<typeof headerToProto> => headerToProto(runtime.header());
  const event = (ev: RunEvent): rollout.RunResponse => {
    if (ev.type === "boundary") {
      const boundary = create(rollout.BoundaryReportSchema, {
        episode: episodeToProto(ev.episode),
        boundaryIndex: ev.boundaryIndex,
        turnIndex: ev.turnIndex,
        sealedAt: timestampFromSeconds(ev.sealedAt),
      });
      return create(rollout.RunResponseSchema, { header: header(), event: { case: "boundary", value: boundary } });
    }
    const result = create(rollout.RunResultSchema, {
      episode: episodeToProto(ev.episode),
      outcome: enumValue(rollout.RunOutcome, ev.outcome),
      result: structFromJson(ev.result),
      turns: ev.turns,
      activeTime: durationFromSeconds(ev.activeTimeS),
      errorMessage: ev.errorMessage,
      ...(ev.receipt !== null ? { receipt: receiptToProto(ev.receipt) } : {}),
    });
    return create(rollout.RunResponseSchema, { header: header(), event: { case: "result", value: result } });
  };
  return {
    Run: door.serverStream(
      service,
      "Run",
      rollout.RunRequestSchema,
      rollout.RunResponseSchema,
      async (request, send, context, call) => {
        const episode = episodeFromProto(request.episode);
        const task = structToJson(request.task, "task");
        const budgetS = secondsFromDuration(request.budget, "budget");
        const fence = request.fence === undefined ? null : fenceFromProto(request.fence);
        // With wait_for_admission a new attempt waits out an open checkpoint (section 5.2
        // item 1); the caller leaving ends the wait.
        const follower = await runtime.admitRun(
          episode,
          task,
          {
            boundariesSeen: request.boundariesSeen,
            budgetS,
            fence,
            waitForAdmission: request.waitForAdmission,
            participantIncarnation: request.participantIncarnation,
          },
          context.signal,
        );
        // Closing the follower when the call ends (also by cancellation) is what
        // cancels the execution once nobody follows it (section 6.6).
        context.signal.addEventListener("abort", () => follower.close(), { once: true });
        try {
          const accepted = new Metadata();
          accepted.set(ACCEPTED_METADATA_KEY, "1");
          accepted.set(INCARNATION_METADATA_KEY, runtime.incarnation);
          call.sendMetadata(accepted);
          for (;;) {
            const next = await follower.next(context.signal);
            if (next === null) break;
            send(event(next));
          }
        } finally {
          follower.close();
        }
      },
      open,
    ),
    Acknowledge: door.unary(
      service,
      "Acknowledge",
      rollout.AcknowledgeRequestSchema,
      rollout.AcknowledgeResponseSchema,
      async (request) => {
        checkListLength("receipts", request.receipts.length);
        const fence = request.fence === undefined ? null : fenceFromProto(request.fence);
        const result = runtime.acknowledge(request.receipts.map(receiptFromProto), fence);
        return create(rollout.AcknowledgeResponseSchema, {
          header: header(),
          acknowledged: result.acknowledged,
          unknown: result.unknown.map(receiptToProto),
        });
      },
      open,
    ),
  };
}

export function resourcesImplementation(runtime: ParticipantRuntime, door: Door, open: boolean): Implementation {
  const service = resources.ResourcesService;
  const header = (): ReturnType<typeof headerToProto> => headerToProto(runtime.header());
  return {
    SeedSession: door.unary(
      service,
      "SeedSession",
      resources.SeedSessionRequestSchema,
      resources.SeedSessionResponseSchema,
      async (request, context) => {
        const task = structToJson(request.task, "task");
        task.prompt_group_id ??= request.promptGroupId;
        task.sibling_index ??= request.siblingIndex;
        task.group_size ??= request.groupSize;
        const existed = await runtime.seedSession(episodeFromProto(request.episode), task, context.signal);
        return create(resources.SeedSessionResponseSchema, { header: header(), existed });
      },
      open,
    ),
    Call: door.unary(
      service,
      "Call",
      resources.CallRequestSchema,
      resources.CallResponseSchema,
      async (request, context) => {
        if (!request.tool) throw invalidArgument("tool is required", { field: "tool" });
        const output = await runtime.callTool(
          episodeFromProto(request.episode),
          request.tool,
          structToJson(request.arguments, "arguments"),
          context.signal,
          dataRequestId(request.requestId),
        );
        return create(resources.CallResponseSchema, { header: header(), output: structFromJson(output) });
      },
      open,
    ),
    Verify: door.unary(
      service,
      "Verify",
      resources.VerifyRequestSchema,
      resources.VerifyResponseSchema,
      async (request, context) => {
        const verdict = await runtime.verify(
          episodeFromProto(request.episode),
          structToJson(request.answer, "answer"),
          context.signal,
          dataRequestId(request.requestId),
        );
        return create(resources.VerifyResponseSchema, { header: header(), reward: verdict.reward, details: structFromJson(verdict.details ?? {}) });
      },
      open,
    ),
    CloseSession: door.unary(
      service,
      "CloseSession",
      resources.CloseSessionRequestSchema,
      resources.CloseSessionResponseSchema,
      async (request, context) => {
        const closed = await runtime.closeSession(episodeFromProto(request.episode), context.signal);
        return create(resources.CloseSessionResponseSchema, { header: header(), closed });
      },
      open,
    ),
  };
}
