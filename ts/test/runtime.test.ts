/**
 * The runtime around the core, without the wire: fencing and replay (section 2.2),
 * leases on a fake clock (4.2), parking at boundaries (5.2), commit and restore of
 * agent and resources state as attempt N+1 (4.8, 4.10), retire (4.11), cancellation (6.6).
 */
import assert from "node:assert/strict";
import { describe, it } from "node:test";

import { TurnpointError, episode, episodeKey } from "../src/index.js";
import type { EpisodeId, JsonObject } from "../src/index.js";
import type { RunEvent, RunFollower } from "../src/index.js";
import { FakeClock, ToyAgent, ToyTools, fence, runtime, tempRoot, until } from "./helpers.js";

async function refusal(promise: Promise<unknown>): Promise<TurnpointError> {
  try {
    await promise;
  } catch (error) {
    if (error instanceof TurnpointError) return error;
    throw error;
  }
  throw new Error("expected a refusal");
}

async function drain(follower: RunFollower): Promise<RunEvent[]> {
  const events: RunEvent[] = [];
  for (;;) {
    const next = await follower.next();
    if (next === null) return events;
    events.push(next);
  }
}

describe("fencing and replay", () => {
  it("adopts higher epochs, refuses lower ones, replays answered request ids", async () => {
    const rt = runtime(tempRoot(), { resources: new ToyTools() });
    const prepared = await rt.prepare(fence(1), "p1", "ck-000000000001", { leaseS: 30 });
    assert.equal(prepared.phase, "PREPARED");
    const resumed = await rt.resume(fence(1), "r1", "ck-000000000001");
    assert.equal(resumed.endedActive, true);
    const stale = await refusal(rt.renew(fence(1), "n1", "ck-000000000001"));
    assert.equal(stale.reason, "STALE_CHECKPOINT");
    rt.describe(fence(2, "coord-b")); // a newer coordinator is heard from

    // The superseded coordinator's retries: the recorded answers, without acting.
    assert.deepEqual(await rt.resume(fence(1), "r1", "ck-000000000001"), resumed);
    assert.equal((await rt.prepare(fence(1), "p1", "ck-000000000001")).phase, "PREPARED");
    assert.equal(rt.core.phase, "IDLE");
    assert.equal((await refusal(rt.renew(fence(1), "n1", "ck-000000000001"))).reason, "STALE_CHECKPOINT");
    // Its request id for another operation, and a new request id, are FENCED.
    const other = await refusal(rt.forget(fence(1), "r1", ["x"]));
    assert.equal(other.reason, "FENCED");
    const fresh = await refusal(rt.resume(fence(1), "r-new", "ck-000000000009"));
    assert.deepEqual(fresh.metadata, { epoch: "2", request_epoch: "1" });
    // Same epoch, another coordinator id: fenced too; no fence at all: fenced.
    assert.equal((await refusal(rt.resume(fence(2, "coord-c"), "x1", "ck-1"))).reason, "FENCED");
    assert.equal((await refusal(rt.resume({ coordinatorId: "", epoch: 0n }, "x2", "ck-1"))).reason, "FENCED");
  });

  it("never records DEADLINE_EXCEEDED: a retry joins the running work", async () => {
    const agent = new ToyAgent(1);
    const rt = runtime(tempRoot(), { agent });
    const e = episode("slow");
    const gate = agent.gate(e, 1);
    const follower = rt.acceptRun(e, {});
    const first = await rt.prepare(fence(1), "p", "ck-1", { leaseS: 30 }, { timeoutS: 0.05 });
    assert.equal(first.phase, "PREPARING"); // not ready in time is an answer
    assert.equal(first.readiness.blockers[0]?.state, "RUNNING");
    gate.open();
    const second = await rt.prepare(fence(1), "p", "ck-1", {}, { timeoutS: 5 });
    assert.equal(second.phase, "PREPARED");
    await rt.resume(fence(1), "r", "ck-1");
    const events = await drain(follower);
    assert.equal(events.at(-1)?.type, "result");
  });
});

