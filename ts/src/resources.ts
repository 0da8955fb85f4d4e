/**
 * Resources servers: tools, sandboxes and verifiers, one session per episode
 * (docs/spec.md section 5.3). A port of turnpoint.participant_sdk._resources.
 *
 * Data requests (seed, call, verify) wait out an open checkpoint instead of being
 * refused; a request in flight blocks prepare (except a REPLAY verify); closing a
 * session is never refused. What a checkpoint does with sessions is the server's
 * `recoveryMode`: RESTART_ONLY (default; sessions are restarts and never block),
 * STATELESS (nothing to save) or EXPORTED (`exportSessions`, `restoreSession` and
 * `retireSession` are required, checked at startup).
 *
 * Hooks get an AbortSignal: it aborts when the caller cancels, or when a close or a
 * retire stops the request (the caller then gets STALE_ATTEMPT at once; the session is
 * freed only after the hook settled).
 *
 * A call or verify with a request id runs at most once per session (docs/spec.md
 * section 6.12, ./effects.ts): its reply is recorded with the session, exported with it
 * in the reserved payload field `turnpoint_effects` and restored with it, so a retry or
 * a continued attempt re-sending the key gets the recorded reply and the hook does not
 * run again; the key with another call is refused (EffectConflictError).
 */
import type { ParticipantCore, WorkKey } from "./core.js";
import { workKey } from "./core.js";
import { EFFECTS_FIELD, EffectRecord, callFingerprint, checkSameCall, splitPayload } from "./effects.js";
import { CancelledError, TurnpointError } from "./errors.js";
import type { EpisodeId } from "./ids.js";
import { episodeKey } from "./ids.js";
import type { KindDescription, KindHost } from "./kinds.js";
import type { EpisodeState, JsonObject, RecoveryMode, VerifyMode } from "./protocol.js";
import type { Record } from "./records.js";
import type { Shared } from "./shared.js";
import { invalidRecord } from "./shared.js";

const SLOT = "session";

/** A verify's score. */
export interface Verdict {
  readonly reward: number;
  readonly details?: JsonObject;
}

/** What a Gym resources server implements; see the module comment. */
export interface ResourcesServer {
  readonly recoveryMode?: RecoveryMode;
  readonly verifyMode?: VerifyMode;
  readonly groupScored?: boolean;
  readonly groupSize?: number;
  readonly environment?: string;
  /** Create the episode's session (the task carries prompt_group_id, sibling_index, group_size). */
  seed(episode: EpisodeId, task: JsonObject, signal: AbortSignal): Promise<void>;
  /**
   * Run one tool call in the episode's session. It runs once per call key: a call
   * re-sent with its key is answered from the session's reply record (spec 6.12).
   */
  call(episode: EpisodeId, tool: string, args: JsonObject, signal: AbortSignal): Promise<JsonObject>;
  /**
   * Score the episode's final answer. An EXPORTED session is not freed here: it stays
   * sealed, exported with every cut, until retired (spec 5.3 item 3), and a restore may
   * ask this verify again on the saved session; free state in close / retireSession.
   */
  verify(episode: EpisodeId, answer: JsonObject, signal: AbortSignal): Promise<Verdict>;
  /** End the session and free its state. */
  close(episode: EpisodeId): Promise<void>;
  /** EXPORTED: the state of each session asked for (keyed by `rollout_id#attempt`). */
  exportSessions?(episodes: readonly EpisodeId[]): Promise<ReadonlyMap<string, JsonObject>>;
  /** EXPORTED: install the state `saved` (attempt N) exported, as `episode` (N+1). */
  restoreSession?(saved: EpisodeId, episode: EpisodeId, state: JsonObject): Promise<void>;
  /** EXPORTED: drop a session's state for good (retired, or restored but not continued). */
  retireSession?(episode: EpisodeId): Promise<void>;
  /** Throw if a saved session cannot be restored (checked before any install). */
  validateSession?(episode: EpisodeId, state: JsonObject): void;
  admissionClosed?(): Promise<void>;
  admissionOpened?(): Promise<void>;
}

/** A kind declares something it cannot honour; thrown when the participant starts. */
export class ConfigurationError extends TurnpointError {
  constructor(message: string) {
    super("INVALID_ARGUMENT", message);
    this.name = "ConfigurationError";
  }
}

