/**
 * The snapshot store's on-disk format (docs/spec.md sections 8.2, 8.3, 8.5), the same
 * bytes as the Python reference (turnpoint.participant_sdk._store_format): records files as ASCII
 * JSON Lines, participant manifests as indented ASCII JSON. Pure functions over bytes.
 */
import { createHash } from "node:crypto";

import { TurnpointError } from "./errors.js";
import type { EpisodeId } from "./ids.js";
import { compareEpisodes, episode as makeEpisode, episodeKey, isValidId, validateId } from "./ids.js";
import { encodeCompact, encodeIndented, isPlainObject, parseStrict } from "./json.js";
import type { ArtifactRef, JsonObject } from "./protocol.js";

export const SCHEMA_VERSION = 1;
export const MANIFEST_NAME = "MANIFEST.json";
export const MAX_PAYLOAD_DEPTH = 100;
export const RECORDS_NAME = /^records-([0-9a-f]{64})\.jsonl$/;
const SHA256_HEX = /^[0-9a-f]{64}$/;

/** Why a snapshot directory cannot be used (section 9.7). */
export type Corruption =
  | "missing"
  | "manifest_invalid"
  | "path_escape"
  | "unexpected_content"
  | "size_mismatch"
  | "digest_mismatch"
  | "record_count_mismatch"
  | "record_invalid"
  | "episodes_mismatch";

/** A snapshot directory is missing, damaged or not what the caller expected. */
export class CorruptSnapshotError extends TurnpointError {
  constructor(
    readonly snapshot: string,
    readonly instance: string,
    readonly kind: Corruption,
    detail: string,
  ) {
    super(
      "INVALID_CHECKPOINT_STATE",
      `snapshot ${JSON.stringify(snapshot)} of instance ${JSON.stringify(instance)} is unusable (${kind}): ${detail}`,
      { snapshot, corruption: kind },
    );
    this.name = "CorruptSnapshotError";
  }
}

/** A record's payload is not plain JSON; raised before anything is written (section 8.2 item 4). */
export class UnserialisableRecordError extends TurnpointError {
  constructor(e: EpisodeId, key: string, location: string, why: string) {
    super("INVALID_CHECKPOINT_STATE", `record ${JSON.stringify(key)} of episode ${episodeKey(e)} cannot be saved: ${location}: ${why}`, {
      episode: episodeKey(e),
      key,
      location,
    });
    this.name = "UnserialisableRecordError";
  }
}

/** One piece of exported state: `key` names what it holds (`run`, `session`). */
export interface Record {
  readonly episode: EpisodeId;
  readonly key: string;
  readonly payload: JsonObject;
}

/** A published instance directory: what a commit replies and a restore is given. */
export interface SnapshotEntry {
  readonly checkpointId: string;
  readonly manifest: ArtifactRef;
  readonly artifacts: readonly ArtifactRef[];
  readonly episodes: readonly EpisodeId[];
}

export interface Manifest {
  readonly checkpointId: string;
  readonly instance: string;
  readonly artifacts: readonly ArtifactRef[];
  readonly episodes: readonly EpisodeId[];
}

export function sha256Hex(data: Uint8Array): string {
  return createHash("sha256").update(data).digest("hex");
}

function episodeJson(e: EpisodeId): { rollout_id: string; attempt: number } {
  return { rollout_id: e.rolloutId, attempt: e.attempt };
}

/** `MANIFEST.json` bytes, exactly as the Python reference writes them. */
export function manifestBytes(manifest: Manifest): Buffer {
  const document = {
    schema_version: SCHEMA_VERSION,
    checkpoint_id: manifest.checkpointId,
    instance: manifest.instance,
    artifacts: manifest.artifacts.map((ref) => ({
      path: ref.path,
      sha256: ref.sha256,
      size_bytes: ref.sizeBytes,
      record_count: ref.recordCount,
    })),
    episodes: manifest.episodes.map(episodeJson),
  };
  return Buffer.from(`${encodeIndented(document)}\n`, "ascii");
}

export function sameManifest(a: Manifest, b: Manifest): boolean {
  return manifestBytes(a).equals(manifestBytes(b));
}

class BadValue extends Error {
  readonly location: string[] = [];
}

