/**
 * The snapshot store (docs/spec.md sections 8.2 to 8.5): the same bytes as the Python
 * reference, round trips, and every corruption a reader must catch before using a record.
 */
import assert from "node:assert/strict";
import { cpSync, mkdirSync, readFileSync, readdirSync, symlinkSync, writeFileSync } from "node:fs";
import path from "node:path";
import { describe, it } from "node:test";
import { fileURLToPath } from "node:url";

import { CorruptSnapshotError, SnapshotConflictError, SnapshotStore, TurnpointError, WriteCancelled, WriteTicket, episode } from "../src/index.js";
import type { Record } from "../src/index.js";
import { encodeCompact, parseStrict } from "../src/json.js";
import { tempRoot } from "./helpers.js";

// dist/test/ -> ts/test/fixtures (the fixture is not copied by tsc).
const FIXTURE = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../../test/fixtures/python-store");
const SNAPSHOT = "ck-000000000007";

/** The records the Python store wrote into the fixture (see test/fixtures/README.md). */
const PYTHON_RECORDS: Record[] = [
  {
    episode: episode("r-2", 1),
    key: "run",
    payload: {
      task: { prompt: "caf\u00e9 \u2603 \u{1F600}", n: 3 },
      boundary_index: 2,
      turn_index: 1,
      state: { history: ['a"b\\c', "tab\tnl\nDEL\x7f", null, true, false], score: 0.5, small: 0.1, neg: -7, nested: [[1, [2, { k: "v" }]]], b: 1, a: 2 },
    },
  },
  { episode: episode("r-10", 0), key: "session", payload: { calls: 2, solved: false, ctrl: "\x01\x1f", z: {}, y: [] } },
];

async function corruption(promise: Promise<unknown>): Promise<string> {
  try {
    await promise;
  } catch (error) {
    if (error instanceof CorruptSnapshotError) return error.kind;
    throw error;
  }
  return "none";
}

function copyFixture(): string {
  const root = tempRoot();
  cpSync(FIXTURE, root, { recursive: true });
  return root;
}

describe("byte compatibility with the Python store", () => {
  it("writes the very bytes the Python store wrote for the same records", async () => {
    const root = tempRoot();
    const entry = await new SnapshotStore(root).write(SNAPSHOT, "tools", SNAPSHOT, PYTHON_RECORDS);
    const dir = path.join(FIXTURE, SNAPSHOT, "tools");
    for (const name of readdirSync(dir)) {
      assert.deepEqual(readFileSync(path.join(root, SNAPSHOT, "tools", name)), readFileSync(path.join(dir, name)), name);
    }
    assert.equal(entry.manifest.sizeBytes, readFileSync(path.join(dir, "MANIFEST.json")).length);
    assert.deepEqual(entry.episodes, [episode("r-10"), episode("r-2", 1)]);
  });

  it("reads what the Python store wrote, verified, with key order kept", async () => {
    const loaded = await new SnapshotStore(FIXTURE).read(SNAPSHOT, "tools");
    assert.deepEqual(loaded.records, PYTHON_RECORDS);
    assert.deepEqual(Object.keys(loaded.records[0]?.payload.state as object), ["history", "score", "small", "neg", "nested", "b", "a"]);
  });

  it("encodes JSON as Python's json.dumps(ensure_ascii=True) does", () => {
    assert.equal(encodeCompact({ s: "\u00e9\u{1F600}\x7f\ud800", n: [0.5, -3, 1e21, 0.1] }), '{"s":"\\u00e9\\ud83d\\ude00\\u007f\\ud800","n":[0.5,-3,1e+21,0.1]}');
  });
});