/** The startup checks: EXPORTED needs its hooks, group-scored needs REPLAY verifies. */
export function checkResourcesServer(server: ResourcesServer): void {
  if ((server.recoveryMode ?? "RESTART_ONLY") === "EXPORTED") {
    const missing = (["exportSessions", "restoreSession", "retireSession"] as const).filter((name) => typeof server[name] !== "function");
    if (missing.length > 0) {
      throw new ConfigurationError(`the resources server declares recoveryMode EXPORTED but does not implement ${missing.join(", ")}`);
    }
  }
  if (server.groupScored === true) {
    if (server.verifyMode !== "REPLAY") {
      throw new ConfigurationError("a group-scored resources server's verify waits on siblings a checkpoint may park: declare verifyMode REPLAY");
    }
    if (!((server.groupSize ?? 0) >= 1)) throw new ConfigurationError("a group-scored resources server needs groupSize >= 1");
  }
}

interface Request {
  readonly promise: Promise<unknown>;
  readonly abort: AbortController;
  /** Resolves when a close or retire stops the request. */
  readonly stopped: Promise<void>;
  stop(): void;
  settled: boolean;
}

class Session {
  readonly key: WorkKey;
  /** Request -> whether it blocks prepare (a REPLAY verify does not). */
  readonly inflight = new Map<Request, boolean>();
  closing = false;
  /** Set once a verify succeeded on an exported session: sealed until retired. */
  verdict: Verdict | undefined = undefined;
  /** Each keyed call's reply (spec 6.12), exported with the session. */
  replies = new EffectRecord();
  /** Keyed calls running now, by key. */
  readonly pending = new Map<string, { operation: string; tool: string; fingerprint: string; done: Promise<void> }>();

  constructor(readonly episode: EpisodeId) {
    this.key = workKey(episode, SLOT);
  }
}

function identity<T>(value: T): T {
  return value;
}

function verdictToJson(verdict: Verdict): JsonObject {
  return { reward: verdict.reward, details: verdict.details ?? {} };
}

function verdictFromJson(recorded: JsonObject): Verdict {
  return { reward: Number(recorded["reward"]), details: (recorded["details"] ?? {}) as JsonObject };
}

function settle(promise: Promise<unknown>): Promise<void> {
  return promise.then(
    () => undefined,
    () => undefined,
  );
}

/** Hosts one ResourcesServer: its sessions and their requests. */
export class ResourcesHost implements KindHost {
  readonly slot = SLOT;
  readonly kind = "RESOURCES" as const;
  private readonly sessions = new Map<string, Session>();

  constructor(
    private readonly shared: Shared,
    private readonly server: ResourcesServer,
  ) {
    checkResourcesServer(server);
  }

  get recoveryMode(): RecoveryMode {
    return this.server.recoveryMode ?? "RESTART_ONLY";
  }

  get recordKey(): string | null {
    return this.recoveryMode === "EXPORTED" ? SLOT : null;
  }

  private get restartOnly(): boolean {
    return this.recoveryMode === "RESTART_ONLY";
  }

  describe(): KindDescription {
    return {
      verifyMode: this.server.verifyMode ?? "WAIT",
      groupScored: this.server.groupScored ?? false,
      groupSize: this.server.groupSize ?? 0,
      environment: this.server.environment ?? "",
    };
  }

  // ---------------------------------------------------------------- data plane

  /** Create the session (waiting out a checkpoint); true if it already existed. */
  async seed(episode: EpisodeId, task: JsonObject, signal?: AbortSignal): Promise<boolean> {
    const shared = this.shared;
    const core = shared.core;
    for (;;) {
      core.checkAttempt(episode);
      if (this.sessions.has(episodeKey(episode))) return true;
      if (core.admissionOpen) break;
      await shared.nextChange(null, signal);
    }
    const session = new Session(episode);
    const state: EpisodeState = this.restartOnly ? "RESTART" : "REQUEST_IN_FLIGHT";
    shared.change((c) => c.admit(session.key, state, shared.now()));
    this.sessions.set(episodeKey(episode), session);
    const request = this.start(session, (s) => this.server.seed(episode, task, s), true);
    try {
      await this.finish(session, request, signal);
    } catch (error) {
      if (this.sessions.get(episodeKey(episode)) === session && session.inflight.size === 0) {
        this.sessions.delete(episodeKey(episode));
        shared.change((c) => c.remove(session.key, shared.now()));
      }
      throw error;
    }
    return false;
  }

