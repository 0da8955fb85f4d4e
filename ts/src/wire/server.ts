/**
 * Hosting a participant as a real gRPC server (docs/spec.md sections 3.5, 3.8, 10): the
 * reference's keepalive and message limits, bearer-token auth, optional (mutual) TLS,
 * grpc.health.v1, binding without port reuse, and a graceful drain (health NOT_SERVING,
 * long-lived streams ended, then a grace period for calls in flight; a second signal
 * cuts it short), and server reflection. A port of turnpoint.server._grpc_server.
 */
import type { EventEmitter } from "node:events";
import { readFileSync } from "node:fs";
import { isIP } from "node:net";

import type { DescService } from "@bufbuild/protobuf";
import { Server, ServerCredentials } from "@grpc/grpc-js";

import * as control from "../gen/turnpoint/v1/checkpoint_control_service_pb.js";
import * as health from "../gen/grpc/health/v1/health_pb.js";
import * as policy from "../gen/turnpoint/v1/policy_service_pb.js";
import * as resources from "../gen/turnpoint/v1/resources_service_pb.js";
import * as rollout from "../gen/turnpoint/v1/rollout_service_pb.js";
import type { ParticipantRuntime } from "../runtime.js";
import { DUPLICATE_AUTHORIZATION, TokenCheck, validateToken, validateTokenSha256 } from "./auth.js";
import { ControlServicer } from "./control.js";
import { resourcesImplementation, rolloutImplementation } from "./data.js";
import { Door, rawDefinition } from "./door.js";
import { HealthService } from "./health.js";
import { ReflectionService } from "./reflection.js";

/** Section 3.5: the numbers both ends share with the Python reference. */
export const KEEPALIVE_TIME_MS = 20_000;
export const KEEPALIVE_TIMEOUT_MS = 10_000;
export const MAX_MESSAGE_BYTES = 16 * 1024 * 1024;

export interface ServerOptions {
  readonly host?: string;
  readonly port?: number;
  /** Never shown in logs or errors. Null needs `allowInsecureNoAuth` (or `tokenSha256`). */
  readonly token: string | null;
  /**
   * The control token's SHA-256 (hex) in place of `token` (section 10.2 item 8): the
   * server checks the coordinator's calls without holding a control credential.
   */
  readonly tokenSha256?: string | null;
  /**
   * A second, data-plane credential (section 10.2): it opens Rollout/Resources/Policy
   * and is refused PERMISSION_DENIED on the control service. Never shown. Without it
   * `token` serves both roles.
   */
  readonly dataToken?: string | null;
  readonly allowInsecureNoAuth?: boolean;
  /** False leaves the data-plane services open (section 10.2 allows it). */
  readonly authDataPlane?: boolean;
  readonly tlsCertFile?: string;
  readonly tlsKeyFile?: string;
  /** Mutual TLS: every client must present a certificate this CA signed. */
  readonly tlsClientCaFile?: string;
  readonly graceS?: number;
}

/** The services a data-plane credential opens (section 10.2); every other one refuses it. */
export const DATA_PLANE_SERVICES: readonly string[] = [rollout.RolloutService.typeName, resources.ResourcesService.typeName, policy.PolicyService.typeName];

export type ServerState = "new" | "serving" | "draining" | "stopped";

function isLoopback(host: string): boolean {
  if (host === "localhost") return true;
  const bare = host.replace(/^\[|\]$/g, "");
  if (isIP(bare) === 4) return bare.startsWith("127.");
  return bare === "::1";
}

function joinHostPort(host: string, port: number): string {
  return host.includes(":") && !host.startsWith("[") ? `[${host}]:${port}` : `${host}:${port}`;
}

/** One participant's gRPC server: start, serve, drain, stop. */
export class ParticipantServer {
  private readonly server: Server;
  private readonly healthService = new HealthService();
  private readonly controlServicer: ControlServicer;
  private readonly services: string[] = [];
  private _state: ServerState = "new";
  private _port: number | null = null;
  private drainPromise: Promise<void> | null = null;
  private terminated!: () => void;
  private readonly terminatedPromise = new Promise<void>((resolve) => (this.terminated = resolve));
  private readonly signalHandlers = new Map<NodeJS.Signals, () => void>();

