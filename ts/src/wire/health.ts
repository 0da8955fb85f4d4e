/**
 * grpc.health.v1.Health (docs/spec.md section 3.8): NOT_SERVING until the port is bound
 * and the services are ready, then SERVING for "" and each turnpoint service; on drain
 * NOT_SERVING for all, permanently. Open: it needs no token (section 10.2).
 */
import { create } from "@bufbuild/protobuf";

import { TurnpointError } from "../errors.js";
import * as health from "../gen/grpc/health/v1/health_pb.js";
import type { Door, Implementation } from "./door.js";

const Status = health.HealthCheckResponse_ServingStatus;

export class HealthService {
  private readonly statuses = new Map<string, health.HealthCheckResponse_ServingStatus>();
  private readonly watchers = new Set<() => void>();
  private shutdown = false;

  set(service: string, serving: boolean): void {
    if (this.shutdown) return;
    this.statuses.set(service, serving ? Status.SERVING : Status.NOT_SERVING);
    for (const wake of this.watchers) wake();
  }

  /** Every service NOT_SERVING for good: a late `set` cannot undo a drain. */
  enterGracefulShutdown(): void {
    for (const service of this.statuses.keys()) this.statuses.set(service, Status.NOT_SERVING);
    this.shutdown = true;
    for (const wake of this.watchers) wake();
  }

  /** Ends every Watch stream (the server stops). */
  close(): void {
    this.closed = true;
    for (const wake of this.watchers) wake();
  }
  private closed = false;

  implementation(door: Door): Implementation {
    const service = health.Health;
    const response = (status: health.HealthCheckResponse_ServingStatus): health.HealthCheckResponse =>
      create(health.HealthCheckResponseSchema, { status });
    return {
      Check: door.unary(
        service,
        "Check",
        health.HealthCheckRequestSchema,
        health.HealthCheckResponseSchema,
        async (request) => {
          const status = this.statuses.get(request.service);
          if (status === undefined) throw new TurnpointError("NOT_FOUND", `unknown service ${JSON.stringify(request.service)}`);
          return response(status);
        },
        true,
      ),
      List: door.unary(
        service,
        "List",
        health.HealthListRequestSchema,
        health.HealthListResponseSchema,
        async () => create(health.HealthListResponseSchema, { statuses: Object.fromEntries([...this.statuses].map(([name, s]) => [name, response(s)])) }),
        true,
      ),
      Watch: door.serverStream(
        service,
        "Watch",
        health.HealthCheckRequestSchema,
        health.HealthCheckResponseSchema,
        async (request, send, context) => {
          let last: health.HealthCheckResponse_ServingStatus | null = null;
          while (!context.signal.aborted && !this.closed) {
            const status = this.statuses.get(request.service) ?? Status.SERVICE_UNKNOWN;
            if (status !== last) {
              send(response(status));
              last = status;
            }
            await new Promise<void>((resolve) => {
              const wake = (): void => {
                this.watchers.delete(wake);
                context.signal.removeEventListener("abort", wake);
                resolve();
              };
              this.watchers.add(wake);
              context.signal.addEventListener("abort", wake, { once: true });
            });
          }
        },
        true,
      ),
    };
  }
}
