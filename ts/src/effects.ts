/**
 * Exactly-once effects: the key of each tool call and the record of its reply
 * (docs/spec.md section 6.12). A port of turnpoint.participant_sdk._effects.
 *
 * An agent names each Call and Verify with a key, `fx:<rollout>:<turn>:<index>`: the
 * turn of its last sealed boundary (`s` before the first) and the call's index after
 * it, the same on every attempt. The resources runtime keeps each key's reply with the
 * session (`EffectRecord`, bounded, exported in the session payload's reserved field
 * `turnpoint_effects` and restored with it) and answers a key it holds from the record;
 * a key re-sent with another operation, tool or arguments is refused
 * (`EffectConflictError`, INVALID_ARGUMENT naming the divergence).
 *
 * Pure: no gRPC, no clock.
 */
import { createHash } from "node:crypto";

import { TurnpointError } from "./errors.js";
import { isValidId } from "./ids.js";
import { cloneJson, encodeCompact, isPlainObject } from "./json.js";
import type { JsonObject, JsonValue } from "./protocol.js";

/** The field of a session's record payload that carries its reply record; reserved. */
export const EFFECTS_FIELD = "turnpoint_effects";
/** Replies a session keeps by default: far more than the calls of one turn. */
export const DEFAULT_REPLY_LIMIT = 256;
const KEY_PREFIX = "fx";
const BEFORE_FIRST_BOUNDARY = "s";
const FINGERPRINT_HEX = 32;
const FORMAT = 1;

/** Which way a re-sent key names another call than its first. */
export type Divergence = "operation" | "tool" | "arguments" | "forgotten";

/** A call key the record cannot answer: re-sent with another call, or forgotten. */
export class EffectConflictError extends TurnpointError {
  constructor(
    readonly requestId: string,
    readonly divergence: Divergence,
    message: string,
  ) {
    super("INVALID_ARGUMENT", message, { field: "request_id", request_id: requestId, divergence });
    this.name = "EffectConflictError";
  }
}

/** Where a call stands in its rollout: after which turn (null: before the first boundary), its index. */
export interface CallPosition {
  readonly turn: number | null;
  readonly index: number;
}

function order(position: CallPosition): [number, number] {
  return [position.turn ?? -1, position.index];
}

function beforeOrAt(a: CallPosition, b: CallPosition): boolean {
  const [at, ai] = order(a);
  const [bt, bi] = order(b);
  return at < bt || (at === bt && ai <= bi);
}

/** The key of one call: identical on every attempt of the rollout (`fx:r:3:0`). */
export function effectKey(rolloutId: string, position: CallPosition): string {
  if (!isValidId(rolloutId)) throw new RangeError(`not a rollout id: ${JSON.stringify(rolloutId)}`);
  const natural = (n: number): boolean => Number.isInteger(n) && n >= 0;
  if (!natural(position.index) || (position.turn !== null && !natural(position.turn))) {
    throw new RangeError(`a call position is never negative, got ${JSON.stringify(position)}`);
  }
  const turn = position.turn === null ? BEFORE_FIRST_BOUNDARY : String(position.turn);
  return [KEY_PREFIX, rolloutId, turn, String(position.index)].join(":");
}

/** The rollout and position an SDK key names; null for any other request id. */
export function parseEffectKey(key: string): { rolloutId: string; position: CallPosition } | null {
  const parts = key.split(":");
  if (parts.length !== 4 || parts[0] !== KEY_PREFIX) return null;
  const [, rolloutId, turn, index] = parts as [string, string, string, string];
  const digits = /^[0-9]+$/;
  if (!digits.test(index) || !(digits.test(turn) || turn === BEFORE_FIRST_BOUNDARY)) return null;
  return { rolloutId, position: { turn: turn === BEFORE_FIRST_BOUNDARY ? null : Number(turn), index: Number(index) } };
}

function sortedKeys(value: unknown): unknown {
  if (Array.isArray(value)) return value.map(sortedKeys);
  if (isPlainObject(value)) {
    const sorted: Record<string, unknown> = {};
    for (const key of Object.keys(value).sort()) sorted[key] = sortedKeys(value[key]);
    return sorted;
  }
  return value;
}

/**
 * A digest of what a call asks, the same as the Python SDK's: sha256 of the canonical
 * JSON of `[operation, tool, arguments]` (keys sorted, ASCII, compact). Numbers are
 * already integral where they can be, as they are after a trip through a Struct.
 */
export function callFingerprint(operation: string, tool: string, args: JsonObject): string {
  const canonical = encodeCompact(sortedKeys([operation, tool, args]));
  return createHash("sha256").update(canonical, "utf8").digest("hex").slice(0, FINGERPRINT_HEX);
}

interface Entry {
  readonly operation: string;
  readonly tool: string;
  readonly fingerprint: string;
  readonly reply: JsonObject;
}