  /** Run one tool call; a `requestId` the session holds answers from its record. */
  call(episode: EpisodeId, tool: string, args: JsonObject, signal?: AbortSignal, requestId = ""): Promise<JsonObject> {
    if (!requestId) return this.request(episode, (s) => this.server.call(episode, tool, args, s), false, signal);
    const fingerprint = callFingerprint("call", tool, args);
    const run = (s: AbortSignal): Promise<JsonObject> => this.server.call(episode, tool, args, s);
    return this.request(episode, (s) => this.once(episode, requestId, { operation: "call", tool, fingerprint }, () => run(s), identity, identity), false, signal);
  }

  /**
   * Run a keyed call at most once per session (docs/spec.md section 6.12), as the
   * request in flight. A key already recorded answers from the record; one running now
   * is waited for (and run here if that run failed, since a failure records nothing).
   */
  private async once<T>(
    episode: EpisodeId,
    requestId: string,
    call: { operation: string; tool: string; fingerprint: string },
    run: () => Promise<T>,
    encode: (value: T) => JsonObject,
    decode: (recorded: JsonObject) => T,
  ): Promise<T> {
    const { operation, tool, fingerprint } = call;
    const session = this.sessions.get(episodeKey(episode)) as Session;
    for (;;) {
      const recorded = session.replies.lookup(requestId, operation, tool, fingerprint);
      if (recorded !== undefined) return decode(recorded);
      const running = session.pending.get(requestId);
      if (running === undefined) break;
      checkSameCall(requestId, running, operation, tool, fingerprint);
      await running.done;
    }
    let finished = (): void => undefined;
    const done = new Promise<void>((resolve) => (finished = resolve));
    session.pending.set(requestId, { ...call, done });
    try {
      const reply = await run();
      session.replies.record(requestId, operation, tool, fingerprint, encode(reply));
      return reply;
    } finally {
      session.pending.delete(requestId);
      finished();
    }
  }

  /**
   * Score the answer (docs/spec.md section 5.3 item 3). A server that does not export
   * sessions ends the session once the verify succeeded; an EXPORTED one seals it: kept,
   * exported with each cut, a repeated verify answering the same verdict, until the
   * coordinator retires the attempt (the agent's cut may still be before this verify).
   * A REPLAY verify that finishes while a checkpoint is open replies after resume: its
   * session belongs to the frozen cut.
   */
  async verify(episode: EpisodeId, answer: JsonObject, signal?: AbortSignal, requestId = ""): Promise<Verdict> {
    const replayable = (this.server.verifyMode ?? "WAIT") === "REPLAY";
    const scored = (s: AbortSignal): Promise<Verdict> => {
      if (!requestId) return this.server.verify(episode, answer, s);
      const call = { operation: "verify", tool: "", fingerprint: callFingerprint("verify", "", answer) };
      return this.once(episode, requestId, call, () => this.server.verify(episode, answer, s), verdictToJson, verdictFromJson);
    };
    if (this.recoveryMode !== "EXPORTED") {
      const verdict = await this.request(episode, scored, replayable, signal);
      await this.closeSession(episode, signal);
      return verdict;
    }
    this.shared.core.checkAttempt(episode);
    const sealed = this.sessions.get(episodeKey(episode));
    if (sealed !== undefined && !sealed.closing && sealed.verdict !== undefined) {
      // Its own key re-sent with another answer is refused first (spec 6.12 item 3).
      if (requestId) sealed.replies.lookup(requestId, "verify", "", callFingerprint("verify", "", answer));
      return sealed.verdict;
    }
    const verdict = await this.request(episode, scored, replayable, signal);
    const session = this.sessions.get(episodeKey(episode));
    if (session !== undefined && !session.closing) session.verdict = verdict;
    while (!this.shared.core.admissionOpen) await this.shared.nextChange(null, signal);
    return verdict;
  }

