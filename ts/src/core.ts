/**
 * The participant's control core: the protocol as plain state, decided in one place.
 * A port of the Python reference (turnpoint.participant_sdk._core), rule for rule.
 *
 * No timers, no I/O, no wall clock: every method that depends on time takes `now`
 * (seconds on any monotonic scale the caller picks), so a test drives hours of leases
 * in microseconds. The runtime (`runtime.ts`) calls it from one place and turns its
 * decisions into waits, jobs and file writes.
 *
 * What it keeps:
 * - the phase machine IDLE -> PREPARING -> PREPARED -> COMMITTED, IDLE -> RESTORED, back
 *   to IDLE by resume or lease expiry. Admission is derived from the phase, so the two
 *   never disagree (section 4.1 item 2);
 * - the lease of the active checkpoint (section 4.2);
 * - recorded answers of the active checkpoint keyed by (id, operation) with an argument
 *   fingerprint: a retry replays, other arguments are a conflict (section 4.3);
 * - finished ids (section 4.4) and fencing with a bounded log of answered request ids
 *   (section 2.2);
 * - the work table with incrementally kept readiness counts (section 4.1);
 * - refusal marks of retired attempts, and the freshness a restore requires (a restore
 *   into a running participant, section 4.16, needs none: it retires what it replaces).
 */
import { TurnpointError } from "./errors.js";
import type { EpisodeId } from "./ids.js";
import { compareEpisodes, episodeKey, nextAttempt, sequenceKey, supersedes, validateId } from "./ids.js";
import type { Blocker, CompletionReceipt, EpisodeState, Fence, Phase, ReadinessReport } from "./protocol.js";
import { BLOCKING_STATES } from "./protocol.js";

function error(reason: TurnpointError["reason"], message: string, metadata: Record<string, string | number | bigint> = {}): TurnpointError {
  const text: Record<string, string> = {};
  for (const [key, value] of Object.entries(metadata)) text[key] = String(value);
  return new TurnpointError(reason, message, text);
}

/** Validate a protocol id; a bad one is INVALID_ARGUMENT and changes nothing. */
export function checkedId(value: unknown, field: string): string {
  return validateId(value, field);
}

/**
 * Finished checkpoint (and restore) ids (section 4.4 item 3): a bounded LRU of exact ids
 * and, per prefix, the highest finished sequence, so an evicted id never looks fresh.
 */
export class FinishedCheckpoints {
  private readonly recent = new Map<string, null>();
  private readonly highest = new Map<string, bigint>();

  constructor(
    private readonly maxIds = 1024,
    private readonly maxPrefixes = 256,
  ) {
    if (maxIds < 1 || maxPrefixes < 1) throw new RangeError("bounds must be >= 1");
  }

  add(checkpointId: string): void {
    this.recent.delete(checkpointId);
    this.recent.set(checkpointId, null);
    while (this.recent.size > this.maxIds) this.recent.delete(this.recent.keys().next().value as string);
    const key = sequenceKey(checkpointId);
    if (key !== null) {
      const [prefix, sequence] = key;
      const known = this.highest.get(prefix);
      this.highest.delete(prefix);
      this.highest.set(prefix, known === undefined || sequence > known ? sequence : known);
      while (this.highest.size > this.maxPrefixes) this.highest.delete(this.highest.keys().next().value as string);
    }
  }

  has(checkpointId: string): boolean {
    if (this.recent.has(checkpointId)) return true;
    const key = sequenceKey(checkpointId);
    if (key === null) return false;
    const highest = this.highest.get(key[0]);
    return highest !== undefined && key[1] <= highest;
  }

  get size(): number {
    return this.recent.size;
  }
}

/** What a request id was answered with: a result, or the TurnpointError thrown. */
export interface RecordedAnswer {
  readonly operation: string;
  readonly answer: unknown;
}

/** Bounded LRU of answered request ids, for fenced retries after a lost reply. */
export class AnswerLog {
  private readonly answers = new Map<string, RecordedAnswer>();

  constructor(private readonly maxRequests = 4096) {
    if (maxRequests < 1) throw new RangeError("maxRequests must be >= 1");
  }

  record(requestId: string, operation: string, answer: unknown): void {
    if (!requestId) return;
    this.answers.delete(requestId);
    this.answers.set(requestId, { operation, answer });
    while (this.answers.size > this.maxRequests) this.answers.delete(this.answers.keys().next().value as string);
  }

  get(requestId: string): RecordedAnswer | undefined {
    return requestId ? this.answers.get(requestId) : undefined;
  }

  get size(): number {
    return this.answers.size;
  }
}

/** An episode's active time: runs while it works, stops while a checkpoint parks it. */
export class ActiveClock {
  private spent = 0;
  private since: number | null;

  constructor(now: number) {
    this.since = now;
  }

  get paused(): boolean {
    return this.since === null;
  }

  pause(now: number): void {
    if (this.since !== null) {
      this.spent += Math.max(0, now - this.since);
      this.since = null;
    }
  }

  resume(now: number): void {
    if (this.since === null) this.since = now;
  }

  active(now: number): number {
    return this.spent + (this.since === null ? 0 : Math.max(0, now - this.since));
  }
}

/** One piece of work in the table: an episode and what of it (`run`, `session`). */
export interface WorkKey {
  readonly episode: EpisodeId;
  readonly slot: string;
}

export function workKey(episode: EpisodeId, slot: string): WorkKey {
  return { episode, slot };
}

