/**
 * The compatible protocol flags, without the wire: saved-nothing commits (section 4.8
 * item 7) and their restore (4.10 item 2), the commit in the prepare (4.6 item 8), the
 * resume in the commit (4.8 item 9), GetStatus's committed checkpoint (4.13) and a Run
 * that waits for admission (5.2 item 1).
 */
import assert from "node:assert/strict";
import { existsSync, readdirSync } from "node:fs";
import path from "node:path";
import { describe, it } from "node:test";

import { CancelledError, SnapshotStore, TurnpointError, episode, episodeKey } from "../src/index.js";
import type { Agent, EpisodeContext, FaultPoint, JsonObject, ResourcesServer, RunEvent, RunFollower, SavedTurn } from "../src/index.js";
import { Gate, ToyAgent, ToyTools, fence, runtime, tempRoot, until } from "./helpers.js";

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

/** Whether `promise` is still pending after a few turns of the event loop. */
async function pending(promise: Promise<unknown>): Promise<boolean> {
  let done = false;
  void promise.then(
    () => (done = true),
    () => (done = true),
  );
  for (let i = 0; i < 5; i++) await new Promise((resolve) => setImmediate(resolve));
  return !done;
}

/** An unaudited (RESTART_ONLY) resources server: its sessions are restarts, never exported. */
function restartOnlyTools(): ResourcesServer {
  return { seed: async () => undefined, call: async () => ({}), verify: async () => ({ reward: 0 }), close: async () => undefined };
}

/**
 * An agent whose exported state is live: `exportStates` hands out the very object each
 * turn then changes. Turn k (1-based) waits at `gates[k]` if set.
 */
class LiveAgent implements Agent {
  readonly live = new Map<string, { turn: number; notes: string[] }>();
  readonly gates = new Map<number, Gate>();

  async run(ctx: EpisodeContext): Promise<JsonObject> {
    const state = { turn: 0, notes: [] as string[] };
    this.live.set(episodeKey(ctx.episode), state);
    for (let turn = 1; turn <= 3; turn++) {
      await this.gates.get(turn)?.wait(ctx.signal);
      state.turn = turn;
      state.notes.push(`turn ${turn}`);
      await ctx.boundary(turn, { turn });
    }
    return { turns: state.turn };
  }

  async exportStates(states: ReadonlyMap<string, SavedTurn>): Promise<ReadonlyMap<string, JsonObject>> {
    return new Map([...states.keys()].map((id) => [id, this.live.get(id) as unknown as JsonObject]));
  }

  /** Slow on purpose: every episode woken by the reopening runs before the write starts. */
  async admissionOpened(): Promise<void> {
    await new Promise((resolve) => setImmediate(resolve));
  }
}

/** A store whose write waits at `records_write` until `gate` opens; `hits` lists each point reached. */
function heldStore(root: string, gate: Gate): { store: SnapshotStore; hits: FaultPoint[] } {
  const hits: FaultPoint[] = [];
  const store = new SnapshotStore(root, async (point) => {
    hits.push(point);
    if (point === "records_write") await gate.wait();
  });
  return { store, hits };
}

