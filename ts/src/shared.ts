/**
 * What the runtime and the kind hosts share: the core, the clocks, the one place state
 * changes and the waits on it.
 *
 * JavaScript runs one piece of code at a time, so the core needs no lock between two
 * awaits: every change is a synchronous block `shared.change(core => ...)` that ends by
 * publishing, which hands the core's events to watchers and wakes every waiter. A
 * waiter re-checks its own predicate in the same synchronous block as the change it
 * then makes (`while (!pred()) await shared.nextChange()`), which is what "re-check
 * admission before it runs" (section 4.9 item 5) needs. The few steps that must not
 * interleave across awaits (running the kinds' admission hooks) take `exclusive`.
 */
import { CancelledError, TurnpointError } from "./errors.js";
import type { CoreEvent, ParticipantCore } from "./core.js";
import type { Record } from "./records.js";
import { episodeKey } from "./ids.js";

/** Tunables of one participant runtime; defaults are the reference's (section 7.9). */
export interface RuntimeConfig {
  readonly defaultLeaseS: number;
  readonly defaultCallTimeoutS: number;
  readonly replyMarginS: number;
  readonly replyMarginFraction: number;
  readonly defaultMaxBlockers: number;
  readonly maxBlockersLimit: number;
  readonly maxFinishedIds: number;
  readonly maxAnsweredRequests: number;
  readonly modelRetryBackoffS: number;
  readonly watchQueueSize: number;
  /**
   * How long a Run that lets a new attempt wait for admission (`wait_for_admission`)
   * waits before it is refused with ADMISSION_CLOSED after all (section 5.2 item 1).
   */
  readonly runAdmissionWaitS: number;
  /**
   * Serve RestoreRunning and list CAPABILITY_RESTORE_RUNNING in Describe (section 4.16);
   * off, the call is refused INVALID_ARGUMENT and a coordinator restores only while fresh.
   */
  readonly restoreRunning: boolean;
}

export const DEFAULT_CONFIG: RuntimeConfig = {
  defaultLeaseS: 60,
  defaultCallTimeoutS: 60,
  replyMarginS: 0.5,
  replyMarginFraction: 0.1,
  defaultMaxBlockers: 32,
  maxBlockersLimit: 1024,
  maxFinishedIds: 1024,
  maxAnsweredRequests: 4096,
  modelRetryBackoffS: 0.5,
  watchQueueSize: 1024,
  runAdmissionWaitS: 5,
  restoreRunning: true,
};

export function runtimeConfig(overrides: Partial<RuntimeConfig> = {}): RuntimeConfig {
  const config = { ...DEFAULT_CONFIG, ...overrides };
  for (const name of ["defaultLeaseS", "defaultCallTimeoutS", "modelRetryBackoffS", "runAdmissionWaitS"] as const) {
    if (!(config[name] > 0)) throw new RangeError(`${name} must be > 0`);
  }
  if (config.replyMarginS < 0 || !(config.replyMarginFraction >= 0 && config.replyMarginFraction < 1)) {
    throw new RangeError("reply margins must be >= 0 (fraction < 1)");
  }
  if (config.watchQueueSize < 1 || config.maxBlockersLimit < 1) throw new RangeError("bounds must be >= 1");
  return config;
}

/**
 * When a call must be answered: its deadline minus the reply margin of section 3.4
 * (`min(0.5 s, 10% of the timeout)`). Measured on the real monotonic clock because it
 * bounds real waits; protocol time (leases, budgets) runs on the injectable clock.
 */
export class Deadline {
  private readonly at: number;

  constructor(timeoutS: number | null, config: RuntimeConfig) {
    const total = timeoutS === null ? config.defaultCallTimeoutS : Math.max(0, timeoutS);
    const margin = Math.min(config.replyMarginS, total * config.replyMarginFraction);
    this.at = performance.now() + (total - margin) * 1000;
  }

  static never(): Deadline {
    const deadline = Object.create(Deadline.prototype) as { at: number };
    deadline.at = Number.POSITIVE_INFINITY;
    return deadline as unknown as Deadline;
  }

  /** Milliseconds left (>= 0), or null for a deadline that never comes. */
  remainingMs(): number | null {
    if (this.at === Number.POSITIVE_INFINITY) return null;
    return Math.max(0, this.at - performance.now());
  }

  exceeded(what: string): TurnpointError {
    return new TurnpointError(
      "DEADLINE_EXCEEDED",
      `${what} did not finish before the call's deadline; it continues and a retry joins it`,
    );
  }
}

/** One WatchBoundaries subscriber: a bounded queue of events and a wake-up. */
export class Watcher {
  readonly events: CoreEvent[] = [];
  lagged = false;
  private wake: (() => void) | null = null;

  constructor(private readonly size: number) {}

  push(events: readonly CoreEvent[]): void {
    this.events.push(...events);
    if (this.events.length > this.size) {
      // The oldest fall out; the readiness report that follows says where all stands.
      this.events.splice(0, this.events.length - this.size);
      this.lagged = true;
    }
    this.notify();
  }