function keyText(key: WorkKey): string {
  return `${key.slot}|${episodeKey(key.episode)}`;
}

export function compareKeys(a: WorkKey, b: WorkKey): number {
  return compareEpisodes(a.episode, b.episode) || (a.slot < b.slot ? -1 : a.slot > b.slot ? 1 : 0);
}

interface Entry {
  readonly key: WorkKey;
  state: EpisodeState;
  receipt: CompletionReceipt | null;
  detail: string;
  /** An in-flight request that is safe to run again (a REPLAY verify) never blocks. */
  replayable: boolean;
  boundaryIndex: number;
  turnIndex: number;
}

function blocks(entry: Entry): boolean {
  return BLOCKING_STATES.has(entry.state) && !entry.replayable;
}

export interface EntryView {
  readonly key: WorkKey;
  readonly state: EpisodeState;
  readonly receipt: CompletionReceipt | null;
  readonly detail: string;
  readonly replayable: boolean;
  readonly boundaryIndex: number;
  readonly turnIndex: number;
  readonly blocks: boolean;
}

/** One entry changed state or sealed a boundary (what WatchBoundaries streams). */
export interface CoreEvent {
  readonly episode: EpisodeId;
  readonly slot: string;
  readonly state: EpisodeState;
  readonly boundaryIndex: number;
  readonly turnIndex: number;
  readonly at: number;
}

export type StartKind = "new" | "join" | "replay";

export interface PrepareStart {
  /** This call closed admission (run the kinds' close hooks; on failure `abortPrepare`). */
  readonly opened: boolean;
  /** The lower checkpoint this one replaced (its background work must be stopped). */
  readonly superseded: string | null;
  /** The recorded ready answer, if any. */
  readonly replay: unknown;
}

export interface CommitStart {
  readonly kind: StartKind;
  readonly answer?: unknown;
  readonly exportKeys: readonly WorkKey[];
  readonly discardKeys: readonly WorkKey[];
}

export interface RestoreStart {
  readonly kind: StartKind;
  readonly answer?: unknown;
}

/**
 * What a restore into a running participant replaces (section 4.16). `scope`: the saved
 * attempts N it continues as N+1; every attempt of their rollouts up to N is retired
 * first. `retireUnscoped`: every other entry held goes too.
 */
export interface RunningRestore {
  readonly scope: readonly EpisodeId[];
  readonly retireUnscoped: boolean;
}

type RestoreOperation = "restore" | "restore_running";
/** Saved attempts listed in one `stale_episodes` refusal: the trailer stays small, and the
 * coordinator's next round learns the rest (section 4.16 item 3). */
export const MAX_STALE_LISTED = 64;

const OTHER_RESTORE: { readonly [K in RestoreOperation]: RestoreOperation } = { restore: "restore_running", restore_running: "restore" };

export interface CoreOptions {
  readonly defaultLeaseS?: number;
  readonly maxFinishedIds?: number;
  readonly maxAnsweredRequests?: number;
  readonly recordEvents?: boolean;
}

/** The whole control state of one participant; see the module comment. */
export class ParticipantCore {
  private readonly defaultLeaseS: number;
  private _phase: Phase = "IDLE";
  private active: string | null = null;
  private activeEpoch = 0n;
  private leaseS: number;
  private _leaseExpiresAt: number | null = null;
  private _leaseExpiries = 0;
  /** `${id}\u0000${operation}` -> [fingerprint, answer or undefined while running]. */
  private answers = new Map<string, [string, unknown]>();
  private readonly finished: FinishedCheckpoints;
  private _fence: Fence | null = null;
  private readonly requests: AnswerLog;

  private readonly entries = new Map<string, Entry>();
  private readonly byRollout = new Map<string, Set<string>>();
  /** Insertion-ordered: the first N blockers are the N oldest. */
  private readonly blockers = new Map<string, null>();
  private readonly restartKeys = new Map<string, WorkKey>();
  private readonly counts = new Map<EpisodeState, number>();
  private pendingRestarts = new Map<string, WorkKey>();
  private readonly marks = new Map<string, number>();
  private _fresh = true;
  private _restoring = false;
  private restoreInstalled: WorkKey[] = [];
  private readonly recordEvents: boolean;
  private events: CoreEvent[] = [];
  private _version = 0;

  constructor(options: CoreOptions = {}) {
    const lease = options.defaultLeaseS ?? 60;
    if (!(lease > 0)) throw new RangeError("defaultLeaseS must be > 0");
    this.defaultLeaseS = lease;
    this.leaseS = lease;
    this.finished = new FinishedCheckpoints(options.maxFinishedIds ?? 1024);
    this.requests = new AnswerLog(options.maxAnsweredRequests ?? 4096);
    this.recordEvents = options.recordEvents ?? false;
  }

  // ---------------------------------------------------------------- read side