describe("leases on a fake clock", () => {
  it("never shortens, and its expiry resumes, counts and finishes the id", async () => {
    const clock = new FakeClock();
    const rt = runtime(tempRoot(), { resources: new ToyTools(), clock: clock.read, wallClock: () => 1_700_000_000 });
    const prepared = await rt.prepare(fence(), "p", "ck-1", { leaseS: 10 });
    const renewed = await rt.renew(fence(), "n", "ck-1", { leaseS: 1 });
    assert.equal(renewed.leaseExpiresAt, prepared.leaseExpiresAt);
    clock.advance(9.9);
    assert.equal(await rt.checkLease(), null);
    clock.advance(0.2);
    assert.equal(await rt.checkLease(), "ck-1");
    const status = rt.status();
    assert.equal(status.phase, "IDLE");
    assert.equal(status.leaseExpiries, 1);
    assert.equal(status.leaseExpiresAt, null);
    assert.equal((await refusal(rt.renew(fence(), "n2", "ck-1"))).reason, "STALE_CHECKPOINT");
    assert.equal((await rt.resume(fence(), "r", "ck-1")).endedActive, false);
  });

  it("hours of leases in milliseconds: renewals keep it open, one missed renewal expires it", async () => {
    const clock = new FakeClock();
    const rt = runtime(tempRoot(), { resources: new ToyTools(), clock: clock.read });
    await rt.prepare(fence(), "p", "ck-1", { leaseS: 30 });
    for (let i = 0; i < 360; i++) {
      clock.advance(10);
      assert.equal(await rt.checkLease(), null);
      await rt.renew(fence(), `n${i}`, "ck-1", { leaseS: 30 });
    }
    clock.advance(30);
    assert.equal(await rt.checkLease(), "ck-1");
  });
});

