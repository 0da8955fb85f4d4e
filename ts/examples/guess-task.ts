/**
 * The example environment `guess` (a port of apps/examples/_task.py, the parts the
 * resources server and the agent need): guess a hidden digit inside a shown range, with
 * a `check` tool that answers higher, lower, correct or invalid. Same rewards, same
 * tokens, same JSON forms as the Python example, so the two languages mix in one run.
 */
import type { JsonObject, JsonValue } from "../src/index.js";

export const MAX_NEW_TOKENS_PER_TURN = 3;
export const GROUP_WEIGHT = 0.25;
const REWARD_RADIUS = 3;

export const Token = {
  BOS: 0,
  EOS: 1,
  TURN: 2,
  RANGE: 3,
  DIGIT_0: 4,
  DIGIT_9: 13,
  HIGHER: 14,
  LOWER: 15,
  CORRECT: 16,
  INVALID: 17,
} as const;
export const VOCAB_SIZE = 18;

export type Reply = "higher" | "lower" | "correct" | "invalid";
const REPLY_TOKENS: { [R in Reply]: number } = { higher: Token.HIGHER, lower: Token.LOWER, correct: Token.CORRECT, invalid: Token.INVALID };

function isInt(value: unknown): value is number {
  return typeof value === "number" && Number.isInteger(value);
}

function isDigit(value: unknown): value is number {
  return isInt(value) && value >= 0 && value <= 9;
}

function strictFields(name: string, data: { [key: string]: unknown }, fields: readonly string[]): void {
  const keys = Object.keys(data);
  const unknown = keys.filter((k) => !fields.includes(k)).sort();
  const missing = fields.filter((k) => !keys.includes(k)).sort();
  if (unknown.length > 0 || missing.length > 0) {
    throw new RangeError(`${name}: unknown fields ${JSON.stringify(unknown)}, missing fields ${JSON.stringify(missing)}`);
  }
}

function isObject(value: unknown): value is { [key: string]: unknown } {
  return value !== null && typeof value === "object" && !Array.isArray(value);
}

/** One prompt; `target` rides along for the tool and the verifier, never the model. */
export interface Task {
  readonly prompt_id: string;
  readonly seed: number;
  readonly group_index: number;
  readonly low: number;
  readonly high: number;
  readonly target: number;
  readonly max_turns: number;
}

const TASK_FIELDS = ["prompt_id", "seed", "group_index", "low", "high", "target", "max_turns"];

export function taskFromJson(data: unknown): Task {
  if (!isObject(data)) throw new RangeError("a task is a JSON object");
  strictFields("Task", data, TASK_FIELDS);
  const task = data as unknown as Task;
  if (typeof task.prompt_id !== "string" || !/^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$/.test(task.prompt_id)) throw new RangeError("prompt_id must be a valid id");
  if (!isInt(task.seed)) throw new RangeError("seed must be an int");
  if (!isInt(task.group_index) || task.group_index < 0) throw new RangeError("group_index must be an int >= 0");
  if (![task.low, task.high, task.target].every(isDigit)) throw new RangeError("low, high and target must be digits");
  if (!(task.low <= task.target && task.target <= task.high)) throw new RangeError("target must lie in [low, high]");
  if (!isInt(task.max_turns) || task.max_turns < 1) throw new RangeError("max_turns must be an int >= 1");
  return { ...task };
}

/** The resources server's state for one episode's `check` tool. */
export interface ToolSession {
  readonly calls: number;
  readonly solved: boolean;
}

export function toolSessionFromJson(data: unknown): ToolSession {
  if (!isObject(data)) throw new RangeError("a tool session is a JSON object");
  strictFields("ToolSession", data, ["calls", "solved"]);
  const { calls, solved } = data;
  if (!isInt(calls) || calls < 0) throw new RangeError(`ToolSession.calls must be an int >= 0, got ${JSON.stringify(calls)}`);
  if (typeof solved !== "boolean") throw new RangeError(`ToolSession.solved must be a bool, got ${JSON.stringify(solved)}`);
  return { calls, solved };
}

/** Answer `check(guess)`: the reply and the session after the call (the call always counts). */
export function toolCall(task: Task, session: ToolSession, guess: unknown): { reply: Reply; session: ToolSession } {
  const calls = session.calls + 1;
  if (calls > task.max_turns || !isDigit(guess)) return { reply: "invalid", session: { calls, solved: session.solved } };
  if (guess === task.target) return { reply: "correct", session: { calls, solved: true } };
  return { reply: task.target > guess ? "higher" : "lower", session: { calls, solved: session.solved } };
}

/** One finished turn on the agent's side. */
export interface Turn {
  readonly completion: readonly number[];
  readonly reply: Reply;
}

export function turnToJson(turn: Turn): JsonObject {
  return { completion: [...turn.completion], reply: turn.reply };
}

export function turnFromJson(data: unknown): Turn {
  if (!isObject(data)) throw new RangeError("a turn is a JSON object");
  strictFields("Turn", data, ["completion", "reply"]);
  const { completion, reply } = data;
  if (!Array.isArray(completion) || !completion.every((t) => isInt(t) && t >= 0 && t < VOCAB_SIZE)) {
    throw new RangeError("Turn.completion must be a list of tokens");
  }
  if (typeof reply !== "string" || !(reply in REPLY_TOKENS)) throw new RangeError(`unknown reply ${JSON.stringify(reply)}`);
  return { completion: completion as number[], reply: reply as Reply };
}

/** The model input for the next turn: the shown range, every past turn, then TURN. */
export function encodeContext(task: Task, turns: readonly Turn[]): number[] {
  const context: number[] = [Token.BOS, Token.RANGE, Token.DIGIT_0 + task.low, Token.DIGIT_0 + task.high];
  for (const turn of turns) context.push(Token.TURN, ...turn.completion, REPLY_TOKENS[turn.reply]);
  context.push(Token.TURN);
  return context;
}

/** The first digit the model emitted this turn, or null. */
export function parseGuess(completion: readonly number[]): number | null {
  const token = completion.find((t) => t >= Token.DIGIT_0 && t <= Token.DIGIT_9);
  return token === undefined ? null : token - Token.DIGIT_0;
}

export function isFinished(task: Task, turns: readonly Turn[]): boolean {
  return turns.length >= task.max_turns || (turns.length > 0 && turns[turns.length - 1]?.reply === "correct");
}

export function episodeAnswer(turns: readonly Turn[]): Array<number | null> {
  return turns.map((turn) => parseGuess(turn.completion));
}

/** Reward in [0, 1] for one answer alone (apps/examples/_task.py per_sibling_reward). */
export function perSiblingReward(task: Task, answer: readonly JsonValue[]): number {
  let total = 0;
  for (const [turnIndex, guess] of answer.slice(0, task.max_turns).entries()) {
    if (guess === task.target && isDigit(guess)) {
      total += task.max_turns - turnIndex;
      break;
    }
    total += isDigit(guess) ? Math.max(0, 1 - Math.abs(guess - task.target) / REWARD_RADIUS) : 0;
  }
  return total / task.max_turns;
}

/** Rewards for the N sibling answers of one prompt, each relative to the group's best. */
export function groupRewards(task: Task, answers: ReadonlyArray<readonly JsonValue[]>): number[] {
  if (answers.length === 0) throw new RangeError("groupRewards needs at least one answer");
  const own = answers.map((answer) => perSiblingReward(task, answer));
  const best = Math.max(...own);
  if (best === 0) return own.map(() => 0);
  return own.map((value) => (1 - GROUP_WEIGHT) * value + (GROUP_WEIGHT * value) / best);
}
