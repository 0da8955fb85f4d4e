/**
 * The wire against a real server on 127.0.0.1:0: bearer-token auth (section 10.1), rich
 * errors in grpc-status-details-bin (9.1), the ControlSession with cancel (3.2), health,
 * Run's acceptance header (6.1), malformed bytes (10.5), and the compatible flags:
 * commit in the prepare (4.6 item 8), saved nothing and release in the commit (4.8 items
 * 7 and 9), GetStatus's committed checkpoint (4.13), a Run waiting for admission (5.2).
 */
import assert from "node:assert/strict";
import { readdirSync } from "node:fs";
import { after, before, describe, it } from "node:test";

import { create, fromBinary, toBinary } from "@bufbuild/protobuf";
import { durationFromMs } from "@bufbuild/protobuf/wkt";
import { Client, Metadata, credentials } from "@grpc/grpc-js";
import type { ServiceError } from "@grpc/grpc-js";

import { CheckpointControlService, ParticipantServer, RolloutService, TurnpointClient, TurnpointError, episode } from "../src/index.js";
import * as pb from "../src/gen/turnpoint/v1/checkpoint_control_service_pb.js";
import * as health from "../src/gen/grpc/health/v1/health_pb.js";
import * as types from "../src/gen/turnpoint/v1/types_pb.js";
import { TokenCheck, tokenSha256 } from "../src/wire/auth.js";
import { DATA_PLANE_SERVICES } from "../src/wire/server.js";
import { errorFromServiceError } from "../src/wire/status.js";
import { Gate, ToyAgent, runtime, tempRoot } from "./helpers.js";

const TOKEN = "test-token-0123456789";
const DATA_TOKEN = "data-token-9876543210";

function metadata(value?: string): Metadata {
  const m = new Metadata();
  if (value !== undefined) m.set("authorization", value);
  return m;
}

describe("token checks", () => {
  it("names why a call is refused, never the token", () => {
    const check = new TokenCheck(TOKEN);
    const unauthenticated = (cause: string) => ({ reason: "UNAUTHENTICATED" as const, cause });
    assert.deepEqual(check.refusal(metadata()), unauthenticated("missing bearer token"));
    assert.deepEqual(check.refusal(metadata(`Basic ${TOKEN}`)), unauthenticated("authorization is not a bearer token"));
    assert.deepEqual(check.refusal(metadata("Bearer wrong")), unauthenticated("bearer token not accepted"));
    assert.equal(check.refusal(metadata(`bEaReR ${TOKEN}`)), null);
    const error = TokenCheck.error("/x/Y", unauthenticated("bearer token not accepted"));
    assert.equal(error.reason, "UNAUTHENTICATED");
    assert.ok(!JSON.stringify([error.message, error.metadata]).includes(TOKEN));
  });

  it("lets a data-plane token call the data plane only (section 10.2)", () => {
    const check = new TokenCheck(TOKEN, DATA_TOKEN, DATA_PLANE_SERVICES);
    const data = metadata(`Bearer ${DATA_TOKEN}`);
    assert.equal(check.refusal(data, "/turnpoint.v1.RolloutService/Run"), null);
    assert.equal(check.refusal(data, "/turnpoint.v1.PolicyService/Generate"), null);
    assert.deepEqual(check.refusal(data, "/turnpoint.v1.CheckpointControlService/Prepare")?.reason, "PERMISSION_DENIED");
    assert.deepEqual(check.refusal(data, "/turnpoint.v1.SomethingNew/Call")?.reason, "PERMISSION_DENIED");
    assert.equal(check.refusal(metadata(`Bearer ${TOKEN}`), "/turnpoint.v1.CheckpointControlService/Prepare"), null);
    assert.equal(check.refusal(metadata(`Bearer ${TOKEN}`), "/turnpoint.v1.RolloutService/Run"), null);
    assert.throws(() => new TokenCheck(TOKEN, TOKEN), RangeError);
  });

  it("checks the control token against its SHA-256 without holding it (section 10.2 item 8)", () => {
    const check = new TokenCheck({ sha256: tokenSha256(TOKEN) }, DATA_TOKEN, DATA_PLANE_SERVICES);
    const prepare = "/turnpoint.v1.CheckpointControlService/Prepare";
    assert.equal(check.refusal(metadata(`Bearer ${TOKEN}`), prepare), null);
    assert.equal(check.refusal(metadata(`Bearer ${DATA_TOKEN}`), prepare)?.reason, "PERMISSION_DENIED");
    assert.equal(check.refusal(metadata("Bearer wrong"), prepare)?.reason, "UNAUTHENTICATED");
    // The digest itself is no credential.
    assert.equal(check.refusal(metadata(`Bearer ${tokenSha256(TOKEN)}`), prepare)?.reason, "UNAUTHENTICATED");
    assert.throws(() => new TokenCheck({ sha256: tokenSha256(DATA_TOKEN) }, DATA_TOKEN), RangeError);
    assert.throws(() => new TokenCheck({ sha256: "not-hex" }), RangeError);
    const rt = runtime(tempRoot(), { agent: new ToyAgent(1), instance: "agent-digest" });
    assert.throws(() => new ParticipantServer(rt, { token: TOKEN, tokenSha256: tokenSha256(TOKEN) }), RangeError);
  });
});

