/**
 * The runtime around the pure core: what the gRPC adapters call, one method per RPC
 * (docs/spec.md sections 4, 5, 6). A port of turnpoint.participant_sdk._runtime and _reads.py.
 *
 * Every control method takes the request's fence and request id and the time left on
 * the caller's deadline (null: none), and answers before that deadline with a reply
 * margin. Work that needs longer (a write, an install, stopping a retired episode)
 * keeps running as a job; the call fails DEADLINE_EXCEEDED and a retry joins the job.
 * `signal` is the caller's cancellation (a cancelled unary call, a session `cancel`):
 * the call's waits end, the jobs go on (section 3.2 item 9).
 *
 * The clock is injectable (monotonic seconds): it drives leases and budgets, so a test
 * can expire a lease by moving a fake clock and calling `checkLease()`.
 */
import { randomBytes } from "node:crypto";

import { AgentHost } from "./agent.js";
import type { Agent, RunFollower } from "./agent.js";
import type { CoreEvent, RunningRestore, WorkKey } from "./core.js";
import { ParticipantCore, checkedId } from "./core.js";
import { TurnpointError } from "./errors.js";
import type { EpisodeId } from "./ids.js";
import { compareEpisodes, episodeKey, nextAttempt, sortedEpisodes, supersedes } from "./ids.js";
import type { KindHost } from "./kinds.js";
import type {
  ArtifactRef,
  Capability,
  CompletionReceipt,
  EpisodeState,
  Fence,
  JsonObject,
  ParticipantKind,
  Phase,
  ReadinessReport,
  RecoveryLevel,
  RecoveryMode,
  VerifyMode,
} from "./protocol.js";
import { PROTOCOL_VERSION } from "./protocol.js";
import type { Record } from "./records.js";
import { detached } from "./records.js";
import { ResourcesHost } from "./resources.js";
import type { ResourcesServer, Verdict } from "./resources.js";
import type { RuntimeConfig } from "./shared.js";
import { Deadline, Shared, Watcher, invalidRecord, runtimeConfig } from "./shared.js";
import type { SnapshotStore } from "./store.js";
import { WriteTicket, storageError } from "./store.js";

// ------------------------------------------------------------------ replies

export interface Header {
  readonly participantId: string;
  readonly incarnation: string;
  readonly epoch: bigint;
}

export interface Description {
  readonly kind: ParticipantKind;
  readonly instanceName: string;
  readonly protocolVersion: string;
  readonly recoveryMode: RecoveryMode;
  readonly verifyMode: VerifyMode;
  readonly groupScored: boolean;
  readonly groupSize: number;
  readonly supportedLevels: readonly RecoveryLevel[];
  readonly environment: string;
  readonly phase: Phase;
  /** The optional operations served (section 4.5 item 7). */
  readonly capabilities: readonly Capability[];
}

/** Times are seconds since the epoch (for a protobuf Timestamp). */
export interface PrepareResult {
  readonly checkpointId: string;
  readonly phase: Phase;
  readonly readiness: ReadinessReport;
  readonly leaseExpiresAt: number | null;
  /** The prepare also committed, saved nothing, empty scope (section 4.6 item 8); phase COMMITTED. */
  readonly committedEmpty: boolean;
}
export interface RenewResult {
  readonly checkpointId: string;
  readonly phase: Phase;
  readonly leaseExpiresAt: number | null;
}
/**
 * `manifest` is null, and `artifacts` and `exported` are empty, exactly when the commit
 * exported nothing and wrote no file (`savedNothing`, section 4.8 item 7).
 */
export interface CommitResult {
  readonly checkpointId: string;
  readonly manifest: ArtifactRef | null;
  readonly artifacts: readonly ArtifactRef[];
  readonly exported: readonly EpisodeId[];
  readonly savedNothing: boolean;
  /** The commit also ended the checkpoint: no Resume is needed (section 4.8 item 9). */
  readonly released: boolean;
}
export interface ResumeResult {
  readonly checkpointId: string;
  readonly phase: Phase;
  readonly endedActive: boolean;
}
export interface RestoreResult {
  readonly restoreId: string;
  readonly installed: readonly EpisodeId[];
  readonly phase: Phase;
  /** The attempts a restore into a running participant stopped before installing (sorted; section 4.16). */
  readonly retired: readonly EpisodeId[];
}
export interface RetireResult {
  readonly stopped: readonly EpisodeId[];
}
export interface ForgetResult {
  readonly forgotten: number;
}
export interface StatusResult {
  readonly phase: Phase;
  readonly activeCheckpointId: string | null;
  readonly leaseExpiresAt: number | null;
  readonly readiness: ReadinessReport;
  readonly admissionOpen: boolean;
  readonly leaseExpiries: number;
  readonly refusedRollouts: number;
  /** The last checkpoint whose commit finished here (written, saved nothing, or in the prepare). */
  readonly committedCheckpointId: string | null;
}
export type WatchEvent =
  | { readonly type: "readiness"; readonly phase: Phase; readonly readiness: ReadinessReport }
  | {
      readonly type: "boundary";
      readonly phase: Phase;
      readonly episode: EpisodeId;
      readonly state: EpisodeState;
      readonly boundaryIndex: number;
      readonly turnIndex: number;
      readonly at: number;
      readonly slot: string;
    };

/** What a control call brings besides its arguments. */
export interface CallOptions {
  /** Seconds left on the caller's deadline; null: none (60 s apply). */
  readonly timeoutS?: number | null;
  /** The caller's cancellation. */
  readonly signal?: AbortSignal;
}

// ------------------------------------------------------------------ jobs

type Stage = "exporting" | "writing" | "done";

/** A promise whose rejection is always observed, so an abandoned job never crashes the process. */
function observed<T>(promise: Promise<T>): Promise<T> {
  promise.catch(() => undefined);
  return promise;
}

interface CommitJob {
  readonly checkpointId: string;
  readonly fingerprint: string;
  readonly snapshot: string;
  readonly exportKeys: readonly WorkKey[];
  readonly discardKeys: readonly WorkKey[];
  readonly exportAbort: AbortController;
  stage: Stage;
  records: Record[] | null;
  /** The records share nothing with live state (copied for a release). */
  detached: boolean;
  discarded: boolean;
  /** The coordinator asked for a resume in the commit; released: admission reopened. */
  release: boolean;
  released: boolean;
  run: Promise<CommitResult> | null;
  failed: boolean;
  ticket: WriteTicket | null;
  write: Promise<unknown> | null;
  writeDone: boolean;
}

