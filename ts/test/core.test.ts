/** The pure core (docs/spec.md section 4): phases, admission, readiness, ids, marks. */
import assert from "node:assert/strict";
import { describe, it } from "node:test";

import { FinishedCheckpoints, ParticipantCore, workKey } from "../src/core.js";
import type { WorkKey } from "../src/core.js";
import { TurnpointError, episode } from "../src/index.js";
import type { EpisodeState, Phase } from "../src/index.js";

function reason(fn: () => unknown): string {
  try {
    fn();
  } catch (error) {
    if (error instanceof TurnpointError) return error.reason;
    throw error;
  }
  return "ok";
}

const run = (id: string, attempt = 0): WorkKey => workKey(episode(id, attempt), "run");

describe("phases and admission", () => {
  it("prepare on an idle participant with nothing running is PREPARED at once", () => {
    const core = new ParticipantCore();
    const start = core.beginPrepare("ck-1", null, 0);
    assert.equal(start.opened, true);
    assert.equal(core.phase, "PREPARED");
    assert.equal(core.admissionOpen, false);
  });

  it("the phase follows readiness while preparing, and admission follows the phase", () => {
    const core = new ParticipantCore();
    core.admit(run("r"), "RUNNING", 0);
    core.beginPrepare("ck-1", null, 0);
    assert.equal(core.phase, "PREPARING");
    assert.equal(reason(() => core.admit(run("late"), "RUNNING", 0)), "ADMISSION_CLOSED");
    core.setState(run("r"), "PARKED", 1);
    assert.equal(core.phase, "PREPARED");
    core.setState(run("r"), "RUNNING", 2); // readiness can regress
    assert.equal(core.phase, "PREPARING");
    assert.equal(core.resume("ck-1", 3), "ck-1");
    assert.equal(core.phase, "IDLE");
    assert.equal(core.admissionOpen, true);
  });

  it("finished ids are stale; a higher id supersedes an open one; others are INVALID_PHASE", () => {
    const core = new ParticipantCore();
    core.beginPrepare("ck-000000000002", null, 0);
    assert.equal(reason(() => core.beginPrepare("ck-000000000001", null, 0)), "STALE_CHECKPOINT");
    assert.equal(reason(() => core.beginPrepare("other-000000000009", null, 0)), "INVALID_PHASE");
    const start = core.beginPrepare("ck-000000000003", null, 0);
    assert.equal(start.superseded, "ck-000000000002");
    assert.equal(start.opened, false);
    assert.equal(core.isFinished("ck-000000000002"), true);
    assert.equal(reason(() => core.renew("ck-000000000002", null, 0)), "STALE_CHECKPOINT");
    // A resume of an id never seen finishes it (section 4.9 item 2).
    core.resume("ck-000000000003", 1);
    core.resume("never-000000000001", 1);
    assert.equal(reason(() => core.beginPrepare("never-000000000001", null, 2)), "STALE_CHECKPOINT");
  });

  it("a newer coordinator's prepare replaces the open checkpoint", () => {
    const core = new ParticipantCore();
    core.beginPrepare("a-1", null, 0, 1n);
    assert.equal(reason(() => core.beginPrepare("b-1", null, 0, 1n)), "INVALID_PHASE");
    assert.equal(core.beginPrepare("b-1", null, 0, 2n).superseded, "a-1");
  });

  it("commit needs PREPARED, refuses restarts in scope, conflicts on other arguments", () => {
    const core = new ParticipantCore();
    core.admit(run("x"), "RUNNING", 0);
    core.markRestart(run("x"), 0);
    core.admit(run("y"), "PARKED", 0);
    assert.equal(reason(() => core.beginCommit("ck-1", "f", [], 0)), "INVALID_PHASE");
    core.beginPrepare("ck-1", null, 0);
    assert.equal(reason(() => core.beginCommit("ck-1", "f", [episode("x")], 0)), "RESTART_IN_SCOPE");
    const start = core.beginCommit("ck-1", "f", [episode("y"), episode("zz")], 0);
    assert.deepEqual(
      start.exportKeys.map((k) => k.episode.rolloutId),
      ["y"],
    );
    assert.equal(core.beginCommit("ck-1", "f", [], 0).kind, "join");
    assert.equal(reason(() => core.beginCommit("ck-1", "g", [], 0)), "CHECKPOINT_CONFLICT");
    core.finishCommit("ck-1", "f", { done: true });
    assert.equal(core.phase, "COMMITTED");
    assert.deepEqual(core.beginCommit("ck-1", "f", [], 0).answer, { done: true });
  });

  it("a restart marked while a checkpoint is open takes effect at resume", () => {
    const core = new ParticipantCore();
    core.admit(run("x"), "PARKED", 0);
    core.beginPrepare("ck-1", null, 0);
    assert.equal(core.markRestart(run("x"), 1), false);
    assert.deepEqual(core.readiness(32).restarts, []);
    core.resume("ck-1", 2);
    assert.deepEqual(core.readiness(32).restarts, [episode("x")]);
  });

  it("restore needs an idle, fresh participant, installs, and fails all or nothing", () => {
    const core = new ParticipantCore();
    assert.equal(core.beginRestore("restore-1", "f", null, 0).kind, "new");
    assert.equal(core.phase, "RESTORED");
    core.installRestored(run("r", 1), 2, 1, 0);
    assert.equal(reason(() => core.beginPrepare("ck-1", null, 0)), "INVALID_PHASE");
    assert.deepEqual(
      core.failRestore("restore-1", 1).map((k) => k.episode),
      [episode("r", 1)],
    );
    assert.equal(core.phase, "IDLE");
    assert.equal(core.fresh, true);
    core.admit(run("w"), "RUNNING", 2);
    const refused = (() => {
      try {
        core.beginRestore("restore-2", "f", null, 3);
      } catch (error) {
        return error as TurnpointError;
      }
      return null;
    })();
    assert.equal(refused?.reason, "INVALID_PHASE");
    assert.equal(refused?.metadata.fresh, "false");
  });
});