describe("an agent served with a control and a data-plane token (section 10.2)", () => {
  let server: ParticipantServer;
  let address: string;

  before(async () => {
    server = new ParticipantServer(runtime(tempRoot(), { agent: new ToyAgent(1), instance: "agent-roles" }), { token: TOKEN, dataToken: DATA_TOKEN });
    await server.start();
    address = `127.0.0.1:${server.port}`;
  });
  after(async () => {
    await server.drainAndStop(0);
  });

  it("runs episodes with the data-plane token and refuses it every control call, the fence unchanged", async () => {
    const harness = new TurnpointClient(address, { token: DATA_TOKEN });
    const stream = harness.serverStream(RolloutService, RolloutService.method.run, { requestId: "r", episode: { rolloutId: "roles", attempt: 0 }, task: {} });
    const events = [];
    for await (const message of stream) events.push(message.event.case);
    assert.equal(events.at(-1), "result");
    const pinned = { coordinatorId: "harness", epoch: 2n ** 64n - 1n };
    await assert.rejects(harness.unary(CheckpointControlService, CheckpointControlService.method.prepare, { fence: pinned, requestId: "p", checkpointId: "ckpt-1" }), (error: unknown) => {
      assert.ok(error instanceof TurnpointError);
      assert.equal(error.reason, "PERMISSION_DENIED");
      assert.equal(error.metadata.method, "/turnpoint.v1.CheckpointControlService/Prepare");
      return true;
    });
    const denied = (error: unknown) => error instanceof TurnpointError && error.reason === "PERMISSION_DENIED";
    const methods = CheckpointControlService.method;
    await assert.rejects(harness.unary(CheckpointControlService, methods.resume, { fence: pinned, requestId: "x", checkpointId: "ckpt-1" }), denied);
    await assert.rejects(harness.unary(CheckpointControlService, methods.restore, { fence: pinned, requestId: "x", restoreId: "restore-1" }), denied);
    await assert.rejects(harness.unary(CheckpointControlService, methods.retire, { fence: pinned, requestId: "x" }), denied);
    assert.equal(server.runtime.core.epoch, 0n);
    harness.close();
    const coordinator = new TurnpointClient(address, { token: TOKEN });
    const described = await coordinator.unary(CheckpointControlService, CheckpointControlService.method.describe, { fence: { coordinatorId: "coord", epoch: 1n } });
    assert.equal(described.instanceName, "agent-roles");
    coordinator.close();
  });

  it("refuses a data-plane token equal to the control one, or without one", () => {
    const rt = runtime(tempRoot(), { agent: new ToyAgent(1), instance: "agent-bad" });
    assert.throws(() => new ParticipantServer(rt, { token: TOKEN, dataToken: TOKEN }), RangeError);
    assert.throws(() => new ParticipantServer(rt, { token: null, dataToken: DATA_TOKEN, allowInsecureNoAuth: true }), RangeError);
  });
});

