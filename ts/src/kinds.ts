/**
 * What the runtime needs from each kind it hosts (agent, resources). A port of the
 * Python `KindHost` protocol (turnpoint.participant_sdk._shared).
 */
import type { WorkKey } from "./core.js";
import type { EpisodeId } from "./ids.js";
import type { ParticipantKind, RecoveryMode, VerifyMode } from "./protocol.js";
import type { Record } from "./records.js";

export interface KindDescription {
  readonly verifyMode?: VerifyMode;
  readonly groupScored?: boolean;
  readonly groupSize?: number;
  readonly environment?: string;
}

export interface KindHost {
  /** Names the kind's entries in the work table (`WorkKey.slot`). */
  readonly slot: string;
  /** Names the records it exports; null: it exports nothing. */
  readonly recordKey: string | null;
  readonly kind: ParticipantKind;
  readonly recoveryMode: RecoveryMode;
  /** Admission just closed; a failure makes the prepare fail and reopen (section 5.1 item 3). */
  admissionClosed(): Promise<void>;
  /** Admission just reopened (also after a restore ends). */
  admissionOpened(): Promise<void>;
  /** Records of the frozen state of `keys` (every key at least one record). */
  exportRecords(keys: readonly WorkKey[], signal: AbortSignal): Promise<Record[]>;
  /** Throw (INVALID_CHECKPOINT_STATE) if `record` cannot be installed. */
  validate(record: Record): void;
  /** Install a validated record as `episode` (attempt N+1) and add its entry. */
  install(record: Record, episode: EpisodeId): Promise<WorkKey>;
  /** Stop the work of `key` and free its state; the runtime then drops the entry. */
  stop(key: WorkKey): Promise<void>;
  /** Stop everything (process shutdown). */
  close(): Promise<void>;
  describe(): KindDescription;
}

/** Deep equality of plain JSON values; object key order does not matter. */
export function sameJson(a: unknown, b: unknown): boolean {
  if (a === b) return true;
  if (typeof a !== typeof b || a === null || b === null || typeof a !== "object") return false;
  if (Array.isArray(a) !== Array.isArray(b)) return false;
  if (Array.isArray(a)) {
    const other = b as unknown[];
    return a.length === other.length && a.every((item, i) => sameJson(item, other[i]));
  }
  const left = a as { [key: string]: unknown };
  const right = b as { [key: string]: unknown };
  const keys = Object.keys(left);
  return keys.length === Object.keys(right).length && keys.every((key) => Object.hasOwn(right, key) && sameJson(left[key], right[key]));
}
