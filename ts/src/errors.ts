/**
 * Protocol errors: one root class, one reason vocabulary, one table to gRPC codes
 * (docs/spec.md section 9). Callers branch on `reason`, never on message text.
 *
 * Pure: no grpc, no protobuf. `wire/status.ts` turns these into a google.rpc.Status
 * (unary calls and streams) or a ControlError (the ControlSession).
 */

/** gRPC status codes by name (the numbers are fixed by gRPC). */
export const GrpcCode = {
  OK: 0,
  CANCELLED: 1,
  UNKNOWN: 2,
  INVALID_ARGUMENT: 3,
  DEADLINE_EXCEEDED: 4,
  NOT_FOUND: 5,
  ALREADY_EXISTS: 6,
  PERMISSION_DENIED: 7,
  RESOURCE_EXHAUSTED: 8,
  FAILED_PRECONDITION: 9,
  ABORTED: 10,
  OUT_OF_RANGE: 11,
  UNIMPLEMENTED: 12,
  INTERNAL: 13,
  UNAVAILABLE: 14,
  DATA_LOSS: 15,
  UNAUTHENTICATED: 16,
} as const;
export type GrpcCodeName = keyof typeof GrpcCode;

/**
 * The table of docs/spec.md section 9.3: reason -> gRPC code. HOOK_FAILED (18) is in
 * types.proto and the Python reference (turnpoint.participant_sdk._failures) but not yet in
 * the spec's table; it travels as INTERNAL like the reference.
 */
export const REASON_CODES = {
  ADMISSION_CLOSED: "UNAVAILABLE",
  STALE_CHECKPOINT: "ABORTED",
  CHECKPOINT_CONFLICT: "ABORTED",
  INVALID_PHASE: "FAILED_PRECONDITION",
  RESTART_IN_SCOPE: "FAILED_PRECONDITION",
  RETIRE_INCOMPLETE: "FAILED_PRECONDITION",
  FENCED: "FAILED_PRECONDITION",
  STALE_ATTEMPT: "FAILED_PRECONDITION",
  INVALID_ARGUMENT: "INVALID_ARGUMENT",
  INVALID_CHECKPOINT_STATE: "DATA_LOSS",
  UNAUTHENTICATED: "UNAUTHENTICATED",
  DEADLINE_EXCEEDED: "DEADLINE_EXCEEDED",
  STORAGE_UNAVAILABLE: "UNAVAILABLE",
  NOT_FOUND: "NOT_FOUND",
  UNAVAILABLE: "UNAVAILABLE",
  NOT_READY: "UNAVAILABLE",
  PROTOCOL_VIOLATION: "INTERNAL",
  HOOK_FAILED: "INTERNAL",
  PERMISSION_DENIED: "PERMISSION_DENIED",
} as const satisfies Record<string, GrpcCodeName>;

/** The `ErrorReason` value name without its `ERROR_REASON_` prefix. */
export type Reason = keyof typeof REASON_CODES;

export const DOMAIN = "turnpoint";

/** Root of every protocol error; `metadata` ends up in ErrorInfo.metadata. */
export class TurnpointError extends Error {
  readonly reason: Reason;
  readonly metadata: Readonly<Record<string, string>>;

  constructor(reason: Reason, message: string, metadata: Record<string, string> = {}) {
    super(message);
    this.name = "TurnpointError";
    this.reason = reason;
    this.metadata = { ...metadata };
  }

  get code(): number {
    return GrpcCode[REASON_CODES[this.reason]];
  }
}

/** Raise from a hook to say "this failed for now; try again" (UNAVAILABLE). */
export class TransientError extends TurnpointError {
  constructor(message = "a transient failure", metadata: Record<string, string> = {}) {
    super("UNAVAILABLE", message, metadata);
    this.name = "TransientError";
  }
}

/** A wait of the SDK ended because its caller (or a stop of the work) cancelled it. */
export class CancelledError extends Error {
  constructor(message = "cancelled") {
    super(message);
    this.name = "CancelledError";
  }
}

export function isCancelled(error: unknown): error is CancelledError {
  return error instanceof CancelledError;
}

export function invalidArgument(message: string, metadata: Record<string, string> = {}): TurnpointError {
  return new TurnpointError("INVALID_ARGUMENT", message, metadata);
}

const MAX_OPERATION_CHARS = 64;

/**
 * The typed error the caller sees for something a participant's hook threw while
 * serving `operation` (turnpoint.participant_sdk._failures): a TurnpointError keeps its reason;
 * a connection or timeout failure is UNAVAILABLE; anything else HOOK_FAILED. The
 * exception's text never goes on the wire (it may hold paths or secrets).
 */
export function hookFailure(error: unknown, operation: string): TurnpointError {
  if (error instanceof TurnpointError) return error;
  const op = operation.slice(0, MAX_OPERATION_CHARS);
  const exception = error instanceof Error ? error.name || "Error" : typeof error;
  const metadata = { operation: op, exception };
  const code = (error as { code?: unknown } | null)?.code;
  const grpcCall = typeof code === "number" && typeof (error as { details?: unknown }).details === "string";
  // A connection or timeout failure (section 5.1 item 5): a socket error, or a gRPC call
  // of the hook's own that ended UNAVAILABLE or DEADLINE_EXCEEDED without a reason.
  if (
    (typeof code === "string" && /^(ECONNREFUSED|ECONNRESET|ETIMEDOUT|EPIPE|EHOSTUNREACH)$/.test(code)) ||
    (grpcCall && (code === GrpcCode.UNAVAILABLE || code === GrpcCode.DEADLINE_EXCEEDED))
  ) {
    return new TurnpointError(
      "UNAVAILABLE",
      `${op}: a participant hook could not reach what it depends on (${exception})`,
      metadata,
    );
  }
  return new TurnpointError("HOOK_FAILED", `${op}: a participant hook raised ${exception}`, metadata);
}
