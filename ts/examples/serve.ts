/**
 * What the two example servers share: the command line of `turnpoint serve`
 * (apps/_serve.py), so either example can stand in for the Python one, and the serving
 * line the demo supervisor reads (`turnpoint: serving <kind> <instance> on <host>:<port>`).
 */
import { randomBytes } from "node:crypto";
import { parseArgs } from "node:util";

import { loadToken, loadTokenSha256, serve, validateId } from "../src/index.js";
import type { Hosted } from "../src/index.js";

export interface ServeArgs {
  readonly kind: string;
  readonly example: string;
  readonly instance: string;
  readonly host: string;
  readonly port: number;
  readonly root: string;
  readonly token: string | null;
  /** The control token's SHA-256 in its place (spec 10.2 item 8). */
  readonly tokenSha256: string | null;
  /** The data-plane credential (spec 10.2): what the example's own calls out present. */
  readonly dataToken: string | null;
  readonly insecureNoAuth: boolean;
  readonly tlsCert?: string;
  readonly tlsKey?: string;
  readonly tlsClientCa?: string;
  readonly policy?: string;
  readonly resources: ReadonlyMap<string, string>;
  readonly groupSize: number;
  readonly verifierLog?: string;
  readonly leaseS: number;
  readonly graceS: number;
  readonly turnDelayS: number;
}

export class UsageError extends Error {}

function number(text: string | undefined, name: string, fallback: number, least = 0): number {
  if (text === undefined) return fallback;
  const value = Number(text);
  if (!Number.isFinite(value) || value < least) throw new UsageError(`--${name} takes a number >= ${least}, got ${JSON.stringify(text)}`);
  return value;
}

/** Parse `turnpoint serve`'s options; `kind` is what this program serves. */
export function parseServeArgs(argv: readonly string[], kind: string, examples: readonly string[]): ServeArgs {
  let parsed;
  try {
    parsed = parseArgs({
      args: [...argv],
      options: {
        kind: { type: "string" },
        example: { type: "string" },
        instance: { type: "string" },
        host: { type: "string", default: "127.0.0.1" },
        port: { type: "string", default: "0" },
        root: { type: "string", default: "snapshots" },
        "token-file": { type: "string" },
        "data-token-file": { type: "string" },
        "control-token-digest-file": { type: "string" },
        "insecure-no-auth": { type: "boolean", default: false },
        "tls-cert": { type: "string" },
        "tls-key": { type: "string" },
        "tls-client-ca": { type: "string" },
        policy: { type: "string" },
        resources: { type: "string", multiple: true, default: [] },
        "group-size": { type: "string" },
        "verifier-log": { type: "string" },
        seed: { type: "string" },
        lease: { type: "string" },
        grace: { type: "string" },
        "turn-delay": { type: "string" },
        faults: { type: "string" },
      },
      strict: true,
      allowPositionals: false,
    });
  } catch (error) {
    throw new UsageError((error as Error).message);
  }
  const v = parsed.values;
  if (v.kind !== undefined && v.kind !== kind) throw new UsageError(`this program serves --kind ${kind}, not ${v.kind}`);
  const example = v.example ?? (examples[0] as string);
  if (!examples.includes(example)) throw new UsageError(`no example ${JSON.stringify(example)} for kind ${kind}; choose one of: ${examples.join(", ")}`);
  if (v.faults) throw new UsageError("--faults (store fault injection) is not supported by the TypeScript examples");
  const instance = v.instance ?? `${kind}-${randomBytes(3).toString("hex")}`;
  validateId(instance, "instance");
  const resources = new Map<string, string>();
  for (const item of v.resources ?? []) {
    const at = item.indexOf("=");
    if (at <= 0 || at === item.length - 1) throw new UsageError(`--resources takes ENV=ADDRESS, got ${JSON.stringify(item)}`);
    resources.set(item.slice(0, at), item.slice(at + 1));
  }
  const tokenSha256 = loadTokenSha256(v["control-token-digest-file"] ?? null);
  if (tokenSha256 !== null && v["token-file"] !== undefined) throw new UsageError("give --token-file or --control-token-digest-file, not both");
  const token = tokenSha256 === null ? loadToken(v["token-file"] ?? null) : null;
  if (token === null && tokenSha256 === null && !v["insecure-no-auth"]) {
    throw new UsageError("no token: set TURNPOINT_TOKEN or pass --token-file (or --insecure-no-auth for a local experiment)");
  }
  const dataTokenFile = v["data-token-file"];
  const dataToken = dataTokenFile === undefined ? null : loadToken(dataTokenFile);
  const port = number(v.port, "port", 0);
  if (!Number.isInteger(port) || port > 65535) throw new UsageError(`--port must be in 0..65535, got ${v.port}`);
  return {
    kind,
    example,
    instance,
    host: v.host ?? "127.0.0.1",
    port,
    root: v.root ?? "snapshots",
    token,
    tokenSha256,
    dataToken,
    insecureNoAuth: v["insecure-no-auth"] ?? false,
    ...(v["tls-cert"] !== undefined ? { tlsCert: v["tls-cert"] } : {}),
    ...(v["tls-key"] !== undefined ? { tlsKey: v["tls-key"] } : {}),
    ...(v["tls-client-ca"] !== undefined ? { tlsClientCa: v["tls-client-ca"] } : {}),
    ...(v.policy !== undefined ? { policy: v.policy } : {}),
    resources,
    groupSize: number(v["group-size"], "group-size", 4, 1),
    ...(v["verifier-log"] !== undefined ? { verifierLog: v["verifier-log"] } : {}),
    leaseS: number(v.lease, "lease", 60),
    graceS: number(v.grace, "grace", 10),
    turnDelayS: number(v["turn-delay"], "turn-delay", 0),
  };
}

/** What an example presents on its own calls out: the data-plane token when there is one. */
export function peerToken(args: ServeArgs): string | null {
  return args.dataToken ?? args.token;
}

/** Parse the command line, build the example and serve it with the SDK's `serve`. */
export async function serveExample(
  kind: string,
  examples: readonly string[],
  build: (args: ServeArgs) => Pick<Hosted, "agent" | "resources" | "close">,
): Promise<number> {
  let args: ServeArgs;
  let built: Hosted;
  try {
    args = parseServeArgs(process.argv.slice(2), kind, examples);
    built = build(args);
  } catch (error) {
    console.error(`turnpoint serve: ${error instanceof Error ? error.message : String(error)}`);
    return 2;
  }
  return serve(built, {
    instance: args.instance,
    root: args.root,
    host: args.host,
    port: args.port,
    token: args.token,
    tokenSha256: args.tokenSha256,
    dataToken: args.dataToken,
    allowInsecureNoAuth: args.insecureNoAuth,
    graceS: args.graceS,
    leaseS: args.leaseS,
    ...(args.tlsCert !== undefined ? { tlsCertFile: args.tlsCert } : {}),
    ...(args.tlsKey !== undefined ? { tlsKeyFile: args.tlsKey } : {}),
    ...(args.tlsClientCa !== undefined ? { tlsClientCaFile: args.tlsClientCa } : {}),
  });
}
