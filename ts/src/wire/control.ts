/**
 * CheckpointControlService over a ParticipantRuntime: one core, two doors (docs/spec.md
 * sections 3.2, 3.3). Every operation has one handler that converts the request, calls
 * the runtime and converts the answer; the unary methods turn a TurnpointError into a
 * rich status, the ControlSession calls the very same handler per message and answers
 * a ControlError instead. A port of turnpoint.server._control.
 */
import { create } from "@bufbuild/protobuf";
import type { MessageShape } from "@bufbuild/protobuf";
import type { ServerDuplexStream, ServerWritableStream } from "@grpc/grpc-js";

import { TurnpointError, invalidArgument } from "../errors.js";
import * as pb from "../gen/turnpoint/v1/checkpoint_control_service_pb.js";
import * as types from "../gen/turnpoint/v1/types_pb.js";
import type { EpisodeId } from "../ids.js";
import type { ArtifactRef, Fence } from "../protocol.js";
import type { ParticipantRuntime } from "../runtime.js";
import {
  artifactFromProto,
  artifactToProto,
  checkListLength,
  enumValue,
  episodeToProto,
  episodesFromProto,
  fenceFromProto,
  headerToProto,
  idFromProto,
  readinessToProto,
  secondsFromDuration,
  timestampFromSeconds,
} from "./convert.js";
import type { CallContext, Door, Implementation } from "./door.js";
import { decode, encode, protocolError } from "./door.js";
import { controlError, grpcStatus } from "./status.js";

const Service = pb.CheckpointControlService;
/** How long an operation on the session may take when the request gives no timeout. */
const DEFAULT_SESSION_OP_TIMEOUT_S = 60;
/** Control requests a session runs at once; more wait their turn (bounded memory). */
const MAX_SESSION_INFLIGHT = 256;

type Operation = Exclude<pb.ControlSessionRequest["operation"]["case"], "cancel" | undefined>;

function requestId(value: string): string {
  if (!value) throw invalidArgument("request_id is required on every mutating request", { field: "request_id" });
  if (value.length > 256) throw invalidArgument("request_id is longer than 256 characters", { field: "request_id" });
  return value;
}

function phase(value: string): types.Phase {
  return enumValue(types.Phase, value);
}

/**
 * What Restore and RestoreRunning both carry, checked, in the runtime's order: fence,
 * request id, restore id, snapshot, manifest, artifacts, scope.
 */
function restoreArguments(
  r: pb.RestoreRequest | pb.RestoreRunningRequest,
): [Fence, string, string, string, ArtifactRef | null, ArtifactRef[], EpisodeId[]] {
  const artifacts = r.entry?.artifacts ?? [];
  checkListLength("entry.artifacts", artifacts.length);
  // Section 4.10 item 2: no manifest names a participant that saved nothing.
  const manifest = r.entry?.manifest;
  if (manifest === undefined && artifacts.length > 0) {
    throw invalidArgument("entry.manifest is required when entry.artifacts are named", { field: "entry.manifest" });
  }
  return [
    fenceFromProto(r.fence),
    requestId(r.requestId),
    idFromProto(r.restoreId, "restore_id"),
    idFromProto(r.snapshot, "snapshot"),
    manifest === undefined ? null : artifactFromProto(manifest),
    artifacts.map(artifactFromProto),
    episodesFromProto(r.scope, "scope"),
  ];
}

/** The control servicer; `close()` ends its long-lived streams (server drain). */
export class ControlServicer {
  private readonly longLived = new Set<AbortController>();
  /** Session operations a caller cancelled (or that a closing session cut short). */
  cancelledByCaller = 0;

  constructor(private readonly runtime: ParticipantRuntime) {}

  private header(): types.ResponseHeader {
    return headerToProto(this.runtime.header());
  }

  // ---------------------------------------------------------------- handlers

