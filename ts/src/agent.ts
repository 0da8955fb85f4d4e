/**
 * Agents: episodes that run turn by turn and park at their turn boundaries (docs/spec.md
 * sections 5.2, 6). A port of turnpoint.participant_sdk._agent.
 *
 * A Gym agent server implements `Agent.run`. The SDK runs each episode as one
 * execution, streams a BoundaryReport each time the episode seals a turn
 * (`await ctx.boundary(turn, state)`), then one RunResult. The state handed to
 * `ctx.boundary` is what a snapshot saves (deep-copied at the boundary; plain JSON).
 *
 * JavaScript cannot interrupt a promise, so cancellation is cooperative: `ctx.signal`
 * aborts when the execution is cancelled (its caller left, a retire, the budget ran out,
 * shutdown); the SDK's own waits (`ctx.boundary`, `ctx.modelCall`) reject at once with
 * CancelledError, and `ctx.modelCall` passes the signal to the call it makes. An
 * execution is over when `run` settles.
 */
import { randomBytes } from "node:crypto";

import type { ParticipantCore, WorkKey } from "./core.js";
import { ActiveClock, workKey } from "./core.js";
import { CancelledError, TurnpointError } from "./errors.js";
import type { EpisodeId } from "./ids.js";
import { episodeKey } from "./ids.js";
import { cloneJson, isPlainObject } from "./json.js";
import type { KindDescription, KindHost } from "./kinds.js";
import { sameJson } from "./kinds.js";
import type { CompletionReceipt, JsonObject, RecoveryMode } from "./protocol.js";
import type { Record } from "./records.js";
import type { Shared } from "./shared.js";
import { ConfigurationError } from "./resources.js";
import { invalidRecord } from "./shared.js";

const SLOT = "run";
const PAYLOAD_FIELDS = ["boundary_index", "state", "task", "turn_index"];

export type RunOutcome = "COMPLETED" | "CANCELLED" | "FAILED" | "BUDGET_EXHAUSTED";

/** The episode sealed a turn; `boundaryIndex` is 1-based and continues across attempts. */
export interface BoundaryReport {
  readonly type: "boundary";
  readonly episode: EpisodeId;
  readonly boundaryIndex: number;
  readonly turnIndex: number;
  /** Seconds since the epoch. */
  readonly sealedAt: number;
}

/** The one final message of a run; `receipt` is null only when CANCELLED. */
export interface RunResult {
  readonly type: "result";
  readonly episode: EpisodeId;
  readonly outcome: RunOutcome;
  readonly receipt: CompletionReceipt | null;
  readonly result: JsonObject;
  readonly turns: number;
  readonly activeTimeS: number;
  readonly errorMessage: string;
}

export type RunEvent = BoundaryReport | RunResult;

/** The last sealed boundary of an episode: where a restored attempt continues. */
export interface SavedTurn {
  readonly boundaryIndex: number;
  readonly turnIndex: number;
  readonly state: JsonObject;
}

/**
 * What a Gym agent server implements. Example:
 *
 *     const agent: Agent = {
 *       async run(ctx, task) {
 *         const saved = ctx.restored;             // after a restore: continue from here
 *         const history = saved ? [...(saved.state.history as string[])] : [];
 *         if (!saved) await ctx.boundary(0, { history });
 *         for (let turn = saved ? saved.turnIndex + 1 : 1; turn <= 3; turn++) {
 *           history.push(await ctx.modelCall((signal) => policy.generate(history, signal)));
 *           await ctx.boundary(turn, { history }); // parks here during a checkpoint
 *         }
 *         return { answer: history.at(-1) ?? null };
 *       },
 *     };
 */
export interface Agent {
  /**
   * Agents export the state they seal, so they are EXPORTED unless they say otherwise. An
   * agent that cannot continue a saved turn (a harness that cannot be replayed) declares
   * RESTART_ONLY: its episodes are restarts, never exported or parked, rerun from their
   * prompts after a restore (section 5.2 item 7). Nothing else is an agent's mode.
   */
  readonly recoveryMode?: RecoveryMode;
  readonly environment?: string;
  run(ctx: EpisodeContext, task: JsonObject): Promise<JsonObject>;
  /** The state to save for each episode (keyed by `rollout_id#attempt`); all must be returned. */
  exportStates?(states: ReadonlyMap<string, SavedTurn>): Promise<ReadonlyMap<string, JsonObject>>;
  /** Throw if a saved state cannot be continued (checked before any install). */
  validateState?(episode: EpisodeId, state: JsonObject): void;
  admissionClosed?(): Promise<void>;
  admissionOpened?(): Promise<void>;
}