  /**
   * End the session and stop its requests; never refused; false if there was none.
   * During a checkpoint it waits for resume, except a restart session.
   */
  async closeSession(episode: EpisodeId, signal?: AbortSignal): Promise<boolean> {
    const shared = this.shared;
    const core = shared.core;
    for (;;) {
      const session = this.sessions.get(episodeKey(episode));
      if (session === undefined) return false;
      if (session.closing) break;
      if (core.admissionOpen || core.isRestart(session.key)) {
        session.closing = true;
        // Closing is work in flight: a prepare waits for it to end.
        shared.change((c) => c.setState(session.key, "REQUEST_IN_FLIGHT", shared.now()));
        break;
      }
      await shared.nextChange(null, signal);
    }
    await this.end(episode, false);
    return true;
  }

  private async request<T>(episode: EpisodeId, factory: (signal: AbortSignal) => Promise<T>, replayable: boolean, signal?: AbortSignal): Promise<T> {
    const shared = this.shared;
    const core = shared.core;
    let session: Session;
    for (;;) {
      core.checkAttempt(episode);
      const found = this.sessions.get(episodeKey(episode));
      // A sealed session takes no more calls (its verify answers from it).
      if (found === undefined || found.closing || found.verdict !== undefined) {
        throw new TurnpointError("NOT_FOUND", `no session for ${episodeKey(episode)}`, { episode: episodeKey(episode) });
      }
      session = found;
      // A restart session is not part of any cut: it keeps running.
      if (core.admissionOpen || core.isRestart(found.key)) break;
      await shared.nextChange(null, signal);
    }
    if (core.entry(session.key)?.state === "RESTORED") {
      shared.change((c) => c.claimRestored(session.key, "IDLE", shared.now()));
    }
    const request = this.start(session, factory, !replayable);
    return (await this.finish(session, request, signal)) as T;
  }

  /** Register a request in flight (right after the admission check, same synchronous block). */
  private start(session: Session, factory: (signal: AbortSignal) => Promise<unknown>, blocking: boolean): Request {
    const abort = new AbortController();
    let stop = (): void => undefined;
    const stopped = new Promise<void>((resolve) => (stop = resolve));
    const request: Request = {
      // Deferred: the hook must not run inside this synchronous change.
      promise: Promise.resolve().then(() => factory(abort.signal)),
      abort,
      stopped,
      stop,
      settled: false,
    };
    void settle(request.promise).then(() => (request.settled = true));
    session.inflight.set(request, blocking);
    this.shared.change((core) => this.syncState(core, session));
    return request;
  }

  private async finish(session: Session, request: Request, signal?: AbortSignal): Promise<unknown> {
    const callerGone = new Promise<"caller">((resolve) => {
      if (signal?.aborted) resolve("caller");
      signal?.addEventListener("abort", () => resolve("caller"), { once: true });
    });
    try {
      const first = await Promise.race([
        request.promise.then(
          (value) => ({ value }),
          (error: unknown) => ({ error }),
        ),
        request.stopped.then(() => "stopped" as const),
        callerGone,
      ]);
      if (first === "caller") {
        // The caller went away: its request stops and is no longer counted.
        request.abort.abort();
        await settle(request.promise);
        throw new CancelledError("the caller cancelled the request");
      }
      if (first === "stopped") {
        throw new TurnpointError("STALE_ATTEMPT", `the request of ${episodeKey(session.episode)} was stopped (retired or closed)`, {
          episode: episodeKey(session.episode),
        });
      }
      if ("error" in first) throw first.error;
      return first.value;
    } finally {
      session.inflight.delete(request);
      this.shared.change((core) => this.syncState(core, session));
    }
  }

  private syncState(core: ParticipantCore, session: Session): void {
    if (core.entry(session.key) === undefined) return;
    let state: EpisodeState = "IDLE";
    let replayable = false;
    if (session.closing || [...session.inflight.values()].some(Boolean)) state = "REQUEST_IN_FLIGHT";
    else if (session.inflight.size > 0) [state, replayable] = ["REQUEST_IN_FLIGHT", true];
    if (this.restartOnly) state = "RESTART";
    core.setState(session.key, state, this.shared.now(), { replayable });
  }