describe("a served agent", () => {
  let server: ParticipantServer;
  let agent: ToyAgent;
  let raw: Client;
  let address: string;

  before(async () => {
    agent = new ToyAgent(2);
    server = new ParticipantServer(runtime(tempRoot(), { agent, instance: "agent-0" }), { token: TOKEN });
    await server.start();
    address = `127.0.0.1:${server.port}`;
    raw = new Client(address, credentials.createInsecure());
  });
  after(async () => {
    raw.close();
    await server.drainAndStop(0);
  });

  function unaryRaw(path: string, bytes: Uint8Array, auth?: string): Promise<Buffer> {
    return new Promise((resolve, reject) => {
      raw.makeUnaryRequest(
        path,
        (b: Buffer) => b,
        (b: Buffer) => b,
        Buffer.from(bytes),
        metadata(auth),
        { deadline: Date.now() + 5000 },
        (error, value) => (error ? reject(error) : resolve(value as Buffer)),
      );
    });
  }

  it("refuses a call without the token with UNAUTHENTICATED and one ErrorInfo", async () => {
    const anonymous = new TurnpointClient(address);
    await assert.rejects(anonymous.unary(CheckpointControlService, CheckpointControlService.method.describe, {}), (error: unknown) => {
      assert.ok(error instanceof TurnpointError);
      assert.equal(error.reason, "UNAUTHENTICATED");
      assert.equal(error.metadata.method, "/turnpoint.v1.CheckpointControlService/Describe");
      assert.equal(error.metadata.cause, "missing bearer token");
      return true;
    });
    anonymous.close();
    const client = new TurnpointClient(address, { token: TOKEN });
    const described = await client.unary(CheckpointControlService, CheckpointControlService.method.describe, {});
    assert.equal(described.instanceName, "agent-0");
    assert.equal(described.protocolVersion, "turnpoint.v1");
    client.close();
  });

  it("serves health without a token, SERVING for the overall name and each service", async () => {
    for (const service of ["", "turnpoint.v1.CheckpointControlService", "turnpoint.v1.RolloutService"]) {
      const bytes = await unaryRaw("/grpc.health.v1.Health/Check", toBinary(health.HealthCheckRequestSchema, create(health.HealthCheckRequestSchema, { service })));
      assert.equal(fromBinary(health.HealthCheckResponseSchema, bytes).status, health.HealthCheckResponse_ServingStatus.SERVING);
    }
  });

  it("answers bytes that are no request INVALID_ARGUMENT with an ErrorInfo, after auth", async () => {
    const path = "/turnpoint.v1.CheckpointControlService/Prepare";
    await assert.rejects(unaryRaw(path, Buffer.from([0x0a, 0x10, 0x61, 0x62]), `Bearer ${TOKEN}`), (error: ServiceError) => {
      assert.equal(errorFromServiceError(error)?.reason, "INVALID_ARGUMENT");
      return true;
    });
    await assert.rejects(unaryRaw(path, Buffer.from([0x0a, 0x10]), undefined), (error: ServiceError) => {
      assert.equal(errorFromServiceError(error)?.reason, "UNAUTHENTICATED");
      return true;
    });
  });

  it("runs an episode over Run with the acceptance header, then acknowledges it", async () => {
    const client = new TurnpointClient(address, { token: TOKEN });
    const e = episode("wire-run");
    const stream = client.serverStream(RolloutService, RolloutService.method.run, { requestId: "r", episode: { rolloutId: e.rolloutId, attempt: 0 }, task: { a: 1 } });
    const messages = [];
    for await (const message of stream) messages.push(message);
    assert.deepEqual(
      messages.map((m) => m.event.case),
      ["boundary", "boundary", "result"],
    );
    const result = messages.at(-1)?.event;
    assert.ok(result?.case === "result" && result.value.receipt !== undefined);
    if (result?.case !== "result" || result.value.receipt === undefined) return;
    const acked = await client.unary(RolloutService, RolloutService.method.acknowledge, { requestId: "a", receipts: [result.value.receipt] });
    assert.equal(acked.acknowledged, 1);
    // The header: a raw call sees turnpoint-accepted: 1 in the initial metadata.
    const headers = await new Promise<Metadata>((resolve, reject) => {
      const call = raw.makeServerStreamRequest(
        "/turnpoint.v1.RolloutService/Run",
        (b: Buffer) => b,
        (b: Buffer) => b,
        Buffer.from(toBinary(RolloutService.method.run.input, create(RolloutService.method.run.input, { requestId: "h", episode: { rolloutId: "hdr" }, task: {} }))),
        metadata(`Bearer ${TOKEN}`),
        {},
      );
      call.on("metadata", (m: Metadata) => resolve(m));
      call.on("error", reject);
      call.on("data", () => undefined);
    });
    assert.deepEqual(headers.get("turnpoint-accepted"), ["1"]);
    // With it, the incarnation that accepted, which a re-attach names (section 6.5 item 5).
    assert.deepEqual(headers.get("turnpoint-incarnation"), [server.runtime.incarnation]);
    client.close();
  });

  it("refuses a re-attach naming another incarnation STALE_ATTEMPT and starts nothing", async () => {
    const client = new TurnpointClient(address, { token: TOKEN });
    const request = { requestId: "gone", episode: { rolloutId: "gone" }, task: {}, boundariesSeen: 1, participantIncarnation: "a-dead-process" };
    await assert.rejects(
      (async () => {
        for await (const _ of client.serverStream(RolloutService, RolloutService.method.run, request)) void _;
      })(),
      (error: unknown) => {
        assert.ok(error instanceof TurnpointError);
        assert.equal(error.reason, "STALE_ATTEMPT");
        assert.equal(error.metadata.request_incarnation, "a-dead-process");
        assert.equal(error.metadata.incarnation, server.runtime.incarnation);
        return true;
      },
    );
    assert.ok(!agent.started.includes("gone#0"), "the run hook was never called");
    // Naming this incarnation is a plain re-attach (nothing held: it starts, as before).
    const own = { ...request, requestId: "own", boundariesSeen: 0, participantIncarnation: server.runtime.incarnation };
    const messages = [];
    for await (const message of client.serverStream(RolloutService, RolloutService.method.run, own)) messages.push(message);
    assert.equal(messages.at(-1)?.event.case, "result");
    client.close();
  });

  it("carries operations on the ControlSession, answers by request id, and honours cancel", async () => {
    const e = episode("held");
    const gate: Gate = agent.gate(e, 1);
    const client = new TurnpointClient(address, { token: TOKEN });
    const running = client.serverStream(RolloutService, RolloutService.method.run, { requestId: "x", episode: { rolloutId: "held" }, task: {} });
    const first = running.next();
    // The episode is now mid-turn, so a prepare waits; cancel it, then ask others.
    const call = raw.makeBidiStreamRequest(
      "/turnpoint.v1.CheckpointControlService/ControlSession",
      (b: Buffer) => b,
      (b: Buffer) => b,
      metadata(`Bearer ${TOKEN}`),
    );
    const answers: pb.ControlSessionResponse[] = [];
    call.on("data", (b: Buffer) => answers.push(fromBinary(pb.ControlSessionResponseSchema, b)));
    const ended = new Promise<void>((resolve) => call.on("end", () => resolve()));
    const send = (message: pb.ControlSessionRequest): void => void call.write(Buffer.from(toBinary(pb.ControlSessionRequestSchema, message)));
    const fence = { coordinatorId: "c", epoch: 1n };
    // The episode is mid-turn once GetStatus counts it RUNNING (bounded poll).
    for (let i = 0; ; i++) {
      const status = await client.unary(CheckpointControlService, CheckpointControlService.method.getStatus, {});
      if (status.readiness?.counts.some((c) => c.state === 1 /* RUNNING */)) break;
      assert.ok(i < 1000, "the episode never started");
      await new Promise((resolve) => setTimeout(resolve, 5));
    }
    send(create(pb.ControlSessionRequestSchema, { requestId: "p1", timeout: durationFromMs(10_000), operation: { case: "prepare", value: { fence, requestId: "p1", checkpointId: "ck-1" } } }));
    send(create(pb.ControlSessionRequestSchema, { requestId: "p1", operation: { case: "cancel", value: {} } }));
    send(create(pb.ControlSessionRequestSchema, { requestId: "s1", operation: { case: "getStatus", value: {} } }));
    send(create(pb.ControlSessionRequestSchema, { requestId: "bad", operation: { case: "renew", value: { fence, requestId: "other", checkpointId: "ck-1" } } }));
    send(create(pb.ControlSessionRequestSchema, { requestId: "r1", operation: { case: "resume", value: { fence, requestId: "r1", checkpointId: "ck-1" } } }));
    send(create(pb.ControlSessionRequestSchema, { requestId: "empty" }));
    call.end();
    await ended;
    const byId = new Map(answers.map((a) => [a.requestId, a.result]));
    assert.equal(byId.has("p1"), false, "a cancelled operation gets no answer");
    assert.equal(byId.get("s1")?.case, "getStatus");
    const bad = byId.get("bad");
    assert.ok(bad?.case === "error" && bad.value.code === 3);
    assert.equal(byId.get("r1")?.case, "resume");
    const empty = byId.get("empty");
    assert.ok(empty?.case === "error" && empty.value.reason === 9);
    gate.open();
    await first;
    for await (const _ of running) void _;
    client.close();
  });
});