interface RestoreJob {
  readonly restoreId: string;
  readonly run: Promise<RestoreResult>;
  done: boolean;
}

export interface RuntimeOptions {
  readonly agent?: Agent;
  readonly resources?: ResourcesServer;
  readonly environment?: string;
  readonly config?: Partial<RuntimeConfig>;
  /** Monotonic seconds (leases, budgets); default performance.now()/1000. */
  readonly clock?: () => number;
  /** Seconds since the epoch; default Date.now()/1000. */
  readonly wallClock?: () => number;
  readonly incarnation?: string;
}

function slotOf(key: WorkKey): string {
  return key.slot.split("/")[0] as string;
}

function settled(promise: Promise<unknown>): Promise<void> {
  return promise.then(
    () => undefined,
    () => undefined,
  );
}

/** A commit's identity (section 4.8 item 2): the snapshot and the set of the scope. */
function commitFingerprint(snapshot: string, sortedScope: readonly EpisodeId[]): string {
  return JSON.stringify([snapshot, sortedScope.map(episodeKey)]);
}

/** The answer of a commit that exported nothing and wrote nothing (section 4.8 item 7). */
function savedNothing(checkpointId: string, released: boolean): CommitResult {
  return { checkpointId, manifest: null, artifacts: [], exported: [], savedNothing: true, released };
}

function newCommitJob(
  checkpointId: string,
  fingerprint: string,
  snapshot: string,
  exportKeys: readonly WorkKey[],
  discardKeys: readonly WorkKey[],
): CommitJob {
  return {
    checkpointId,
    fingerprint,
    snapshot,
    exportKeys,
    discardKeys,
    exportAbort: new AbortController(),
    stage: "exporting",
    records: null,
    detached: false,
    discarded: false,
    release: false,
    released: false,
    run: null,
    failed: false,
    ticket: null,
    write: null,
    writeDone: false,
  };
}

/** A Resume (or lease expiry) stopped the commit while it exported or discarded. */
function checkNotStopped(job: CommitJob, what: string): void {
  if (job.exportAbort.signal.aborted) {
    throw new TurnpointError("STALE_CHECKPOINT", `${what} was stopped by a resume`, { checkpoint_id: job.checkpointId });
  }
}

/** One participant: the control plane, the hosted kinds and their data plane. */
export class ParticipantRuntime {
  readonly instanceName: string;
  readonly incarnation: string;
  readonly shared: Shared;
  readonly agent: AgentHost | null;
  readonly resources: ResourcesHost | null;
  readonly config: RuntimeConfig;
  private readonly hosts = new Map<string, KindHost>();
  private readonly environment: string;
  private readonly commitJobs = new Map<string, CommitJob>();
  /** Commits that ended their checkpoint (release): a repeat joins or replays them. */
  private readonly released = new Map<string, CommitJob>();
  private committedCheckpointId: string | null = null;
  private restoreJob: RestoreJob | null = null;
  private readonly stops = new Map<string, Promise<void>>();
  private readonly background = new Set<Promise<unknown>>();
  private leaseLoop: Promise<void> | null = null;
  private closed = false;

  constructor(
    instanceName: string,
    private readonly store: SnapshotStore,
    options: RuntimeOptions,
  ) {
    this.instanceName = checkedId(instanceName, "instance_name");
    if (this.instanceName === "trainer") throw new RangeError("the instance name 'trainer' is reserved (section 2.3)");
    this.config = runtimeConfig(options.config);
    this.incarnation = options.incarnation ?? randomBytes(8).toString("hex");
    const core = new ParticipantCore({
      defaultLeaseS: this.config.defaultLeaseS,
      maxFinishedIds: this.config.maxFinishedIds,
      maxAnsweredRequests: this.config.maxAnsweredRequests,
      recordEvents: true,
    });
    this.shared = new Shared(
      core,
      this.config,
      options.clock ?? (() => performance.now() / 1000),
      options.wallClock ?? (() => Date.now() / 1000),
    );
    this.agent = options.agent !== undefined ? new AgentHost(this.shared, options.agent) : null;
    this.resources = options.resources !== undefined ? new ResourcesHost(this.shared, options.resources) : null;
    for (const host of [this.agent, this.resources]) if (host !== null) this.hosts.set(host.slot, host);
    if (this.hosts.size === 0) throw new RangeError("a participant hosts at least one of agent, resources");
    this.environment =
      options.environment ?? ([...this.hosts.values()].map((h) => h.describe().environment ?? "").find((env) => env !== "") || "");
  }

  get core(): ParticipantCore {
    return this.shared.core;
  }

  get kind(): ParticipantKind {
    return this.agent !== null && this.resources !== null ? "ENVIRONMENT" : ([...this.hosts.values()][0] as KindHost).kind;
  }

  /** The weakest mode hosted decides what the participant as a whole can promise. */
  get recoveryMode(): RecoveryMode {
    const modes = new Set([...this.hosts.values()].map((h) => h.recoveryMode));
    for (const mode of ["RESTART_ONLY", "EXPORTED", "STATELESS"] as const) if (modes.has(mode)) return mode;
    return "RESTART_ONLY";
  }

  header(): Header {
    return { participantId: this.instanceName, incarnation: this.incarnation, epoch: this.core.epoch };
  }

  // ---------------------------------------------------------------- lifecycle

  /** Start the lease timer (an expiry turns into a resume, section 4.2 item 3). */
  start(): void {
    if (this.leaseLoop !== null) return;
    this.leaseLoop = this.runLeaseLoop();
  }

  /** Stop the lease timer and all hosted work; wait for background writes to settle. */
  async close(): Promise<void> {
    this.closed = true;
    this.shared.publish();
    await this.leaseLoop;
    this.leaseLoop = null;
    for (const host of this.hosts.values()) await host.close();
    for (const job of this.commitJobs.values()) if (job.stage === "exporting") job.exportAbort.abort();
    const pending = [...this.commitJobs.values()].flatMap((job) => (job.write === null ? [] : [job.write]));
    await Promise.all([...pending, ...this.background].map(settled));
  }

