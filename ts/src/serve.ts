/**
 * Host one participant the way `turnpoint serve` does (apps/_serve.py): a runtime over a
 * snapshot store, served with the bearer token, TLS, health, reflection and a drain on
 * SIGTERM/SIGINT, and the serving line a supervisor reads
 * (`turnpoint: serving <kind> <instance> on <host>:<port>`).
 *
 *     import { serve } from "@turnpoint/participant";
 *     process.exitCode = await serve({ resources: new CounterTools() }, { instance: "tools", root: "snapshots" });
 */
import type { Agent } from "./agent.js";
import type { ResourcesServer } from "./resources.js";
import { ParticipantRuntime } from "./runtime.js";
import { SnapshotStore } from "./store.js";
import { loadToken } from "./wire/auth.js";
import { ParticipantServer } from "./wire/server.js";

/** What to host: an agent, a resources server, or both in one participant. */
export interface Hosted {
  readonly agent?: Agent;
  readonly resources?: ResourcesServer;
  /** Runs after the server stopped (or failed to start): close your own clients here. */
  readonly close?: () => Promise<void>;
}

/** Where and how to serve it; the token defaults to $TURNPOINT_TOKEN / $TURNPOINT_TOKEN_FILE. */
export interface ServeOptions {
  /** The instance name, unique in the job (spec 2.3). */
  readonly instance: string;
  /** The snapshot root the coordinator also reads (spec 8.1). */
  readonly root: string;
  readonly host?: string;
  /** 0 (the default) picks a free port. */
  readonly port?: number;
  readonly token?: string | null;
  /** The control token's SHA-256 (hex) instead of the token (spec 10.2 item 8). */
  readonly tokenSha256?: string | null;
  /** The data-plane credential (spec 10.2); without it `token` serves both roles. */
  readonly dataToken?: string | null;
  readonly allowInsecureNoAuth?: boolean;
  readonly tlsCertFile?: string;
  readonly tlsKeyFile?: string;
  readonly tlsClientCaFile?: string;
  /** How long a drain waits for calls in flight (default 10 s). */
  readonly graceS?: number;
  /** The lease a checkpoint holds when the coordinator names none (default 60 s). */
  readonly leaseS?: number;
  /** Serve RestoreRunning and list its capability (spec 4.16; default true). */
  readonly restoreRunning?: boolean;
}

/**
 * Serve `hosted` until SIGTERM or SIGINT drained it; the process's exit status: 0 after
 * a drain, 2 when the server could not start (the reason on stderr, one line).
 */
export async function serve(hosted: Hosted, options: ServeOptions): Promise<number> {
  const kind = hosted.agent !== undefined ? (hosted.resources !== undefined ? "environment" : "agent") : "resources";
  const host = options.host ?? "127.0.0.1";
  let server: ParticipantServer;
  try {
    const runtime = new ParticipantRuntime(options.instance, new SnapshotStore(options.root), {
      ...(hosted.agent !== undefined ? { agent: hosted.agent } : {}),
      ...(hosted.resources !== undefined ? { resources: hosted.resources } : {}),
      config: { defaultLeaseS: options.leaseS ?? 60, restoreRunning: options.restoreRunning ?? true },
    });
    server = new ParticipantServer(runtime, {
      host,
      port: options.port ?? 0,
      // Given the digest, the token is not read from the environment at all.
      token: options.token === undefined ? ((options.tokenSha256 ?? null) === null ? loadToken(null) : null) : options.token,
      tokenSha256: options.tokenSha256 ?? null,
      dataToken: options.dataToken ?? null,
      allowInsecureNoAuth: options.allowInsecureNoAuth ?? false,
      graceS: options.graceS ?? 10,
      ...(options.tlsCertFile !== undefined ? { tlsCertFile: options.tlsCertFile } : {}),
      ...(options.tlsKeyFile !== undefined ? { tlsKeyFile: options.tlsKeyFile } : {}),
      ...(options.tlsClientCaFile !== undefined ? { tlsClientCaFile: options.tlsClientCaFile } : {}),
    });
    await server.start();
  } catch (error) {
    console.error(`turnpoint serve: ${error instanceof Error ? error.message : String(error)}`);
    await hosted.close?.();
    return 2;
  }
  server.installSignalHandlers();
  process.stdout.write(`turnpoint: serving ${kind} ${options.instance} on ${host}:${server.port}\n`);
  await server.waitForTermination();
  await hosted.close?.();
  return 0;
}