describe("the compatible flags over the wire", () => {
  let server: ParticipantServer;
  let client: TurnpointClient;
  // Made here, not in `before`: their `after` clean-ups belong to the suite.
  const root = tempRoot();
  const rt = runtime(root, { agent: new ToyAgent(1), instance: "agent-1" });
  const control = CheckpointControlService;
  const fence = { coordinatorId: "coord-w", epoch: 1n };

  before(async () => {
    server = new ParticipantServer(rt, { token: TOKEN });
    await server.start();
    client = new TurnpointClient(`127.0.0.1:${server.port}`, { token: TOKEN });
  });
  after(async () => {
    client.close();
    await server.drainAndStop(0);
  });

  it("commits an idle participant in the prepare; a Commit replays saved_nothing; GetStatus names it", async () => {
    const checkpointId = "ck-000000000001";
    const prepared = await client.unary(control, control.method.prepare, { fence, requestId: "p1", checkpointId, emptyCommitSnapshot: checkpointId });
    assert.equal(prepared.committedEmpty, true);
    assert.equal(prepared.phase, types.Phase.COMMITTED);
    const committed = await client.unary(control, control.method.commit, { fence, requestId: "c1", checkpointId, snapshot: checkpointId, acceptSavedNothing: true });
    assert.equal(committed.savedNothing, true);
    assert.equal(committed.manifest, undefined);
    assert.deepEqual([committed.artifacts.length, committed.exported.length, committed.released], [0, 0, false]);
    const status = await client.unary(control, control.method.getStatus, {});
    assert.equal(status.committedCheckpointId, checkpointId);
    assert.equal(status.phase, types.Phase.COMMITTED);
    await client.unary(control, control.method.resume, { fence, requestId: "r1", checkpointId });
    assert.deepEqual(readdirSync(root), [], "saved nothing: no directory was made");
  });

  it("a Run with wait_for_admission is admitted once a releasing commit ends the checkpoint", async () => {
    const checkpointId = "ck-000000000002";
    const prepared = await client.unary(control, control.method.prepare, { fence, requestId: "p2", checkpointId });
    assert.equal(prepared.phase, types.Phase.PREPARED);
    const refused = client.serverStream(RolloutService, RolloutService.method.run, { requestId: "no-wait", episode: { rolloutId: "eager" }, task: {} });
    await assert.rejects(
      async () => {
        for await (const _ of refused) void _;
      },
      (error: unknown) => error instanceof TurnpointError && error.reason === "ADMISSION_CLOSED",
    );
    const run = client.serverStream(RolloutService, RolloutService.method.run, { requestId: "waits", episode: { rolloutId: "patient" }, task: {}, waitForAdmission: true });
    const first = run.next();
    let answered = false;
    void first.then(
      () => (answered = true),
      () => (answered = true),
    );
    await new Promise((resolve) => setTimeout(resolve, 100));
    assert.equal(answered, false, "the Run waits instead of being refused");
    const status = await client.unary(control, control.method.getStatus, {});
    assert.equal(status.readiness?.blockerCount, 0);
    assert.deepEqual(status.readiness?.counts, [], "a waiting Run is in no cut");
    const committed = await client.unary(control, control.method.commit, {
      fence,
      requestId: "c2",
      checkpointId,
      snapshot: checkpointId,
      acceptSavedNothing: true,
      release: true,
    });
    assert.equal(committed.released, true);
    assert.equal(committed.savedNothing, true);
    const events = [(await first).value];
    for await (const message of run) events.push(message);
    assert.deepEqual(
      events.map((m) => m?.event.case),
      ["boundary", "result"],
    );
    const after = await client.unary(control, control.method.getStatus, {});
    assert.equal(after.phase, types.Phase.IDLE);
    assert.equal(after.committedCheckpointId, checkpointId);
    const result = events.at(-1)?.event;
    if (result?.case === "result" && result.value.receipt !== undefined) {
      await client.unary(RolloutService, RolloutService.method.acknowledge, { requestId: "a2", receipts: [result.value.receipt] });
    }
  });
});
