/**
 * Conversions at the wire edge. Everything that comes off the wire passes through here
 * before the runtime sees it, so a bad id or a negative duration becomes
 * INVALID_ARGUMENT and changes nothing (docs/spec.md section 10.5). Enums map by name.
 */
import { create } from "@bufbuild/protobuf";
import type { JsonObject as PbJsonObject } from "@bufbuild/protobuf";
import type { Duration, Timestamp } from "@bufbuild/protobuf/wkt";
import { DurationSchema, timestampFromMs } from "@bufbuild/protobuf/wkt";

import { invalidArgument } from "../errors.js";
import type { EpisodeId } from "../ids.js";
import { episode as makeEpisode, validateId } from "../ids.js";
import type { ArtifactRef, Blocker, CompletionReceipt, Fence, JsonObject, ReadinessReport } from "../protocol.js";
import { checkedArtifact } from "../protocol.js";
import * as types from "../gen/turnpoint/v1/types_pb.js";
import type { Header } from "../runtime.js";

export const MAX_LIST_LENGTH = 10_000;

export function idFromProto(value: string, field: string): string {
  return validateId(value, field);
}

export function episodeFromProto(message: types.EpisodeId | undefined, field = "episode"): EpisodeId {
  const rolloutId = message?.rolloutId ?? "";
  const attempt = message?.attempt ?? 0;
  return makeEpisode(rolloutId, attempt, field);
}

export function checkListLength(field: string, length: number, limit = MAX_LIST_LENGTH): void {
  if (length > limit) {
    throw invalidArgument(`${field} has ${length} entries; at most ${limit} are accepted`, {
      field,
      length: String(length),
      limit: String(limit),
    });
  }
}

export function episodesFromProto(messages: readonly types.EpisodeId[], field: string): EpisodeId[] {
  checkListLength(field, messages.length);
  return messages.map((m) => episodeFromProto(m, field));
}

export function episodeToProto(e: EpisodeId): types.EpisodeId {
  return create(types.EpisodeIdSchema, { rolloutId: e.rolloutId, attempt: e.attempt });
}

/** Seconds in a Duration; `fallback` when unset or zero; negative is INVALID_ARGUMENT. */
export function secondsFromDuration(message: Duration | undefined, field: string, fallback: number | null = null): number | null {
  if (message === undefined) return fallback;
  const seconds = Number(message.seconds) + message.nanos / 1e9;
  if (seconds < 0) throw invalidArgument(`${field} must not be negative`, { field });
  return seconds === 0 ? fallback : seconds;
}

export function durationFromSeconds(seconds: number): Duration {
  const nanos = BigInt(Math.round(Math.max(0, seconds) * 1e9));
  return create(DurationSchema, { seconds: nanos / 1_000_000_000n, nanos: Number(nanos % 1_000_000_000n) });
}

export function timestampFromSeconds(epochSeconds: number): Timestamp {
  return timestampFromMs(Math.round(epochSeconds * 1000));
}

/** A request without a fence acts as coordinator "" at epoch 0 (section 2.2 item 6). */
export function fenceFromProto(message: types.Fence | undefined): Fence {
  if (message === undefined) return { coordinatorId: "", epoch: 0n };
  return { coordinatorId: validateId(message.coordinatorId, "fence.coordinator_id"), epoch: message.epoch };
}

export function headerToProto(header: Header): types.ResponseHeader {
  return create(types.ResponseHeaderSchema, { participantId: header.participantId, incarnation: header.incarnation, epoch: header.epoch });
}

/** Proto enum value for an SDK name: `enumValue(types.Phase, "PREPARED")`. */
export function enumValue<E extends { [name: string]: string | number }>(protoEnum: E, name: string): number {
  const value = protoEnum[name];
  if (typeof value !== "number") throw new Error(`no value ${name} in the enum`);
  return value;
}

export function receiptToProto(receipt: CompletionReceipt): types.CompletionReceipt {
  return create(types.CompletionReceiptSchema, { episode: episodeToProto(receipt.episode), receiptId: receipt.receiptId });
}

export function receiptFromProto(message: types.CompletionReceipt): CompletionReceipt {
  return { episode: episodeFromProto(message.episode, "receipt.episode"), receiptId: validateId(message.receiptId, "receipt_id") };
}

function blockerToProto(blocker: Blocker): types.Blocker {
  return create(types.BlockerSchema, {
    episode: episodeToProto(blocker.episode),
    state: enumValue(types.EpisodeState, blocker.state),
    ...(blocker.receipt !== null ? { receipt: receiptToProto(blocker.receipt) } : {}),
    detail: blocker.detail,
  });
}

export function readinessToProto(report: ReadinessReport): types.ReadinessReport {
  return create(types.ReadinessReportSchema, {
    ready: report.ready,
    blockerCount: report.blockerCount,
    blockers: report.blockers.map(blockerToProto),
    counts: report.counts.map(([state, count]) => create(types.StateCountSchema, { state: enumValue(types.EpisodeState, state), count })),
    restarts: report.restarts.map(episodeToProto),
  });
}

export function artifactToProto(ref: ArtifactRef): types.ArtifactRef {
  return create(types.ArtifactRefSchema, {
    path: ref.path,
    sha256: ref.sha256,
    sizeBytes: BigInt(ref.sizeBytes),
    recordCount: BigInt(ref.recordCount),
  });
}

export function artifactFromProto(message: types.ArtifactRef): ArtifactRef {
  if (message.sizeBytes > BigInt(Number.MAX_SAFE_INTEGER) || message.recordCount > BigInt(Number.MAX_SAFE_INTEGER)) {
    throw invalidArgument("artifact size or record count is out of range", { field: "artifact" });
  }
  return checkedArtifact({
    path: message.path,
    sha256: message.sha256,
    sizeBytes: Number(message.sizeBytes),
    recordCount: Number(message.recordCount),
  });
}

/** Nesting a Struct may have, the protobuf limit (section 10.5). */
const MAX_STRUCT_DEPTH = 100;

/**
 * A Struct field as plain JSON (protobuf-es already hands Struct fields over as JSON
 * objects). JavaScript has one number type, so integral numbers are integers already
 * (section 3.7). NaN and Infinity have no JSON form, and nesting past the protobuf limit
 * is refused: bad input, said as such, naming the field.
 */
export function structToJson(value: PbJsonObject | undefined, field: string): JsonObject {
  if (value === undefined) return {};
  const check = (item: unknown, depth: number): void => {
    if (typeof item === "number" && !Number.isFinite(item)) {
      throw invalidArgument(`${field} holds a number JSON cannot carry (NaN or Infinity)`, { field });
    }
    if (item === null || typeof item !== "object") return;
    if (depth > MAX_STRUCT_DEPTH) throw invalidArgument(`${field} is nested deeper than ${MAX_STRUCT_DEPTH} levels`, { field });
    for (const inner of Array.isArray(item) ? item : Object.values(item)) check(inner, depth + 1);
  };
  check(value, 1);
  return value as JsonObject;
}

export function structFromJson(value: JsonObject): PbJsonObject {
  return value as PbJsonObject;
}