type Stop = "cancelled" | "retired" | "budget" | "shutdown";

class Execution {
  readonly key: WorkKey;
  restored: SavedTurn | null;
  readonly clock: ActiveClock;
  readonly boundaries: BoundaryReport[] = [];
  readonly abort = new AbortController();
  running = false;
  done: Promise<void> = Promise.resolve();
  result: RunResult | null = null;
  followers = 0;
  stop: Stop | null = null;

  constructor(
    readonly episode: EpisodeId,
    readonly task: JsonObject,
    public saved: SavedTurn | null,
    readonly budgetS: number | null,
    now: number,
  ) {
    this.key = workKey(episode, SLOT);
    this.restored = saved;
    this.clock = new ActiveClock(now);
  }

  /** Saved state nobody runs: restored, or cancelled after sealing a boundary. */
  get claimable(): boolean {
    const cancelled = this.result !== null && this.result.outcome === "CANCELLED";
    return !this.running && (this.result === null || cancelled) && this.saved !== null;
  }
}

/** Handed to `Agent.run`: the episode's identity, its boundary and model calls. */
export class EpisodeContext {
  constructor(
    private readonly host: AgentHost,
    private readonly ex: Execution,
  ) {}

  get episode(): EpisodeId {
    return this.ex.episode;
  }

  /** The saved turn this attempt continues from (after a restore or a cancel), else null. */
  get restored(): SavedTurn | null {
    return this.ex.restored;
  }

  get lastBoundary(): SavedTurn | null {
    return this.ex.saved;
  }

  /** Aborts when the execution is cancelled; pass it to what `run` waits on. */
  get signal(): AbortSignal {
    return this.ex.abort.signal;
  }

  /**
   * Seal a turn: report it, and park here while a checkpoint holds admission. Woken by
   * resume, the episode stays parked if a new checkpoint closed first.
   */
  boundary(turnIndex: number, state: JsonObject): Promise<void> {
    return this.host.seal(this.ex, turnIndex, cloneJson(state));
  }

  /**
   * Issue a call that counts as parked at the last boundary (section 5.2 item 4): made
   * right after a boundary, safe to issue again after a restore. A reply arriving while
   * a checkpoint is open is held until resume; a call refused with ADMISSION_CLOSED
   * (throw a TurnpointError with that reason) parks and is retried after resume. Before
   * the first boundary it is a plain call.
   */
  modelCall<T>(factory: (signal: AbortSignal) => Promise<T>): Promise<T> {
    return this.host.modelCall(this.ex, factory);
  }

  /** This episode cannot be captured: it starts over after a restore (deferred while open). */
  markRestart(): void {
    this.host.shared.change((core) => core.markRestart(this.ex.key, this.host.shared.now()));
  }
}

/** Follows one execution for one Run call: boundaries past `boundariesSeen`, then the result. */
export class RunFollower {
  private seen = 0;
  private readonly queue: RunEvent[] = [];
  private delivered = false;
  private closed = false;
  private finished = false;

  constructor(
    private readonly host: AgentHost,
    private readonly ex: Execution,
    private readonly boundariesSeen: number,
  ) {
    ex.followers++;
  }

  get episode(): EpisodeId {
    return this.ex.episode;
  }

  /** The next event, or null after the result. STALE_ATTEMPT if the attempt was retired. */
  async next(signal?: AbortSignal): Promise<RunEvent | null> {
    for (;;) {
      const queued = this.queue.shift();
      if (queued !== undefined) {
        if (queued.type === "result") this.delivered = true;
        return queued;
      }
      if (this.finished) return null;
      const ex = this.ex;
      while (!(ex.boundaries.length > this.seen || ex.result !== null)) await this.host.shared.nextChange(null, signal);
      const batch = ex.boundaries.slice(this.seen);
      this.seen = ex.boundaries.length;
      for (const report of batch) if (report.boundaryIndex > this.boundariesSeen) this.queue.push(report);
      const result = ex.result;
      if (result !== null) {
        this.finished = true;
        if (ex.stop === "retired") {
          throw new TurnpointError("STALE_ATTEMPT", `${episodeKey(ex.episode)} was retired while it ran`, { episode: episodeKey(ex.episode) });
        }
        this.queue.push(result);
      }
    }
  }