describe("saved-nothing commits", () => {
  it("write nothing at all, answer saved_nothing, and a retry replays the answer", async () => {
    const root = tempRoot();
    const hits: FaultPoint[] = [];
    const rt = runtime(root, { resources: new ToyTools(), instance: "tools", store: new SnapshotStore(root, (point) => void hits.push(point)) });
    await rt.prepare(fence(), "p", "ck-000000000001");
    assert.equal(rt.status().committedCheckpointId, null);
    const committed = await rt.commit(fence(), "c", "ck-000000000001", "ck-000000000001", [episode("absent")], { acceptSavedNothing: true });
    assert.deepEqual(committed, {
      checkpointId: "ck-000000000001",
      manifest: null,
      artifacts: [],
      exported: [],
      savedNothing: true,
      released: false,
    });
    assert.deepEqual(readdirSync(root), [], "no snapshot directory, no file");
    assert.deepEqual(hits, [], "the store was never asked to write");
    assert.equal(rt.core.phase, "COMMITTED");
    assert.equal(rt.status().committedCheckpointId, "ck-000000000001");
    // A retry (new request id, scope in another form) replays; another identity conflicts.
    assert.deepEqual(await rt.commit(fence(), "c2", "ck-000000000001", "ck-000000000001", [episode("absent")], { acceptSavedNothing: true }), committed);
    const conflict = await refusal(rt.commit(fence(), "c3", "ck-000000000001", "ck-000000000001", [], { acceptSavedNothing: true }));
    assert.equal(conflict.reason, "CHECKPOINT_CONFLICT");
    await rt.resume(fence(), "r", "ck-000000000001");
    assert.equal(rt.core.phase, "IDLE");
  });

  it("without accept_saved_nothing an export of nothing still writes a manifest and an empty records file", async () => {
    const root = tempRoot();
    const rt = runtime(root, { resources: new ToyTools(), instance: "tools" });
    await rt.prepare(fence(), "p", "ck-1");
    const committed = await rt.commit(fence(), "c", "ck-1", "ck-1", []);
    assert.equal(committed.savedNothing, false);
    assert.ok(committed.manifest !== null);
    assert.equal(committed.artifacts[0]?.recordCount, 0);
    assert.deepEqual(readdirSync(path.join(root, "ck-1", "tools")).sort(), ["MANIFEST.json", path.basename(committed.artifacts[0]?.path ?? "")].sort());
    // With records to export the flag changes nothing: they are written.
    const tools = new ToyTools();
    const other = runtime(root, { resources: tools, instance: "tools-b" });
    await other.seedSession(episode("s"), {});
    await other.prepare(fence(), "p", "ck-2");
    const written = await other.commit(fence(), "c", "ck-2", "ck-2", [episode("s")], { acceptSavedNothing: true });
    assert.equal(written.savedNothing, false);
    assert.deepEqual(written.exported, [episode("s")]);
    assert.ok(existsSync(path.join(root, "ck-2", "tools-b", "MANIFEST.json")));
  });

  it("a restore of a saved-nothing entry installs nothing; with a scope it is INVALID_CHECKPOINT_STATE", async () => {
    const root = tempRoot();
    const rt = runtime(root, { resources: new ToyTools(), instance: "tools" });
    const answer = await rt.restore(fence(), "x", "restore-1", "ck-1", null, [], []);
    assert.deepEqual(answer, { restoreId: "restore-1", installed: [], phase: "RESTORED", retired: [] });
    assert.equal((await rt.resume(fence(), "y", "restore-1")).endedActive, true);

    const fresh = runtime(root, { resources: new ToyTools(), instance: "tools" });
    const error = await refusal(fresh.restore(fence(), "x", "restore-1", "ck-1", null, [], [episode("s")]));
    assert.equal(error.reason, "INVALID_CHECKPOINT_STATE");
    assert.deepEqual(error.metadata, { snapshot: "ck-1" });
    assert.equal(fresh.core.phase, "IDLE");
    assert.equal(fresh.core.fresh, true);
  });
});

describe("commit in the prepare", () => {
  it("an idle participant commits saved-nothing in the prepare; a later Commit replays or conflicts", async () => {
    const root = tempRoot();
    const rt = runtime(root, { resources: new ToyTools(), instance: "tools" });
    const prepared = await rt.prepare(fence(), "p", "ck-000000000001", { emptyCommitSnapshot: "ck-000000000001" });
    assert.equal(prepared.committedEmpty, true);
    assert.equal(prepared.phase, "COMMITTED");
    assert.equal(prepared.readiness.ready, true);
    assert.equal(rt.core.phase, "COMMITTED");
    assert.deepEqual(readdirSync(root), []);
    assert.equal(rt.status().committedCheckpointId, "ck-000000000001");
    // Recorded like a ready answer: a repeat of the prepare replays it.
    const again = await rt.prepare(fence(), "p2", "ck-000000000001", { emptyCommitSnapshot: "ck-000000000001" });
    assert.equal(again.committedEmpty, true);
    assert.equal(again.phase, "COMMITTED");
    // A Commit with that identity replays saved_nothing, also without the flag.
    const replay = await rt.commit(fence(), "c", "ck-000000000001", "ck-000000000001", []);
    assert.deepEqual(replay, { checkpointId: "ck-000000000001", manifest: null, artifacts: [], exported: [], savedNothing: true, released: false });
    assert.deepEqual(readdirSync(root), []);
    assert.equal((await refusal(rt.commit(fence(), "c2", "ck-000000000001", "other-snapshot", []))).reason, "CHECKPOINT_CONFLICT");
    assert.equal((await refusal(rt.commit(fence(), "c3", "ck-000000000001", "ck-000000000001", [episode("x")]))).reason, "CHECKPOINT_CONFLICT");
    await rt.resume(fence(), "r", "ck-000000000001");
    assert.equal(rt.core.phase, "IDLE");
  });

  it("restarts do not stop it; an episode held here does, and the prepare answers as usual", async () => {
    const restarts = runtime(tempRoot(), { resources: restartOnlyTools() });
    await restarts.seedSession(episode("s"), {});
    const prepared = await restarts.prepare(fence(), "p", "ck-1", { emptyCommitSnapshot: "ck-1" });
    assert.deepEqual(prepared.readiness.restarts, [episode("s")]);
    assert.equal(prepared.committedEmpty, true);

    const root = tempRoot();
    const agent = new ToyAgent(2);
    const rt = runtime(root, { agent, instance: "agent-0" });
    const e = episode("held");
    const gate = agent.gate(e, 2);
    const follower = rt.acceptRun(e, {});
    await follower.next();
    const waiting = rt.prepare(fence(), "p", "ck-1", { emptyCommitSnapshot: "ck-1" });
    gate.open();
    const answer = await waiting;
    assert.equal(answer.committedEmpty, false);
    assert.equal(answer.phase, "PREPARED");
    assert.equal(rt.status().committedCheckpointId, null);
    const committed = await rt.commit(fence(), "c", "ck-1", "ck-1", [e], { acceptSavedNothing: true });
    assert.deepEqual(committed.exported, [e]);
    assert.equal(rt.status().committedCheckpointId, "ck-1");
    await rt.resume(fence(), "r", "ck-1");
    await drain(follower);
  });
});