describe("agents", () => {
  it("a mid-turn episode blocks; it parks at its next boundary; resume releases it", async () => {
    const agent = new ToyAgent(2);
    const rt = runtime(tempRoot(), { agent });
    const e = episode("r-1");
    const gate = agent.gate(e, 2);
    const follower = rt.acceptRun(e, { prompt: "p" });
    assert.equal((await follower.next())?.type, "boundary");
    await until(() => rt.core.entry({ episode: e, slot: "run" })?.state === "RUNNING", "turn 2 running");
    const notReady = await rt.prepare(fence(), "p", "ck-1", { leaseS: 30 }, { timeoutS: 0.05 });
    assert.equal(notReady.phase, "PREPARING");
    assert.equal((await refusal(Promise.resolve().then(() => rt.acceptRun(episode("new"), {})))).reason, "ADMISSION_CLOSED");
    gate.open();
    const ready = await rt.prepare(fence(), "p", "ck-1", {}, { timeoutS: 5 });
    assert.equal(ready.phase, "PREPARED");
    assert.deepEqual(ready.readiness.counts, [["PARKED", 1]]);
    await rt.resume(fence(), "r", "ck-1");
    const events = await drain(follower);
    const result = events.at(-1);
    assert.equal(result?.type, "result");
    if (result?.type !== "result") return;
    assert.equal(result.outcome, "COMPLETED");
    assert.equal(result.turns, 2);
    assert.match(result.receipt?.receiptId ?? "", /^rc-[0-9a-f]{24}$/);
    // Kept until acknowledged, blocking; released once.
    assert.equal(rt.status().readiness.blockers[0]?.state, "COMPLETED_UNACKED");
    const receipt = result.receipt as NonNullable<typeof result.receipt>;
    assert.deepEqual(rt.acknowledge([receipt]), { acknowledged: 1, unknown: [] });
    assert.equal(rt.acknowledge([receipt]).unknown.length, 1);
  });

  it("commits parked turns and restores them as attempt N+1 into a fresh participant", async () => {
    const root = tempRoot();
    const agent = new ToyAgent(3);
    const rt = runtime(root, { agent, instance: "agent-0" });
    const e = episode("r-1", 4);
    const gate = agent.gate(e, 2);
    const follower = rt.acceptRun(e, { prompt: "p" });
    await follower.next();
    const waiting = rt.prepare(fence(), "p", "ck-000000000001", { leaseS: 30 });
    gate.open();
    assert.equal((await waiting).phase, "PREPARED");
    const committed = await rt.commit(fence(), "c", "ck-000000000001", "ck-000000000001", [e]);
    assert.deepEqual(committed.exported, [e]);
    assert.equal(committed.artifacts[0]?.recordCount, 1);
    assert.deepEqual(await rt.commit(fence(), "c2", "ck-000000000001", "ck-000000000001", [e]), committed);
    follower.close(); // the trainer crashed: nobody follows

    const fresh = new ToyAgent(3);
    const restored = runtime(root, { agent: fresh, instance: "agent-0" });
    const answer = await restored.restore(fence(2), "x", "restore-2", "ck-000000000001", committed.manifest, committed.artifacts, [e], { leaseS: 30 });
    assert.deepEqual(answer.installed, [episode("r-1", 5)]);
    assert.equal(restored.core.phase, "RESTORED");
    // The replacement is accepted while closed and parks before doing any work.
    const next = restored.acceptRun(episode("r-1", 5), { prompt: "p" });
    await until(() => restored.core.entry({ episode: episode("r-1", 5), slot: "run" })?.state === "PARKED", "parked");
    assert.deepEqual(fresh.started, []);
    await restored.resume(fence(2), "y", "restore-2");
    const events = await drain(next);
    assert.deepEqual(
      events.filter((ev) => ev.type === "boundary").map((ev) => (ev.type === "boundary" ? ev.boundaryIndex : 0)),
      [3],
    );
    const result = events.at(-1);
    assert.equal(result?.type === "result" && JSON.stringify(result.result.history), "[10,20,30]");
    // Attempt 4 is dead here (section 2.5 item 2).
    assert.equal((await refusal(Promise.resolve().then(() => restored.acceptRun(e, { prompt: "p" })))).reason, "STALE_ATTEMPT");
  });

  it("a cancelled run after a boundary stays committable and continues from it", async () => {
    const agent = new ToyAgent(2);
    const rt = runtime(tempRoot(), { agent });
    const e = episode("c");
    const gate = agent.gate(e, 2);
    const first = rt.acceptRun(e, {});
    await first.next();
    first.close();
    await until(() => rt.core.entry({ episode: e, slot: "run" })?.state === "PARKED", "parked after cancel");
    gate.open();
    const again = rt.acceptRun(e, {}, );
    const events = await drain(again);
    assert.equal(events.at(-1)?.type === "result" && events.at(-1)?.type, "result");
    assert.equal(agent.started.length, 2);
  });

  it("a restart-only agent never parks, blocks or exports; a cancel starts over (5.2 item 7)", async () => {
    const agent = Object.assign(new ToyAgent(2), { recoveryMode: "RESTART_ONLY" as const });
    const rt = runtime(tempRoot(), { agent });
    assert.deepEqual(rt.describe(null).supportedLevels, ["SIBLING", "PROMPT_GROUP"]);
    const e = episode("restart");
    const gate = agent.gate(e, 2);
    const first = rt.acceptRun(e, {});
    assert.equal((await first.next())?.type, "boundary");
    assert.equal(rt.core.entry({ episode: e, slot: "run" })?.state, "RESTART");
    const ready = await rt.prepare(fence(), "p", "ck-1", { leaseS: 30 }, { timeoutS: 1 });
    assert.equal(ready.phase, "PREPARED");
    assert.deepEqual(ready.readiness.restarts, [e]);
    const committed = await rt.commit(fence(), "c", "ck-1", "ck-1", []);
    assert.deepEqual(committed.exported, []);
    await rt.resume(fence(), "r", "ck-1");
    first.close();
    await until(() => rt.core.entry({ episode: e, slot: "run" }) === undefined, "dropped after cancel");
    gate.open();
    const events = await drain(rt.acceptRun(e, {}));
    const result = events.at(-1);
    assert.equal(result?.type === "result" && JSON.stringify(result.result.history), "[10,20]");
    assert.deepEqual(agent.started, [episodeKey(e), episodeKey(e)]);
    assert.throws(() => runtime(tempRoot(), { agent: Object.assign(new ToyAgent(1), { recoveryMode: "STATELESS" as const }) }), /EXPORTED or RESTART_ONLY/);
  });

  it("retire stops a running episode; its Run ends STALE_ATTEMPT", async () => {
    const agent = new ToyAgent(2);
    const rt = runtime(tempRoot(), { agent });
    const e = episode("doomed");
    agent.gate(e, 2);
    const follower = rt.acceptRun(e, {});
    await follower.next();
    const retired = await rt.retire(fence(), "t", [e]);
    assert.deepEqual(retired.stopped, [e]);
    assert.equal((await refusal(follower.next())).reason, "STALE_ATTEMPT");
    assert.equal(rt.status().refusedRollouts, 1);
  });
});

