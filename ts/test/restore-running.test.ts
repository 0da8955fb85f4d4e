/**
 * RestoreRunning (docs/spec.md section 4.16) over a real server on 127.0.0.1:0, through
 * both control doors (unary and the ControlSession), as the Python SDK's
 * tests/integration/test_restore_running_wire.py does: it retires what it replaces and
 * installs the saved episodes as N+1 beside live work, replays a repeat, refuses a stale
 * attempt and an older coordinator, and is listed as a capability only where it is
 * served. Then, without the wire: a resources server's sessions, and a snapshot that
 * fails its check before anything is retired.
 */
import assert from "node:assert/strict";
import { after, describe, it } from "node:test";

import { create, fromBinary, toBinary } from "@bufbuild/protobuf";
import type { MessageInitShape } from "@bufbuild/protobuf";
import { durationFromMs } from "@bufbuild/protobuf/wkt";
import { Client, Metadata, credentials } from "@grpc/grpc-js";

import { CheckpointControlService, ParticipantServer, RolloutService, TurnpointClient, TurnpointError, episode } from "../src/index.js";
import type { EpisodeId, ParticipantRuntime } from "../src/index.js";
import * as pb from "../src/gen/turnpoint/v1/checkpoint_control_service_pb.js";
import * as ro from "../src/gen/turnpoint/v1/rollout_service_pb.js";
import * as types from "../src/gen/turnpoint/v1/types_pb.js";
import { Gate, ToyAgent, ToyTools, fence as fenceOf, runtime, tempRoot, until } from "./helpers.js";

const TOKEN = "test-token-0123456789";
const control = CheckpointControlService;
const FENCE = { coordinatorId: "coord", epoch: 1n };
const A = episode("rollout-a");
const B = episode("rollout-b");
const C = episode("rollout-c");
const next = (e: EpisodeId): EpisodeId => episode(e.rolloutId, e.attempt + 1);
const wireEpisode = (e: EpisodeId) => ({ rolloutId: e.rolloutId, attempt: e.attempt });
const plain = (items: readonly { rolloutId: string; attempt: number }[]) => items.map((e) => `${e.rolloutId}#${e.attempt}`);

async function refusal(promise: Promise<unknown>): Promise<TurnpointError> {
  try {
    await promise;
  } catch (error) {
    if (error instanceof TurnpointError) return error;
    throw error;
  }
  throw new Error("expected a refusal");
}

type Door = "unary" | "session";
type RestoreRunningInit = MessageInitShape<typeof pb.RestoreRunningRequestSchema>;
/** What a test varies in a RestoreRunning request. */
interface Varied {
  readonly requestId?: string;
  readonly fence?: { coordinatorId: string; epoch: bigint };
  readonly scope?: EpisodeId[];
  readonly retireUnscoped?: boolean;
}

/** One served agent and a coordinator's view of it, RestoreRunning through `door`. */
class Served {
  readonly agent = new ToyAgent(3);
  readonly rt: ParticipantRuntime;
  private server!: ParticipantServer;
  private client!: TurnpointClient;
  private raw!: Client;
  private requests = 0;
  /** The boundary index each Run started here sealed first. */
  readonly firstBoundary = new Map<string, number>();

  constructor(
    readonly door: Door,
    restoreRunning = true,
  ) {
    this.rt = runtime(tempRoot(), { agent: this.agent, instance: "agent-0", config: { restoreRunning } });
  }

  async start(): Promise<this> {
    this.server = new ParticipantServer(this.rt, { token: TOKEN });
    await this.server.start();
    const address = `127.0.0.1:${this.server.port}`;
    this.client = new TurnpointClient(address, { token: TOKEN });
    this.raw = new Client(address, credentials.createInsecure());
    return this;
  }

  async stop(): Promise<void> {
    this.client.close();
    this.raw.close();
    await this.server.drainAndStop(0);
  }

  rid(): string {
    return `rid-${++this.requests}`;
  }

  describe(): Promise<pb.DescribeResponse> {
    return this.client.unary(control, control.method.describe, {});
  }