describe("readiness reports", () => {
  it("caps the listed blockers, never the count; oldest first; counts sorted by state name", () => {
    const core = new ParticipantCore();
    for (const id of ["c", "a", "b"]) core.admit(run(id), "RUNNING", 0);
    core.admit(run("p"), "PARKED", 0);
    const report = core.readiness(2);
    assert.equal(report.ready, false);
    assert.equal(report.blockerCount, 3);
    assert.deepEqual(
      report.blockers.map((b) => b.episode.rolloutId),
      ["c", "a"],
    );
    assert.deepEqual(report.counts, [
      ["PARKED", 1],
      ["RUNNING", 3],
    ]);
  });

  it("a replayable request in flight never blocks", () => {
    const core = new ParticipantCore();
    const key = workKey(episode("s"), "session");
    core.admit(key, "REQUEST_IN_FLIGHT", 0);
    assert.equal(core.ready, false);
    core.setState(key, "REQUEST_IN_FLIGHT", 0, { replayable: true });
    assert.equal(core.ready, true);
  });

  it("keeps counts and blockers equal to a full scan through a random sequence", () => {
    // A seeded generator: the same sequence every run. 32-bit arithmetic (a product in
    // doubles loses the low bits) and the high bits (the low ones cycle quickly).
    let seed = 7;
    const random = (n: number): number => {
      seed = (Math.imul(seed, 1103515245) + 12345) >>> 0;
      return (seed >>> 16) % n;
    };
    const states: EpisodeState[] = ["RUNNING", "PARKED", "AWAITING_MODEL", "COMPLETED_UNACKED", "RESTART", "REQUEST_IN_FLIGHT", "IDLE", "RESTORED"];
    const core = new ParticipantCore();
    const keys: WorkKey[] = [];
    let checkpoint = 0;
    for (let step = 0; step < 2000; step++) {
      const action = random(8);
      try {
        if (action === 0) {
          const key = run(`r${random(20)}`, random(3));
          core.admit(key, states[random(states.length)] as EpisodeState, step);
          keys.push(key);
        } else if (action === 1 && keys.length > 0) {
          core.setState(keys[random(keys.length)] as WorkKey, states[random(states.length)] as EpisodeState, step, { replayable: random(4) === 0 });
        } else if (action === 2 && keys.length > 0) {
          core.remove(keys.splice(random(keys.length), 1)[0] as WorkKey, step);
        } else if (action === 3) {
          core.beginPrepare(`ck-${++checkpoint}`, null, step);
        } else if (action === 4) {
          core.resume(`ck-${checkpoint}`, step);
        } else if (action === 5 && keys.length > 0) {
          core.markRestart(keys[random(keys.length)] as WorkKey, step);
        } else if (action === 6 && keys.length > 0) {
          for (const key of core.beginRetire([(keys[random(keys.length)] as WorkKey).episode], step)) core.finishRetire(key, step);
        } else if (action === 7) {
          // A whole restore into the running core (section 4.16): retire, install N+1, resume.
          const running = { scope: [episode(`r${random(20)}`, random(3))], retireUnscoped: random(3) === 0 };
          const restoreId = `ck-${++checkpoint}`;
          core.beginRestore(restoreId, "f", null, step, running);
          for (const key of core.retireForRestore(restoreId, running, step)) core.finishRetire(key, step);
          for (const e of running.scope) core.installRestored(run(e.rolloutId, e.attempt + 1), 0, 0, step);
          core.finishRestore(restoreId, "answer");
          for (const e of running.scope) {
            assert.deepEqual(
              core.keysOf(e.rolloutId).map((key) => key.episode.attempt),
              [e.attempt + 1],
            );
          }
          if (running.retireUnscoped) assert.equal([...core.allEntries()].length, running.scope.length);
          core.resume(restoreId, step);
        }
      } catch (error) {
        if (!(error instanceof TurnpointError) && !(error instanceof Error && /already in the table|not in the table/.test(error.message))) throw error;
      }
      const [blocking, counts] = core.recount();
      assert.equal(core.blockerCount, blocking, `step ${step}`);
      assert.deepEqual(core.keptCounts(), counts, `step ${step}`);
      const phase: Phase = core.phase;
      assert.equal(core.admissionOpen, phase === "IDLE");
      if (phase === "PREPARING" || phase === "PREPARED") assert.equal(phase === "PREPARED", core.ready);
    }
  });
});