  private async handle(operation: Operation, request: unknown, timeoutS: number | null, signal: AbortSignal): Promise<{ case: Operation; value: unknown }> {
    const rt = this.runtime;
    const options = { timeoutS, signal };
    switch (operation) {
      case "describe": {
        const r = request as pb.DescribeRequest;
        const d = rt.describe(r.fence === undefined ? null : fenceFromProto(r.fence));
        return {
          case: operation,
          value: create(pb.DescribeResponseSchema, {
            header: this.header(),
            kind: enumValue(types.ParticipantKind, d.kind),
            instanceName: d.instanceName,
            protocolVersion: d.protocolVersion,
            recoveryMode: enumValue(types.RecoveryMode, d.recoveryMode),
            verifyMode: enumValue(types.VerifyMode, d.verifyMode),
            groupScored: d.groupScored,
            groupSize: d.groupSize,
            supportedLevels: d.supportedLevels.map((level) => enumValue(types.RecoveryLevel, level)),
            environment: d.environment,
            phase: phase(d.phase),
            capabilities: d.capabilities.map((capability) => enumValue(pb.Capability, capability)),
          }),
        };
      }
      case "prepare": {
        const r = request as pb.PrepareRequest;
        const checkpointId = idFromProto(r.checkpointId, "checkpoint_id");
        const fence = fenceFromProto(r.fence);
        const rid = requestId(r.requestId);
        const leaseS = secondsFromDuration(r.lease, "lease");
        checkListLength("expected_episodes", r.expectedEpisodes.length); // a hint: held to the limit, not parsed
        const emptyCommitSnapshot = r.emptyCommitSnapshot ? idFromProto(r.emptyCommitSnapshot, "empty_commit_snapshot") : null;
        const result = await rt.prepare(fence, rid, checkpointId, { leaseS, maxBlockers: r.maxBlockers, emptyCommitSnapshot }, options);
        return {
          case: operation,
          value: create(pb.PrepareResponseSchema, {
            header: this.header(),
            phase: phase(result.phase),
            readiness: readinessToProto(result.readiness),
            checkpointId: result.checkpointId,
            committedEmpty: result.committedEmpty,
            ...(result.leaseExpiresAt !== null ? { leaseExpiresAt: timestampFromSeconds(result.leaseExpiresAt) } : {}),
          }),
        };
      }
      case "renew": {
        const r = request as pb.RenewRequest;
        const fence = fenceFromProto(r.fence);
        const rid = requestId(r.requestId);
        const checkpointId = idFromProto(r.checkpointId, "checkpoint_id");
        const result = await rt.renew(fence, rid, checkpointId, { leaseS: secondsFromDuration(r.lease, "lease") });
        return {
          case: operation,
          value: create(pb.RenewResponseSchema, {
            header: this.header(),
            phase: phase(result.phase),
            ...(result.leaseExpiresAt !== null ? { leaseExpiresAt: timestampFromSeconds(result.leaseExpiresAt) } : {}),
          }),
        };
      }
      case "commit": {
        const r = request as pb.CommitRequest;
        const fence = fenceFromProto(r.fence);
        const rid = requestId(r.requestId);
        const checkpointId = idFromProto(r.checkpointId, "checkpoint_id");
        const snapshot = idFromProto(r.snapshot, "snapshot");
        const scope = episodesFromProto(r.scope, "scope");
        const result = await rt.commit(fence, rid, checkpointId, snapshot, scope, { acceptSavedNothing: r.acceptSavedNothing, release: r.release }, options);
        return {
          case: operation,
          value: create(pb.CommitResponseSchema, {
            header: this.header(),
            checkpointId: result.checkpointId,
            ...(result.manifest !== null ? { manifest: artifactToProto(result.manifest) } : {}),
            artifacts: result.artifacts.map(artifactToProto),
            exported: result.exported.map(episodeToProto),
            savedNothing: result.savedNothing,
            released: result.released,
          }),
        };
      }
      case "resume": {
        const r = request as pb.ResumeRequest;
        const fence = fenceFromProto(r.fence);
        const rid = requestId(r.requestId);
        const result = await rt.resume(fence, rid, idFromProto(r.checkpointId, "checkpoint_id"), options);
        return {
          case: operation,
          value: create(pb.ResumeResponseSchema, { header: this.header(), phase: phase(result.phase), endedActive: result.endedActive }),
        };
      }
      case "restore": {
        const r = request as pb.RestoreRequest;
        const result = await rt.restore(...restoreArguments(r), { leaseS: secondsFromDuration(r.lease, "lease") }, options);
        return {
          case: operation,
          value: create(pb.RestoreResponseSchema, {
            header: this.header(),
            restoreId: result.restoreId,
            installed: result.installed.map(episodeToProto),
            phase: phase(result.phase),
          }),
        };
      }
      case "restoreRunning": {
        const r = request as pb.RestoreRunningRequest;
        const args = { leaseS: secondsFromDuration(r.lease, "lease"), retireUnscoped: r.retireUnscoped };
        const result = await rt.restoreRunning(...restoreArguments(r), args, options);
        return {
          case: operation,
          value: create(pb.RestoreRunningResponseSchema, {
            header: this.header(),
            restoreId: result.restoreId,
            installed: result.installed.map(episodeToProto),
            phase: phase(result.phase),
            retired: result.retired.map(episodeToProto),
          }),
        };
      }
      case "retire": {
        const r = request as pb.RetireRequest;
        const fence = fenceFromProto(r.fence);
        const rid = requestId(r.requestId);
        const result = await rt.retire(fence, rid, episodesFromProto(r.episodes, "episodes"), options);
        return { case: operation, value: create(pb.RetireResponseSchema, { header: this.header(), stopped: result.stopped.map(episodeToProto) }) };
      }
      case "forget": {
        const r = request as pb.ForgetRequest;
        checkListLength("rollout_ids", r.rolloutIds.length);
        const rolloutIds = r.rolloutIds.map((id) => idFromProto(id, "rollout_ids"));
        const fence = fenceFromProto(r.fence);
        const result = await rt.forget(fence, requestId(r.requestId), rolloutIds);
        return { case: operation, value: create(pb.ForgetResponseSchema, { header: this.header(), forgotten: result.forgotten }) };
      }
      case "getStatus": {
        const r = request as pb.GetStatusRequest;
        const status = rt.status(r.maxBlockers);
        return {
          case: operation,
          value: create(pb.GetStatusResponseSchema, {
            header: this.header(),
            phase: phase(status.phase),
            activeCheckpointId: status.activeCheckpointId ?? "",
            readiness: readinessToProto(status.readiness),
            admissionOpen: status.admissionOpen,
            leaseExpiries: BigInt(status.leaseExpiries),
            refusedRollouts: status.refusedRollouts,
            committedCheckpointId: status.committedCheckpointId ?? "",
            ...(status.leaseExpiresAt !== null ? { leaseExpiresAt: timestampFromSeconds(status.leaseExpiresAt) } : {}),
          }),
        };
      }
    }
  }