  private async runLeaseLoop(): Promise<void> {
    const shared = this.shared;
    while (!this.closed) {
      const expires = shared.core.leaseExpiresAt;
      const delay = expires === null ? null : expires - shared.now();
      if (delay === null || delay > 0) {
        // Any state change (a renew, a resume) wakes this to look again.
        await shared.nextChange(delay === null ? null : delay * 1000);
        continue;
      }
      try {
        await this.checkLease();
      } catch (error) {
        console.error("turnpoint: lease expiry could not resume the participant:", error);
        await shared.nextChange(1000);
      }
    }
  }

  /** Resume the active checkpoint if its lease ran out; returns its id, else null. */
  async checkLease(): Promise<string | null> {
    const expired = this.core.leaseExpired(this.shared.now());
    if (expired === null) return null;
    const result = await this.doResume(expired, Deadline.never(), undefined, true);
    return result.endedActive ? expired : null;
  }

  // ---------------------------------------------------------------- fencing wrapper

  /** Fence the request (section 2.2), run it, record its answer under `requestId`. */
  private async control<T>(operation: string, fence: Fence, requestId: string, work: () => Promise<T>): Promise<T> {
    const core = this.core;
    const recorded = this.shared.change((c) => c.checkFence(fence, requestId));
    if (recorded !== undefined) {
      if (recorded.operation === operation) {
        if (recorded.answer instanceof TurnpointError) {
          const error = recorded.answer;
          throw new TurnpointError(error.reason, error.message, { ...error.metadata });
        }
        return recorded.answer as T;
      }
      throw new TurnpointError("FENCED", `request ${JSON.stringify(requestId)} answered another operation; epoch ${fence.epoch} is fenced`, {
        epoch: String(core.epoch),
        request_epoch: String(fence.epoch),
      });
    }
    try {
      const result = await work();
      core.recordAnswer(requestId, operation, result);
      return result;
    } catch (error) {
      // DEADLINE_EXCEEDED is not recorded: the work still runs and a retry joins it.
      if (error instanceof TurnpointError && error.reason !== "DEADLINE_EXCEEDED") core.recordAnswer(requestId, operation, error);
      throw error;
    }
  }

  private cap(maxBlockers: number): number {
    if (!(maxBlockers >= 0)) throw new TurnpointError("INVALID_ARGUMENT", "max_blockers must be >= 0", { field: "max_blockers" });
    return Math.min(maxBlockers || this.config.defaultMaxBlockers, this.config.maxBlockersLimit);
  }

  private leaseWall(): number | null {
    return this.shared.toWall(this.core.leaseExpiresAt);
  }

  private deadline(options: CallOptions): Deadline {
    return new Deadline(options.timeoutS ?? null, this.config);
  }

  // ---------------------------------------------------------------- prepare / renew

  /**
   * Close admission, let running work park, wait until ready or just before the
   * deadline (section 4.6). Not ready in time is an answer, not an error. With
   * `emptyCommitSnapshot`, a participant ready with nothing but restarts commits
   * saved-nothing under that snapshot in the same call (item 8).
   */
  prepare(
    fence: Fence,
    requestId: string,
    checkpointId: string,
    args: { leaseS?: number | null; maxBlockers?: number; emptyCommitSnapshot?: string | null } = {},
    options: CallOptions = {},
  ): Promise<PrepareResult> {
    const deadline = this.deadline(options);
    const cap = this.cap(args.maxBlockers ?? 0);
    const snapshot = args.emptyCommitSnapshot || null;
    if (snapshot !== null) checkedId(snapshot, "empty_commit_snapshot");
    return this.control("prepare", fence, requestId, () => this.doPrepare(checkpointId, args.leaseS ?? null, cap, deadline, snapshot, options.signal));
  }

  private async doPrepare(
    checkpointId: string,
    leaseS: number | null,
    cap: number,
    deadline: Deadline,
    emptyCommitSnapshot: string | null,
    signal?: AbortSignal,
  ): Promise<PrepareResult> {
    const shared = this.shared;
    const core = this.core;
    const start = shared.change((c) => c.beginPrepare(checkpointId, leaseS, shared.now(), c.epoch));
    if (start.replay !== undefined) return { ...(start.replay as PrepareResult), leaseExpiresAt: this.leaseWall() };
    if (start.superseded !== null) {
      // A publication of the superseded checkpoint cannot be stopped; it may finish in
      // the background (its snapshot is simply never used).
      for (const publishing of this.abandonCommit(start.superseded)) this.keepInBackground(publishing);
    }
    if (start.opened || start.superseded !== null) this.forgetReleased();
    if (start.opened) await this.closeAdmission(checkpointId);
    await shared.waitUntil(() => core.ready || core.activeCheckpointId !== checkpointId, deadline.remainingMs(), signal);
    if (core.activeCheckpointId !== checkpointId) {
      throw new TurnpointError("STALE_CHECKPOINT", `checkpoint ${JSON.stringify(checkpointId)} was resumed while its prepare waited`, {
        checkpoint_id: checkpointId,
      });
    }
    const readiness = core.readiness(cap);
    const committedEmpty =
      emptyCommitSnapshot !== null &&
      core.ready &&
      readiness.counts.every(([state]) => state === "RESTART") &&
      this.commitEmpty(checkpointId, emptyCommitSnapshot);
    const result: PrepareResult = { checkpointId, phase: core.phase, readiness, leaseExpiresAt: this.leaseWall(), committedEmpty };
    if (core.ready) core.recordPrepareAnswer(checkpointId, result);
    return result;
  }