describe("retire, forget and attempts", () => {
  it("marks only rise; attempts at or below the mark and below a held attempt are refused", () => {
    const core = new ParticipantCore();
    core.admit(run("r", 2), "RUNNING", 0);
    assert.equal(reason(() => core.checkAttempt(episode("r", 1))), "STALE_ATTEMPT");
    const keys = core.beginRetire([episode("r", 3)], 0);
    assert.deepEqual(
      keys.map((k) => k.episode.attempt),
      [2],
    );
    core.beginRetire([episode("r", 1)], 0);
    assert.equal(core.refusalMark("r"), 3);
    assert.equal(reason(() => core.forget(["r"])), "RETIRE_INCOMPLETE");
    core.finishRetire(keys[0] as WorkKey, 1);
    assert.equal(core.forget(["r", "never"]), 1);
    assert.equal(core.forget(["r"]), 0);
  });

  it("retire and forget need IDLE or RESTORED", () => {
    const core = new ParticipantCore();
    core.beginPrepare("ck-1", null, 0);
    assert.equal(reason(() => core.beginRetire([episode("r")], 0)), "INVALID_PHASE");
    assert.equal(reason(() => core.forget(["r"])), "INVALID_PHASE");
  });
});

describe("finished ids", () => {
  it("never look fresh again after leaving the exact set", () => {
    const finished = new FinishedCheckpoints(2);
    for (let i = 1; i <= 5; i++) finished.add(`ck-${String(i).padStart(12, "0")}`);
    assert.equal(finished.size, 2);
    assert.equal(finished.has("ck-000000000001"), true);
    assert.equal(finished.has("ck-000000000006"), false);
    finished.add("no-sequence");
    finished.add("x-1");
    finished.add("y-1");
    assert.equal(finished.has("no-sequence"), false); // ids without a sequence rely on the LRU
  });
});