describe("resume in the commit", () => {
  it("reopens admission before the write, which writes the records as exported", async () => {
    const root = tempRoot();
    const writeGate = new Gate();
    const { store, hits } = heldStore(root, writeGate);
    const agent = new LiveAgent();
    const rt = runtime(root, { agent, instance: "agent-0", store });
    const e = episode("r", 2);
    agent.gates.set(2, new Gate());
    const follower = rt.acceptRun(e, { prompt: "p" });
    assert.equal((await follower.next())?.type, "boundary");
    const waiting = rt.prepare(fence(), "p", "ck-000000000001");
    (agent.gates.get(2) as Gate).open();
    assert.equal((await waiting).phase, "PREPARED"); // parked at boundary 2

    const commit = rt.commit(fence(), "c", "ck-000000000001", "ck-000000000001", [e], { release: true });
    await until(() => hits.includes("records_write"), "the write started");
    // The checkpoint ended before the write finished: admission is open, work goes on.
    assert.equal(rt.core.phase, "IDLE");
    assert.equal(rt.status().admissionOpen, true);
    assert.equal(rt.status().committedCheckpointId, null, "not committed until written");
    const newcomer = rt.acceptRun(episode("new"), {});
    const events = await drain(follower);
    assert.equal(events.at(-1)?.type, "result");
    assert.equal(agent.live.get(episodeKey(e))?.turn, 3, "the live state moved on");
    // A repeat with the same identity joins the write still running.
    const joined = rt.commit(fence(), "c-again", "ck-000000000001", "ck-000000000001", [e], { release: true });
    assert.equal(await pending(joined), true);
    writeGate.open();
    const committed = await commit;
    assert.equal(committed.released, true);
    assert.equal(committed.savedNothing, false);
    assert.deepEqual(committed.exported, [e]);
    assert.deepEqual(await joined, committed);
    assert.equal(rt.status().committedCheckpointId, "ck-000000000001");
    assert.ok(committed.manifest !== null);
    const loaded = await new SnapshotStore(root).read("ck-000000000001", "agent-0", { manifest: committed.manifest });
    assert.deepEqual(loaded.records.map((r) => r.payload), [
      { task: { prompt: "p" }, boundary_index: 2, turn_index: 2, state: { turn: 2, notes: ["turn 1", "turn 2"] } },
    ]);
    await drain(newcomer);
  });

  it("replays after the release, conflicts with another identity, is stale once a newer checkpoint opened", async () => {
    const rt = runtime(tempRoot(), { resources: new ToyTools(), instance: "tools" });
    await rt.seedSession(episode("s"), {});
    await rt.prepare(fence(), "p", "ck-000000000001");
    const committed = await rt.commit(fence(), "c", "ck-000000000001", "ck-000000000001", [episode("s")], { release: true });
    assert.equal(committed.released, true);
    assert.equal(rt.core.phase, "IDLE");
    assert.equal(rt.status().committedCheckpointId, "ck-000000000001");
    assert.deepEqual(await rt.commit(fence(), "c2", "ck-000000000001", "ck-000000000001", [episode("s")], { release: true }), committed);
    const conflict = await refusal(rt.commit(fence(), "c3", "ck-000000000001", "ck-000000000001", [], { release: true }));
    assert.equal(conflict.reason, "CHECKPOINT_CONFLICT");
    // Renew and Prepare of the ended id are stale, as after any resume.
    assert.equal((await refusal(rt.renew(fence(), "n", "ck-000000000001"))).reason, "STALE_CHECKPOINT");
    await rt.prepare(fence(), "p2", "ck-000000000002");
    const stale = await refusal(rt.commit(fence(), "c4", "ck-000000000001", "ck-000000000001", [episode("s")], { release: true }));
    assert.equal(stale.reason, "STALE_CHECKPOINT");
    await rt.resume(fence(), "r", "ck-000000000002");
  });

  it("a released commit that exported nothing saves nothing; a resume of its id changes nothing", async () => {
    const root = tempRoot();
    const rt = runtime(root, { resources: new ToyTools(), instance: "tools" });
    await rt.prepare(fence(), "p", "ck-1");
    const committed = await rt.commit(fence(), "c", "ck-1", "ck-1", [], { release: true, acceptSavedNothing: true });
    assert.equal(committed.savedNothing, true);
    assert.equal(committed.released, true);
    assert.equal(rt.core.phase, "IDLE");
    assert.deepEqual(readdirSync(root), []);
    const resumed = await rt.resume(fence(), "r", "ck-1");
    assert.deepEqual([resumed.phase, resumed.endedActive], ["IDLE", false]);
  });

  it("a resume of the released id while the write is unpublished stops it; nothing is left", async () => {
    const root = tempRoot();
    const writeGate = new Gate();
    const { store, hits } = heldStore(root, writeGate);
    const tools = new ToyTools();
    const rt = runtime(root, { resources: tools, instance: "tools", store });
    await rt.seedSession(episode("s"), {});
    await rt.prepare(fence(), "p", "ck-1");
    const commit = rt.commit(fence(), "c", "ck-1", "ck-1", [episode("s")], { release: true });
    await until(() => hits.includes("records_write"), "the write started");
    const resumed = rt.resume(fence(), "r", "ck-1");
    writeGate.open();
    assert.equal((await resumed).endedActive, false);
    assert.equal((await refusal(commit)).reason, "STALE_CHECKPOINT");
    assert.equal(existsSync(path.join(root, "ck-1", "tools", "MANIFEST.json")), false);
    assert.equal(rt.status().committedCheckpointId, null);
  });
});