  constructor(
    readonly runtime: ParticipantRuntime,
    private readonly options: ServerOptions,
  ) {
    const tokenSha256 = options.tokenSha256 ?? null;
    if (options.token !== null && tokenSha256 !== null) throw new RangeError("give the control token or its SHA-256 digest, not both");
    const controlCredential = options.token ?? (tokenSha256 === null ? null : { sha256: validateTokenSha256(tokenSha256) });
    if (controlCredential === null && options.allowInsecureNoAuth !== true) {
      throw new RangeError(
        "no bearer token configured: set $TURNPOINT_TOKEN or $TURNPOINT_TOKEN_FILE (or pass a token file), " +
          "or explicitly allow insecure serving without auth",
      );
    }
    if (options.token !== null) validateToken(options.token);
    const dataToken = options.dataToken ?? null;
    if (dataToken !== null) {
      validateToken(dataToken);
      if (controlCredential === null) throw new RangeError("a data-plane token needs a control token beside it");
      if (options.authDataPlane === false) throw new RangeError("a data-plane token has no use when the data plane is open");
    }
    if ((options.tlsCertFile === undefined) !== (options.tlsKeyFile === undefined)) throw new RangeError("TLS needs both a certificate and a key");
    if (options.tlsClientCaFile !== undefined && options.tlsCertFile === undefined) throw new RangeError("mutual TLS needs a certificate and a key");
    this.server = new Server({
      "grpc.keepalive_time_ms": KEEPALIVE_TIME_MS,
      "grpc.keepalive_timeout_ms": KEEPALIVE_TIMEOUT_MS,
      "grpc.max_receive_message_length": MAX_MESSAGE_BYTES,
      "grpc.max_send_message_length": MAX_MESSAGE_BYTES,
    });
    // TokenCheck refuses a data-plane token equal to the control one (by digest).
    const door = new Door(controlCredential === null ? null : new TokenCheck(controlCredential, dataToken, DATA_PLANE_SERVICES));
    const openData = options.authDataPlane === false;
    this.controlServicer = new ControlServicer(runtime);
    this.add(control.CheckpointControlService, this.controlServicer.implementation(door));
    if (runtime.agent !== null) this.add(rollout.RolloutService, rolloutImplementation(runtime, door, openData));
    if (runtime.resources !== null) this.add(resources.ResourcesService, resourcesImplementation(runtime, door, openData));
    this.server.addService(rawDefinition(health.Health), this.healthService.implementation(door));
    const served: DescService[] = [control.CheckpointControlService, health.Health];
    if (runtime.agent !== null) served.push(rollout.RolloutService);
    if (runtime.resources !== null) served.push(resources.ResourcesService);
    for (const [service, impl] of new ReflectionService(served).implementations(door)) this.server.addService(rawDefinition(service), impl);
  }

  private add(service: typeof control.CheckpointControlService | typeof rollout.RolloutService | typeof resources.ResourcesService, impl: Parameters<Server["addService"]>[1]): void {
    this.server.addService(rawDefinition(service), impl);
    this.services.push(service.typeName);
  }

  get state(): ServerState {
    return this._state;
  }

  /** The bound port; known once `start` returned. */
  get port(): number {
    if (this._port === null) throw new Error("the server has not been started");
    return this._port;
  }

  get address(): string {
    return joinHostPort(this.options.host ?? "127.0.0.1", this.port);
  }