describe("hook failures", () => {
  it("map to UNAVAILABLE for connection and timeout failures, else HOOK_FAILED, never quoting the text", async () => {
    const { hookFailure } = await import("../src/index.js");
    assert.equal(hookFailure(Object.assign(new Error("connect ECONNREFUSED 10.0.0.1:80"), { code: "ECONNREFUSED" }), "Call").reason, "UNAVAILABLE");
    assert.equal(hookFailure(Object.assign(new Error("14 UNAVAILABLE"), { code: 14, details: "x" }), "Call").reason, "UNAVAILABLE");
    const failed = hookFailure(new TypeError("secret /etc/path"), "Verify");
    assert.equal(failed.reason, "HOOK_FAILED");
    assert.deepEqual(failed.metadata, { operation: "Verify", exception: "TypeError" });
    assert.ok(!failed.message.includes("secret"));
    const own = new TurnpointError("NOT_FOUND", "no session");
    assert.equal(hookFailure(own, "Call"), own);
  });
});

describe("data-plane fencing (section 6.9)", () => {
  it("refuses a fenced-out coordinator's Run, serves a tool's, adopts a higher epoch", () => {
    const core = new ParticipantCore();
    assert.equal(core.checkFence({ coordinatorId: "coord", epoch: 5n }, "d1"), undefined);
    assert.equal(reason(() => core.checkDataFence({ coordinatorId: "old", epoch: 3n })), "FENCED");
    assert.equal(reason(() => core.checkDataFence({ coordinatorId: "other", epoch: 5n })), "FENCED");
    assert.equal(reason(() => core.checkDataFence(null)), "ok");
    assert.equal(reason(() => core.checkDataFence({ coordinatorId: "coord", epoch: 5n })), "ok");
    assert.equal(reason(() => core.checkDataFence({ coordinatorId: "new", epoch: 6n })), "ok");
    assert.equal(core.fence?.coordinatorId, "new");
  });
});