  /** Start a Run over the wire; resolves once it is accepted and sealed boundary 1. */
  async run(e: EpisodeId): Promise<AsyncGenerator<ro.RunResponse>> {
    const stream = this.client.serverStream(RolloutService, RolloutService.method.run, { requestId: this.rid(), episode: wireEpisode(e), task: {} });
    const first = (await stream.next()).value?.event;
    assert.equal(first?.case, "boundary");
    if (first?.case === "boundary") this.firstBoundary.set(`${e.rolloutId}#${e.attempt}`, first.value.boundaryIndex);
    return stream;
  }

  /** The Run's remaining events: the boundary indexes it sealed and how it ended. */
  async rest(stream: AsyncGenerator<ro.RunResponse>): Promise<{ boundaries: number[]; end: string }> {
    const boundaries: number[] = [];
    try {
      for await (const message of stream) {
        if (message.event.case === "boundary") boundaries.push(message.event.value.boundaryIndex);
        if (message.event.case === "result") return { boundaries, end: "result" };
      }
      return { boundaries, end: "closed" };
    } catch (error) {
      if (error instanceof TurnpointError) return { boundaries, end: error.reason };
      throw error;
    }
  }

  /** Prepare while `parking` reach their next boundary, commit them as `snapshot`, resume. */
  async snapshot(snapshot: string, parking: Gate[], scope: EpisodeId[]): Promise<pb.CommitResponse> {
    const prepared = this.client.unary(control, control.method.prepare, { fence: FENCE, requestId: this.rid(), checkpointId: snapshot, lease: durationFromMs(30_000) });
    await until(() => this.rt.core.activeCheckpointId === snapshot, "the prepare closed admission");
    for (const gate of parking) gate.open();
    assert.equal((await prepared).phase, types.Phase.PREPARED);
    const committed = await this.client.unary(control, control.method.commit, { fence: FENCE, requestId: this.rid(), checkpointId: snapshot, snapshot, scope: scope.map(wireEpisode) });
    await this.resume(snapshot);
    return committed;
  }

  async resume(checkpointId: string, fence = FENCE): Promise<void> {
    const resumed = await this.client.unary(control, control.method.resume, { fence, requestId: this.rid(), checkpointId });
    assert.equal(resumed.endedActive, true);
  }

  restoreRunning(
    restoreId: string,
    committed: pb.CommitResponse,
    scope: EpisodeId[],
    varied: Varied = {},
  ): Promise<pb.RestoreRunningResponse> {
    const request: RestoreRunningInit = {
      fence: varied.fence ?? FENCE,
      requestId: varied.requestId ?? this.rid(),
      restoreId,
      snapshot: "ck-000000000001",
      entry: { artifacts: committed.artifacts, ...(committed.manifest !== undefined ? { manifest: committed.manifest } : {}) },
      scope: (varied.scope ?? scope).map(wireEpisode),
      lease: durationFromMs(30_000),
      retireUnscoped: varied.retireUnscoped ?? false,
    };
    if (this.door === "unary") return this.client.unary(control, control.method.restoreRunning, request);
    return this.overSession(request);
  }

  /** One RestoreRunning on its own ControlSession; a ControlError becomes a TurnpointError. */
  private overSession(request: RestoreRunningInit): Promise<pb.RestoreRunningResponse> {
    const metadata = new Metadata();
    metadata.set("authorization", `Bearer ${TOKEN}`);
    const call = this.raw.makeBidiStreamRequest(
      "/turnpoint.v1.CheckpointControlService/ControlSession",
      (b: Buffer) => b,
      (b: Buffer) => b,
      metadata,
      { deadline: Date.now() + 10_000 },
    );
    const requestId = request.requestId as string;
    const answer = new Promise<pb.RestoreRunningResponse>((resolve, reject) => {
      call.on("data", (bytes: Buffer) => {
        const result = fromBinary(pb.ControlSessionResponseSchema, bytes).result;
        if (result.case === "restoreRunning") resolve(result.value);
        else if (result.case === "error") {
          const e = result.value;
          reject(new TurnpointError(types.ErrorReason[e.reason] as TurnpointError["reason"], e.message, { ...e.metadata }));
        } else reject(new Error(`unexpected answer ${String(result.case)}`));
      });
      call.on("error", reject);
      call.on("end", () => reject(new Error("the session ended without an answer")));
    });
    const message = create(pb.ControlSessionRequestSchema, {
      requestId,
      timeout: durationFromMs(10_000),
      operation: { case: "restoreRunning", value: create(pb.RestoreRunningRequestSchema, request) },
    });
    call.write(Buffer.from(toBinary(pb.ControlSessionRequestSchema, message)));
    call.end();
    return answer;
  }
}