  // ---------------------------------------------------------------- the unary door

  private unary<In extends (typeof UNARY)[Operation]>(door: Door, operation: Operation): Implementation[string] {
    const [name, input, output] = UNARY[operation] as [string, In[1], In[2]];
    return door.unary(Service, name, input, output, async (request, context: CallContext) => {
      const answer = await this.handle(operation, request, context.timeoutS, context.signal);
      return answer.value as MessageShape<In[2]>;
    });
  }

  /** Handlers for `server.addService(rawDefinition(CheckpointControlService), ...)`. */
  implementation(door: Door): Implementation {
    const impl: Implementation = {};
    for (const operation of Object.keys(UNARY) as Operation[]) impl[UNARY[operation][0]] = this.unary(door, operation);
    impl.WatchBoundaries = door.serverStream(Service, "WatchBoundaries", pb.WatchBoundariesRequestSchema, pb.WatchBoundariesResponseSchema, (request, send, context, call) =>
      this.watchBoundaries(request, send, context, call),
    );
    impl.ControlSession = door.bidi(Service, "ControlSession", (call, path) => this.controlSession(call, path));
    return impl;
  }

  /** End every long-lived stream (sessions, watches): the server drains. */
  close(): void {
    for (const controller of this.longLived) controller.abort();
  }

  // ---------------------------------------------------------------- watch

  private async watchBoundaries(
    request: pb.WatchBoundariesRequest,
    send: (message: pb.WatchBoundariesResponse) => void,
    context: CallContext,
    call: ServerWritableStream<Buffer, Buffer>,
  ): Promise<void> {
    const fence = request.fence === undefined ? null : fenceFromProto(request.fence);
    const controller = new AbortController();
    context.signal.addEventListener("abort", () => controller.abort(), { once: true });
    this.longLived.add(controller);
    try {
      for await (const event of this.runtime.watch(request.maxBlockers, fence, controller.signal)) {
        if (call.cancelled) return;
        const base = { header: this.header(), phase: phase(event.phase) };
        if (event.type === "readiness") {
          send(create(pb.WatchBoundariesResponseSchema, { ...base, event: { case: "readiness", value: readinessToProto(event.readiness) } }));
        } else {
          const boundary = create(pb.BoundaryEventSchema, {
            episode: episodeToProto(event.episode),
            state: enumValue(types.EpisodeState, event.state),
            boundaryIndex: event.boundaryIndex,
            turnIndex: event.turnIndex,
            at: timestampFromSeconds(event.at),
          });
          send(create(pb.WatchBoundariesResponseSchema, { ...base, event: { case: "boundary", value: boundary } }));
        }
      }
    } catch (error) {
      // The stream ends when its caller cancels or the server drains: not an error.
      if (!controller.signal.aborted) throw error;
    } finally {
      this.longLived.delete(controller);
    }
  }

  // ---------------------------------------------------------------- the session door

