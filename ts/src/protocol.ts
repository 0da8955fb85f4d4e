/**
 * The protocol's vocabulary as plain data (docs/spec.md sections 2 to 4): phases,
 * episode states, kinds, modes, the fence, readiness reports, receipts and artifact
 * references. Names are the proto value names minus their prefix (`"PREPARED"` is
 * `PHASE_PREPARED`); `wire/convert.ts` maps them to the generated enums by name.
 *
 * Pure: nothing here imports grpc or protobuf.
 */
import type { EpisodeId } from "./ids.js";
import { TurnpointError } from "./errors.js";
import { validateId } from "./ids.js";

export const PROTOCOL_VERSION = "turnpoint.v1";

export type Phase = "IDLE" | "PREPARING" | "PREPARED" | "COMMITTED" | "RESTORED";

export type EpisodeState =
  | "RUNNING"
  | "PARKED"
  | "AWAITING_MODEL"
  | "COMPLETED_UNACKED"
  | "RESTART"
  | "RETIRING"
  | "RESTORED"
  | "REQUEST_IN_FLIGHT"
  | "IDLE";

/** Section 4.1 item 5. AWAITING_MODEL is absent: a model call after a boundary is parked. */
export const BLOCKING_STATES: ReadonlySet<EpisodeState> = new Set<EpisodeState>([
  "RUNNING",
  "COMPLETED_UNACKED",
  "RETIRING",
  "REQUEST_IN_FLIGHT",
]);

export type ParticipantKind = "AGENT" | "RESOURCES" | "MODEL" | "ENVIRONMENT";
export type RecoveryMode = "STATELESS" | "EXPORTED" | "RESTART_ONLY";
export type VerifyMode = "WAIT" | "REPLAY";
export type RecoveryLevel = "TURN" | "SIBLING" | "PROMPT_GROUP";
/** An optional control operation a participant serves (section 4.5 item 7). */
export type Capability = "RESTORE_RUNNING";

/** Who sends a control request. `epoch` is a uint64 on the wire, so a bigint here. */
export interface Fence {
  readonly coordinatorId: string;
  readonly epoch: bigint;
}

export interface CompletionReceipt {
  readonly episode: EpisodeId;
  readonly receiptId: string;
}

export interface Blocker {
  readonly episode: EpisodeId;
  readonly state: EpisodeState;
  readonly receipt: CompletionReceipt | null;
  readonly detail: string;
}

/** Section 4.1: `blockers` capped, `blockerCount` and `restarts` never. */
export interface ReadinessReport {
  readonly ready: boolean;
  readonly blockerCount: number;
  readonly blockers: readonly Blocker[];
  /** Non-zero states only, sorted by state name. */
  readonly counts: ReadonlyArray<readonly [EpisodeState, number]>;
  readonly restarts: readonly EpisodeId[];
}

/** One durable file of a snapshot (section 8.3); `path` is `<instance>/<file name>`. */
export interface ArtifactRef {
  readonly path: string;
  readonly sha256: string;
  readonly sizeBytes: number;
  readonly recordCount: number;
}

const SHA256_HEX = /^[0-9a-f]{64}$/;

/** Check an artifact reference (section 8.3): two valid-id components, a proper digest. */
export function checkedArtifact(ref: ArtifactRef): ArtifactRef {
  const parts = ref.path.split("/");
  if (parts.length !== 2) {
    throw new TurnpointError("INVALID_ARGUMENT", `artifact path ${JSON.stringify(ref.path)} must be '<instance>/<file name>'`, {
      field: "artifact path",
    });
  }
  validateId(parts[0], "artifact path instance");
  validateId(parts[1], "artifact path file name");
  if (!SHA256_HEX.test(ref.sha256)) {
    throw new TurnpointError("INVALID_ARGUMENT", "sha256 must be 64 lowercase hex characters", { field: "sha256" });
  }
  for (const [name, value] of [
    ["size_bytes", ref.sizeBytes],
    ["record_count", ref.recordCount],
  ] as const) {
    if (!Number.isSafeInteger(value) || value < 0) {
      throw new TurnpointError("INVALID_ARGUMENT", `${name} must be an integer >= 0`, { field: name });
    }
  }
  return ref;
}

export function sameArtifact(a: ArtifactRef, b: ArtifactRef): boolean {
  return a.path === b.path && a.sha256 === b.sha256 && a.sizeBytes === b.sizeBytes && a.recordCount === b.recordCount;
}

/** JSON values as the SDK hands them to hooks (Struct payloads, record payloads). */
export type JsonValue = null | boolean | number | string | JsonValue[] | { [key: string]: JsonValue };
export type JsonObject = { [key: string]: JsonValue };