  /**
   * Commit `checkpointId` saved-nothing with an empty scope, now (section 4.6 item 8).
   * Only for a participant that holds restarts at most: nothing a commit could export or
   * discard, so every scope would export nothing and the Commit's answer is known. A
   * commit already started for this id counts only if it is this one; any other gives
   * its own answer, and the prepare answers as a plain ready prepare.
   */
  private commitEmpty(checkpointId: string, snapshot: string): boolean {
    const fingerprint = commitFingerprint(snapshot, []);
    return this.shared.change((core) => {
      let start;
      try {
        start = core.beginCommit(checkpointId, fingerprint, [], this.shared.now());
      } catch (error) {
        if (error instanceof TurnpointError) return false; // committed with another identity
        throw error;
      }
      if (start.kind === "replay") return (start.answer as CommitResult).savedNothing;
      if (start.kind === "join") return false; // a Commit of this id is running
      // New, with an empty scope and no restored entry: nothing to export or discard.
      core.finishCommit(checkpointId, fingerprint, savedNothing(checkpointId, false));
      this.committedCheckpointId = checkpointId;
      return true;
    });
  }

  /** Run the kinds' close hooks; any failure reopens admission (section 4.6 step 5). */
  private closeAdmission(checkpointId: string): Promise<void> {
    return this.shared.exclusive(async () => {
      const closed: KindHost[] = [];
      try {
        for (const host of this.hosts.values()) {
          await host.admissionClosed();
          closed.push(host);
        }
      } catch (error) {
        this.shared.change((c) => c.abortPrepare(checkpointId));
        for (const host of closed) await this.openedHook(host);
        throw error;
      }
    });
  }

  private async openedHook(host: KindHost): Promise<void> {
    try {
      await host.admissionOpened();
    } catch (error) {
      // Admission is open whatever a user hook says (section 5.1 item 3); log it.
      console.error(`turnpoint: the admission-opened hook of ${host.kind} failed:`, error);
    }
  }

  renew(fence: Fence, requestId: string, checkpointId: string, args: { leaseS?: number | null } = {}): Promise<RenewResult> {
    return this.control("renew", fence, requestId, async () =>
      this.shared.change((core) => {
        core.renew(checkpointId, args.leaseS ?? null, this.shared.now());
        return { checkpointId, phase: core.phase, leaseExpiresAt: this.leaseWall() };
      }),
    );
  }

  // ---------------------------------------------------------------- commit

  /**
   * Export the frozen state once, write it under `<root>/<snapshot>/<instance>/`
   * (section 4.8). The same arguments (scope in any order) join the running write or
   * replay its answer; a failed write is redone with the same records. With
   * `acceptSavedNothing` an export of nothing writes nothing at all and answers
   * `savedNothing` (item 7). With `release` the checkpoint ends as soon as the export is
   * taken: admission reopens before the write, which goes on with records that share
   * nothing with the live state, and the answer says `released` (item 9).
   */
  commit(
    fence: Fence,
    requestId: string,
    checkpointId: string,
    snapshot: string,
    scope: readonly EpisodeId[],
    args: { acceptSavedNothing?: boolean; release?: boolean } = {},
    options: CallOptions = {},
  ): Promise<CommitResult> {
    const deadline = this.deadline(options);
    return this.control("commit", fence, requestId, () => this.doCommit(checkpointId, snapshot, scope, args, deadline, options.signal));
  }

  private async doCommit(
    checkpointId: string,
    snapshot: string,
    scope: readonly EpisodeId[],
    args: { acceptSavedNothing?: boolean; release?: boolean },
    deadline: Deadline,
    signal?: AbortSignal,
  ): Promise<CommitResult> {
    checkedId(snapshot, "snapshot");
    const scopeKeys = sortedEpisodes(scope);
    const fingerprint = commitFingerprint(snapshot, scopeKeys);
    let job = this.released.get(checkpointId);
    if (job !== undefined) {
      // The commit ended its checkpoint: only the same commit can come again.
      if (job.fingerprint !== fingerprint) {
        throw new TurnpointError("CHECKPOINT_CONFLICT", `checkpoint ${JSON.stringify(checkpointId)} was committed with other arguments`, {
          checkpoint_id: checkpointId,
        });
      }
    } else {
      const start = this.shared.change((core) => core.beginCommit(checkpointId, fingerprint, scopeKeys, this.shared.now()));
      if (start.kind === "replay") return start.answer as CommitResult;
      if (start.kind === "new") this.commitJobs.set(checkpointId, newCommitJob(checkpointId, fingerprint, snapshot, start.exportKeys, start.discardKeys));
      job = this.commitJobs.get(checkpointId);
      if (job === undefined) throw new TurnpointError("STALE_CHECKPOINT", `the commit of ${JSON.stringify(checkpointId)} was stopped`, { checkpoint_id: checkpointId });
    }
    job.release ||= args.release === true;
    let run = job.run;
    if (run === null || job.failed) {
      const running = job;
      running.failed = false;
      run = running.run = observed(this.driveCommit(running, args.acceptSavedNothing === true));
      run.catch(() => (running.failed = true));
    }
    return this.awaitJob(run, deadline, `commit of ${JSON.stringify(checkpointId)}`, signal);
  }

  private async awaitJob<T>(job: Promise<T>, deadline: Deadline, what: string, signal?: AbortSignal): Promise<T> {
    const remaining = deadline.remainingMs();
    let timer: NodeJS.Timeout | undefined;
    let onAbort: (() => void) | undefined;
    const limits = new Promise<never>((_, reject) => {
      if (remaining !== null) timer = setTimeout(() => reject(deadline.exceeded(what)), remaining);
      if (signal !== undefined) {
        onAbort = () => reject(new TurnpointError("DEADLINE_EXCEEDED", `${what}: the caller cancelled; the work continues`));
        if (signal.aborted) onAbort();
        else signal.addEventListener("abort", onAbort, { once: true });
      }
    });
    try {
      return await Promise.race([job, limits]);
    } finally {
      if (timer !== undefined) clearTimeout(timer);
      if (onAbort !== undefined) signal?.removeEventListener("abort", onAbort);
    }
  }