  /**
   * Serve each request as it arrives; answers go out in completion order. A session
   * that breaks cancels its operations' waits only: work that belongs to the runtime (a
   * write, an install) keeps going, and the lease decides about an open checkpoint.
   */
  private controlSession(call: ServerDuplexStream<Buffer, Buffer>, path: string): void {
    const session = new AbortController();
    this.longLived.add(session);
    const running = new Map<string, AbortController>();
    const waiting: Array<() => void> = [];
    let inflight = 0;
    let readerDone = false;
    let ended = false;

    const finish = (): void => {
      if (ended) return;
      if (readerDone && inflight === 0) {
        ended = true;
        this.longLived.delete(session);
        if (!call.cancelled) call.end();
      }
    };
    const serve = async (message: pb.ControlSessionRequest, controller: AbortController): Promise<void> => {
      const onSessionAbort = (): void => controller.abort();
      session.signal.addEventListener("abort", onSessionAbort, { once: true });
      try {
        const response = await this.sessionAnswer(message, controller.signal);
        if (response !== null && !call.cancelled && !ended) call.write(encode(pb.ControlSessionResponseSchema, response));
        else if (response === null) this.cancelledByCaller++;
      } finally {
        session.signal.removeEventListener("abort", onSessionAbort);
        if (running.get(message.requestId) === controller) running.delete(message.requestId);
        inflight--;
        waiting.shift()?.();
        finish();
      }
    };

    call.on("data", (bytes: Buffer) => {
      let message: pb.ControlSessionRequest;
      try {
        message = decode(pb.ControlSessionRequestSchema, bytes, path);
      } catch (error) {
        // Bytes that are no ControlSessionRequest end the session INVALID_ARGUMENT.
        if (!ended && !call.cancelled && error instanceof TurnpointError) {
          ended = true;
          session.abort();
          this.longLived.delete(session);
          call.emit("error", grpcStatus(error));
        }
        return;
      }
      if (message.operation.case === "cancel") {
        running.get(message.requestId)?.abort();
        return;
      }
      inflight++;
      const controller = new AbortController();
      running.set(message.requestId, controller);
      const go = (): void => void serve(message, controller);
      if (inflight > MAX_SESSION_INFLIGHT) waiting.push(go);
      else go();
    });
    call.on("end", () => {
      readerDone = true;
      finish();
    });
    call.on("cancelled", () => {
      session.abort();
      readerDone = true;
      this.longLived.delete(session);
    });
    session.signal.addEventListener("abort", () => {
      // The server drains: end the stream once what runs has answered (or was cut).
      readerDone = true;
      finish();
    });
  }

  /** The answer to one session message; null when the caller cancelled it (no answer). */
  private async sessionAnswer(message: pb.ControlSessionRequest, signal: AbortSignal): Promise<pb.ControlSessionResponse | null> {
    const operation = message.operation.case;
    try {
      if (operation === undefined) throw invalidArgument("a ControlSessionRequest must carry an operation", { field: "operation" });
      if (operation === "cancel") return null;
      const timeoutS = secondsFromDuration(message.timeout, "timeout", DEFAULT_SESSION_OP_TIMEOUT_S);
      const inner = message.operation.value as { requestId?: string };
      if (inner.requestId !== undefined && inner.requestId !== message.requestId) {
        throw invalidArgument("request_id of the session message and its operation differ", { field: "request_id" });
      }
      const answer = await this.handle(operation, message.operation.value, timeoutS, signal);
      if (signal.aborted) return null;
      return create(pb.ControlSessionResponseSchema, {
        requestId: message.requestId,
        result: { case: answer.case, value: answer.value } as pb.ControlSessionResponse["result"],
      });
    } catch (error) {
      const mapped = protocolError(error, operation ?? "unknown");
      if (mapped === null || signal.aborted) return null;
      return create(pb.ControlSessionResponseSchema, { requestId: message.requestId, result: { case: "error", value: controlError(mapped) } });
    }
  }
}

const UNARY = {
  describe: ["Describe", pb.DescribeRequestSchema, pb.DescribeResponseSchema],
  prepare: ["Prepare", pb.PrepareRequestSchema, pb.PrepareResponseSchema],
  renew: ["Renew", pb.RenewRequestSchema, pb.RenewResponseSchema],
  commit: ["Commit", pb.CommitRequestSchema, pb.CommitResponseSchema],
  resume: ["Resume", pb.ResumeRequestSchema, pb.ResumeResponseSchema],
  restore: ["Restore", pb.RestoreRequestSchema, pb.RestoreResponseSchema],
  restoreRunning: ["RestoreRunning", pb.RestoreRunningRequestSchema, pb.RestoreRunningResponseSchema],
  retire: ["Retire", pb.RetireRequestSchema, pb.RetireResponseSchema],
  forget: ["Forget", pb.ForgetRequestSchema, pb.ForgetResponseSchema],
  getStatus: ["GetStatus", pb.GetStatusRequestSchema, pb.GetStatusResponseSchema],
} as const;