  /** The caller is gone: the last follower leaving before the result cancels (section 6.6). */
  close(): void {
    if (this.closed) return;
    this.closed = true;
    this.ex.followers--;
    if (!this.delivered && this.ex.followers === 0 && this.ex.result === null) this.host.cancel(this.ex, "cancelled");
  }
}

/** Hosts one Agent: its executions, their parking and their export. */
export class AgentHost implements KindHost {
  readonly slot = SLOT;
  readonly kind = "AGENT" as const;
  private readonly executions = new Map<string, Execution>();

  constructor(
    readonly shared: Shared,
    private readonly agent: Agent,
  ) {
    const mode = this.recoveryMode;
    if (mode !== "EXPORTED" && mode !== "RESTART_ONLY") {
      throw new ConfigurationError(`the agent declares recoveryMode ${mode}: an agent is EXPORTED or RESTART_ONLY`);
    }
  }

  get recoveryMode(): RecoveryMode {
    return this.agent.recoveryMode ?? "EXPORTED";
  }

  get recordKey(): string | null {
    return this.restartOnly ? null : SLOT;
  }

  private get restartOnly(): boolean {
    return this.recoveryMode === "RESTART_ONLY";
  }

  describe(): KindDescription {
    return { environment: this.agent.environment ?? "" };
  }

  // ---------------------------------------------------------------- data plane

  /**
   * Accept a Run (throwing ADMISSION_CLOSED, STALE_ATTEMPT, INVALID_ARGUMENT at once),
   * then follow it. A new episode while admission is closed is refused; saved state (a
   * restore, a cancel after a boundary) starts a new execution that parks first;
   * re-invoked for a running or completed attempt it attaches (section 6.5). The caller
   * must `close()` the follower when its call ends.
   */
  acceptRun(episode: EpisodeId, task: JsonObject, options: { boundariesSeen?: number; budgetS?: number | null } = {}): RunFollower {
    const boundariesSeen = options.boundariesSeen ?? 0;
    const budgetS = options.budgetS ?? null;
    if (!Number.isInteger(boundariesSeen) || boundariesSeen < 0) {
      throw new TurnpointError("INVALID_ARGUMENT", "boundaries_seen must be >= 0", { field: "boundaries_seen" });
    }
    if (budgetS !== null && !(budgetS >= 0)) throw new TurnpointError("INVALID_ARGUMENT", "budget must be >= 0", { field: "budget" });
    const ex = this.shared.change((core) => this.attach(core, episode, task, budgetS || null));
    return new RunFollower(this, ex, boundariesSeen);
  }

  /**
   * `acceptRun`, except that with `waitForAdmission` a new attempt refused because a
   * checkpoint holds admission waits until admission reopens, then is admitted (section
   * 5.2 item 1). While it waits it is not in the work table: in no cut, blocking no
   * prepare, accepted by nobody. Refused ADMISSION_CLOSED after all once it waited
   * `runAdmissionWaitS`; `signal` (the caller leaving) ends the wait with CancelledError.
   */
  async admitRun(
    episode: EpisodeId,
    task: JsonObject,
    options: { boundariesSeen?: number; budgetS?: number | null; waitForAdmission?: boolean } = {},
    signal?: AbortSignal,
  ): Promise<RunFollower> {
    const core = this.shared.core;
    let until: number | null = null;
    for (;;) {
      try {
        return this.acceptRun(episode, task, options);
      } catch (error) {
        if (options.waitForAdmission !== true || !(error instanceof TurnpointError) || error.reason !== "ADMISSION_CLOSED") throw error;
        until ??= performance.now() + this.shared.config.runAdmissionWaitS * 1000;
        // Woken open, it tries again at once; a checkpoint that closed first refuses it again.
        if (!(await this.shared.waitUntil(() => core.admissionOpen, Math.max(0, until - performance.now()), signal))) throw error;
      }
    }
  }