  /**
   * Export once, drop restored state the scope leaves out, release if asked, write (or,
   * saved nothing, write nothing); retried as a whole.
   */
  private async driveCommit(job: CommitJob, acceptSavedNothing: boolean): Promise<CommitResult> {
    const what = `commit of ${JSON.stringify(job.checkpointId)}`;
    if (job.records === null) {
      job.stage = "exporting";
      const records = await this.exportRecords(job.exportKeys, job.exportAbort.signal);
      checkNotStopped(job, what);
      // Written after admission reopened, the records must not share the state the work
      // then changes.
      job.records = job.release ? records.map(detached) : records;
      job.detached = job.release;
    }
    if (!job.discarded) {
      for (const key of job.discardKeys) await this.stopAndDrop(key);
      job.discarded = true;
      checkNotStopped(job, what);
    }
    if (job.release && !job.released) {
      await this.releaseCheckpoint(job);
      checkNotStopped(job, what); // a Resume of the released id is an abort (section 4.9 item 6)
    }
    if (job.records.length === 0 && acceptSavedNothing) {
      // Section 4.8 item 7: nothing exported, nothing written (not a directory, not a
      // file, not an fsync); the snapshot manifest records the participant without files.
      return this.finishCommit(job, savedNothing(job.checkpointId, job.released));
    }
    job.stage = "writing";
    const ticket = (job.ticket = new WriteTicket());
    const write = observed(this.store.write(job.snapshot, this.instanceName, job.checkpointId, job.records, ticket));
    job.write = write;
    job.writeDone = false;
    void settled(write).then(() => (job.writeDone = true));
    let entry;
    try {
      entry = await write;
    } catch (error) {
      throw storageError(error, what);
    }
    return this.finishCommit(job, {
      checkpointId: job.checkpointId,
      manifest: entry.manifest,
      artifacts: entry.artifacts,
      exported: entry.episodes,
      savedNothing: false,
      released: job.released,
    });
  }

  /** Record `result` as the commit's answer; GetStatus names the checkpoint as committed. */
  private finishCommit(job: CommitJob, result: CommitResult): CommitResult {
    this.shared.change((core) => core.finishCommit(job.checkpointId, job.fingerprint, result));
    this.committedCheckpointId = job.checkpointId;
    job.stage = "done";
    return result;
  }

  /**
   * Section 4.8 item 9: end the checkpoint as a Resume of it would (section 4.9 item 1),
   * keeping this commit's write, which a Resume would stop.
   */
  private async releaseCheckpoint(job: CommitJob): Promise<void> {
    if (this.core.activeCheckpointId !== job.checkpointId) return; // ended meanwhile: nothing to release
    if (!job.detached && job.records !== null) {
      // Asked for by a retry that joined after the export: copy before admission reopens.
      job.records = job.records.map(detached);
      job.detached = true;
    }
    this.shared.change((core) => core.resume(job.checkpointId, this.shared.now()));
    job.released = true;
    this.released.set(job.checkpointId, job);
    await this.shared.exclusive(async () => {
      for (const host of this.hosts.values()) await this.openedHook(host);
    });
  }

  /**
   * A newer checkpoint opened: released commits are forgotten, a repeat of one is stale
   * (section 4.8 item 9). A write still running stays where a Resume of its id can stop
   * it, and leaves once it settled.
   */
  private forgetReleased(): void {
    for (const [checkpointId, job] of this.released) {
      this.released.delete(checkpointId);
      const drop = (): void => {
        if (this.commitJobs.get(checkpointId) === job) this.commitJobs.delete(checkpointId);
      };
      if (job.run === null) drop();
      else void settled(job.run).then(drop);
    }
  }

  private async exportRecords(keys: readonly WorkKey[], signal: AbortSignal): Promise<Record[]> {
    const records: Record[] = [];
    const wanted = new Set(keys.map((key) => episodeKey(key.episode)));
    for (const [slot, host] of this.hosts) {
      const mine = keys.filter((key) => slotOf(key) === slot);
      if (mine.length === 0) continue;
      const exported = await host.exportRecords(mine, signal);
      const stray = sortedEpisodes(exported.map((r) => r.episode)).filter((e) => !wanted.has(episodeKey(e)));
      if (stray.length > 0) {
        const first = episodeKey(stray[0] as EpisodeId);
        throw new TurnpointError("INVALID_CHECKPOINT_STATE", `${host.kind} exported episodes outside the commit: ${first}`, { episode: first });
      }
      records.push(...exported);
    }
    return records;
  }

  /**
   * Stop a commit nothing will use; return publications under way. An export is
   * cancelled (not waited for); an unpublished write is cancelled through its ticket; a
   * publication already under way cannot be stopped, so the caller waits for it.
   */
  private abandonCommit(checkpointId: string): Promise<unknown>[] {
    this.released.delete(checkpointId);
    const job = this.commitJobs.get(checkpointId);
    if (job === undefined) return [];
    if (job.stage === "exporting") job.exportAbort.abort();
    if (job.ticket !== null && job.write !== null && !job.writeDone) {
      const state = job.ticket.cancel();
      if (state === "publishing") return [job.write];
      // Cancelled: the writer notices at its next step and removes its own file.
      this.keepInBackground(job.write);
    }
    this.commitJobs.delete(checkpointId);
    return [];
  }

  private keepInBackground(work: Promise<unknown>): void {
    const done = settled(work);
    this.background.add(done);
    void done.then(() => this.background.delete(done));
  }

  // ---------------------------------------------------------------- resume and lease

  /**
   * End the checkpoint (also abort, section 4.9): reopen admission, release parked work.
   * Stops an unpublished write, waits only for a publication under way. Idempotent,
   * also for ids never seen.
   */
  resume(fence: Fence, requestId: string, checkpointId: string, options: CallOptions = {}): Promise<ResumeResult> {
    const deadline = this.deadline(options);
    return this.control("resume", fence, requestId, () => this.doResume(checkpointId, deadline, options.signal, false));
  }

