/** What the tests share: a fake clock, temporary roots, fences, toy kinds with named gates. */
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { after } from "node:test";

import type { Agent, EpisodeContext, EpisodeId, Fence, JsonObject, ResourcesServer, Verdict } from "../src/index.js";
import { ParticipantRuntime, SnapshotStore, episodeKey } from "../src/index.js";
import type { RuntimeOptions } from "../src/index.js";

export class FakeClock {
  now = 1000;
  readonly read = (): number => this.now;
  advance(seconds: number): void {
    this.now += seconds;
  }
}

export function tempRoot(): string {
  const dir = mkdtempSync(path.join(tmpdir(), "turnpoint-ts-"));
  after(() => rmSync(dir, { recursive: true, force: true }));
  return dir;
}

export function fence(epoch = 1, coordinatorId = "coord-a"): Fence {
  return { coordinatorId, epoch: BigInt(epoch) };
}

/** A promise the test resolves by hand: the named point an episode waits at. */
export class Gate {
  private opened = false;
  private waiters: Array<() => void> = [];
  open(): void {
    this.opened = true;
    for (const wake of this.waiters.splice(0)) wake();
  }
  wait(signal?: AbortSignal): Promise<void> {
    if (this.opened) return Promise.resolve();
    return new Promise((resolve, reject) => {
      if (signal?.aborted) return reject(new Error("aborted"));
      this.waiters.push(resolve);
      signal?.addEventListener("abort", () => reject(new Error("aborted")), { once: true });
    });
  }
}

/**
 * An agent of `turns` turns. Turn k (1-based) waits at `gates.get(rollout#attempt/k)` if
 * one is set, between its boundary k-1 and boundary k (mid-turn: RUNNING).
 */
export class ToyAgent implements Agent {
  readonly gates = new Map<string, Gate>();
  readonly started: string[] = [];

  constructor(private readonly turns = 2) {}

  gate(e: EpisodeId, turn: number): Gate {
    const gate = new Gate();
    this.gates.set(`${episodeKey(e)}/${turn}`, gate);
    return gate;
  }

  async run(ctx: EpisodeContext, task: JsonObject): Promise<JsonObject> {
    this.started.push(episodeKey(ctx.episode));
    const saved = ctx.restored;
    const history = saved !== null ? [...(saved.state.history as number[])] : [];
    for (let turn = saved !== null ? saved.turnIndex + 1 : 1; turn <= this.turns; turn++) {
      await this.gates.get(`${episodeKey(ctx.episode)}/${turn}`)?.wait(ctx.signal);
      history.push(turn * 10);
      await ctx.boundary(turn, { history });
    }
    return { history, task };
  }
}

/** An EXPORTED resources server whose session counts tool calls; `hold` blocks a call. */
export class ToyTools implements ResourcesServer {
  readonly recoveryMode = "EXPORTED" as const;
  readonly environment = "toy";
  readonly sessions = new Map<string, { calls: number }>();
  hold: Gate | null = null;

  async seed(e: EpisodeId): Promise<void> {
    this.sessions.set(episodeKey(e), { calls: 0 });
  }
  async call(e: EpisodeId, _tool: string, _args: JsonObject, signal: AbortSignal): Promise<JsonObject> {
    await this.hold?.wait(signal);
    const session = this.sessions.get(episodeKey(e));
    if (session === undefined) throw new Error("no session");
    session.calls++;
    return { calls: session.calls };
  }
  async verify(e: EpisodeId): Promise<Verdict> {
    return { reward: this.sessions.get(episodeKey(e))?.calls ?? 0 };
  }
  async close(e: EpisodeId): Promise<void> {
    this.sessions.delete(episodeKey(e));
  }
  async exportSessions(episodes: readonly EpisodeId[]): Promise<ReadonlyMap<string, JsonObject>> {
    return new Map(episodes.map((e) => [episodeKey(e), { ...(this.sessions.get(episodeKey(e)) ?? { calls: -1 }) }]));
  }
  async restoreSession(_saved: EpisodeId, e: EpisodeId, state: JsonObject): Promise<void> {
    this.sessions.set(episodeKey(e), { calls: state.calls as number });
  }
  async retireSession(e: EpisodeId): Promise<void> {
    this.sessions.delete(episodeKey(e));
  }
}

export function runtime(root: string, options: RuntimeOptions & { instance?: string; store?: SnapshotStore } = {}): ParticipantRuntime {
  const rt = new ParticipantRuntime(options.instance ?? "p-0", options.store ?? new SnapshotStore(root), options);
  after(() => rt.close());
  return rt;
}

/** Poll `predicate` until it holds, bounded (never a sleep as synchronisation). */
export async function until(predicate: () => boolean, what: string, boundMs = 5000): Promise<void> {
  const end = Date.now() + boundMs;
  while (!predicate()) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 2));
  }
}
