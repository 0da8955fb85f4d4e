/**
 * Exactly-once tool calls in the TypeScript resources runtime (docs/spec.md section
 * 6.12): the key and the record as the Python SDK has them, a keyed call retried and
 * re-sent by the next attempt after a restore answered from the record (the tool runs
 * once), the key with other arguments refused, the record bounded and exported in the
 * reserved payload field.
 */
import assert from "node:assert/strict";
import { describe, it } from "node:test";

import { EFFECTS_FIELD, EffectRecord, callFingerprint, parseEffectKey } from "../src/effects.js";
import { EffectConflictError, TurnpointError, effectKey, episode } from "../src/index.js";
import { Gate, ToyTools, fence, runtime, tempRoot, until } from "./helpers.js";

async function conflict(promise: Promise<unknown>): Promise<EffectConflictError> {
  try {
    await promise;
  } catch (error) {
    if (error instanceof EffectConflictError) return error;
    throw error;
  }
  throw new Error("expected an EffectConflictError");
}

describe("keys and the record", () => {
  it("keys name the rollout, the turn and the index, the same on every attempt", () => {
    assert.equal(effectKey("r-1", { turn: 3, index: 0 }), "fx:r-1:3:0");
    assert.equal(effectKey("r-1", { turn: null, index: 2 }), "fx:r-1:s:2");
    assert.deepEqual(parseEffectKey("fx:r-1:3:0"), { rolloutId: "r-1", position: { turn: 3, index: 0 } });
    assert.equal(parseEffectKey("call-r-1-0-3"), null);
    assert.throws(() => effectKey("r-1", { turn: -1, index: 0 }), RangeError);
  });

  it("a call's fingerprint is the Python SDK's (sorted keys, ASCII, integral numbers)", () => {
    // turnpoint.participant_sdk._effects.call_fingerprint of the same call.
    const args = { count: 1, b: [1, "é", null, true, 0.5] };
    assert.equal(callFingerprint("call", "deal", args), "78e151913f3fcdd0a33f984574fac31b");
    assert.equal(callFingerprint("call", "deal", { b: [1, "é", null, true, 0.5], count: 1.0 }), callFingerprint("call", "deal", args));
  });

  it("is bounded: past the limit the oldest goes, and an SDK key at or before it is refused as forgotten", () => {
    const record = new EffectRecord(2);
    for (let turn = 0; turn < 3; turn++) record.record(effectKey("r", { turn, index: 0 }), "call", "deal", "f", { turn });
    assert.equal(record.size, 2);
    assert.equal(record.lookup(effectKey("r", { turn: 3, index: 0 }), "call", "deal", "f"), undefined);
    const forgotten = (() => {
      try {
        record.lookup(effectKey("r", { turn: 0, index: 0 }), "call", "deal", "f");
      } catch (error) {
        return error as EffectConflictError;
      }
      return null;
    })();
    assert.equal(forgotten?.divergence, "forgotten");
    const copy = EffectRecord.fromJson(record.toJson());
    assert.deepEqual(copy.toJson(), record.toJson());
    assert.throws(() => EffectRecord.fromJson({ ...record.toJson(), format: 2 }), /format/);
  });
});

describe("the resources runtime", () => {
  it("answers a retried key from the record, refuses other arguments, and carries the record through a restore", async () => {
    const root = tempRoot();
    const tools = new ToyTools();
    const rt = runtime(root, { resources: tools, instance: "tools" });
    const first = episode("hand");
    const key = effectKey("hand", { turn: 0, index: 0 });
    await rt.seedSession(first, {});
    // A retry while the first run is still running waits for it.
    tools.hold = new Gate();
    const running = rt.callTool(first, "deal", { count: 1 }, undefined, key);
    await until(() => rt.core.blockerCount === 1, "the call in flight");
    const retry = rt.callTool(first, "deal", { count: 1 }, undefined, key);
    tools.hold.open();
    tools.hold = null;
    assert.deepEqual(await running, { calls: 1 });
    assert.deepEqual(await retry, { calls: 1 });
    assert.deepEqual(await rt.callTool(first, "deal", { count: 1 }, undefined, key), { calls: 1 });
    const diverged = await conflict(rt.callTool(first, "deal", { count: 2 }, undefined, key));
    assert.equal(diverged.divergence, "arguments");
    assert.deepEqual(diverged.metadata, { field: "request_id", request_id: key, divergence: "arguments" });
    assert.equal((await conflict(rt.callTool(first, "split", { count: 1 }, undefined, key))).divergence, "tool");
    assert.equal((await conflict(rt.verify(first, { count: 1 }, undefined, key))).divergence, "operation");
    assert.equal(tools.sessions.get("hand#0")?.calls, 1);

    assert.equal((await rt.prepare(fence(), "p", "ck-000000000001", { leaseS: 30 }, { timeoutS: 5 })).phase, "PREPARED");
    const committed = await rt.commit(fence(), "c", "ck-000000000001", "ck-000000000001", [first]);
    await rt.resume(fence(), "r", "ck-000000000001");

    const tools2 = new ToyTools();
    const restored = runtime(root, { resources: tools2, instance: "tools" });
    await restored.restore(fence(2), "x", "restore-1", "ck-000000000001", committed.manifest, [], [first]);
    await restored.resume(fence(2), "y", "restore-1");
    const continued = episode("hand", 1);
    // The hook saw the state without the reserved field.
    assert.deepEqual(tools2.sessions.get("hand#1"), { calls: 1 });
    assert.deepEqual(await restored.callTool(continued, "deal", { count: 1 }, undefined, key), { calls: 1 });
    assert.equal(tools2.sessions.get("hand#1")?.calls, 1, "the re-sent call did not run the tool");
    assert.equal((await conflict(restored.callTool(continued, "deal", { count: 3 }, undefined, key))).divergence, "arguments");
    const next = effectKey("hand", { turn: 1, index: 0 });
    assert.deepEqual(await restored.callTool(continued, "deal", { count: 1 }, undefined, next), { calls: 2 });
    const verdictKey = effectKey("hand", { turn: 2, index: 0 });
    const verdict = await restored.verify(continued, { total: 2 }, undefined, verdictKey);
    assert.deepEqual(await restored.verify(continued, { total: 2 }, undefined, verdictKey), verdict);
    // Sealed by the verify, the session still refuses its key with another answer.
    assert.equal((await conflict(restored.verify(continued, { total: 9 }, undefined, verdictKey))).divergence, "arguments");
  });

  it("refuses an export that uses the reserved field", async () => {
    const root = tempRoot();
    const tools = new ToyTools();
    tools.exportSessions = async (episodes) => new Map(episodes.map((e) => [`${e.rolloutId}#${e.attempt}`, { [EFFECTS_FIELD]: {} }]));
    const rt = runtime(root, { resources: tools, instance: "tools" });
    const e = episode("hand");
    await rt.seedSession(e, {});
    await rt.callTool(e, "deal", {}, undefined, effectKey("hand", { turn: 0, index: 0 }));
    await rt.prepare(fence(), "p", "ck-000000000001", { leaseS: 30 }, { timeoutS: 5 });
    const error = await rt.commit(fence(), "c", "ck-000000000001", "ck-000000000001", [e]).then(
      () => null,
      (failure: unknown) => failure,
    );
    assert.ok(error instanceof TurnpointError, String(error));
    assert.equal(error.reason, "INVALID_CHECKPOINT_STATE");
    assert.equal(error.metadata.field, EFFECTS_FIELD);
  });
});
