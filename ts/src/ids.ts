/**
 * Identifier rules (docs/spec.md section 2.4) and episodes (section 2.5), in one place.
 *
 * A valid id is 1 to 128 characters of [A-Za-z0-9._-], the first a letter or digit, so
 * it is always one harmless path component.
 */
import { TurnpointError } from "./errors.js";

export const MAX_ID_LENGTH = 128;
const ID_PATTERN = /^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$/;

/** Why an id (or attempt) is invalid; `field` names what was validated. */
export class InvalidIdError extends TurnpointError {
  readonly field: string;

  constructor(field: string, value: unknown, why: string, metadata: Record<string, string> = {}) {
    const shown = typeof value === "string" && value.length > 40 ? `${value.slice(0, 40)}...` : String(value);
    super("INVALID_ARGUMENT", `invalid ${field} ${JSON.stringify(shown)}: ${why}`, { field, ...metadata });
    this.name = "InvalidIdError";
    this.field = field;
  }
}

export function isValidId(value: unknown): value is string {
  return typeof value === "string" && ID_PATTERN.test(value);
}

/** `value` if it is a valid protocol id, else INVALID_ARGUMENT (metadata `field`). */
export function validateId(value: unknown, field = "id"): string {
  if (typeof value !== "string") throw new InvalidIdError(field, value, "must be a string");
  if (!value) throw new InvalidIdError(field, value, "must not be empty");
  if (value.length > MAX_ID_LENGTH) throw new InvalidIdError(field, value, `must be at most ${MAX_ID_LENGTH} characters`);
  if (!ID_PATTERN.test(value)) {
    if (!/^[A-Za-z0-9]/.test(value)) throw new InvalidIdError(field, value, "must start with a letter or digit");
    throw new InvalidIdError(field, value, "may contain only letters, digits, '.', '_' and '-'");
  }
  return value;
}

/** One attempt of one rollout. Plain data; compare with `sameEpisode`, key with `episodeKey`. */
export interface EpisodeId {
  readonly rolloutId: string;
  readonly attempt: number;
}

export function episode(rolloutId: string, attempt = 0, at?: string): EpisodeId {
  const extra = at === undefined ? {} : { at };
  try {
    validateId(rolloutId, "rollout_id");
  } catch (error) {
    if (error instanceof InvalidIdError) throw new InvalidIdError("rollout_id", rolloutId, "is not a valid id", extra);
    throw error;
  }
  if (!Number.isInteger(attempt) || attempt < 0) {
    throw new InvalidIdError("attempt", attempt, "must be an integer >= 0", extra);
  }
  return { rolloutId, attempt };
}

/** `rollout_id#attempt`, the text form of section 1.5 (also a map key). */
export function episodeKey(e: EpisodeId): string {
  return `${e.rolloutId}#${e.attempt}`;
}

export function parseEpisodeKey(text: string): EpisodeId {
  const at = text.lastIndexOf("#");
  const attempt = Number(text.slice(at + 1));
  return episode(text.slice(0, at), attempt);
}

export function sameEpisode(a: EpisodeId, b: EpisodeId): boolean {
  return a.rolloutId === b.rolloutId && a.attempt === b.attempt;
}

/** Section 1.5 order: rollout id in byte order (ids are ASCII), then attempt. */
export function compareEpisodes(a: EpisodeId, b: EpisodeId): number {
  if (a.rolloutId !== b.rolloutId) return a.rolloutId < b.rolloutId ? -1 : 1;
  return a.attempt - b.attempt;
}

export function nextAttempt(e: EpisodeId): EpisodeId {
  return { rolloutId: e.rolloutId, attempt: e.attempt + 1 };
}

/** Sorted and unique, the form every episode list on the wire takes. */
export function sortedEpisodes(items: Iterable<EpisodeId>): EpisodeId[] {
  const unique = new Map<string, EpisodeId>();
  for (const item of items) unique.set(episodeKey(item), item);
  return [...unique.values()].sort(compareEpisodes);
}

/** `("ck", 7n)` for `"ck-000000000007"`; null for an id without a sequence (section 2.6). */
export function sequenceKey(checkpointId: string): [string, bigint] | null {
  const dash = checkpointId.lastIndexOf("-");
  if (dash <= 0) return null;
  const digits = checkpointId.slice(dash + 1);
  if (!/^[0-9]{1,18}$/.test(digits)) return null;
  return [checkpointId.slice(0, dash), BigInt(digits)];
}

/** Whether `newer` has the same prefix as `older` and a higher sequence. */
export function supersedes(newer: string, older: string): boolean {
  const a = sequenceKey(newer);
  const b = sequenceKey(older);
  return a !== null && b !== null && a[0] === b[0] && a[1] > b[1];
}