  /** Bind and serve; returns the bound port. A taken port fails (no SO_REUSEPORT). */
  async start(): Promise<number> {
    if (this._state !== "new") throw new Error(`start() called on a server that is ${this._state}`);
    const options = this.options;
    for (const name of ["", ...this.services]) this.healthService.set(name, false);
    let credentials = ServerCredentials.createInsecure();
    if (options.tlsCertFile !== undefined && options.tlsKeyFile !== undefined) {
      const ca = options.tlsClientCaFile !== undefined ? readFileSync(options.tlsClientCaFile) : null;
      credentials = ServerCredentials.createSsl(
        ca,
        [{ cert_chain: readFileSync(options.tlsCertFile), private_key: readFileSync(options.tlsKeyFile) }],
        ca !== null,
      );
    }
    const address = joinHostPort(options.host ?? "127.0.0.1", options.port ?? 0);
    this._port = await new Promise<number>((resolve, reject) => {
      this.server.bindAsync(address, credentials, (error, port) => (error !== null ? reject(error) : resolve(port)));
    });
    this.markDuplicateAuthorization();
    this.runtime.start();
    for (const name of ["", ...this.services]) this.healthService.set(name, true);
    this._state = "serving";
    if (options.token === null && (options.tokenSha256 ?? null) === null) console.warn("turnpoint: serving WITHOUT authentication: anyone who can connect controls it");
    else if (options.tlsCertFile === undefined && !isLoopback(options.host ?? "127.0.0.1")) {
      console.warn(`turnpoint: the bearer token travels in plaintext: ${options.host} is not loopback`);
    }
    return this._port;
  }

  /**
   * Node's HTTP/2 layer drops every `authorization` header but the first before grpc-js
   * builds the call's metadata; the raw headers still have them all. This listener runs
   * first and marks a request that carried several (grpc-js keeps its listening servers
   * in a private map: without it, a warning says the check is missing).
   */
  private markDuplicateAuthorization(): void {
    const servers = (this.server as unknown as { http2Servers?: unknown }).http2Servers;
    if (!(servers instanceof Map)) {
      console.warn("turnpoint: cannot read raw HTTP/2 headers: a second authorization entry goes unnoticed");
      return;
    }
    for (const http2Server of servers.keys() as IterableIterator<EventEmitter>) {
      http2Server.prependListener("stream", (_stream: unknown, headers: { [name: string]: unknown }, _flags: unknown, rawHeaders: unknown) => {
        if (!Array.isArray(rawHeaders)) return;
        let count = 0;
        for (let i = 0; i < rawHeaders.length; i += 2) if (String(rawHeaders[i]).toLowerCase() === "authorization") count++;
        if (count > 1) headers.authorization = DUPLICATE_AUTHORIZATION;
      });
    }
  }

  /** Health NOT_SERVING, long-lived streams ended, then stop with a grace period. */
  drainAndStop(graceS?: number): Promise<void> {
    if (this.drainPromise === null) this.drainPromise = this.drain(graceS ?? this.options.graceS ?? 10);
    return this.drainPromise;
  }

  private async drain(graceS: number): Promise<void> {
    this._state = "draining";
    try {
      this.healthService.enterGracefulShutdown();
      this.controlServicer.close();
      this.healthService.close();
      await new Promise<void>((resolve) => {
        const timer = setTimeout(() => this.server.forceShutdown(), graceS * 1000);
        this.server.tryShutdown(() => {
          clearTimeout(timer);
          resolve();
        });
      });
      await this.runtime.close();
    } finally {
      this._state = "stopped";
      for (const [signal, handler] of this.signalHandlers) process.off(signal, handler);
      this.signalHandlers.clear();
      this.terminated();
    }
  }

  /** SIGTERM/SIGINT drain and stop; a second signal cancels what is left of the grace. */
  installSignalHandlers(signals: readonly NodeJS.Signals[] = ["SIGTERM", "SIGINT"]): void {
    for (const signal of signals) {
      const handler = (): void => {
        if (this.drainPromise === null) void this.drainAndStop();
        else this.server.forceShutdown();
      };
      this.signalHandlers.set(signal, handler);
      process.on(signal, handler);
    }
  }

  waitForTermination(): Promise<void> {
    return this.terminatedPromise;
  }
}
