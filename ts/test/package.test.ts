/**
 * The package another project depends on: `npm pack` ships the SDK's compiled sources
 * and declarations only (no tests, fixtures, examples or source maps), and the export
 * map's one entry point is the curated face, `serve()` on it, the core's machinery not.
 */
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { dirname, join } from "node:path";
import { describe, it } from "node:test";
import { fileURLToPath } from "node:url";

const PACKAGE_DIR = join(dirname(fileURLToPath(import.meta.url)), "..", "..");

describe("the package", () => {
  it("packs dist/src only", () => {
    const output = execFileSync("npm", ["pack", "--dry-run", "--json", "--ignore-scripts"], { cwd: PACKAGE_DIR, encoding: "utf8", timeout: 60_000 });
    const [packed] = JSON.parse(output) as Array<{ files: Array<{ path: string }> }>;
    const paths = (packed?.files ?? []).map((file) => file.path);
    assert.ok(paths.includes("dist/src/index.js") && paths.includes("dist/src/index.d.ts"), paths.join(", "));
    const stray = paths.filter((path) => !(path === "package.json" || (path.startsWith("dist/src/") && /\.(js|d\.ts)$/.test(path))));
    assert.deepEqual(stray, []);
  });

  it("exports the curated face by its name", async () => {
    const face = (await import("@turnpoint/participant")) as Record<string, unknown>;
    for (const name of ["serve", "ParticipantRuntime", "ParticipantServer", "SnapshotStore", "EffectConflictError", "effectKey", "TurnpointError"]) {
      assert.equal(typeof face[name], "function", name);
    }
    for (const name of ["ParticipantCore", "ActiveClock", "AnswerLog", "FinishedCheckpoints"]) assert.equal(face[name], undefined, name);
  });
});
