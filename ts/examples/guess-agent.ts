/**
 * The `guess` agent in TypeScript (apps/examples/_participants.py GuessAgent), served like
 * `turnpoint serve --kind agent`:
 *
 *     TURNPOINT_TOKEN=... node dist/examples/guess-agent.js --port 0 --root DIR --instance agent-0 \
 *         --policy 127.0.0.1:PORT --resources guess=127.0.0.1:PORT [--resources guess-group=...]
 *
 * Each turn is one Generate on the Python policy server and one `check` call on the
 * environment's resources server, then a sealed boundary; finally a verify. It seals
 * boundary 0 as soon as it accepts an episode and makes every later call through
 * `ctx.modelCall`, so the episode counts as parked at its boundary whenever it waits
 * on a server a checkpoint holds closed (spec section 5.2 item 8).
 */
import { createHash } from "node:crypto";

import { PolicyService, ResourcesService, TurnpointClient, episodeKey } from "../src/index.js";
import type { Agent, EpisodeContext, EpisodeId, JsonObject } from "../src/index.js";
import type { Reply, Task, Turn } from "./guess-task.js";
import { MAX_NEW_TOKENS_PER_TURN, encodeContext, episodeAnswer, isFinished, parseGuess, taskFromJson, turnFromJson, turnToJson } from "./guess-task.js";
import { peerToken, serveExample } from "./serve.js";

function episodeProto(e: EpisodeId): { rolloutId: string; attempt: number } {
  return { rolloutId: e.rolloutId, attempt: e.attempt };
}

function sleep(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(resolve, ms);
    signal.addEventListener("abort", () => (clearTimeout(timer), reject(new Error("cancelled"))), { once: true });
  });
}

/** A reproducible sampling seed per (rollout, attempt, turn). */
function generationSeed(e: EpisodeId, turn: number): bigint {
  const digest = createHash("sha256").update(`${e.rolloutId}/${e.attempt}/${turn}`).digest();
  return BigInt(digest.readUInt32BE(0) & 0x7fffffff);
}

export class GuessAgent implements Agent {
  readonly recoveryMode = "EXPORTED" as const;
  private readonly policy: TurnpointClient;
  private readonly resources = new Map<string, TurnpointClient>();

  constructor(
    policyAddress: string,
    resourcesAddresses: ReadonlyMap<string, string>,
    token: string | null,
    private readonly temperature = 1.0,
    private readonly turnDelayS = 0,
  ) {
    this.policy = new TurnpointClient(policyAddress, { token });
    for (const [environment, address] of resourcesAddresses) this.resources.set(environment, new TurnpointClient(address, { token }));
  }

  async run(ctx: EpisodeContext, task: JsonObject): Promise<JsonObject> {
    const e = ctx.episode;
    const prompt = taskFromJson(task.task);
    const environment = String(task.environment);
    const resources = this.resources.get(environment);
    if (resources === undefined) throw new RangeError(`no resources server for environment ${JSON.stringify(environment)}`);
    const saved = ctx.restored;
    const turns: Turn[] = saved !== null ? (saved.state.turns as JsonObject[]).map(turnFromJson) : [];
    const versions: number[] = saved !== null ? [...((saved.state.versions as number[] | undefined) ?? [])] : [];
    if (saved === null) {
      // Boundary 0: accepted, owns nothing yet; everything after it may be issued again.
      await ctx.boundary(0, { turns: [], versions: [] });
    }
    await ctx.modelCall((signal) => this.seed(resources, e, task, signal));
    while (!isFinished(prompt, turns)) {
      const [completion, reply, version] = await ctx.modelCall((signal) => this.turn(resources, e, prompt, turns, signal));
      turns.push({ completion, reply });
      versions.push(version);
      await ctx.boundary(turns.length, { turns: turns.map(turnToJson), versions });
    }
    const guesses = episodeAnswer(turns);
    const reward = await ctx.modelCall((signal) => this.verify(resources, e, guesses, signal));
    return {
      environment,
      prompt_group_id: String(task.prompt_group_id ?? ""),
      sibling_index: Math.trunc(Number(task.sibling_index ?? 0)),
      turns: turns.map(turnToJson),
      prompts: turns.map((_, k) => encodeContext(prompt, turns.slice(0, k))),
      guesses,
      weights_versions: versions,
      reward,
    };
  }

  private async seed(resources: TurnpointClient, e: EpisodeId, task: JsonObject, signal: AbortSignal): Promise<void> {
    await resources.unary(
      ResourcesService,
      ResourcesService.method.seedSession,
      {
        requestId: `seed-${e.rolloutId}-${e.attempt}`,
        episode: episodeProto(e),
        promptGroupId: String(task.prompt_group_id ?? ""),
        siblingIndex: Math.trunc(Number(task.sibling_index ?? 0)),
        groupSize: Math.trunc(Number(task.group_size ?? 1)),
        task,
      },
      { timeoutS: 120, signal },
    );
  }

  private async turn(resources: TurnpointClient, e: EpisodeId, prompt: Task, turns: readonly Turn[], signal: AbortSignal): Promise<[number[], Reply, number]> {
    const turn = turns.length;
    // The latency of a real model: the episode waits here parked at its boundary.
    if (this.turnDelayS > 0) await sleep(this.turnDelayS * 1000, signal);
    const completion: number[] = [];
    let version = 0;
    const stream = this.policy.serverStream(
      PolicyService,
      PolicyService.method.generate,
      {
        requestId: `gen-${e.rolloutId}-${e.attempt}-${turn}`,
        episode: episodeProto(e),
        promptTokenIds: encodeContext(prompt, turns),
        maxNewTokens: MAX_NEW_TOKENS_PER_TURN,
        temperature: this.temperature,
        seed: generationSeed(e, turn),
      },
      { timeoutS: 120, signal },
    );
    for await (const chunk of stream) {
      completion.push(...chunk.tokenIds);
      version = Number(chunk.weightsVersion);
    }
    const answer = await resources.unary(
      ResourcesService,
      ResourcesService.method.call,
      {
        requestId: `call-${e.rolloutId}-${e.attempt}-${turn}`,
        episode: episodeProto(e),
        tool: "check",
        arguments: { guess: parseGuess(completion), turn },
      },
      { timeoutS: 120, signal },
    );
    const reply = answer.output?.reply;
    if (reply !== "higher" && reply !== "lower" && reply !== "correct" && reply !== "invalid") {
      throw new RangeError(`the check tool answered ${JSON.stringify(reply)} for ${episodeKey(e)}`);
    }
    return [completion, reply, version];
  }

  private async verify(resources: TurnpointClient, e: EpisodeId, guesses: Array<number | null>, signal: AbortSignal): Promise<number> {
    const response = await resources.unary(
      ResourcesService,
      ResourcesService.method.verify,
      { requestId: `verify-${e.rolloutId}-${e.attempt}`, episode: episodeProto(e), answer: { guesses } },
      { timeoutS: 300, signal },
    );
    return response.reward;
  }

  close(): void {
    this.policy.close();
    for (const client of this.resources.values()) client.close();
  }
}

let agent: GuessAgent | undefined;
const code = await serveExample("agent", ["guess"], (args) => {
  if (args.policy === undefined || args.resources.size === 0) {
    throw new RangeError("the guess agent needs --policy ADDRESS and --resources ENV=ADDRESS (one per environment it serves)");
  }
  agent = new GuessAgent(args.policy, args.resources, peerToken(args), 1.0, args.turnDelayS);
  return { agent, close: async () => agent?.close() };
});
process.exitCode = code;