  get phase(): Phase {
    return this._phase;
  }
  get admissionOpen(): boolean {
    return this._phase === "IDLE";
  }
  get activeCheckpointId(): string | null {
    return this.active;
  }
  get leaseExpiresAt(): number | null {
    return this._leaseExpiresAt;
  }
  get leaseExpiries(): number {
    return this._leaseExpiries;
  }
  get fence(): Fence | null {
    return this._fence;
  }
  get epoch(): bigint {
    return this._fence?.epoch ?? 0n;
  }
  /** No data-plane work was ever admitted and no restore installed anything. */
  get fresh(): boolean {
    return this._fresh;
  }
  get restoring(): boolean {
    return this._restoring;
  }
  get ready(): boolean {
    return this.blockers.size === 0;
  }
  get blockerCount(): number {
    return this.blockers.size;
  }
  /** Bumped on every change a readiness report or status could show. */
  get version(): number {
    return this._version;
  }
  get refusedRollouts(): number {
    return this.marks.size;
  }
  refusalMark(rolloutId: string): number | undefined {
    return this.marks.get(rolloutId);
  }
  isFinished(checkpointId: string): boolean {
    return this.finished.has(checkpointId);
  }
  entry(key: WorkKey): EntryView | undefined {
    const entry = this.entries.get(keyText(key));
    return entry === undefined ? undefined : view(entry);
  }
  *allEntries(): IterableIterator<EntryView> {
    for (const entry of this.entries.values()) yield view(entry);
  }
  keysOf(rolloutId: string): WorkKey[] {
    const keys = [...(this.byRollout.get(rolloutId) ?? [])].map((text) => (this.entries.get(text) as Entry).key);
    return keys.sort(compareKeys);
  }
  isRestart(key: WorkKey): boolean {
    return this.restartKeys.has(keyText(key));
  }

