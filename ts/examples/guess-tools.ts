/**
 * The `guess` environment's tools in TypeScript (apps/examples/_participants.py GuessTools
 * and GroupGuessTools): the `check` tool, a per-sibling verifier or a group-scored one,
 * sessions exported so rollouts continue at turn level. Every reward returned is
 * appended to the verifier log for the demo's audit.
 */
import { appendFileSync, closeSync, fsyncSync, openSync } from "node:fs";

import { TurnpointError, episodeKey } from "../src/index.js";
import type { EpisodeId, JsonObject, JsonValue, ResourcesServer, Verdict } from "../src/index.js";
import type { Task, ToolSession } from "./guess-task.js";
import { groupRewards, perSiblingReward, taskFromJson, toolCall, toolSessionFromJson } from "./guess-task.js";

/** Append-only JSON lines of every reward a verifier returned (fsynced, like the Python one). */
export class VerifierLog {
  constructor(private readonly file: string | undefined) {}

  write(entry: { verifier: string; rollout_id: string; attempt: number; reward: number }): void {
    if (this.file === undefined) return;
    const sorted = { attempt: entry.attempt, reward: entry.reward, rollout_id: entry.rollout_id, verifier: entry.verifier };
    const fd = openSync(this.file, "a");
    try {
      appendFileSync(fd, `${JSON.stringify(sorted)}\n`);
      fsyncSync(fd);
    } finally {
      closeSync(fd);
    }
  }
}

function badInput(field: string, error: unknown): TurnpointError {
  const kind = error instanceof Error ? error.name : typeof error;
  return new TurnpointError("INVALID_ARGUMENT", `${field} does not fit the guess environment (${kind})`, { field });
}

function toInt(value: unknown): number {
  const number = typeof value === "string" ? Number(value) : value;
  if (typeof number !== "number" || !Number.isFinite(number)) throw new TypeError(`${JSON.stringify(value)} is not a number`);
  return Math.trunc(number);
}

function guesses(answer: JsonObject): Array<number | null> {
  const raw = answer.guesses ?? [];
  if (!Array.isArray(raw)) throw new TypeError("guesses must be a list");
  return raw.map((g) => (g === null ? null : toInt(g)));
}

interface Session {
  task: Task;
  prompt_group_id: string;
  sibling_index: number;
  history: ToolSession[];
}

function sessionJson(session: Session): JsonObject {
  return {
    task: { ...session.task },
    prompt_group_id: session.prompt_group_id,
    sibling_index: session.sibling_index,
    history: session.history.map((h) => ({ ...h })),
  };
}

function sessionFromJson(state: JsonObject): Session {
  const history = state.history;
  if (!Array.isArray(history)) throw new TypeError("history must be a list");
  return {
    task: taskFromJson(state.task),
    prompt_group_id: String(state.prompt_group_id ?? ""),
    sibling_index: toInt(state.sibling_index ?? 0),
    history: history.map(toolSessionFromJson),
  };
}

/** The `check` tool and a per-sibling verifier, with exported sessions. */
export class GuessTools implements ResourcesServer {
  readonly recoveryMode = "EXPORTED" as const;
  readonly verifyMode: "WAIT" | "REPLAY" = "WAIT";
  readonly environment: string = "guess";
  protected readonly sessions = new Map<string, Session>();

  constructor(
    readonly name: string,
    protected readonly log: VerifierLog,
  ) {}

  async seed(episode: EpisodeId, task: JsonObject): Promise<void> {
    const inner = task.task;
    if (inner === null || typeof inner !== "object" || Array.isArray(inner)) {
      throw new TurnpointError("INVALID_ARGUMENT", "a guess session is seeded with its task", { field: "task" });
    }
    let parsed: Task;
    let sibling: number;
    try {
      parsed = taskFromJson(inner);
      sibling = toInt(task.sibling_index ?? 0);
    } catch (error) {
      throw badInput("task", error);
    }
    if (!this.sessions.has(episodeKey(episode))) {
      this.sessions.set(episodeKey(episode), {
        task: parsed,
        prompt_group_id: String(task.prompt_group_id ?? ""),
        sibling_index: sibling,
        history: [{ calls: 0, solved: false }],
      });
    }
  }

  protected session(episode: EpisodeId): Session {
    const session = this.sessions.get(episodeKey(episode));
    if (session === undefined) throw new TurnpointError("NOT_FOUND", `no session for ${episodeKey(episode)}`, { episode: episodeKey(episode) });
    return session;
  }

  async call(episode: EpisodeId, tool: string, args: JsonObject): Promise<JsonObject> {
    if (tool !== "check") return { error: `unknown tool ${JSON.stringify(tool.slice(0, 40))}` };
    const session = this.session(episode);
    let turn: number;
    let guess: number | null;
    try {
      turn = toInt(args.turn ?? session.history.length - 1);
      if (!(turn >= 0 && turn < session.history.length)) throw new RangeError(`turn ${turn} is not a turn of this session`);
      guess = args.guess === undefined || args.guess === null ? null : toInt(args.guess);
    } catch (error) {
      throw badInput("arguments", error);
    }
    // A call names its turn and is answered from the session as it was before that turn,
    // so a call issued again after a restore gives the same reply (section 5.2 item 8).
    const history = session.history.slice(0, turn + 1);
    const result = toolCall(session.task, history[history.length - 1] as ToolSession, guess);
    session.history = [...history, result.session];
    return { reply: result.reply };
  }