  /** Stop the session's requests, free it on the server, drop its entry. */
  private async end(episode: EpisodeId, retire: boolean): Promise<void> {
    const session = this.sessions.get(episodeKey(episode));
    if (session === undefined) return;
    session.closing = true;
    const requests = [...session.inflight.keys()].filter((r) => !r.settled);
    for (const request of requests) {
      request.stop();
      request.abort.abort();
    }
    await Promise.all(requests.map((r) => settle(r.promise)));
    if (retire && this.recoveryMode === "EXPORTED") await this.server.retireSession?.(episode);
    else await this.server.close(episode);
    this.shared.change((core) => {
      if (this.sessions.get(episodeKey(episode)) === session) this.sessions.delete(episodeKey(episode));
      if (!retire) core.remove(session.key, this.shared.now());
    });
  }

  // ---------------------------------------------------------------- kind hooks

  async admissionClosed(): Promise<void> {
    await this.server.admissionClosed?.();
  }

  async admissionOpened(): Promise<void> {
    await this.server.admissionOpened?.();
  }

  async exportRecords(keys: readonly WorkKey[]): Promise<Record[]> {
    if (this.recoveryMode !== "EXPORTED") return []; // stateless: nothing to save
    const episodes = keys.map((key) => key.episode);
    const states = await (this.server.exportSessions as NonNullable<ResourcesServer["exportSessions"]>)(episodes);
    return episodes.map((e) => {
      const state = states.get(episodeKey(e));
      if (state === undefined) {
        throw new TurnpointError("INVALID_CHECKPOINT_STATE", `the resources server's export left out the session of ${episodeKey(e)}`, {
          episode: episodeKey(e),
        });
      }
      return { episode: e, key: SLOT, payload: this.withReplies(e, state) };
    });
  }

  /** The session's payload: the server's state plus its reply record, if any. */
  private withReplies(episode: EpisodeId, state: JsonObject): JsonObject {
    if (EFFECTS_FIELD in state) {
      throw new TurnpointError("INVALID_CHECKPOINT_STATE", `the resources server's export of ${episodeKey(episode)} uses the reserved field ${EFFECTS_FIELD}`, {
        episode: episodeKey(episode),
        field: EFFECTS_FIELD,
      });
    }
    const session = this.sessions.get(episodeKey(episode));
    if (session === undefined || session.replies.size === 0) return state;
    return { ...state, [EFFECTS_FIELD]: session.replies.toJson() };
  }

  validate(record: Record): void {
    try {
      const { state } = splitPayload(record.payload);
      this.server.validateSession?.(record.episode, state);
    } catch (error) {
      throw invalidRecord(record, error instanceof Error ? error.message : String(error));
    }
  }

  async install(record: Record, episode: EpisodeId): Promise<WorkKey> {
    const { state, replies } = splitPayload(record.payload);
    await (this.server.restoreSession as NonNullable<ResourcesServer["restoreSession"]>)(record.episode, episode, state);
    // docs/spec.md section 5.6 item 4: a restore hook that installs nothing would let the
    // episode continue against an empty session; the server's own export must hold it.
    const present = await (this.server.exportSessions as NonNullable<ResourcesServer["exportSessions"]>)([episode]);
    if (!present.has(episodeKey(episode))) {
      await (this.server.retireSession as NonNullable<ResourcesServer["retireSession"]>)(episode);
      throw new TurnpointError(
        "INVALID_CHECKPOINT_STATE",
        `restoreSession installed nothing for ${episodeKey(episode)}: exportSessions does not hold the session afterwards`,
        { episode: episodeKey(episode) },
      );
    }
    const session = new Session(episode);
    if (replies !== null) session.replies = replies;
    this.shared.change((core) => {
      core.installRestored(session.key, 0, 0, this.shared.now());
      this.sessions.set(episodeKey(episode), session);
    });
    return session.key;
  }

  async stop(key: WorkKey): Promise<void> {
    await this.end(key.episode, true);
  }

  async close(): Promise<void> {
    const requests = [...this.sessions.values()].flatMap((s) => [...s.inflight.keys()]).filter((r) => !r.settled);
    for (const request of requests) request.abort.abort();
    await Promise.all(requests.map((r) => settle(r.promise)));
  }
}