/** Check that `value` is plain JSON (string keys, finite numbers, bounded nesting). */
function checkPlain(value: unknown, depth: number): void {
  if (value === null || typeof value === "string" || typeof value === "boolean") return;
  if (typeof value === "number") {
    if (!Number.isFinite(value)) throw new BadValue(`${value} is not a JSON number`);
    return;
  }
  if (typeof value !== "object") throw new BadValue(`${typeof value} is not JSON-serialisable`);
  if (depth >= MAX_PAYLOAD_DEPTH) throw new BadValue(`nested deeper than ${MAX_PAYLOAD_DEPTH} levels`);
  if (Array.isArray(value)) {
    value.forEach((item, index) => {
      try {
        checkPlain(item, depth + 1);
      } catch (error) {
        if (error instanceof BadValue) error.location.push(`[${index}]`);
        throw error;
      }
    });
    return;
  }
  if (!isPlainObject(value)) throw new BadValue(`${(value as object).constructor?.name ?? "object"} is not JSON-serialisable`);
  for (const [key, item] of Object.entries(value)) {
    try {
      checkPlain(item, depth + 1);
    } catch (error) {
      if (error instanceof BadValue) error.location.push(`[${JSON.stringify(key)}]`);
      throw error;
    }
  }
}

/**
 * `record` with a payload of its own: what the participant does after the export (a
 * commit that releases admission, section 4.8 item 9) cannot change what is written.
 * Plain objects and arrays are copied, key order kept; anything else (or anything nested
 * deeper than a payload may be) is kept as it is, so the write still refuses it.
 */
export function detached(record: Record): Record {
  return { episode: record.episode, key: record.key, payload: copyPlain(record.payload, 0) as JsonObject };
}

function copyPlain(value: unknown, depth: number): unknown {
  if (value === null || typeof value !== "object" || depth > MAX_PAYLOAD_DEPTH) return value;
  if (Array.isArray(value)) return value.map((item: unknown) => copyPlain(item, depth + 1));
  if (!isPlainObject(value)) return value;
  // fromEntries defines own properties, so a `__proto__` key stays a key.
  return Object.fromEntries(Object.entries(value).map(([key, item]) => [key, copyPlain(item, depth + 1)]));
}

/** Serialise every record (nothing is written if one fails) and describe the file. */
export function encodeRecords(instance: string, records: Iterable<Record>): { data: Buffer; ref: ArtifactRef; episodes: EpisodeId[] } {
  const lines: string[] = [];
  const episodes = new Map<string, EpisodeId>();
  for (const record of records) {
    validateId(record.key, "record key");
    if (!isPlainObject(record.payload)) {
      throw new UnserialisableRecordError(record.episode, record.key, "payload", "must be an object");
    }
    try {
      checkPlain(record.payload, 1);
    } catch (error) {
      if (!(error instanceof BadValue)) throw error;
      throw new UnserialisableRecordError(record.episode, record.key, `payload${error.location.reverse().join("")}`, error.message);
    }
    lines.push(`${encodeCompact({ episode: episodeJson(record.episode), key: record.key, payload: record.payload })}\n`);
    episodes.set(episodeKey(record.episode), record.episode);
  }
  const data = Buffer.from(lines.join(""), "ascii");
  const sha256 = sha256Hex(data);
  const ref: ArtifactRef = { path: `${instance}/records-${sha256}.jsonl`, sha256, sizeBytes: data.length, recordCount: lines.length };
  return { data, ref, episodes: [...episodes.values()].sort(compareEpisodes) };
}

/** What a commit replies for a manifest: its own reference, artifacts and episodes. */
export function entryOf(manifest: Manifest, bytes: Buffer): SnapshotEntry {
  return {
    checkpointId: manifest.checkpointId,
    manifest: { path: `${manifest.instance}/${MANIFEST_NAME}`, sha256: sha256Hex(bytes), sizeBytes: bytes.length, recordCount: 0 },
    artifacts: manifest.artifacts,
    episodes: manifest.episodes,
  };
}

function exactFields(value: unknown, fields: readonly string[], what: string): { [key: string]: unknown } {
  if (!isPlainObject(value)) throw new Error(`${what} must be an object`);
  const keys = Object.keys(value);
  const unknown = keys.filter((k) => !fields.includes(k)).sort();
  const missing = fields.filter((k) => !keys.includes(k)).sort();
  if (unknown.length > 0 || missing.length > 0) {
    throw new Error(`${what}: unknown fields ${JSON.stringify(unknown)}, missing fields ${JSON.stringify(missing)}`);
  }
  return value;
}

function count(value: unknown, what: string): number {
  if (typeof value !== "number" || !Number.isSafeInteger(value) || value < 0) throw new Error(`${what} must be an integer >= 0`);
  return value;
}

function parseEpisode(value: unknown): EpisodeId {
  const fields = exactFields(value, ["rollout_id", "attempt"], "episode");
  const { rollout_id: rolloutId, attempt } = fields;
  if (typeof rolloutId !== "string") throw new Error("episode rollout_id must be a string");
  if (typeof attempt !== "number" || !Number.isInteger(attempt)) throw new Error("episode attempt must be an integer");
  return makeEpisode(rolloutId, attempt);
}