  private async doResume(checkpointId: string, deadline: Deadline, signal: AbortSignal | undefined, expired: boolean): Promise<ResumeResult> {
    checkedId(checkpointId, "checkpoint_id");
    const shared = this.shared;
    const core = this.core;
    for (;;) {
      const active = core.activeCheckpointId;
      const endsActive = active !== null && (checkpointId === active || supersedes(checkpointId, active));
      if (expired && core.leaseExpired(shared.now()) !== checkpointId) {
        // Renewed (or resumed) since the expiry was seen: nothing to do.
        return { checkpointId, phase: core.phase, endedActive: false };
      }
      const waits: Promise<unknown>[] = [];
      const restore = this.restoreJob;
      if (endsActive && restore !== null && !restore.done) {
        // Admission reopens only once an install that outlived its call finished.
        waits.push(restore.run);
      } else {
        for (const ended of new Set(endsActive ? [checkpointId, active] : [checkpointId])) {
          if (ended !== null) waits.push(...this.abandonCommit(ended));
        }
      }
      if (waits.length === 0) {
        const ended = shared.change((c) => c.resume(checkpointId, shared.now(), expired));
        if (ended !== null) {
          this.restoreJob = null;
          await this.shared.exclusive(async () => {
            for (const host of this.hosts.values()) await this.openedHook(host);
          });
        }
        return { checkpointId, phase: core.phase, endedActive: ended !== null };
      }
      try {
        await this.awaitJob(Promise.all(waits.map(settled)), deadline, `resume of ${JSON.stringify(checkpointId)}`, signal);
      } catch (error) {
        throw error instanceof TurnpointError ? deadline.exceeded(`resume of ${JSON.stringify(checkpointId)}`) : error;
      }
    }
  }

  // ---------------------------------------------------------------- restore

  /**
   * Install saved episodes (attempt N) as attempt N+1 into an idle, fresh participant
   * (section 4.10). Verifies every digest, validates every record before installing any;
   * all or nothing. An install that outlives the call keeps running; a retry joins it.
   * A null `manifest` names a participant that saved nothing in the snapshot: nothing
   * is read or installed, and the scope must be empty.
   */
  restore(
    fence: Fence,
    requestId: string,
    restoreId: string,
    snapshot: string,
    manifest: ArtifactRef | null,
    artifacts: readonly ArtifactRef[],
    scope: readonly EpisodeId[],
    args: { leaseS?: number | null } = {},
    options: CallOptions = {},
  ): Promise<RestoreResult> {
    const deadline = this.deadline(options);
    return this.control("restore", fence, requestId, () =>
      this.doRestore(restoreId, snapshot, manifest, artifacts, scope, args.leaseS ?? null, deadline, null, options.signal),
    );
  }

  /**
   * Restore into a participant that may hold work (section 4.16): the restore above
   * without the freshness it requires. Once every record is read and validated, every
   * attempt of the scoped rollouts up to the saved one is retired (refused from then
   * on), with `retireUnscoped` every other entry too, and only then are the saved
   * episodes installed as N+1. Work it does not name keeps its state; the participant
   * stays closed (RESTORED) until resume.
   */
  restoreRunning(
    fence: Fence,
    requestId: string,
    restoreId: string,
    snapshot: string,
    manifest: ArtifactRef | null,
    artifacts: readonly ArtifactRef[],
    scope: readonly EpisodeId[],
    args: { leaseS?: number | null; retireUnscoped?: boolean } = {},
    options: CallOptions = {},
  ): Promise<RestoreResult> {
    if (!this.config.restoreRunning) {
      return Promise.reject(
        new TurnpointError("INVALID_ARGUMENT", "this participant does not serve RestoreRunning (no capability listed)", { field: "restore_running" }),
      );
    }
    const deadline = this.deadline(options);
    const running: RunningRestore = { scope: sortedEpisodes(scope), retireUnscoped: args.retireUnscoped ?? false };
    return this.control("restore_running", fence, requestId, () =>
      this.doRestore(restoreId, snapshot, manifest, artifacts, scope, args.leaseS ?? null, deadline, running, options.signal),
    );
  }

  private async doRestore(
    restoreId: string,
    snapshot: string,
    manifest: ArtifactRef | null,
    artifacts: readonly ArtifactRef[],
    scope: readonly EpisodeId[],
    leaseS: number | null,
    deadline: Deadline,
    running: RunningRestore | null,
    signal?: AbortSignal,
  ): Promise<RestoreResult> {
    checkedId(snapshot, "snapshot");
    const scopeKeys = sortedEpisodes(scope);
    // Section 4.16 item 2: the identity includes the set of the scope and retire_unscoped.
    const fingerprint = JSON.stringify([snapshot, manifest, artifacts, scopeKeys.map(episodeKey), running?.retireUnscoped ?? null]);
    const start = this.shared.change((core) => core.beginRestore(restoreId, fingerprint, leaseS, this.shared.now(), running));
    if (start.kind === "replay") return start.answer as RestoreResult;
    if (start.kind === "new" || this.restoreJob === null) {
      const job: RestoreJob = {
        restoreId,
        run: observed(this.driveRestore(restoreId, snapshot, manifest, artifacts, scopeKeys, running)),
        done: false,
      };
      void settled(job.run).then(() => (job.done = true));
      this.restoreJob = job;
    }
    return this.awaitJob(this.restoreJob.run, deadline, `restore ${JSON.stringify(restoreId)}`, signal);
  }

  private async driveRestore(
    restoreId: string,
    snapshot: string,
    manifest: ArtifactRef | null,
    artifacts: readonly ArtifactRef[],
    scope: readonly EpisodeId[],
    running: RunningRestore | null,
  ): Promise<RestoreResult> {
    // Deferred one turn, so the job exists before its first failure can clear it.
    await Promise.resolve();
    const installed: EpisodeId[] = [];
    try {
      const records = await this.readRestored(restoreId, snapshot, manifest, artifacts, scope);
      const plan = this.validateRecords(records);
      const retired = running === null ? [] : await this.retireForRestore(restoreId, running);
      for (const [record, host] of plan) {
        const key = await host.install(record, nextAttempt(record.episode));
        installed.push(key.episode);
      }
      const result: RestoreResult = { restoreId, installed: sortedEpisodes(installed), phase: "RESTORED", retired };
      this.shared.change((core) => core.finishRestore(restoreId, result));
      return result;
    } catch (error) {
      const undone = this.shared.change((core) => core.failRestore(restoreId, this.shared.now()));
      if (this.restoreJob?.restoreId === restoreId) this.restoreJob = null;
      for (const key of undone) {
        try {
          await this.hosts.get(slotOf(key))?.stop(key);
        } catch (stopError) {
          console.error(`turnpoint: could not free ${episodeKey(key.episode)} after a failed restore:`, stopError);
        }
      }
      throw error;
    }
  }