  private attach(core: ParticipantCore, episode: EpisodeId, task: JsonObject, budgetS: number | null): Execution {
    core.checkAttempt(episode);
    const now = this.shared.now();
    const id = episodeKey(episode);
    let existing = this.executions.get(id);
    if (existing !== undefined && !existing.claimable && !existing.running && existing.result === null) {
      this.executions.delete(id); // nothing saved, nothing running: start over
      existing = undefined;
    }
    if (existing !== undefined && !existing.claimable) {
      sameTask(existing, task);
      return existing;
    }
    let ex: Execution;
    if (existing !== undefined) {
      // Restored (or cancelled at a boundary): this run continues from the saved turn.
      sameTask(existing, task);
      ex = new Execution(episode, task, existing.saved, budgetS, now);
      core.claimRestored(ex.key, core.admissionOpen ? "RUNNING" : "PARKED", now);
    } else {
      // A restart-only agent's episode is a restart from its start: in no cut, never
      // parked, never blocking a prepare (section 5.2 item 7).
      core.admit(workKey(episode, SLOT), this.restartOnly ? "RESTART" : "RUNNING", now);
      ex = new Execution(episode, task, null, budgetS, now);
    }
    this.executions.set(id, ex);
    ex.running = true;
    // Deferred: `run` must not start inside this synchronous change.
    ex.done = Promise.resolve().then(() => this.execute(ex));
    return ex;
  }

  /** Release retained results (section 6.4); unknown receipts are listed. */
  acknowledge(receipts: readonly CompletionReceipt[]): { acknowledged: number; unknown: CompletionReceipt[] } {
    let acknowledged = 0;
    const unknown: CompletionReceipt[] = [];
    this.shared.change((core) => {
      for (const receipt of receipts) {
        const key = core.acknowledge(receipt);
        if (key === undefined || key.slot !== SLOT) {
          unknown.push(receipt);
          continue;
        }
        core.remove(key, this.shared.now());
        const id = episodeKey(receipt.episode);
        const ex = this.executions.get(id);
        if (ex?.result?.receipt?.receiptId === receipt.receiptId) this.executions.delete(id);
        acknowledged++;
      }
    });
    return { acknowledged, unknown };
  }

  // ---------------------------------------------------------------- executions

  cancel(ex: Execution, reason: Stop): void {
    if (ex.stop === null && ex.running) {
      ex.stop = reason;
      ex.abort.abort();
    }
  }

  private async execute(ex: Execution): Promise<void> {
    const watchdog = ex.budgetS !== null ? this.watchBudget(ex) : null;
    let outcome: RunOutcome = "COMPLETED";
    let value: JsonObject = {};
    let message = "";
    try {
      if (ex.restored !== null) await this.hold(ex);
      const returned: unknown = await this.agent.run(new EpisodeContext(this, ex), ex.task);
      if (!isPlainObject(returned)) throw new TypeError("run returned something other than a plain object");
      value = returned as JsonObject;
    } catch (error) {
      if (ex.stop === null) {
        outcome = "FAILED";
        message = error instanceof Error ? `${error.name}: ${error.message}` : String(error);
      }
    }
    if (ex.stop !== null) outcome = ex.stop === "budget" ? "BUDGET_EXHAUSTED" : "CANCELLED";
    this.shared.change((core) => this.finish(core, ex, outcome, value, message));
    await watchdog;
  }

  private finish(core: ParticipantCore, ex: Execution, outcome: RunOutcome, value: JsonObject, message: string): void {
    const now = this.shared.now();
    const turns = ex.saved?.boundaryIndex ?? 0;
    const active = ex.clock.active(now);
    ex.running = false;
    const id = episodeKey(ex.episode);
    const mine = this.executions.get(id) === ex;
    const base = { type: "result" as const, episode: ex.episode, turns, activeTimeS: active, errorMessage: message };
    if (outcome === "CANCELLED") {
      ex.result = { ...base, outcome, receipt: null, result: {} };
      if (ex.stop === "retired" || ex.stop === "shutdown" || !mine) return; // the retire (or shutdown) frees it
      if (ex.saved !== null && !this.restartOnly && core.entry(ex.key) !== undefined) {
        // Nothing owed, but the sealed boundary stays committable and claimable.
        core.setState(ex.key, "PARKED", now, { detail: `cancelled at boundary ${ex.saved.boundaryIndex}` });
      } else {
        core.remove(ex.key, now);
        this.executions.delete(id);
      }
      return;
    }
    // A valid protocol id, unique per completion.
    const receipt: CompletionReceipt = { episode: ex.episode, receiptId: `rc-${randomBytes(12).toString("hex")}` };
    ex.result = { ...base, outcome, receipt, result: value };
    if (mine && core.entry(ex.key) !== undefined) {
      core.setState(ex.key, "COMPLETED_UNACKED", now, { receipt, detail: outcome });
    }
  }