describe("round trips and conflicts", () => {
  it("the same records give the same bytes; a retry returns the published entry", async () => {
    const store = new SnapshotStore(tempRoot());
    const first = await store.write("ck-1", "p", "ck-1", PYTHON_RECORDS);
    const again = await store.write("ck-1", "p", "ck-1", PYTHON_RECORDS);
    assert.deepEqual(again, first);
    const loaded = await store.read("ck-1", "p", { manifest: first.manifest, artifacts: first.artifacts }, (e) => e.rolloutId === "r-10");
    assert.equal(loaded.records.length, 1);
  });

  it("an empty write still publishes a manifest and an empty records file", async () => {
    const root = tempRoot();
    const entry = await new SnapshotStore(root).write("ck-1", "p", "ck-1", []);
    assert.equal(entry.artifacts[0]?.sizeBytes, 0);
    assert.deepEqual(readdirSync(path.join(root, "ck-1", "p")).sort(), ["MANIFEST.json", `records-${entry.artifacts[0]?.sha256}.jsonl`]);
  });

  it("a published directory never changes: another checkpoint or content is a conflict", async () => {
    const store = new SnapshotStore(tempRoot());
    await store.write("snap", "p", "ck-1", []);
    await assert.rejects(store.write("snap", "p", "ck-2", []), SnapshotConflictError);
    await assert.rejects(store.write("snap", "p", "ck-1", PYTHON_RECORDS), SnapshotConflictError);
  });

  it("a cancelled write leaves nothing on disk", async () => {
    const root = tempRoot();
    const ticket = new WriteTicket();
    const store = new SnapshotStore(root, async (point) => {
      if (point === "records_write") ticket.cancel();
    });
    await assert.rejects(store.write("ck-1", "p", "ck-1", PYTHON_RECORDS, ticket), WriteCancelled);
    assert.deepEqual(readdirSync(path.join(root, "ck-1", "p")), []);
  });

  it("a disk error is STORAGE_UNAVAILABLE with the errno at the runtime's edge", async () => {
    const root = tempRoot();
    const store = new SnapshotStore(root, (point) => {
      if (point === "manifest_write") throw Object.assign(new Error("no space"), { code: "ENOSPC" });
    });
    await assert.rejects(store.write("ck-1", "p", "ck-1", []), /no space/);
    assert.deepEqual(readdirSync(path.join(root, "ck-1", "p")), []);
    const { storageError } = await import("../src/store.js");
    const mapped = storageError(Object.assign(new Error("x"), { code: "ENOSPC" }), "commit");
    assert.equal(mapped.reason, "STORAGE_UNAVAILABLE");
    assert.equal(mapped.metadata.errno, "28");
  });

  it("a payload that is not plain JSON fails before a byte is written, naming where", async () => {
    const root = tempRoot();
    const bad: Record = { episode: episode("r"), key: "run", payload: { a: [1, { b: Number.NaN }] } };
    await assert.rejects(new SnapshotStore(root).write("ck-1", "p", "ck-1", [bad]), (error: TurnpointError) => {
      assert.equal(error.reason, "INVALID_CHECKPOINT_STATE");
      assert.equal(error.metadata.location, 'payload["a"][1]["b"]');
      return true;
    });
  });
});

describe("corruption is caught before any record is used", () => {
  const records = (root: string): string => {
    const dir = path.join(root, SNAPSHOT, "tools");
    return path.join(dir, readdirSync(dir).find((n) => n.startsWith("records-")) as string);
  };

  it("digest, size and record count", async () => {
    let root = copyFixture();
    const file = records(root);
    const bytes = readFileSync(file);
    bytes[10] = bytes[10] === 0x61 ? 0x62 : 0x61;
    writeFileSync(file, bytes);
    assert.equal(await corruption(new SnapshotStore(root).read(SNAPSHOT, "tools")), "digest_mismatch");
    root = copyFixture();
    writeFileSync(records(root), Buffer.concat([readFileSync(records(root)), Buffer.from("x")]));
    assert.equal(await corruption(new SnapshotStore(root).read(SNAPSHOT, "tools")), "size_mismatch");
    root = copyFixture();
    const manifest = path.join(root, SNAPSHOT, "tools", "MANIFEST.json");
    writeFileSync(manifest, readFileSync(manifest, "ascii").replace('"record_count": 2', '"record_count": 3'));
    assert.equal(await corruption(new SnapshotStore(root).read(SNAPSHOT, "tools")), "record_count_mismatch");
  });

  it("a manifest that is not strict (duplicate keys, unknown fields) or missing", async () => {
    let root = copyFixture();
    let manifest = path.join(root, SNAPSHOT, "tools", "MANIFEST.json");
    writeFileSync(manifest, readFileSync(manifest, "ascii").replace('"schema_version": 1,', '"schema_version": 1, "schema_version": 1,'));
    assert.equal(await corruption(new SnapshotStore(root).read(SNAPSHOT, "tools")), "manifest_invalid");
    root = copyFixture();
    manifest = path.join(root, SNAPSHOT, "tools", "MANIFEST.json");
    writeFileSync(manifest, readFileSync(manifest, "ascii").replace('"schema_version": 1,', '"schema_version": 1, "extra": 0,'));
    assert.equal(await corruption(new SnapshotStore(root).read(SNAPSHOT, "tools")), "manifest_invalid");
    assert.equal(await corruption(new SnapshotStore(root).read(SNAPSHOT, "nobody")), "missing");
  });

  it("a manifest other than the one expected, and a symlink planted under the root", async () => {
    const root = copyFixture();
    const store = new SnapshotStore(root);
    const entry = (await store.read(SNAPSHOT, "tools")).entry;
    assert.equal(await corruption(store.read(SNAPSHOT, "tools", { manifest: { ...entry.manifest, sizeBytes: 1 } })), "unexpected_content");
    mkdirSync(path.join(root, "elsewhere"));
    symlinkSync(path.join(root, SNAPSHOT), path.join(root, "ck-000000000008"));
    assert.equal(await corruption(store.read("ck-000000000008", "tools")), "path_escape");
  });
});

describe("strict JSON", () => {
  it("refuses duplicate keys, NaN, trailing data and deep nesting", () => {
    for (const text of ['{"a":1,"a":2}', "NaN", '{"a":Infinity}', "[1] x", "[".repeat(200) + "]".repeat(200)]) {
      assert.throws(() => parseStrict(text), text);
    }
    assert.deepEqual(parseStrict('{"__proto__":{"x":1}}'), JSON.parse('{"__proto__":{"x":1}}'));
  });
});