describe("a Run that waits for admission", () => {
  it("is admitted after resume instead of refused, and is in no cut while it waits", async () => {
    const agent = new ToyAgent(1);
    const rt = runtime(tempRoot(), { agent });
    await rt.prepare(fence(), "p", "ck-1");
    const e = episode("late");
    assert.equal((await refusal(rt.admitRun(e, {}))).reason, "ADMISSION_CLOSED");
    const waiting = rt.admitRun(e, { a: 1 }, { waitForAdmission: true });
    assert.equal(await pending(waiting), true);
    assert.equal(rt.core.entry({ episode: e, slot: "run" }), undefined);
    assert.deepEqual(rt.status().readiness.counts, []);
    assert.equal(rt.core.fresh, true);
    await rt.resume(fence(), "r", "ck-1");
    const events = await drain(await waiting);
    const result = events.at(-1);
    assert.equal(result?.type === "result" && result.outcome, "COMPLETED");
    assert.deepEqual(agent.started, [episodeKey(e)]);
  });

  it("is refused ADMISSION_CLOSED after the participant's bound, and its caller leaving ends the wait", async () => {
    const agent = new ToyAgent(1);
    const rt = runtime(tempRoot(), { agent, config: { runAdmissionWaitS: 0.05 } });
    await rt.prepare(fence(), "p", "ck-1");
    const started = performance.now();
    const late = await refusal(rt.admitRun(episode("a"), {}, { waitForAdmission: true }));
    assert.equal(late.reason, "ADMISSION_CLOSED");
    assert.ok(performance.now() - started >= 40);

    const caller = new AbortController();
    const cancelled = rt.admitRun(episode("b"), {}, { waitForAdmission: true }, caller.signal);
    caller.abort();
    await assert.rejects(cancelled, CancelledError);
    await rt.resume(fence(), "r", "ck-1");
    assert.deepEqual(agent.started, []);
    assert.equal(rt.core.entry({ episode: episode("b"), slot: "run" }), undefined);
  });

  it("still meets every other refusal at once", async () => {
    const rt = runtime(tempRoot(), { agent: new ToyAgent(1) });
    await rt.retire(fence(), "t", [episode("gone", 3)]);
    await rt.prepare(fence(), "p", "ck-1");
    const stale = await refusal(rt.admitRun(episode("gone", 2), {}, { waitForAdmission: true }));
    assert.equal(stale.reason, "STALE_ATTEMPT");
    await rt.resume(fence(), "r", "ck-1");
  });
});