  async verify(episode: EpisodeId, answer: JsonObject): Promise<Verdict> {
    const session = this.session(episode);
    let answered: Array<number | null>;
    try {
      answered = guesses(answer);
    } catch (error) {
      throw badInput("answer", error);
    }
    const reward = perSiblingReward(session.task, answered);
    this.log.write({ verifier: this.name, rollout_id: episode.rolloutId, attempt: episode.attempt, reward });
    return { reward, details: { verifier: this.name } };
  }

  async close(episode: EpisodeId): Promise<void> {
    this.sessions.delete(episodeKey(episode));
  }

  async exportSessions(episodes: readonly EpisodeId[]): Promise<ReadonlyMap<string, JsonObject>> {
    const exported = new Map<string, JsonObject>();
    for (const e of episodes) {
      const session = this.sessions.get(episodeKey(e));
      if (session !== undefined) exported.set(episodeKey(e), sessionJson(session));
    }
    return exported;
  }

  validateSession(_episode: EpisodeId, state: JsonObject): void {
    sessionFromJson(state);
  }

  async restoreSession(_saved: EpisodeId, episode: EpisodeId, state: JsonObject): Promise<void> {
    this.sessions.set(episodeKey(episode), sessionFromJson(state));
  }

  async retireSession(episode: EpisodeId): Promise<void> {
    this.sessions.delete(episodeKey(episode));
  }
}

interface Group {
  answers: { [sibling: string]: JsonValue[] };
  rewards: { [sibling: string]: number } | null;
}

/**
 * Group-scored: each sibling's verify waits for all N siblings (REPLAY); a group's
 * rewards, once computed, are exported with every session of the group, so a sibling
 * replaying its verify after a restore gets the same reward.
 */
export class GroupGuessTools extends GuessTools {
  override readonly verifyMode = "REPLAY" as const;
  override readonly environment = "guess-group";
  readonly groupScored = true;
  private readonly groups = new Map<string, Group>();
  private readonly waiters = new Set<() => void>();

  constructor(
    name: string,
    log: VerifierLog,
    readonly groupSize: number,
  ) {
    super(name, log);
  }

  private group(id: string): Group {
    let group = this.groups.get(id);
    if (group === undefined) this.groups.set(id, (group = { answers: {}, rewards: null }));
    return group;
  }

  override async verify(episode: EpisodeId, answer: JsonObject, signal?: AbortSignal): Promise<Verdict> {
    const session = this.session(episode);
    const groupId = session.prompt_group_id;
    const sibling = String(session.sibling_index);
    let answered: Array<number | null>;
    try {
      answered = guesses(answer);
    } catch (error) {
      throw badInput("answer", error);
    }
    const group = this.group(groupId);
    if (group.rewards === null) {
      group.answers[sibling] = answered;
      if (Object.keys(group.answers).length >= this.groupSize) {
        const order = Object.keys(group.answers).sort((a, b) => Number(a) - Number(b));
        const rewards = groupRewards(session.task, order.map((s) => group.answers[s] as JsonValue[]));
        group.rewards = Object.fromEntries(order.map((s, i) => [s, rewards[i] as number]));
        for (const wake of [...this.waiters]) wake();
      }
    }
    while (this.group(groupId).rewards === null) {
      await new Promise<void>((resolve, reject) => {
        const wake = (): void => {
          this.waiters.delete(wake);
          resolve();
        };
        this.waiters.add(wake);
        signal?.addEventListener(
          "abort",
          () => {
            this.waiters.delete(wake);
            reject(new Error("the verify was stopped"));
          },
          { once: true },
        );
      });
    }
    const reward = (this.group(groupId).rewards as { [sibling: string]: number })[sibling] as number;
    this.log.write({ verifier: this.name, rollout_id: episode.rolloutId, attempt: episode.attempt, reward });
    return { reward, details: { verifier: this.name, group: groupId } };
  }

  override async exportSessions(episodes: readonly EpisodeId[]): Promise<ReadonlyMap<string, JsonObject>> {
    const exported = new Map<string, JsonObject>();
    for (const [id, state] of await super.exportSessions(episodes)) {
      const group = this.groups.get(String(state.prompt_group_id));
      exported.set(id, { ...state, group: group === undefined ? null : (structuredClone(group) as unknown as JsonObject) });
    }
    return exported;
  }

  override validateSession(episode: EpisodeId, state: JsonObject): void {
    const { group: _group, ...plain } = state;
    super.validateSession(episode, plain);
  }

  override async restoreSession(saved: EpisodeId, episode: EpisodeId, state: JsonObject): Promise<void> {
    const { group, ...plain } = state;
    await super.restoreSession(saved, episode, plain);
    if (group !== null && typeof group === "object" && !Array.isArray(group) && group.rewards !== null && group.rewards !== undefined) {
      this.groups.set(String(plain.prompt_group_id), structuredClone(group) as unknown as Group);
    }
  }
}