describe("resources", () => {
  it("a request in flight blocks prepare; requests wait out a checkpoint; sessions export and restore", async () => {
    const root = tempRoot();
    const tools = new ToyTools();
    const rt = runtime(root, { resources: tools, instance: "tools" });
    const e = episode("s");
    assert.equal(await rt.seedSession(e, {}), false);
    assert.equal(await rt.seedSession(e, {}), true);
    tools.hold = new (await import("./helpers.js")).Gate();
    const call = rt.callTool(e, "t", {});
    await until(() => rt.core.blockerCount === 1, "call in flight");
    const notReady = await rt.prepare(fence(), "p", "ck-000000000001", { leaseS: 30 }, { timeoutS: 0.05 });
    assert.equal(notReady.readiness.blockers[0]?.state, "REQUEST_IN_FLIGHT");
    tools.hold.open();
    assert.deepEqual(await call, { calls: 1 });
    assert.equal((await rt.prepare(fence(), "p", "ck-000000000001", {}, { timeoutS: 5 })).phase, "PREPARED");
    // A new call waits for resume instead of being refused.
    let answered = false;
    const held = rt.callTool(e, "t", {}).then((v) => ((answered = true), v));
    const committed = await rt.commit(fence(), "c", "ck-000000000001", "ck-000000000001", [e]);
    assert.equal(answered, false);
    await rt.resume(fence(), "r", "ck-000000000001");
    assert.deepEqual(await held, { calls: 2 });

    const tools2 = new ToyTools();
    const restored = runtime(root, { resources: tools2, instance: "tools" });
    await restored.restore(fence(2), "x", "restore-1", "ck-000000000001", committed.manifest, [], [e]);
    await restored.resume(fence(2), "y", "restore-1");
    assert.deepEqual(await restored.callTool(episode("s", 1), "t", {}), { calls: 2 });
  });

  it("a corrupt snapshot is INVALID_CHECKPOINT_STATE and leaves the participant idle and fresh", async () => {
    const root = tempRoot();
    const rt = runtime(root, { resources: new ToyTools(), instance: "tools" });
    await rt.prepare(fence(), "p", "ck-1");
    const committed = await rt.commit(fence(), "c", "ck-1", "ck-1", []);
    const fresh = runtime(root, { resources: new ToyTools(), instance: "tools" });
    assert.ok(committed.manifest !== null, "a commit without accept_saved_nothing writes");
    const forged = { ...committed.manifest, sha256: "0".repeat(64) };
    const error = await refusal(fresh.restore(fence(), "x", "restore-1", "ck-1", forged, [], []));
    assert.equal(error.reason, "INVALID_CHECKPOINT_STATE");
    assert.equal(error.metadata.corruption, "unexpected_content");
    assert.equal(fresh.core.phase, "IDLE");
    assert.equal(fresh.core.fresh, true);
  });

  it("a restore hook that installs nothing fails the restore whole (spec 5.6 item 4)", async () => {
    class RestoresNothing extends ToyTools {
      override async exportSessions(episodes: readonly EpisodeId[]): Promise<ReadonlyMap<string, JsonObject>> {
        const held = episodes.filter((e) => this.sessions.has(episodeKey(e)));
        return new Map(held.map((e) => [episodeKey(e), { calls: this.sessions.get(episodeKey(e))?.calls ?? 0 }]));
      }
      override async restoreSession(): Promise<void> {}
    }
    const root = tempRoot();
    const rt = runtime(root, { resources: new ToyTools(), instance: "tools" });
    const e = episode("s");
    await rt.seedSession(e, {});
    await rt.prepare(fence(), "p", "ck-000000000001", {}, { timeoutS: 5 });
    const committed = await rt.commit(fence(), "c", "ck-000000000001", "ck-000000000001", [e]);
    const fresh = runtime(root, { resources: new RestoresNothing(), instance: "tools" });
    const error = await refusal(fresh.restore(fence(2), "x", "restore-1", "ck-000000000001", committed.manifest, [], [e]));
    assert.equal(error.reason, "INVALID_CHECKPOINT_STATE");
    assert.equal(error.metadata.episode, episodeKey(episode("s", 1)));
    assert.equal(fresh.core.phase, "IDLE");
    assert.equal(fresh.core.fresh, true);
  });
});

describe("description", () => {
  it("agent plus resources is an ENVIRONMENT; the weakest recovery mode decides the levels", () => {
    const both = runtime(tempRoot(), { agent: new ToyAgent(), resources: new ToyTools() });
    const d = both.describe(null);
    assert.equal(d.kind, "ENVIRONMENT");
    assert.equal(d.environment, "toy");
    assert.deepEqual(d.supportedLevels, ["TURN", "SIBLING", "PROMPT_GROUP"]);
    const unaudited = runtime(tempRoot(), {
      resources: { seed: async () => undefined, call: async () => ({}), verify: async () => ({ reward: 0 }), close: async () => undefined },
    });
    assert.equal(unaudited.describe(null).recoveryMode, "RESTART_ONLY");
    assert.deepEqual(unaudited.describe(null).supportedLevels, ["SIBLING", "PROMPT_GROUP"]);
    assert.throws(() => runtime(tempRoot(), { resources: { ...new ToyTools(), recoveryMode: "EXPORTED", exportSessions: undefined } as never }), /does not implement/);
  });
});
