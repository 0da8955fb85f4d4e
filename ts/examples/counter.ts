import { TurnpointError, episodeKey } from "@turnpoint/participant";
import type { EpisodeId, JsonObject, ResourcesServer, Verdict } from "@turnpoint/participant";

interface Counter {
  target: number;
  total: number;
}

/** The counter environment's tools: `add({add: n})` adds to the session's total. */
export class CounterTools implements ResourcesServer {
  readonly recoveryMode = "EXPORTED" as const;
  readonly environment = "counter";
  private readonly sessions = new Map<string, Counter>();

  async seed(episode: EpisodeId, task: JsonObject): Promise<void> {
    if (typeof task.target !== "number" || !Number.isInteger(task.target)) {
      throw new TurnpointError("INVALID_ARGUMENT", "task.target must be an integer", { field: "target" });
    }
    if (!this.sessions.has(episodeKey(episode))) this.sessions.set(episodeKey(episode), { target: task.target, total: 0 });
  }

  async call(episode: EpisodeId, tool: string, args: JsonObject): Promise<JsonObject> {
    if (tool !== "add" || typeof args.add !== "number") {
      throw new TurnpointError("INVALID_ARGUMENT", "the tool is add({add: number})", { field: "arguments" });
    }
    const session = this.session(episode);
    session.total += args.add; // not idempotent: the runtime runs it once per call key
    return { total: session.total };
  }

  async verify(episode: EpisodeId): Promise<Verdict> {
    const { target, total } = this.session(episode);
    return { reward: total === target ? 1 : 0, details: { total } };
  }

  async close(episode: EpisodeId): Promise<void> {
    this.sessions.delete(episodeKey(episode));
  }

  async exportSessions(episodes: readonly EpisodeId[]): Promise<ReadonlyMap<string, JsonObject>> {
    return new Map(episodes.map((e) => [episodeKey(e), { ...this.session(e) }]));
  }

  validateSession(_saved: EpisodeId, state: JsonObject): void {
    if (typeof state.target !== "number" || typeof state.total !== "number") throw new Error("target and total are numbers");
  }

  async restoreSession(_saved: EpisodeId, episode: EpisodeId, state: JsonObject): Promise<void> {
    this.sessions.set(episodeKey(episode), { target: state.target as number, total: state.total as number });
  }

  async retireSession(episode: EpisodeId): Promise<void> {
    this.sessions.delete(episodeKey(episode));
  }

  private session(episode: EpisodeId): Counter {
    const session = this.sessions.get(episodeKey(episode));
    if (session === undefined) throw new TurnpointError("NOT_FOUND", `no session for ${episodeKey(episode)}`, { episode: episodeKey(episode) });
    return session;
  }
}