  notify(): void {
    const wake = this.wake;
    this.wake = null;
    wake?.();
  }

  /** Resolves at the next push (or `notify`), or at once if events are queued. */
  waitForEvents(signal?: AbortSignal): Promise<void> {
    if (this.events.length > 0) return Promise.resolve();
    return new Promise((resolve, reject) => {
      const onAbort = (): void => reject(new CancelledError("the watch was cancelled"));
      if (signal?.aborted) return onAbort();
      signal?.addEventListener("abort", onAbort, { once: true });
      this.wake = () => {
        signal?.removeEventListener("abort", onAbort);
        resolve();
      };
    });
  }
}

/** Resolves after `ms` (or never for null), or rejects with CancelledError on `signal`. */
export function sleep(ms: number | null, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(new CancelledError());
    let timer: NodeJS.Timeout | undefined;
    const onAbort = (): void => {
      if (timer !== undefined) clearTimeout(timer);
      reject(new CancelledError());
    };
    if (ms !== null) {
      timer = setTimeout(() => {
        signal?.removeEventListener("abort", onAbort);
        resolve();
      }, ms);
    }
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

/** The core, the clocks and the one place state changes. */
export class Shared {
  private waiters = new Set<() => void>();
  private readonly watchers = new Set<Watcher>();
  private exclusiveChain: Promise<unknown> = Promise.resolve();

  constructor(
    readonly core: ParticipantCore,
    readonly config: RuntimeConfig,
    /** Monotonic seconds: leases and budgets (injectable for tests). */
    readonly clock: () => number,
    /** Seconds since the epoch: what goes on the wire. */
    readonly wallClock: () => number,
  ) {}

  now(): number {
    return this.clock();
  }

  /** Map a time on the protocol clock to seconds since the epoch, for the wire. */
  toWall(at: number | null): number | null {
    return at === null ? null : this.wallClock() + (at - this.clock());
  }

  /** Change state synchronously, then let watchers and waiters know. */
  change<T>(work: (core: ParticipantCore) => T): T {
    try {
      return work(this.core);
    } finally {
      this.publish();
    }
  }

  /** Hand the core's events to watchers and wake every waiter to re-check. */
  publish(): void {
    const events = this.core.drainEvents();
    for (const watcher of this.watchers) {
      if (events.length > 0) watcher.push(events);
      else watcher.notify();
    }
    const waiters = this.waiters;
    this.waiters = new Set();
    for (const wake of waiters) wake();
  }

  /**
   * Resolves at the next publish, after `timeoutMs` (null: no limit), or rejects with
   * CancelledError when `signal` aborts. Callers loop: `while (!pred()) await ...`.
   */
  nextChange(timeoutMs: number | null = null, signal?: AbortSignal): Promise<void> {
    return new Promise((resolve, reject) => {
      if (signal?.aborted) return reject(new CancelledError());
      let timer: NodeJS.Timeout | undefined;
      const done = (): void => {
        if (timer !== undefined) clearTimeout(timer);
        signal?.removeEventListener("abort", onAbort);
        this.waiters.delete(done);
        resolve();
      };
      const onAbort = (): void => {
        if (timer !== undefined) clearTimeout(timer);
        this.waiters.delete(done);
        reject(new CancelledError());
      };
      this.waiters.add(done);
      if (timeoutMs !== null) timer = setTimeout(done, Math.max(0, timeoutMs));
      signal?.addEventListener("abort", onAbort, { once: true });
    });
  }

  /** Wait until `predicate()` holds or `timeoutMs` passed; returns it (re-check after!). */
  async waitUntil(predicate: () => boolean, timeoutMs: number | null, signal?: AbortSignal): Promise<boolean> {
    const until = timeoutMs === null ? null : performance.now() + timeoutMs;
    while (!predicate()) {
      const left = until === null ? null : until - performance.now();
      if (left !== null && left <= 0) return predicate();
      await this.nextChange(left, signal);
    }
    return true;
  }

  /** Run `work` with no other `exclusive` work interleaved (hooks that span awaits). */
  exclusive<T>(work: () => Promise<T>): Promise<T> {
    const run = this.exclusiveChain.catch(() => undefined).then(work);
    this.exclusiveChain = run.catch(() => undefined);
    return run;
  }

  addWatcher(): Watcher {
    const watcher = new Watcher(this.config.watchQueueSize);
    this.watchers.add(watcher);
    return watcher;
  }

  removeWatcher(watcher: Watcher): void {
    this.watchers.delete(watcher);
  }
}

export function invalidRecord(record: Record, why: string): TurnpointError {
  return new TurnpointError("INVALID_CHECKPOINT_STATE", `record ${JSON.stringify(record.key)} of ${episodeKey(record.episode)} is invalid: ${why}`, {
    episode: episodeKey(record.episode),
    key: record.key,
  });
}