  /** The report for a reply: O(cap + restarts), never a scan of the table. */
  readiness(maxBlockers: number): ReadinessReport {
    const listed: Blocker[] = [];
    for (const text of this.blockers.keys()) {
      if (listed.length >= Math.max(0, maxBlockers)) break;
      const entry = this.entries.get(text) as Entry;
      listed.push({ episode: entry.key.episode, state: entry.state, receipt: entry.receipt, detail: entry.detail });
    }
    const counts = [...this.counts.entries()]
      .filter(([, count]) => count > 0)
      .sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0));
    const restarts = new Map<string, EpisodeId>();
    for (const key of this.restartKeys.values()) restarts.set(episodeKey(key.episode), key.episode);
    return {
      ready: this.blockers.size === 0,
      blockerCount: this.blockers.size,
      blockers: listed,
      counts,
      restarts: [...restarts.values()].sort(compareEpisodes),
    };
  }

  /** Blocker count and counts by state from a full scan (what tests compare against). */
  recount(): [number, Map<EpisodeState, number>] {
    const counts = new Map<EpisodeState, number>();
    let blocking = 0;
    for (const entry of this.entries.values()) {
      counts.set(entry.state, (counts.get(entry.state) ?? 0) + 1);
      if (blocks(entry)) blocking++;
    }
    return [blocking, counts];
  }

  /** Counts kept incrementally (non-zero only), for comparison with `recount`. */
  keptCounts(): Map<EpisodeState, number> {
    return new Map([...this.counts.entries()].filter(([, count]) => count > 0));
  }

  drainEvents(): CoreEvent[] {
    const events = this.events;
    this.events = [];
    return events;
  }

  // ---------------------------------------------------------------- fencing

  /**
   * Adopt a higher epoch; refuse a lower one unless `requestId` was answered (section
   * 2.2). Returns the recorded answer for a fenced retry, undefined when it may proceed.
   */
  checkFence(fence: Fence, requestId: string): RecordedAnswer | undefined {
    const current = this._fence;
    if (current === null || fence.epoch > current.epoch) {
      this._fence = fence;
      this._version++;
      return undefined;
    }
    if (fence.epoch === current.epoch && fence.coordinatorId === current.coordinatorId) return undefined;
    const recorded = this.requests.get(requestId);
    if (recorded !== undefined) return recorded;
    throw error(
      "FENCED",
      `coordinator ${JSON.stringify(fence.coordinatorId)} epoch ${fence.epoch} is fenced by ` +
        `${JSON.stringify(current.coordinatorId)} epoch ${current.epoch}`,
      { epoch: current.epoch, request_epoch: fence.epoch },
    );
  }

  /**
   * A data-plane call (Run, Acknowledge) from a coordinator the control plane fenced out
   * is refused; a higher epoch is adopted; a call without a fence is not fenced
   * (section 6.9).
   */
  checkDataFence(fence: Fence | null): void {
    if (fence === null) return;
    const current = this._fence;
    if (current === null || fence.epoch > current.epoch) {
      this._fence = fence;
      this._version++;
      return;
    }
    if (fence.epoch === current.epoch && fence.coordinatorId === current.coordinatorId) return;
    throw error(
      "FENCED",
      `a data-plane call from coordinator ${JSON.stringify(fence.coordinatorId)} epoch ` +
        `${fence.epoch} is fenced by ${JSON.stringify(current.coordinatorId)} epoch ${current.epoch}`,
      { epoch: current.epoch, request_epoch: fence.epoch },
    );
  }

  /** Read-only calls remember a higher epoch but are never refused (section 2.2 item 5). */
  observeFence(fence: Fence | null): void {
    if (fence !== null && (this._fence === null || fence.epoch > this._fence.epoch)) {
      this._fence = fence;
      this._version++;
    }
  }

  recordAnswer(requestId: string, operation: string, answer: unknown): void {
    this.requests.record(requestId, operation, answer);
  }

  // ---------------------------------------------------------------- lease

  private leaseLength(leaseS: number | null): number {
    if (leaseS === null || leaseS === 0) return this.active !== null ? this.leaseS : this.defaultLeaseS;
    if (!(leaseS > 0)) throw error("INVALID_ARGUMENT", `lease must be > 0, got ${leaseS}`, { field: "lease" });
    return leaseS;
  }

  private renewAt(now: number, leaseS: number | null = null): void {
    this.leaseS = this.leaseLength(leaseS);
    const target = now + this.leaseS;
    const current = this._leaseExpiresAt;
    this._leaseExpiresAt = current === null ? target : Math.max(current, target);
    this._version++;
  }

  /** Extend the lease of the active checkpoint to at least `now + lease`. */
  renew(checkpointId: string, leaseS: number | null, now: number): number {
    this.requireActive(checkpointId);
    this.renewAt(now, leaseS);
    return this._leaseExpiresAt as number;
  }

  /** The active id whose lease ran out (the caller resumes it), or null. */
  leaseExpired(now: number): string | null {
    if (this.active === null || this._leaseExpiresAt === null) return null;
    return now >= this._leaseExpiresAt ? this.active : null;
  }

  // ---------------------------------------------------------------- phases

  private requireActive(checkpointId: string): void {
    checkedId(checkpointId, "checkpoint_id");
    if (checkpointId === this.active) return;
    if (this.finished.has(checkpointId)) {
      throw error("STALE_CHECKPOINT", `checkpoint ${JSON.stringify(checkpointId)} is finished`, { checkpoint_id: checkpointId });
    }
    throw error(
      "INVALID_PHASE",
      `checkpoint ${JSON.stringify(checkpointId)} is not active (phase ${this._phase}, active ${JSON.stringify(this.active)})`,
      { checkpoint_id: checkpointId, phase: this._phase },
    );
  }

  private setPhase(phase: Phase): void {
    if (phase !== this._phase) {
      this._phase = phase;
      this._version++;
    }
  }

  private refreshReadinessPhase(): void {
    if (this._phase === "PREPARING" || this._phase === "PREPARED") {
      this.setPhase(this.blockers.size === 0 ? "PREPARED" : "PREPARING");
    }
  }

  private dropAnswers(checkpointId: string): void {
    for (const key of [...this.answers.keys()]) {
      if (key.startsWith(`${checkpointId}\u0000`)) this.answers.delete(key);
    }
  }

  private finishActive(now: number, reopen: boolean): string {
    const ended = this.active as string;
    this.finished.add(ended);
    this.dropAnswers(ended);
    this.active = null;
    this._leaseExpiresAt = null;
    if (reopen) {
      this.setPhase("IDLE");
      this.applyPendingRestarts(now);
    }
    this._version++;
    return ended;
  }

  /** Open `checkpointId` (closing admission) or repeat the request for it (section 4.6). */
  beginPrepare(checkpointId: string, leaseS: number | null, now: number, epoch = 0n): PrepareStart {
    checkedId(checkpointId, "checkpoint_id");
    const lease = this.leaseLength(leaseS);
    if (checkpointId === this.active) {
      if (this._phase === "RESTORED") {
        throw error("INVALID_PHASE", `${JSON.stringify(checkpointId)} is a restore, not a checkpoint`, { phase: this._phase });
      }
      this.renewAt(now, lease);
      const recorded = this.answers.get(`${checkpointId}\u0000prepare`);
      return { opened: false, superseded: null, replay: recorded?.[1] };
    }
    if (this.finished.has(checkpointId)) {
      throw error("STALE_CHECKPOINT", `checkpoint ${JSON.stringify(checkpointId)} is finished`, { checkpoint_id: checkpointId });
    }
    let superseded: string | null = null;
    if (this.active !== null) {
      if (this._phase === "RESTORED") {
        throw error("INVALID_PHASE", `restore ${JSON.stringify(this.active)} holds the participant until it is resumed`, {
          phase: this._phase,
          active: this.active,
        });
      }
      if (supersedes(this.active, checkpointId)) {
        throw error("STALE_CHECKPOINT", `checkpoint ${JSON.stringify(checkpointId)} is superseded by ${JSON.stringify(this.active)}`, {
          checkpoint_id: checkpointId,
        });
      }
      if (!(supersedes(checkpointId, this.active) || epoch > this.activeEpoch)) {
        throw error("INVALID_PHASE", `checkpoint ${JSON.stringify(this.active)} is active`, { phase: this._phase, active: this.active });
      }
      // A higher id (or a newer coordinator) replaces the open checkpoint without ever
      // reopening admission in between.
      superseded = this.finishActive(now, false);
    }
    this.active = checkpointId;
    this.activeEpoch = epoch;
    this._leaseExpiresAt = null;
    this.renewAt(now, lease);
    this.setPhase("PREPARING");
    this.refreshReadinessPhase();
    return { opened: superseded === null, superseded, replay: undefined };
  }

  /** Closing admission failed: reopen it, as if the prepare never happened. */
  abortPrepare(checkpointId: string): void {
    if (this.active !== checkpointId || (this._phase !== "PREPARING" && this._phase !== "PREPARED")) return;
    this.dropAnswers(checkpointId);
    this.active = null;
    this._leaseExpiresAt = null;
    this.setPhase("IDLE");
    this._version++;
  }

  /**
   * Record a *ready* answer: a repeat of the prepare replays it (section 4.3 item 1).
   * COMMITTED too: a prepare that committed in the same call (section 4.6 item 8).
   */
  recordPrepareAnswer(checkpointId: string, answer: unknown): void {
    if (this.active === checkpointId && (this._phase === "PREPARED" || this._phase === "COMMITTED")) {
      this.answers.set(`${checkpointId}\u0000prepare`, ["", answer]);
    }
  }

  /** Decide a commit: replay, join the running one, or start exporting (section 4.8). */
  beginCommit(checkpointId: string, fingerprint: string, scope: readonly EpisodeId[], now: number): CommitStart {
    this.requireActive(checkpointId);
    if (this._phase === "RESTORED") throw error("INVALID_PHASE", "cannot commit a restore", { phase: this._phase });
    this.renewAt(now);
    const recorded = this.answers.get(`${checkpointId}\u0000commit`);
    if (recorded !== undefined) {
      if (recorded[0] !== fingerprint) {
        throw error("CHECKPOINT_CONFLICT", `checkpoint ${JSON.stringify(checkpointId)} was committed with other arguments`, {
          checkpoint_id: checkpointId,
        });
      }
      if (recorded[1] !== undefined) return { kind: "replay", answer: recorded[1], exportKeys: [], discardKeys: [] };
      return { kind: "join", exportKeys: [], discardKeys: [] };
    }
    if (this._phase !== "PREPARED") {
      throw error(
        "INVALID_PHASE",
        `commit needs a prepared participant; phase is ${this._phase} with ${this.blockers.size} blockers`,
        { phase: this._phase, blocker_count: this.blockers.size },
      );
    }
    const scoped = new Set(scope.map(episodeKey));
    const restarts = [...this.restartKeys.values()]
      .map((key) => key.episode)
      .filter((e) => scoped.has(episodeKey(e)))
      .sort(compareEpisodes);
    if (restarts.length > 0) {
      const first = restarts[0] as EpisodeId;
      throw error("RESTART_IN_SCOPE", `scope names ${restarts.length} restart episodes, e.g. ${episodeKey(first)}`, {
        episode: episodeKey(first),
      });
    }
    const exportKeys: WorkKey[] = [];
    const discardKeys: WorkKey[] = [];
    for (const entry of this.entries.values()) {
      const inScope = scoped.has(episodeKey(entry.key.episode));
      if (inScope && exportable(entry) && !this.refused(entry.key.episode)) exportKeys.push(entry.key);
      if (entry.state === "RESTORED" && !inScope) discardKeys.push(entry.key);
    }
    this.answers.set(`${checkpointId}\u0000commit`, [fingerprint, undefined]);
    return { kind: "new", exportKeys: exportKeys.sort(compareKeys), discardKeys: discardKeys.sort(compareKeys) };
  }

  finishCommit(checkpointId: string, fingerprint: string, answer: unknown): void {
    const recorded = this.answers.get(`${checkpointId}\u0000commit`);
    if (this.active !== checkpointId || recorded === undefined || recorded[0] !== fingerprint) return;
    this.answers.set(`${checkpointId}\u0000commit`, [fingerprint, answer]);
    this.setPhase("COMMITTED");
  }

  /**
   * End `checkpointId` (or a lower active one it supersedes); remember it finished, also
   * for ids never seen (section 4.9). Returns the id it ended, or null.
   */
  resume(checkpointId: string, now: number, expired = false): string | null {
    checkedId(checkpointId, "checkpoint_id");
    let ended: string | null = null;
    const active = this.active;
    if (active !== null && (checkpointId === active || supersedes(checkpointId, active))) {
      if (this._restoring) {
        throw error("INVALID_PHASE", `restore ${JSON.stringify(active)} is still installing`, { phase: this._phase });
      }
      ended = this.finishActive(now, true);
      if (expired) this._leaseExpiries++;
    }
    this.finished.add(checkpointId);
    return ended;
  }

  /**
   * Close admission for a restore (or replay/join a repeat of it). Without `running`: a
   * restore into an idle, fresh participant (section 4.10). With it: a restore into a
   * participant that may hold work (section 4.16); freshness is not required, but a
   * scoped attempt this participant retired, or one it holds a newer attempt of, is
   * refused before anything changes.
   */
  beginRestore(restoreId: string, fingerprint: string, leaseS: number | null, now: number, running: RunningRestore | null = null): RestoreStart {
    checkedId(restoreId, "restore_id");
    const lease = this.leaseLength(leaseS);
    const operation: RestoreOperation = running === null ? "restore" : "restore_running";
    if (restoreId === this.active && this._phase === "RESTORED") {
      const recorded = this.answers.get(`${restoreId}\u0000${operation}`);
      if (recorded === undefined && this.answers.has(`${restoreId}\u0000${OTHER_RESTORE[operation]}`)) {
        throw error("CHECKPOINT_CONFLICT", `restore ${JSON.stringify(restoreId)} was requested by another operation`, {
          checkpoint_id: restoreId,
        });
      }
      if (recorded !== undefined && recorded[0] !== fingerprint) {
        throw error("CHECKPOINT_CONFLICT", `restore ${JSON.stringify(restoreId)} was requested with other arguments`, {
          checkpoint_id: restoreId,
        });
      }
      this.renewAt(now, lease);
      if (recorded !== undefined && recorded[1] !== undefined) return { kind: "replay", answer: recorded[1] };
      return { kind: "join" };
    }
    if (this.finished.has(restoreId)) {
      throw error("STALE_CHECKPOINT", `restore ${JSON.stringify(restoreId)} is finished`, { checkpoint_id: restoreId });
    }
    if (this._phase !== "IDLE") {
      throw error("INVALID_PHASE", `restore needs an idle participant; phase is ${this._phase}`, { phase: this._phase });
    }
    if (running === null && !this._fresh) {
      throw error("INVALID_PHASE", "restore needs a fresh participant; this one already served work", {
        phase: this._phase,
        fresh: "false",
      });
    }
    if (running !== null && !running.retireUnscoped) {
      // A heal: an attempt retired here, or one a newer attempt held here has replaced,
      // is never continued.
      for (const e of [...running.scope].sort(compareEpisodes)) this.checkAttempt(e);
    } else if (running !== null) {
      this.refuseReusedInstalls(running.scope);
    }
    this.active = restoreId;
    this.activeEpoch = this.epoch;
    this._leaseExpiresAt = null;
    this.renewAt(now, lease);
    this.setPhase("RESTORED");
    this._restoring = true;
    this.restoreInstalled = [];
    this.answers.set(`${restoreId}\u0000${operation}`, [fingerprint, undefined]);
    return { kind: "new" };
  }

  /**
   * Flag RETIRING what a running restore replaces, before it installs anything (section
   * 4.16 item 4). Every attempt of a scoped rollout up to the saved one is refused from
   * now on (the refusal mark rises as a Retire's does); with `retireUnscoped` every other
   * entry goes too, without a mark, and every unscoped rollout's mark is forgotten: its
   * coordinator is fenced (section 6.9), and the new one may reuse those attempt numbers.
   * Returns the keys to stop.
   */
  retireForRestore(restoreId: string, running: RunningRestore, now: number): WorkKey[] {
    if (this.active !== restoreId || !this._restoring) throw new Error("retireForRestore outside its restore");
    if (running.retireUnscoped) {
      // The fenced incarnation's marks of unscoped rollouts go too: what it ran of them
      // after the snapshot is not in the new one's lineage, which dispatches them again.
      const scopedIds = new Set(running.scope.map((e) => e.rolloutId));
      for (const rolloutId of [...this.marks.keys()]) {
        if (!scopedIds.has(rolloutId)) {
          this.marks.delete(rolloutId);
          this._version++;
        }
      }
    }
    for (const e of running.scope) {
      this.marks.set(e.rolloutId, Math.max(this.marks.get(e.rolloutId) ?? -1, e.attempt));
      this._version++;
    }
    const scoped = new Set(running.scope.map((e) => e.rolloutId));
    const keys: WorkKey[] = [];
    for (const entry of [...this.entries.values()].sort((a, b) => compareKeys(a.key, b.key))) {
      const rolloutId = entry.key.episode.rolloutId;
      // A newer attempt of a scoped rollout is held only when the fenced incarnation
      // left it (beginRestore refused it otherwise).
      const goes = scoped.has(rolloutId)
        ? entry.key.episode.attempt <= (this.marks.get(rolloutId) as number) || running.retireUnscoped
        : running.retireUnscoped;
      if (goes) {
        this.pendingRestarts.delete(keyText(entry.key));
        this.setState(entry.key, "RETIRING", now);
        keys.push(entry.key);
      }
    }
    return keys;
  }

  installRestored(key: WorkKey, boundaryIndex: number, turnIndex: number, now: number): void {
    if (!this._restoring) throw new Error("installRestored outside a restore");
    if (this.entries.has(keyText(key))) {
      throw error("INVALID_CHECKPOINT_STATE", `${episodeKey(key.episode)} is installed twice`, { episode: episodeKey(key.episode) });
    }
    this.add(key, "RESTORED", now);
    const entry = this.entries.get(keyText(key)) as Entry;
    entry.boundaryIndex = boundaryIndex;
    entry.turnIndex = turnIndex;
    this.restoreInstalled.push(key);
  }

  finishRestore(restoreId: string, answer: unknown): void {
    if (this.active !== restoreId || !this._restoring) return;
    this._restoring = false;
    this._fresh = false;
    this.restoreInstalled = [];
    const operation: RestoreOperation = this.answers.has(`${restoreId}\u0000restore`) ? "restore" : "restore_running";
    const recorded = this.answers.get(`${restoreId}\u0000${operation}`) as [string, unknown];
    this.answers.set(`${restoreId}\u0000${operation}`, [recorded[0], answer]);
    this._version++;
  }

  /** Undo a restore: drop what it installed, reopen, stay fresh. Returns the keys. */
  failRestore(restoreId: string, now: number): WorkKey[] {
    if (this.active !== restoreId || !this._restoring) return [];
    const installed = this.restoreInstalled;
    for (const key of installed) {
      if (this.entries.has(keyText(key))) this.removeEntry(key, now);
    }
    this._restoring = false;
    this.restoreInstalled = [];
    this.dropAnswers(restoreId);
    this.active = null;
    this._leaseExpiresAt = null;
    this.setPhase("IDLE");
    return installed;
  }

  // ---------------------------------------------------------------- the work table

  /**
   * A new incarnation's restore (`retireUnscoped`): refuse every saved attempt N whose
   * N+1 this participant has retired (section 4.16 item 3). N itself may be retired here
   * (the fenced incarnation finished or retried it after the snapshot): the restore
   * continues the snapshot's state of N, and N+1 is above the mark. A retired N+1 is
   * not. The refusal lists every such attempt with its rollout's mark
   * (`stale_episodes`, section 9.5), so the coordinator reruns them all above their marks
   * in one more round. A newer attempt merely held goes with the other unscoped work.
   */
  private refuseReusedInstalls(scope: readonly EpisodeId[]): void {
    const stale = [...scope].sort(compareEpisodes).filter((e) => this.refused(nextAttempt(e)));
    const first = stale[0];
    if (first === undefined) return;
    const markOf = (e: EpisodeId): number => this.marks.get(e.rolloutId) as number;
    const listed = stale
      .slice(0, MAX_STALE_LISTED)
      .map((e) => `${e.rolloutId}#${e.attempt}:${markOf(e)}`)
      .join(",");
    throw error(
      "STALE_ATTEMPT",
      `${stale.length} saved attempt(s) would continue as an attempt retired here, first ${episodeKey(first)} (retired through ${markOf(first)})`,
      { episode: episodeKey(first), retired_through: markOf(first), stale_episodes: listed },
    );
  }

  private refused(e: EpisodeId): boolean {
    const mark = this.marks.get(e.rolloutId);
    return mark !== undefined && e.attempt <= mark;
  }

  /** Refuse a retired attempt, or one older than an attempt held here (sections 2.5, 6.9). */
  checkAttempt(e: EpisodeId): void {
    const mark = this.marks.get(e.rolloutId);
    if (mark !== undefined && e.attempt <= mark) {
      throw error("STALE_ATTEMPT", `${episodeKey(e)} was retired`, { episode: episodeKey(e), retired_through: mark });
    }
    const newer = this.keysOf(e.rolloutId).filter((key) => key.episode.attempt > e.attempt);
    if (newer.length > 0) {
      throw error("STALE_ATTEMPT", `${episodeKey(e)} is superseded by ${episodeKey((newer[0] as WorkKey).episode)}`, {
        episode: episodeKey(e),
      });
    }
  }

  /** Add new data-plane work; refused while a checkpoint holds admission. */
  admit(key: WorkKey, state: EpisodeState, now: number, detail = ""): void {
    this.checkAttempt(key.episode);
    if (this.entries.has(keyText(key))) throw new Error(`${keyText(key)} is already in the table`);
    if (!this.admissionOpen) {
      throw error("ADMISSION_CLOSED", `admission is closed by ${JSON.stringify(this.active)} (${this._phase})`, {
        phase: this._phase,
        checkpoint_id: this.active ?? "",
      });
    }
    this._fresh = false;
    this.add(key, state, now, detail);
  }

  private add(key: WorkKey, state: EpisodeState, now: number, detail = ""): void {
    const text = keyText(key);
    const entry: Entry = { key, state, receipt: null, detail, replayable: false, boundaryIndex: 0, turnIndex: 0 };
    this.entries.set(text, entry);
    let keys = this.byRollout.get(key.episode.rolloutId);
    if (keys === undefined) this.byRollout.set(key.episode.rolloutId, (keys = new Set()));
    keys.add(text);
    this.counts.set(state, (this.counts.get(state) ?? 0) + 1);
    if (blocks(entry)) this.blockers.set(text, null);
    if (state === "RESTART") this.restartKeys.set(text, key);
    this.changed(entry, now);
  }

  /**
   * Move an entry to `state`; returns the state it has afterwards. A restart stays a
   * restart until retired, and nothing leaves RETIRING except removal (section 4.1 item 6).
   */
  setState(
    key: WorkKey,
    state: EpisodeState,
    now: number,
    options: { receipt?: CompletionReceipt; detail?: string; replayable?: boolean } = {},
  ): EpisodeState {
    const text = keyText(key);
    const entry = this.entries.get(text);
    if (entry === undefined) throw new Error(`${text} is not in the table`);
    if (entry.state === "RETIRING" && state !== "RETIRING") return entry.state;
    if (entry.state === "RESTART" && state !== "RETIRING") state = "RESTART";
    const wasBlocking = blocks(entry);
    if (state !== entry.state) {
      this.counts.set(entry.state, (this.counts.get(entry.state) ?? 0) - 1);
      this.counts.set(state, (this.counts.get(state) ?? 0) + 1);
      if (entry.state === "RESTART") this.restartKeys.delete(text);
      if (state === "RESTART") this.restartKeys.set(text, key);
      entry.state = state;
    }
    if (options.receipt !== undefined) entry.receipt = options.receipt;
    if (options.detail !== undefined) entry.detail = options.detail;
    if (options.replayable !== undefined) entry.replayable = options.replayable;
    const nowBlocking = blocks(entry);
    if (nowBlocking && !wasBlocking) this.blockers.set(text, null);
    else if (wasBlocking && !nowBlocking) this.blockers.delete(text);
    this.changed(entry, now);
    return entry.state;
  }

  sealBoundary(key: WorkKey, boundaryIndex: number, turnIndex: number, now: number): void {
    const entry = this.entries.get(keyText(key));
    if (entry === undefined) throw new Error(`${keyText(key)} is not in the table`);
    entry.boundaryIndex = boundaryIndex;
    entry.turnIndex = turnIndex;
    this.changed(entry, now);
  }

  remove(key: WorkKey, now: number): void {
    if (this.entries.has(keyText(key))) this.removeEntry(key, now);
  }

  private removeEntry(key: WorkKey, now: number): void {
    const text = keyText(key);
    const entry = this.entries.get(text) as Entry;
    this.entries.delete(text);
    const keys = this.byRollout.get(key.episode.rolloutId) as Set<string>;
    keys.delete(text);
    if (keys.size === 0) this.byRollout.delete(key.episode.rolloutId);
    this.counts.set(entry.state, (this.counts.get(entry.state) ?? 0) - 1);
    this.blockers.delete(text);
    this.restartKeys.delete(text);
    this.pendingRestarts.delete(text);
    entry.state = "IDLE";
    entry.replayable = false;
    this.changed(entry, now);
  }

  /** A Run or request names restored (or cancelled-at-boundary) state: it is claimed. */
  claimRestored(key: WorkKey, state: EpisodeState, now: number): void {
    this.checkAttempt(key.episode);
    this.setState(key, state, now);
  }

  /**
   * Make an entry a restart; deferred to resume while a checkpoint is open, because the
   * coordinator builds its commit scope from the restarts prepare reported (section 4.1
   * item 7). Returns whether it took effect now.
   */
  markRestart(key: WorkKey, now: number): boolean {
    const text = keyText(key);
    if (!this.entries.has(text)) return false;
    if (!this.admissionOpen) {
      this.pendingRestarts.set(text, key);
      return false;
    }
    this.setState(key, "RESTART", now);
    return true;
  }

  private applyPendingRestarts(now: number): void {
    const pending = [...this.pendingRestarts.values()].sort(compareKeys);
    this.pendingRestarts = new Map();
    for (const key of pending) {
      if (this.entries.has(keyText(key))) this.setState(key, "RESTART", now);
    }
  }

  /** The entry holding `receipt` (the caller frees it and removes it), or undefined. */
  acknowledge(receipt: CompletionReceipt): WorkKey | undefined {
    for (const text of this.byRollout.get(receipt.episode.rolloutId) ?? []) {
      const entry = this.entries.get(text) as Entry;
      if (
        entry.key.episode.attempt === receipt.episode.attempt &&
        entry.receipt !== null &&
        entry.receipt.receiptId === receipt.receiptId &&
        entry.receipt.episode.attempt === receipt.episode.attempt
      ) {
        return entry.key;
      }
    }
    return undefined;
  }

  /**
   * Mark the rollouts refused first, then flag every attempt up to the mark RETIRING
   * (section 4.11). Returns every key still to be stopped and freed, including those of
   * an earlier retire that did not finish.
   */
  beginRetire(episodes: readonly EpisodeId[], now: number): WorkKey[] {
    if (this._phase !== "IDLE" && this._phase !== "RESTORED") {
      throw error("INVALID_PHASE", `retire needs an idle or restored participant; phase is ${this._phase}`, { phase: this._phase });
    }
    if (this._restoring) throw error("INVALID_PHASE", "a restore is still installing", { phase: "RESTORED" });
    for (const e of episodes) {
      const mark = this.marks.get(e.rolloutId) ?? -1;
      // Marks only rise: retiring attempt 1 after attempt 3 leaves 3 refused.
      this.marks.set(e.rolloutId, Math.max(mark, e.attempt));
      this._version++;
    }
    const keys: WorkKey[] = [];
    for (const rolloutId of [...new Set(episodes.map((e) => e.rolloutId))].sort()) {
      const mark = this.marks.get(rolloutId) as number;
      for (const key of this.keysOf(rolloutId)) {
        if (key.episode.attempt <= mark) {
          this.pendingRestarts.delete(keyText(key));
          this.setState(key, "RETIRING", now);
          keys.push(key);
        }
      }
    }
    return keys;
  }

  finishRetire(key: WorkKey, now: number): void {
    const entry = this.entries.get(keyText(key));
    if (entry !== undefined && entry.state === "RETIRING") this.removeEntry(key, now);
  }

  /** Drop refusal marks (section 4.12); refused while open or a retire is unfinished. */
  forget(rolloutIds: readonly string[]): number {
    for (const rolloutId of rolloutIds) checkedId(rolloutId, "rollout_id");
    if (this._phase !== "IDLE" && this._phase !== "RESTORED") {
      throw error("INVALID_PHASE", `forget needs an idle or restored participant; phase is ${this._phase}`, { phase: this._phase });
    }
    for (const rolloutId of rolloutIds) {
      const retiring = this.keysOf(rolloutId).filter((key) => this.entries.get(keyText(key))?.state === "RETIRING");
      if (retiring.length > 0) {
        throw error("RETIRE_INCOMPLETE", `retire of ${episodeKey((retiring[0] as WorkKey).episode)} has not freed its state yet`, {
          rollout_id: rolloutId,
        });
      }
    }
    let dropped = 0;
    for (const rolloutId of new Set(rolloutIds)) {
      if (this.marks.delete(rolloutId)) dropped++;
    }
    if (dropped > 0) this._version++;
    return dropped;
  }

  private changed(entry: Entry, now: number): void {
    this._version++;
    this.refreshReadinessPhase();
    if (this.recordEvents) {
      this.events.push({
        episode: entry.key.episode,
        slot: entry.key.slot,
        state: entry.state,
        boundaryIndex: entry.boundaryIndex,
        turnIndex: entry.turnIndex,
        at: now,
      });
    }
  }
}

function exportable(entry: Entry): boolean {
  return !blocks(entry) && entry.state !== "RESTART" && entry.state !== "RETIRING";
}

function view(entry: Entry): EntryView {
  return {
    key: entry.key,
    state: entry.state,
    receipt: entry.receipt,
    detail: entry.detail,
    replayable: entry.replayable,
    boundaryIndex: entry.boundaryIndex,
    turnIndex: entry.turnIndex,
    blocks: blocks(entry),
  };
}
