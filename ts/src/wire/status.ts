/**
 * Protocol errors on the wire (docs/spec.md section 9): a `google.rpc.Status` carrying
 * exactly one `google.rpc.ErrorInfo` (domain "turnpoint") in the
 * `grpc-status-details-bin` trailer for unary calls and streams, or a `ControlError` on
 * the ControlSession. One table (errors.ts REASON_CODES) decides the gRPC code.
 */
import { create, fromBinary, toBinary } from "@bufbuild/protobuf";
import { anyIs, anyPack, anyUnpack } from "@bufbuild/protobuf/wkt";
import { Metadata } from "@grpc/grpc-js";
import type { ServiceError, StatusObject } from "@grpc/grpc-js";

import { DOMAIN, REASON_CODES, TurnpointError } from "../errors.js";
import type { Reason } from "../errors.js";
import { ErrorInfoSchema } from "../gen/google/rpc/error_details_pb.js";
import { StatusSchema } from "../gen/google/rpc/status_pb.js";
import * as types from "../gen/turnpoint/v1/types_pb.js";

export const STATUS_DETAILS_KEY = "grpc-status-details-bin";

/** The encoded google.rpc.Status of an error: code from the table, one ErrorInfo. */
export function statusBytes(error: TurnpointError): Uint8Array {
  const info = create(ErrorInfoSchema, { reason: error.reason, domain: DOMAIN, metadata: { ...error.metadata } });
  const status = create(StatusSchema, { code: error.code, message: error.message, details: [anyPack(ErrorInfoSchema, info)] });
  return toBinary(StatusSchema, status);
}

/** What a grpc-js handler ends a call with (callback error, or a stream's 'error'). */
export function grpcStatus(error: TurnpointError): Partial<StatusObject> & { code: number; details: string; metadata: Metadata } {
  const metadata = new Metadata();
  metadata.set(STATUS_DETAILS_KEY, Buffer.from(statusBytes(error)));
  return { code: error.code, details: error.message, metadata };
}

export function controlError(error: TurnpointError): types.ControlError {
  return create(types.ControlErrorSchema, {
    code: error.code,
    reason: types.ErrorReason[error.reason],
    message: error.message,
    metadata: { ...error.metadata },
  });
}

function isReason(name: string): name is Reason {
  return Object.hasOwn(REASON_CODES, name);
}

/**
 * The protocol error a failed call carries, or null when it carries none (a transport
 * failure): the caller then classifies it by its gRPC code alone (section 9.1).
 */
export function errorFromServiceError(error: Partial<ServiceError>): TurnpointError | null {
  const raw = error.metadata?.get(STATUS_DETAILS_KEY)[0];
  if (!(raw instanceof Buffer)) return null;
  let status;
  try {
    status = fromBinary(StatusSchema, raw);
  } catch {
    return null;
  }
  const infos = status.details.filter((any) => anyIs(any, ErrorInfoSchema)).map((any) => anyUnpack(any, ErrorInfoSchema));
  if (infos.length !== 1) return null;
  const info = infos[0];
  if (info === undefined || info.domain !== DOMAIN || !isReason(info.reason)) return null;
  return new TurnpointError(info.reason, status.message, { ...info.metadata });
}