for (const door of ["unary", "session"] as const) {
  describe(`RestoreRunning through the ${door} door`, () => {
    const opened: Served[] = [];
    const serve = async (restoreRunning = true): Promise<Served> => {
      const served = await new Served(door, restoreRunning).start();
      opened.push(served);
      return served;
    };
    after(async () => {
      for (const served of opened) await served.stop();
    });

    /** A and B each parked at boundary 2 in snapshot ck-1, then held mid-turn 3. */
    async function twoSnapshotted(wire: Served): Promise<[pb.CommitResponse, AsyncGenerator<ro.RunResponse>, AsyncGenerator<ro.RunResponse>, Gate, Gate]> {
      const gates = [A, B].map((e) => wire.agent.gate(e, 2));
      const holds = [A, B].map((e) => wire.agent.gate(e, 3)) as [Gate, Gate];
      const runA = await wire.run(A);
      const runB = await wire.run(B);
      const committed = await wire.snapshot("ck-000000000001", gates, [A, B]);
      return [committed, runA, runB, ...holds];
    }

    it("lists the capability only where it is served", async () => {
      assert.deepEqual((await (await serve()).describe()).capabilities, [pb.Capability.RESTORE_RUNNING]);
      const without = await serve(false);
      assert.deepEqual((await without.describe()).capabilities, []);
      const error = await refusal(without.restoreRunning("restore-1", create(pb.CommitResponseSchema), []));
      assert.equal(error.reason, "INVALID_ARGUMENT");
      assert.equal(error.metadata.field, "restore_running");
    });

    it("installs N+1 into a running participant whose other work goes on", async () => {
      const wire = await serve();
      const [committed, runA, runB, holdA, holdB] = await twoSnapshotted(wire);
      const holdC = wire.agent.gate(C, 2);
      const runC = await wire.run(C); // started after the snapshot, never saved
      const healed = await wire.restoreRunning("restore-1", committed, [A]);
      assert.deepEqual(plain(healed.installed), plain([next(A)]));
      assert.deepEqual(plain(healed.retired), plain([A]));
      assert.equal(healed.phase, types.Phase.RESTORED);
      assert.equal((await wire.rest(runA)).end, "STALE_ATTEMPT");
      const state = (e: EpisodeId) => wire.rt.core.entry({ episode: e, slot: "run" })?.state;
      assert.deepEqual([state(next(A)), state(B), state(C)], ["RESTORED", "RUNNING", "RUNNING"]);
      await wire.resume("restore-1");
      // The replacement continues from the saved turn; the live episodes finish as if
      // nothing had happened.
      const runNext = await wire.run(next(A));
      assert.deepEqual(await wire.rest(runNext), { boundaries: [], end: "result" });
      assert.equal(wire.firstBoundary.get("rollout-a#1"), 3);
      for (const gate of [holdA, holdB, holdC]) gate.open();
      assert.deepEqual(await wire.rest(runB), { boundaries: [2, 3], end: "result" });
      assert.deepEqual(await wire.rest(runC), { boundaries: [2, 3], end: "result" });
      assert.deepEqual(wire.agent.started, ["rollout-a#0", "rollout-b#0", "rollout-c#0", "rollout-a#1"]);
    });

    it("replays a repeat, refuses other arguments, and a stale attempt once N+1 exists", async () => {
      const wire = await serve();
      const [committed] = await twoSnapshotted(wire);
      const requestId = "heal-1";
      const first = await wire.restoreRunning("restore-1", committed, [A], { requestId });
      for (const again of [await wire.restoreRunning("restore-1", committed, [A], { requestId }), await wire.restoreRunning("restore-1", committed, [A])]) {
        assert.deepEqual([plain(again.installed), plain(again.retired)], [plain(first.installed), plain(first.retired)]);
      }
      for (const other of [{ scope: [] }, { retireUnscoped: true }]) {
        assert.equal((await refusal(wire.restoreRunning("restore-1", committed, [A], other))).reason, "CHECKPOINT_CONFLICT");
      }
      await wire.resume("restore-1");
      // Attempt N is dead here now: on the data plane, and as a scope to continue.
      assert.equal((await refusal(wire.run(A))).reason, "STALE_ATTEMPT");
      const stale = await refusal(wire.restoreRunning("restore-2", committed, [A]));
      assert.equal(stale.reason, "STALE_ATTEMPT");
      assert.equal(stale.metadata.episode, "rollout-a#0");
      assert.equal((await refusal(wire.restoreRunning("restore-1", committed, [A]))).reason, "STALE_CHECKPOINT");
      assert.equal(wire.rt.core.entry({ episode: next(A), slot: "run" })?.state, "RESTORED");
      assert.equal(wire.rt.core.admissionOpen, true);
    });

    it("fences an older coordinator's late call, which changes nothing", async () => {
      const wire = await serve();
      const [committed] = await twoSnapshotted(wire);
      const newer = { coordinatorId: "coord", epoch: 2n };
      await wire.restoreRunning("restore-2", committed, [A, B], { fence: newer, retireUnscoped: true });
      await wire.resume("restore-2", newer);
      const error = await refusal(wire.restoreRunning("restore-3", committed, [next(A)]));
      assert.equal(error.reason, "FENCED");
      assert.equal(error.metadata.epoch, "2");
      assert.equal(wire.rt.core.entry({ episode: next(A), slot: "run" })?.state, "RESTORED");
      assert.equal(wire.rt.core.admissionOpen, true);
    });

    it("retire_unscoped frees the fenced incarnation's work without refusing it", async () => {
      const wire = await serve();
      const [committed, , runB, , holdB] = await twoSnapshotted(wire);
      wire.agent.gate(C, 2);
      const runC = await wire.run(C);
      const healed = await wire.restoreRunning("restore-1", committed, [A], { retireUnscoped: true });
      assert.deepEqual(plain(healed.retired), plain([A, B, C]));
      assert.equal((await wire.rest(runB)).end, "STALE_ATTEMPT");
      assert.equal((await wire.rest(runC)).end, "STALE_ATTEMPT");
      assert.equal(wire.rt.core.entry({ episode: C, slot: "run" }), undefined);
      assert.equal(wire.rt.core.refusalMark(C.rolloutId), undefined);
      await wire.resume("restore-1");
      holdB.open();
      // The new incarnation may run those rollouts again under the same attempts.
      const again = await wire.run(C);
      wire.agent.gates.get("rollout-c#0/2")?.open();
      assert.equal((await wire.rest(again)).end, "result");
      assert.equal((await wire.rest(await wire.run(B))).end, "result");
    });
  });
}