function errorText(error: unknown): string {
  return error instanceof Error ? error.message : String(error);
}

/**
 * Parse and check a participant manifest (section 8.5 item 2): strict JSON, exact
 * fields, schema version, instance, one artifact whose path carries its digest and stays
 * in the directory, sorted unique episodes.
 */
export function parseManifest(snapshot: string, instance: string, data: Buffer): Manifest {
  const invalid = (detail: string, kind: Corruption = "manifest_invalid"): never => {
    throw new CorruptSnapshotError(snapshot, instance, kind, `${MANIFEST_NAME}: ${detail}`);
  };
  let document: { [key: string]: unknown };
  try {
    const text = new TextDecoder("utf-8", { fatal: true }).decode(data);
    document = exactFields(parseStrict(text), ["schema_version", "checkpoint_id", "instance", "artifacts", "episodes"], "manifest");
  } catch (error) {
    return invalid(errorText(error));
  }
  try {
    const version = document.schema_version;
    if (version !== SCHEMA_VERSION) throw new Error(`schema_version ${JSON.stringify(version)} is not ${SCHEMA_VERSION}`);
    const checkpointId = validateId(document.checkpoint_id, "checkpoint_id");
    if (document.instance !== instance) throw new Error(`names instance ${JSON.stringify(document.instance)}`);
    const rawArtifacts = document.artifacts;
    if (!Array.isArray(rawArtifacts) || rawArtifacts.length !== 1) throw new Error(`schema ${SCHEMA_VERSION} lists exactly one records file`);
    const rawEpisodes = document.episodes;
    if (!Array.isArray(rawEpisodes)) throw new Error("episodes must be a list");
    const episodes = rawEpisodes.map(parseEpisode);
    for (let i = 1; i < episodes.length; i++) {
      if (compareEpisodes(episodes[i - 1] as EpisodeId, episodes[i] as EpisodeId) >= 0) throw new Error("episodes must be sorted and unique");
    }
    const artifacts: ArtifactRef[] = [];
    for (const item of rawArtifacts) {
      const fields = exactFields(item, ["path", "sha256", "size_bytes", "record_count"], "artifact");
      const { path, sha256 } = fields;
      if (typeof sha256 !== "string" || !SHA256_HEX.test(sha256)) throw new Error(`sha256 ${JSON.stringify(sha256)} is not 64 lowercase hex characters`);
      if (typeof path !== "string") throw new Error("artifact path must be a string");
      const parts = path.split("/");
      if (parts.length !== 2 || parts[0] !== instance || !isValidId(parts[1])) {
        invalid(`artifact path ${JSON.stringify(path)} leaves the instance directory`, "path_escape");
      }
      if (path !== `${instance}/records-${sha256}.jsonl`) throw new Error(`artifact path ${JSON.stringify(path)} does not match its digest`);
      artifacts.push({ path, sha256, sizeBytes: count(fields.size_bytes, "size_bytes"), recordCount: count(fields.record_count, "record_count") });
    }
    return { checkpointId, instance, artifacts, episodes };
  } catch (error) {
    if (error instanceof CorruptSnapshotError) throw error;
    return invalid(errorText(error));
  }
}

/** The records of a verified file (size and digest already checked), parsed strictly. */
export function decodeRecords(snapshot: string, instance: string, ref: ArtifactRef, data: Buffer): Record[] {
  const invalid = (kind: Corruption, detail: string): never => {
    throw new CorruptSnapshotError(snapshot, instance, kind, `${ref.path}: ${detail}`);
  };
  let text = "";
  try {
    text = new TextDecoder("utf-8", { fatal: true }).decode(data);
  } catch (error) {
    invalid("record_invalid", errorText(error));
  }
  const lines = text.split("\n");
  // Every record ends with a newline, so the split leaves exactly one empty tail.
  if (lines.pop() !== "") invalid("record_invalid", "ends mid-record");
  if (lines.length !== ref.recordCount) {
    invalid("record_count_mismatch", `holds ${lines.length} records, the manifest says ${ref.recordCount}`);
  }
  return lines.map((line, index) => {
    try {
      const fields = exactFields(parseStrict(line, MAX_PAYLOAD_DEPTH + 2), ["episode", "key", "payload"], "record");
      if (!isPlainObject(fields.payload)) throw new Error("payload must be an object");
      return { episode: parseEpisode(fields.episode), key: validateId(fields.key, "record key"), payload: fields.payload as JsonObject };
    } catch (error) {
      return invalid("record_invalid", `line ${index + 1}: ${errorText(error)}`);
    }
  });
}