  /**
   * Stop and free what a running restore replaces; throw RETIRE_INCOMPLETE if any could
   * not stop. What was retired stays retired if the restore then fails: the coordinator
   * reruns those rollouts above the retired attempt (section 4.16 item 5).
   */
  private async retireForRestore(restoreId: string, running: RunningRestore): Promise<EpisodeId[]> {
    const keys = this.shared.change((core) => core.retireForRestore(restoreId, running, this.shared.now()));
    const outcomes = await Promise.allSettled(keys.map((key) => this.stopTask(key)));
    const failed = outcomes.filter((o) => o.status === "rejected");
    if (failed.length > 0) {
      throw new TurnpointError("RETIRE_INCOMPLETE", `${failed.length} of ${keys.length} replaced attempts could not be stopped`, {
        failed: String(failed.length),
      });
    }
    return sortedEpisodes(keys.map((key) => key.episode));
  }

  /** The selected records of the snapshot, verified whole; none for a saved-nothing entry. */
  private async readRestored(
    restoreId: string,
    snapshot: string,
    manifest: ArtifactRef | null,
    artifacts: readonly ArtifactRef[],
    scope: readonly EpisodeId[],
  ): Promise<readonly Record[]> {
    if (manifest === null) {
      // Section 4.10 item 2: this participant saved nothing in the snapshot, so there is
      // nothing to read and nothing it could continue.
      if (scope.length > 0 || artifacts.length > 0) {
        throw new TurnpointError(
          "INVALID_CHECKPOINT_STATE",
          `restore ${JSON.stringify(restoreId)} names no manifest but a non-empty scope or artifacts: nothing was saved here to continue`,
          { snapshot },
        );
      }
      return [];
    }
    const wanted = new Set(scope.map(episodeKey));
    try {
      const loaded = await this.store.read(
        snapshot,
        this.instanceName,
        { manifest, ...(artifacts.length > 0 ? { artifacts } : {}) },
        (e) => wanted.has(episodeKey(e)),
      );
      return loaded.records;
    } catch (error) {
      throw storageError(error, `restore ${JSON.stringify(restoreId)}`);
    }
  }

  /** Check every record before any is installed (section 4.10 item 5). */
  private validateRecords(records: readonly Record[]): Array<[Record, KindHost]> {
    const plan: Array<[Record, KindHost]> = [];
    const seen = new Set<string>();
    const byKey = new Map<string, KindHost>();
    for (const host of this.hosts.values()) if (host.recordKey !== null) byKey.set(host.recordKey, host);
    for (const record of records) {
      const host = byKey.get(record.key);
      if (host === undefined) throw invalidRecord(record, "no hosted kind restores this record key");
      const id = `${episodeKey(record.episode)}|${record.key}`;
      if (seen.has(id)) throw invalidRecord(record, "the episode has two records of this key");
      seen.add(id);
      host.validate(record);
      plan.push([record, host]);
    }
    return plan;
  }

  // ---------------------------------------------------------------- retire / forget

  /**
   * Refuse the rollouts first, then stop these attempts and every earlier one; reply
   * once they stopped and their state is freed (section 4.11).
   */
  retire(fence: Fence, requestId: string, episodes: readonly EpisodeId[], options: CallOptions = {}): Promise<RetireResult> {
    const deadline = this.deadline(options);
    return this.control("retire", fence, requestId, () => this.doRetire(episodes, deadline, options.signal));
  }

  private async doRetire(episodes: readonly EpisodeId[], deadline: Deadline, signal?: AbortSignal): Promise<RetireResult> {
    let keys: WorkKey[];
    for (;;) {
      const restore = this.restoreJob;
      if (restore === null || restore.done) {
        keys = this.shared.change((core) => core.beginRetire(episodes, this.shared.now()));
        break;
      }
      await this.awaitJob(settled(restore.run), deadline, "retire (waiting for a restore install)", signal);
    }
    const tasks = keys.map((key) => this.stopTask(key));
    const outcomes = await this.awaitJob(Promise.allSettled(tasks), deadline, "retire", signal);
    const failed = outcomes.filter((o) => o.status === "rejected");
    if (failed.length > 0) {
      throw new TurnpointError("RETIRE_INCOMPLETE", `${failed.length} of ${tasks.length} retired attempts could not be stopped`, {
        failed: String(failed.length),
      });
    }
    return { stopped: sortedEpisodes(keys.map((key) => key.episode)) };
  }

  /** The task stopping `key` (joined if one runs; restarted if one failed). */
  private stopTask(key: WorkKey): Promise<void> {
    const id = `${key.slot}|${episodeKey(key.episode)}`;
    let task = this.stops.get(id);
    if (task === undefined) {
      task = observed(this.stopAndDrop(key));
      this.stops.set(id, task);
      const mine = task;
      void settled(task).then(() => {
        if (this.stops.get(id) === mine) this.stops.delete(id);
      });
    }
    return task;
  }

  private async stopAndDrop(key: WorkKey): Promise<void> {
    await this.hosts.get(slotOf(key))?.stop(key);
    this.shared.change((core) => {
      core.finishRetire(key, this.shared.now());
      core.remove(key, this.shared.now());
    });
  }

  /** Drop refusal marks (section 4.12). */
  forget(fence: Fence, requestId: string, rolloutIds: readonly string[]): Promise<ForgetResult> {
    return this.control("forget", fence, requestId, async () => ({ forgotten: this.shared.change((core) => core.forget(rolloutIds)) }));
  }

  // ---------------------------------------------------------------- reads

  describe(fence: Fence | null): Description {
    this.shared.change((core) => core.observeFence(fence));
    const extra = Object.assign({}, ...[...this.hosts.values()].map((h) => h.describe())) as ReturnType<KindHost["describe"]>;
    const mode = this.recoveryMode;
    return {
      kind: this.kind,
      instanceName: this.instanceName,
      protocolVersion: PROTOCOL_VERSION,
      recoveryMode: mode,
      verifyMode: extra.verifyMode ?? "WAIT",
      groupScored: extra.groupScored ?? false,
      groupSize: extra.groupSize ?? 0,
      supportedLevels: mode === "RESTART_ONLY" ? ["SIBLING", "PROMPT_GROUP"] : ["TURN", "SIBLING", "PROMPT_GROUP"],
      environment: this.environment,
      phase: this.core.phase,
      capabilities: this.config.restoreRunning ? ["RESTORE_RUNNING"] : [],
    };
  }