  /** Park at the last boundary until admission opens (section 5.2 item 3). */
  private async hold(ex: Execution): Promise<void> {
    const shared = this.shared;
    const core = shared.core;
    if (core.admissionOpen || core.isRestart(ex.key)) {
      const entry = core.entry(ex.key);
      if (entry !== undefined && entry.state !== "RUNNING") shared.change((c) => c.setState(ex.key, "RUNNING", shared.now()));
      return;
    }
    shared.change((c) => c.setState(ex.key, "PARKED", shared.now()));
    ex.clock.pause(shared.now());
    while (!core.admissionOpen) await shared.nextChange(null, ex.abort.signal);
    shared.change((c) => c.setState(ex.key, "RUNNING", shared.now()));
    ex.clock.resume(shared.now());
  }

  /** @internal EpisodeContext.boundary */
  async seal(ex: Execution, turnIndex: number, state: JsonObject): Promise<void> {
    if (!Number.isInteger(turnIndex) || turnIndex < 0) throw new RangeError(`turnIndex must be an integer >= 0, got ${turnIndex}`);
    if (ex.abort.signal.aborted) throw new CancelledError(`${episodeKey(ex.episode)} was cancelled`);
    const shared = this.shared;
    shared.change((core) => {
      const index = (ex.saved?.boundaryIndex ?? 0) + 1;
      ex.saved = { boundaryIndex: index, turnIndex, state };
      ex.boundaries.push({ type: "boundary", episode: ex.episode, boundaryIndex: index, turnIndex, sealedAt: shared.wallClock() });
      core.sealBoundary(ex.key, index, turnIndex, shared.now());
    });
    await this.hold(ex);
  }

  /** @internal EpisodeContext.modelCall */
  async modelCall<T>(ex: Execution, factory: (signal: AbortSignal) => Promise<T>): Promise<T> {
    const signal = ex.abort.signal;
    if (ex.saved === null) return factory(signal);
    const shared = this.shared;
    const core = shared.core;
    for (;;) {
      shared.change((c) => c.setState(ex.key, "AWAITING_MODEL", shared.now()));
      if (!core.admissionOpen) {
        // Closed since the boundary: the call waits, parked, instead of issuing.
        ex.clock.pause(shared.now());
        while (!core.admissionOpen) await shared.nextChange(null, signal);
        ex.clock.resume(shared.now());
      }
      let reply: T;
      try {
        reply = await factory(signal);
      } catch (error) {
        if (error instanceof TurnpointError && error.reason === "ADMISSION_CLOSED" && !signal.aborted) {
          await this.afterRefusal(signal);
          continue;
        }
        if (!signal.aborted) shared.change((c) => c.setState(ex.key, "RUNNING", shared.now()));
        throw error;
      }
      // A reply that arrives while a checkpoint is open is held until resume.
      while (!core.admissionOpen) await shared.nextChange(null, signal);
      shared.change((c) => c.setState(ex.key, "RUNNING", shared.now()));
      ex.clock.resume(shared.now());
      return reply;
    }
  }

  /** The model refused with ADMISSION_CLOSED: stay parked, retry after (our) resume. */
  private async afterRefusal(signal: AbortSignal): Promise<void> {
    const shared = this.shared;
    const core = shared.core;
    if (core.admissionOpen) {
      // Our own admission is open: the model's checkpoint is not in step with ours.
      await shared.waitUntil(() => !core.admissionOpen, shared.config.modelRetryBackoffS * 1000, signal);
    }
    while (!core.admissionOpen) await shared.nextChange(null, signal);
  }

  private async watchBudget(ex: Execution): Promise<void> {
    const budget = ex.budgetS as number;
    const shared = this.shared;
    while (ex.running) {
      const spent = ex.clock.active(shared.now());
      if (spent >= budget) {
        this.cancel(ex, "budget");
        return;
      }
      // Paused (parked by a checkpoint): nothing to time until something changes.
      await shared.nextChange(ex.clock.paused ? null : (budget - spent) * 1000);
    }
  }

  // ---------------------------------------------------------------- kind hooks