/** Refuse a key that names another call than the one it named first. */
export function checkSameCall(key: string, held: { operation: string; tool: string; fingerprint: string }, operation: string, tool: string, fingerprint: string): void {
  if (held.operation !== operation) throw new EffectConflictError(key, "operation", `${key} was a ${held.operation}, re-sent as a ${operation}`);
  if (held.tool !== tool) throw new EffectConflictError(key, "tool", `${key} called tool ${JSON.stringify(held.tool)}, re-sent for ${JSON.stringify(tool)}`);
  if (held.fingerprint !== fingerprint) throw new EffectConflictError(key, "arguments", `${key} was re-sent with other arguments than its first call`);
}

/** The replies of one session's calls, by key; at most `limit` of them, oldest dropped first. */
export class EffectRecord {
  private readonly entries = new Map<string, Entry>();
  forgottenThrough: CallPosition | null = null;

  constructor(readonly limit: number = DEFAULT_REPLY_LIMIT) {
    if (!(Number.isInteger(limit) && limit >= 1)) throw new RangeError(`limit must be >= 1, got ${limit}`);
  }

  get size(): number {
    return this.entries.size;
  }

  /** The recorded reply, undefined if the call has not run; throws EffectConflictError. */
  lookup(key: string, operation: string, tool: string, fingerprint: string): JsonObject | undefined {
    const entry = this.entries.get(key);
    if (entry === undefined) {
      const parsed = parseEffectKey(key);
      const forgotten = this.forgottenThrough;
      if (parsed !== null && forgotten !== null && beforeOrAt(parsed.position, forgotten)) {
        throw new EffectConflictError(key, "forgotten", `call ${key} is older than the ${this.limit} replies the session keeps`);
      }
      return undefined;
    }
    checkSameCall(key, entry, operation, tool, fingerprint);
    return cloneJson(entry.reply);
  }

  /** Keep a call's reply, dropping the oldest past the limit. */
  record(key: string, operation: string, tool: string, fingerprint: string, reply: JsonObject): void {
    this.entries.delete(key);
    this.entries.set(key, { operation, tool, fingerprint, reply: cloneJson(reply) });
    while (this.entries.size > this.limit) {
      const dropped = this.entries.keys().next().value as string;
      this.entries.delete(dropped);
      const parsed = parseEffectKey(dropped);
      if (parsed !== null && (this.forgottenThrough === null || beforeOrAt(this.forgottenThrough, parsed.position))) {
        this.forgottenThrough = parsed.position;
      }
    }
  }

  /** The record as the session payload's `turnpoint_effects` object (spec 6.12 item 5). */
  toJson(): JsonObject {
    const forgotten = this.forgottenThrough;
    return {
      format: FORMAT,
      limit: this.limit,
      forgotten_through: forgotten === null ? null : { turn: forgotten.turn, index: forgotten.index },
      replies: [...this.entries].map(([key, e]) => ({ key, operation: e.operation, tool: e.tool, fingerprint: e.fingerprint, reply: cloneJson(e.reply) })),
    };
  }

  /** Decode `toJson`; throws Error (a bad record) on anything else. */
  static fromJson(value: JsonValue | undefined): EffectRecord {
    if (!isPlainObject(value)) throw new Error("the reply record must be an object");
    if (value["format"] !== FORMAT) throw new Error(`the reply record has format ${JSON.stringify(value["format"])}, not ${FORMAT}`);
    const limit = value["limit"];
    if (typeof limit !== "number" || !Number.isInteger(limit) || limit < 1) throw new Error("the reply record's limit must be an integer >= 1");
    const record = new EffectRecord(limit);
    const natural = (n: unknown): n is number => typeof n === "number" && Number.isInteger(n) && n >= 0;
    const forgotten = value["forgotten_through"];
    if (forgotten !== null && forgotten !== undefined) {
      if (!isPlainObject(forgotten)) throw new Error("forgotten_through must be an object or null");
      const { turn, index } = forgotten;
      if (!natural(index)) throw new Error("forgotten_through needs an integer index");
      if (!(turn === null || natural(turn))) throw new Error("forgotten_through needs an integer turn, or null");
      record.forgottenThrough = { turn, index };
    }
    const replies = value["replies"];
    if (!Array.isArray(replies) || replies.length > limit) throw new Error(`replies must be a list of at most ${limit} entries`);
    for (const item of replies) {
      if (!isPlainObject(item)) throw new Error("each reply must be an object");
      const { key, operation, tool, fingerprint, reply } = item;
      if (typeof key !== "string" || typeof operation !== "string" || typeof tool !== "string" || typeof fingerprint !== "string") {
        throw new Error("a reply needs string key, operation, tool and fingerprint");
      }
      if (!isPlainObject(reply)) throw new Error(`the reply of ${key} must be an object`);
      if (record.entries.has(key)) throw new Error(`the key ${key} is recorded twice`);
      record.entries.set(key, { operation, tool, fingerprint, reply: cloneJson(reply as JsonObject) });
    }
    return record;
  }
}

/** A session record's payload as the server's own state and the reply record. */
export function splitPayload(payload: JsonObject): { state: JsonObject; replies: EffectRecord | null } {
  const state: JsonObject = {};
  for (const [key, value] of Object.entries(payload)) if (key !== EFFECTS_FIELD) state[key] = value;
  const raw = payload[EFFECTS_FIELD];
  return { state, replies: raw === undefined ? null : EffectRecord.fromJson(raw) };
}
