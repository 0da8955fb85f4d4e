/**
 * The examples' command line (examples/serve.ts) takes the two credentials of spec 10.2
 * as `turnpoint serve` does: `--token-file` is the control token the server checks,
 * `--data-token-file` the data-plane token the example's own calls out present; the
 * demo passes both to a `--participant-command`.
 */
import assert from "node:assert/strict";
import { writeFileSync } from "node:fs";
import path from "node:path";
import { describe, it } from "node:test";

import { parseServeArgs, peerToken } from "../examples/serve.js";
import { tokenSha256 } from "../src/index.js";
import { tempRoot } from "./helpers.js";

function tokenFile(dir: string, name: string, token: string): string {
  const file = path.join(dir, name);
  writeFileSync(file, `${token}\n`, { mode: 0o600 });
  return file;
}

describe("the examples' serve arguments", () => {
  it("take a data-plane token file, and the calls out present that token", () => {
    const dir = tempRoot();
    const control = tokenFile(dir, "token", "control-token-1234");
    const data = tokenFile(dir, "data-token", "data-token-5678");

    const args = parseServeArgs(["--token-file", control, "--data-token-file", data], "agent", ["guess"]);

    assert.equal(args.token, "control-token-1234");
    assert.equal(args.dataToken, "data-token-5678");
    assert.equal(peerToken(args), "data-token-5678");
  });

  it("without one, the control token serves both roles", () => {
    const control = tokenFile(tempRoot(), "token", "control-token-1234");

    const args = parseServeArgs(["--token-file", control], "agent", ["guess"]);

    assert.equal(args.dataToken, null);
    assert.equal(peerToken(args), "control-token-1234");
  });

  it("take the control token's digest in its place: the process holds no control credential", () => {
    const dir = tempRoot();
    const digest = tokenFile(dir, "token.sha256", tokenSha256("control-token-1234"));
    const data = tokenFile(dir, "data-token", "data-token-5678");

    const args = parseServeArgs(["--control-token-digest-file", digest, "--data-token-file", data], "agent", ["guess"]);

    assert.equal(args.token, null);
    assert.equal(args.tokenSha256, tokenSha256("control-token-1234"));
    assert.equal(peerToken(args), "data-token-5678");
    const control = tokenFile(dir, "token", "control-token-1234");
    assert.throws(() => parseServeArgs(["--control-token-digest-file", digest, "--token-file", control], "agent", ["guess"]), /not both/);
  });
});
