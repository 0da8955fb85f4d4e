/**
 * docs/typescript.md's counter example as its reader runs it: `serve()` hosts
 * `CounterTools` in a child process (examples/counter-serve.ts), a keyed `add` re-sent
 * is answered from the record (the total moves once), the key with other arguments is
 * refused naming the divergence, and SIGTERM drains the server to exit 0. That the
 * guide's code blocks are these very files is checked on the repository's side
 * (tests/unit/test_typescript_guide.py): npm test needs ts/ alone.
 */
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { dirname, join } from "node:path";
import { createInterface } from "node:readline";
import { describe, it } from "node:test";
import { fileURLToPath } from "node:url";

import { ResourcesService, TurnpointClient, TurnpointError, effectKey } from "../src/index.js";
import { tempRoot } from "./helpers.js";

const TS_DIR = join(dirname(fileURLToPath(import.meta.url)), "..", "..");
const TOKEN = "counter-token-1234";
const BOUND_MS = 30_000;

function bounded<T>(promise: Promise<T>, what: string): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const timeout = new Promise<never>((_, reject) => (timer = setTimeout(() => reject(new Error(`timed out: ${what}`)), BOUND_MS)));
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

describe("the counter example", () => {
  it("is served by serve(), answers a re-sent key once and drains on SIGTERM", async () => {
    const child = spawn(process.execPath, [join(TS_DIR, "dist", "examples", "counter-serve.js")], {
      env: { ...process.env, TURNPOINT_TOKEN: TOKEN, SNAPSHOT_ROOT: tempRoot() },
      stdio: ["ignore", "pipe", "pipe"],
    });
    const exited = new Promise<number | null>((resolve) => child.on("exit", (code) => resolve(code)));
    let stderr = "";
    child.stderr.on("data", (chunk: Buffer) => (stderr += chunk.toString()));
    try {
      const lines = createInterface({ input: child.stdout });
      const line = await bounded(new Promise<string>((resolve) => lines.once("line", resolve)), "the serving line");
      const match = /^turnpoint: serving resources counter-tools on (\S+)$/.exec(line);
      assert.ok(match, `${line}\n${stderr}`);
      const client = new TurnpointClient(match[1] as string, { token: TOKEN });
      try {
        const episode = { rolloutId: "count-1", attempt: 0 };
        await client.unary(ResourcesService, ResourcesService.method.seedSession, { requestId: "seed", episode, task: { target: 2 } });
        const key = effectKey("count-1", { turn: 0, index: 0 });
        const add = { requestId: key, episode, tool: "add", arguments: { add: 2 } };
        const first = await client.unary(ResourcesService, ResourcesService.method.call, add);
        const again = await client.unary(ResourcesService, ResourcesService.method.call, add);
        assert.deepEqual(first.output, { total: 2 });
        assert.deepEqual(again.output, { total: 2 });
        const refusal = await client.unary(ResourcesService, ResourcesService.method.call, { ...add, arguments: { add: 3 } }).then(
          () => null,
          (error: unknown) => error,
        );
        assert.ok(refusal instanceof TurnpointError, String(refusal));
        assert.equal(refusal.reason, "INVALID_ARGUMENT");
        assert.equal(refusal.metadata.divergence, "arguments");
        const verdict = await client.unary(ResourcesService, ResourcesService.method.verify, {
          requestId: effectKey("count-1", { turn: 1, index: 0 }),
          episode,
          answer: {},
        });
        assert.equal(verdict.reward, 1);
      } finally {
        client.close();
      }
      child.kill("SIGTERM");
      assert.equal(await bounded(exited, "the drained exit"), 0, stderr);
    } finally {
      if (child.exitCode === null) child.kill("SIGKILL");
    }
  });
});