  status(maxBlockers = 0): StatusResult {
    const cap = this.cap(maxBlockers);
    const core = this.core;
    return {
      phase: core.phase,
      activeCheckpointId: core.activeCheckpointId,
      leaseExpiresAt: this.leaseWall(),
      readiness: core.readiness(cap),
      admissionOpen: core.admissionOpen,
      leaseExpiries: core.leaseExpiries,
      refusedRollouts: core.refusedRollouts,
      committedCheckpointId: this.committedCheckpointId,
    };
  }

  /**
   * WatchBoundaries (section 4.14): a readiness report first, then boundary events as
   * they happen and a new report after each batch that moved readiness or the phase.
   */
  async *watch(maxBlockers: number, fence: Fence | null, signal?: AbortSignal): AsyncGenerator<WatchEvent, void, undefined> {
    const cap = this.cap(maxBlockers);
    const watcher: Watcher = this.shared.addWatcher();
    try {
      this.shared.change((core) => core.observeFence(fence));
      const core = this.core;
      let report = core.readiness(cap);
      let last = signature(core.phase, report);
      yield { type: "readiness", phase: core.phase, readiness: report };
      while (!signal?.aborted && !this.closed) {
        await watcher.waitForEvents(signal);
        const events = watcher.events.splice(0);
        for (const event of events) yield this.boundaryEvent(event, core.phase);
        report = core.readiness(cap);
        const now = signature(core.phase, report);
        if (now !== last || watcher.lagged) {
          watcher.lagged = false;
          last = now;
          yield { type: "readiness", phase: core.phase, readiness: report };
        }
      }
    } finally {
      this.shared.removeWatcher(watcher);
    }
  }

  private boundaryEvent(event: CoreEvent, phase: Phase): WatchEvent {
    return {
      type: "boundary",
      phase,
      episode: event.episode,
      state: event.state,
      boundaryIndex: event.boundaryIndex,
      turnIndex: event.turnIndex,
      at: this.shared.toWall(event.at) as number,
      slot: event.slot,
    };
  }

  // ---------------------------------------------------------------- data plane

  private agentHost(): AgentHost {
    if (this.agent === null) throw new TurnpointError("NOT_FOUND", "this participant hosts no agent");
    return this.agent;
  }

  private resourcesHost(): ResourcesHost {
    if (this.resources === null) throw new TurnpointError("NOT_FOUND", "this participant hosts no resources");
    return this.resources;
  }

  /**
   * RolloutService.Run: accept now (errors throw here), then follow; close the follower.
   * `participantIncarnation` (a re-attach: the incarnation that accepted the attempt)
   * other than this one's is STALE_ATTEMPT before anything starts: that execution died
   * with its process (docs/spec.md section 6.5 item 5).
   */
  acceptRun(
    episode: EpisodeId,
    task: JsonObject,
    options: { boundariesSeen?: number; budgetS?: number | null; fence?: Fence | null; participantIncarnation?: string } = {},
  ): RunFollower {
    this.core.checkDataFence(options.fence ?? null);
    this.checkIncarnation(episode, options.participantIncarnation ?? "");
    return this.agentHost().acceptRun(episode, task, options);
  }

  private checkIncarnation(episode: EpisodeId, named: string): void {
    if (named !== "" && named !== this.incarnation) {
      const id = episodeKey(episode);
      throw new TurnpointError(
        "STALE_ATTEMPT",
        `${id} was accepted by incarnation ${named}, not by this one (${this.incarnation}): that execution is gone`,
        { episode: id, incarnation: this.incarnation, request_incarnation: named },
      );
    }
  }

  /**
   * `acceptRun`, except that with `waitForAdmission` a new attempt that arrives while a
   * checkpoint holds admission waits for resume, at most `runAdmissionWaitS`, instead
   * of being refused at once (section 5.2 item 1). `signal` cancels the wait.
   */
  async admitRun(
    episode: EpisodeId,
    task: JsonObject,
    options: {
      boundariesSeen?: number;
      budgetS?: number | null;
      fence?: Fence | null;
      waitForAdmission?: boolean;
      participantIncarnation?: string;
    } = {},
    signal?: AbortSignal,
  ): Promise<RunFollower> {
    this.core.checkDataFence(options.fence ?? null);
    this.checkIncarnation(episode, options.participantIncarnation ?? "");
    return this.agentHost().admitRun(episode, task, options, signal);
  }

  acknowledge(
    receipts: readonly CompletionReceipt[],
    fence: Fence | null = null,
  ): { acknowledged: number; unknown: CompletionReceipt[] } {
    this.core.checkDataFence(fence);
    return this.agentHost().acknowledge(receipts);
  }

  seedSession(episode: EpisodeId, task: JsonObject, signal?: AbortSignal): Promise<boolean> {
    return this.resourcesHost().seed(episode, task, signal);
  }

  /** ResourcesService.Call; a `requestId` runs the tool once per session (spec 6.12). */
  callTool(episode: EpisodeId, tool: string, args: JsonObject, signal?: AbortSignal, requestId = ""): Promise<JsonObject> {
    return this.resourcesHost().call(episode, tool, args, signal, requestId);
  }

  /** ResourcesService.Verify, deduplicated by `requestId` like a call. */
  verify(episode: EpisodeId, answer: JsonObject, signal?: AbortSignal, requestId = ""): Promise<Verdict> {
    return this.resourcesHost().verify(episode, answer, signal, requestId);
  }

  closeSession(episode: EpisodeId, signal?: AbortSignal): Promise<boolean> {
    return this.resourcesHost().closeSession(episode, signal);
  }

  /** Wait until `predicate(core)` holds (for tests and tools); false after `timeoutMs`. */
  waitFor(predicate: (core: ParticipantCore) => boolean, timeoutMs: number | null = null): Promise<boolean> {
    return this.shared.waitUntil(() => predicate(this.core), timeoutMs);
  }
}

function signature(phase: Phase, report: ReadinessReport): string {
  return JSON.stringify([phase, report.ready, report.blockerCount, report.counts, report.restarts.map(episodeKey)]);
}

export { compareEpisodes };