  async admissionClosed(): Promise<void> {
    const now = this.shared.now();
    for (const ex of this.executions.values()) {
      if (this.shared.core.entry(ex.key)?.state === "AWAITING_MODEL") ex.clock.pause(now);
    }
    await this.agent.admissionClosed?.();
  }

  async admissionOpened(): Promise<void> {
    const now = this.shared.now();
    for (const ex of this.executions.values()) {
      if (this.shared.core.entry(ex.key)?.state === "AWAITING_MODEL") ex.clock.resume(now);
    }
    await this.agent.admissionOpened?.();
  }

  async exportRecords(keys: readonly WorkKey[]): Promise<Record[]> {
    const saved = new Map<string, SavedTurn>();
    for (const key of keys) {
      const ex = this.executions.get(episodeKey(key.episode));
      if (ex === undefined || ex.saved === null) {
        throw new TurnpointError("INVALID_CHECKPOINT_STATE", `${episodeKey(key.episode)} has no sealed boundary to export`, {
          episode: episodeKey(key.episode),
        });
      }
      saved.set(episodeKey(key.episode), ex.saved);
    }
    const states =
      this.agent.exportStates !== undefined
        ? await this.agent.exportStates(saved)
        : new Map([...saved.entries()].map(([id, turn]) => [id, turn.state] as const));
    const records: Record[] = [];
    for (const [id, turn] of saved) {
      const state = states.get(id);
      if (state === undefined) {
        throw new TurnpointError("INVALID_CHECKPOINT_STATE", `the agent's export left out ${id}`, { episode: id });
      }
      const ex = this.executions.get(id) as Execution;
      records.push({
        episode: ex.episode,
        key: SLOT,
        payload: { task: ex.task, boundary_index: turn.boundaryIndex, turn_index: turn.turnIndex, state },
      });
    }
    return records;
  }

  validate(record: Record): void {
    const payload = record.payload;
    const fields = Object.keys(payload).sort();
    if (fields.join(",") !== PAYLOAD_FIELDS.join(",")) {
      throw invalidRecord(record, `fields ${JSON.stringify(fields)} are not ${JSON.stringify(PAYLOAD_FIELDS)}`);
    }
    for (const [name, least] of [
      ["boundary_index", 1],
      ["turn_index", 0],
    ] as const) {
      const value = payload[name];
      if (typeof value !== "number" || !Number.isSafeInteger(value) || value < least) {
        throw invalidRecord(record, `${name} must be an integer >= ${least}`);
      }
    }
    if (!isPlainObject(payload.task) || !isPlainObject(payload.state)) throw invalidRecord(record, "task and state must be objects");
    try {
      this.agent.validateState?.(record.episode, payload.state as JsonObject);
    } catch (error) {
      throw invalidRecord(record, error instanceof Error ? error.message : String(error));
    }
  }

  async install(record: Record, episode: EpisodeId): Promise<WorkKey> {
    const payload = record.payload;
    const saved: SavedTurn = {
      boundaryIndex: payload.boundary_index as number,
      turnIndex: payload.turn_index as number,
      state: payload.state as JsonObject,
    };
    const ex = new Execution(episode, payload.task as JsonObject, saved, null, this.shared.now());
    this.shared.change((core) => {
      core.installRestored(ex.key, saved.boundaryIndex, saved.turnIndex, this.shared.now());
      this.executions.set(episodeKey(episode), ex);
    });
    return ex.key;
  }

  async stop(key: WorkKey): Promise<void> {
    const id = episodeKey(key.episode);
    const ex = this.executions.get(id);
    if (ex === undefined) return;
    if (ex.running) {
      this.cancel(ex, "retired");
      await ex.done;
    }
    if (this.executions.get(id) === ex) this.executions.delete(id);
  }

  async close(): Promise<void> {
    const running: Promise<void>[] = [];
    for (const ex of this.executions.values()) {
      if (ex.running) {
        running.push(ex.done);
        this.cancel(ex, "shutdown");
      }
    }
    await Promise.allSettled(running);
  }
}

function sameTask(ex: Execution, task: JsonObject): void {
  if (!sameJson(ex.task, task)) {
    throw new TurnpointError("INVALID_ARGUMENT", `${episodeKey(ex.episode)} is held here with another task`, {
      episode: episodeKey(ex.episode),
      field: "task",
    });
  }
}