describe("restore into a running participant (section 4.16)", () => {
  const scoped = (attempt: number, retireUnscoped = false) => ({ scope: [episode("a", attempt)], retireUnscoped });

  it("needs no freshness, closes admission, and retires the scoped rollout up to N before installing N+1", () => {
    const core = new ParticipantCore();
    core.admit(run("a", 0), "RUNNING", 0);
    core.admit(run("b", 0), "RUNNING", 0);
    assert.equal(reason(() => core.beginRestore("restore-1", "f", null, 1)), "INVALID_PHASE"); // plain Restore: not fresh
    assert.equal(core.beginRestore("restore-1", "f", null, 1, scoped(0)).kind, "new");
    assert.equal(core.phase, "RESTORED");
    assert.equal(core.admissionOpen, false);
    const keys = core.retireForRestore("restore-1", scoped(0), 2);
    assert.deepEqual(keys, [run("a", 0)]);
    assert.equal(core.entry(run("a", 0))?.state, "RETIRING");
    assert.equal(core.entry(run("b", 0))?.state, "RUNNING"); // unscoped work goes on
    assert.equal(core.refusalMark("a"), 0);
    core.finishRetire(run("a", 0), 3);
    core.installRestored(run("a", 1), 1, 1, 3);
    core.finishRestore("restore-1", "answer");
    assert.deepEqual(core.beginRestore("restore-1", "f", null, 4, scoped(0)), { kind: "replay", answer: "answer" });
    assert.equal(core.resume("restore-1", 5), "restore-1");
    assert.equal(reason(() => core.checkAttempt(episode("a", 0))), "STALE_ATTEMPT");
    assert.equal(reason(() => core.beginRestore("restore-1", "f", null, 6, scoped(0))), "STALE_CHECKPOINT");
  });

  it("the same id with other arguments, or asked by the other operation, is CHECKPOINT_CONFLICT", () => {
    const core = new ParticipantCore();
    core.beginRestore("restore-1", "f", null, 0, scoped(0));
    assert.equal(core.beginRestore("restore-1", "f", null, 0, scoped(0)).kind, "join"); // still installing
    assert.equal(reason(() => core.beginRestore("restore-1", "g", null, 0, scoped(0))), "CHECKPOINT_CONFLICT");
    assert.equal(reason(() => core.beginRestore("restore-1", "f", null, 0)), "CHECKPOINT_CONFLICT");
    const fresh = new ParticipantCore();
    fresh.beginRestore("restore-1", "f", null, 0);
    assert.equal(reason(() => fresh.beginRestore("restore-1", "f", null, 0, scoped(0))), "CHECKPOINT_CONFLICT");
  });

  it("refuses a retired scope attempt, or one superseded here, before anything changes", () => {
    const core = new ParticipantCore();
    core.admit(run("a", 2), "RUNNING", 0);
    core.admit(run("b", 0), "RUNNING", 0);
    for (const attempt of [0, 1]) {
      assert.equal(reason(() => core.beginRestore("restore-1", "f", null, 1, scoped(attempt))), "STALE_ATTEMPT");
    }
    // A new incarnation (retireUnscoped) continues a saved N retired here as N+1, but
    // refuses one whose N+1 is retired too, listing it with its mark (section 4.16 item 3).
    for (const key of core.beginRetire([episode("b", 1)], 1)) core.finishRetire(key, 1);
    const reused = { scope: [episode("b", 0)], retireUnscoped: true };
    assert.throws(
      () => core.beginRestore("restore-1", "f", null, 2, reused),
      (error: unknown) =>
        error instanceof TurnpointError &&
        error.reason === "STALE_ATTEMPT" &&
        error.metadata["stale_episodes"] === "b#0:1" &&
        error.metadata["retired_through"] === "1",
    );
    assert.equal(core.phase, "IDLE");
    assert.equal(core.activeCheckpointId, null);
    assert.equal(core.entry(run("a", 2))?.state, "RUNNING");
    // With retireUnscoped a newer attempt held here came from the fenced incarnation: it goes.
    core.beginRestore("restore-1", "f", null, 3, scoped(1, true));
    assert.deepEqual(core.retireForRestore("restore-1", scoped(1, true), 3), [run("a", 2)]);
    assert.equal(core.refusalMark("a"), 1);
  });

  it("retireUnscoped forgets the marks of unscoped rollouts; a heal keeps them", () => {
    for (const retireUnscoped of [true, false]) {
      const core = new ParticipantCore();
      core.admit(run("b", 0), "RUNNING", 0);
      for (const key of core.beginRetire([episode("b", 0)], 0)) core.finishRetire(key, 0);
      assert.equal(core.refusalMark("b"), 0);
      const running = { scope: [episode("a", 2)], retireUnscoped };
      core.beginRestore("restore-1", "f", null, 1, running);
      core.retireForRestore("restore-1", running, 1);
      assert.equal(core.refusalMark("b"), retireUnscoped ? undefined : 0);
      assert.equal(core.refusalMark("a"), 2);
    }
  });

  it("retireUnscoped frees every other entry without a refusal mark", () => {
    const core = new ParticipantCore();
    core.admit(run("a", 0), "RUNNING", 0);
    core.admit(workKey(episode("c", 0), "session"), "IDLE", 0);
    core.beginRestore("restore-1", "f", null, 1, scoped(0, true));
    const keys = core.retireForRestore("restore-1", scoped(0, true), 1);
    assert.deepEqual(keys, [run("a", 0), workKey(episode("c", 0), "session")]);
    for (const key of keys) core.finishRetire(key, 2);
    assert.equal(core.refusalMark("c"), undefined);
    assert.equal(core.refusalMark("a"), 0);
    core.finishRestore("restore-1", "answer");
    core.resume("restore-1", 3);
    core.admit(workKey(episode("c", 0), "session"), "IDLE", 4); // the new incarnation may run it again
  });

  it("a failed install undoes the installs and reopens; what was retired stays retired", () => {
    const core = new ParticipantCore();
    core.admit(run("a", 0), "RUNNING", 0);
    core.beginRestore("restore-1", "f", null, 1, scoped(0));
    for (const key of core.retireForRestore("restore-1", scoped(0), 1)) core.finishRetire(key, 1);
    core.installRestored(run("a", 1), 1, 1, 2);
    assert.deepEqual(core.failRestore("restore-1", 3), [run("a", 1)]);
    assert.equal(core.phase, "IDLE");
    assert.equal(core.entry(run("a", 1)), undefined);
    assert.equal(reason(() => core.checkAttempt(episode("a", 0))), "STALE_ATTEMPT");
    assert.throws(() => core.retireForRestore("restore-1", scoped(0), 4), /outside its restore/);
  });
});