describe("RestoreRunning without the wire", () => {
  it("restores a resources server's session as N+1 beside live sessions; the old attempt is refused", async () => {
    const tools = new ToyTools();
    const rt = runtime(tempRoot(), { resources: tools, instance: "tools" });
    const s = episode("s");
    const t = episode("t");
    for (const e of [s, t]) await rt.seedSession(e, {});
    await rt.callTool(s, "count", {});
    await rt.prepare(fenceOf(), "p", "ck-000000000001");
    const committed = await rt.commit(fenceOf(), "c", "ck-000000000001", "ck-000000000001", [s, t]);
    await rt.resume(fenceOf(), "r", "ck-000000000001");
    await rt.callTool(s, "count", {}); // past the snapshot: redone by the restored attempt
    await rt.callTool(t, "count", {});
    const healed = await rt.restoreRunning(fenceOf(), "h", "restore-1", "ck-000000000001", committed.manifest, committed.artifacts, [s]);
    assert.deepEqual([healed.installed, healed.retired], [[next(s)], [s]]);
    assert.equal(tools.sessions.has("s#0"), false, "the replaced session was freed");
    await rt.resume(fenceOf(), "r2", "restore-1");
    assert.deepEqual(await rt.callTool(next(s), "count", {}), { calls: 2 });
    assert.deepEqual(await rt.callTool(t, "count", {}), { calls: 2 }); // untouched
    assert.equal((await refusal(rt.callTool(s, "count", {}))).reason, "STALE_ATTEMPT");
  });

  it("checks every record before it retires anything: a corrupt snapshot changes nothing", async () => {
    const agent = new ToyAgent(3);
    const rt = runtime(tempRoot(), { agent, instance: "agent-0" });
    const park = agent.gate(A, 2);
    const hold = agent.gate(A, 3);
    const follower = rt.acceptRun(A, {});
    await follower.next();
    const prepared = rt.prepare(fenceOf(), "p", "ck-000000000001", { leaseS: 30 });
    park.open();
    assert.equal((await prepared).phase, "PREPARED");
    const committed = await rt.commit(fenceOf(), "c", "ck-000000000001", "ck-000000000001", [A]);
    await rt.resume(fenceOf(), "r", "ck-000000000001");
    assert.ok(committed.manifest !== null);
    const forged = { ...committed.manifest, sha256: "0".repeat(64) };
    const error = await refusal(rt.restoreRunning(fenceOf(), "h", "restore-1", "ck-000000000001", forged, committed.artifacts, [A]));
    assert.equal(error.reason, "INVALID_CHECKPOINT_STATE");
    assert.equal(rt.core.phase, "IDLE");
    assert.equal(rt.core.refusalMark(A.rolloutId), undefined);
    assert.equal(rt.core.entry({ episode: A, slot: "run" })?.state, "RUNNING");
    hold.open();
    for (;;) {
      const event = await follower.next();
      if (event === null || event.type === "result") break;
    }
  });

  it("a replaced session that cannot be freed is RETIRE_INCOMPLETE: nothing installed, admission open, the retired stays retired", async () => {
    class StuckTools extends ToyTools {
      stuck = true;
      override async retireSession(e: EpisodeId): Promise<void> {
        if (this.stuck) throw new Error("the sandbox did not answer");
        await super.retireSession(e);
      }
    }
    const tools = new StuckTools();
    const rt = runtime(tempRoot(), { resources: tools, instance: "tools" });
    const s = episode("s");
    await rt.seedSession(s, {});
    await rt.prepare(fenceOf(), "p", "ck-000000000001");
    const committed = await rt.commit(fenceOf(), "c", "ck-000000000001", "ck-000000000001", [s]);
    await rt.resume(fenceOf(), "r", "ck-000000000001");
    const error = await refusal(rt.restoreRunning(fenceOf(), "h", "restore-1", "ck-000000000001", committed.manifest, committed.artifacts, [s]));
    assert.equal(error.reason, "RETIRE_INCOMPLETE");
    assert.equal(rt.core.phase, "IDLE");
    assert.equal(rt.core.entry({ episode: next(s), slot: "session" }), undefined);
    assert.equal(rt.core.refusalMark(s.rolloutId), 0);
    assert.equal(tools.sessions.has("s#1"), false);
    // A Retire finishes the job once the server answers; the coordinator reruns the rollout above it.
    tools.stuck = false;
    assert.deepEqual((await rt.retire(fenceOf(), "t", [s])).stopped, [s]);
    assert.equal(rt.core.entry({ episode: s, slot: "session" }), undefined);
  });
});
