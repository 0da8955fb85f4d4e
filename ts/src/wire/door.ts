/**
 * The plumbing every servicer shares: grpc-js service definitions built from the
 * generated descriptors with raw bytes in and out, so that a handler authenticates the
 * call before a byte of the request is parsed (section 10.1 item 4) and a request that
 * does not parse is INVALID_ARGUMENT with an ErrorInfo (section 10.5), never the
 * INTERNAL grpc-js would answer for a throwing deserializer.
 */
import { fromBinary, toBinary } from "@bufbuild/protobuf";
import type { DescMessage, DescService, MessageShape } from "@bufbuild/protobuf";
import type {
  Metadata,
  ServerDuplexStream,
  ServerUnaryCall,
  ServerWritableStream,
  ServiceDefinition,
  UntypedServiceImplementation,
  handleBidiStreamingCall,
  handleServerStreamingCall,
  handleUnaryCall,
  sendUnaryData,
} from "@grpc/grpc-js";

import { CancelledError, TurnpointError, hookFailure, invalidArgument } from "../errors.js";
import type { TokenCheck } from "./auth.js";
import { TokenCheck as Tokens } from "./auth.js";
import { grpcStatus } from "./status.js";

/** A grpc-js definition of `service` whose handlers see and send raw bytes. */
export function rawDefinition(service: DescService): ServiceDefinition {
  const definition: { [name: string]: ServiceDefinition[string] } = {};
  for (const method of service.methods) {
    definition[method.name] = {
      path: `/${service.typeName}/${method.name}`,
      requestStream: method.methodKind === "client_streaming" || method.methodKind === "bidi_streaming",
      responseStream: method.methodKind === "server_streaming" || method.methodKind === "bidi_streaming",
      requestSerialize: (value: Buffer) => value,
      requestDeserialize: (bytes: Buffer) => bytes,
      responseSerialize: (value: Buffer) => value,
      responseDeserialize: (bytes: Buffer) => bytes,
      originalName: method.localName,
    };
  }
  return definition;
}

export function methodPath(service: DescService, name: string): string {
  return `/${service.typeName}/${name}`;
}

/**
 * Decode a request; bytes that do not parse are INVALID_ARGUMENT with metadata `method`
 * and `message_type` (section 10.5).
 */
export function decode<Desc extends DescMessage>(schema: Desc, bytes: Uint8Array, method = ""): MessageShape<Desc> {
  try {
    return fromBinary(schema, bytes);
  } catch (error) {
    throw invalidArgument(`the request is not a valid ${schema.typeName}: ${error instanceof Error ? error.message.slice(0, 80) : "unparseable"}`, {
      method,
      message_type: schema.typeName,
    });
  }
}

export function encode<Desc extends DescMessage>(schema: Desc, message: MessageShape<Desc>): Buffer {
  const bytes = toBinary(schema, message);
  return Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength);
}

/**
 * The protocol error to answer for whatever a handler threw; null for a cancellation
 * (its caller is gone, nothing is answered). A hook's own failure is logged here, and
 * the caller sees HOOK_FAILED or UNAVAILABLE without its text (turnpoint.participant_sdk._failures).
 */
export function protocolError(error: unknown, operation: string): TurnpointError | null {
  if (error instanceof TurnpointError) return error;
  if (error instanceof CancelledError) return null;
  const mapped = hookFailure(error, operation);
  console.warn(`turnpoint: ${operation} failed in a participant hook; the caller sees ${mapped.reason}:`, error);
  return mapped;
}

/** Seconds left on a call's deadline; null when it has none. */
export function timeLeft(call: { getDeadline(): Date | number }): number | null {
  const deadline = call.getDeadline();
  const at = deadline instanceof Date ? deadline.getTime() : deadline;
  if (!Number.isFinite(at)) return null;
  return Math.max(0, (at - Date.now()) / 1000);
}

/** Aborts when the call is cancelled by its caller (or the server drains). */
export function callSignal(call: { on(event: "cancelled", listener: () => void): unknown; cancelled: boolean }): AbortController {
  const controller = new AbortController();
  if (call.cancelled) controller.abort();
  call.on("cancelled", () => controller.abort());
  return controller;
}

export interface CallContext {
  readonly path: string;
  readonly timeoutS: number | null;
  readonly signal: AbortSignal;
  readonly metadata: Metadata;
}

/** Builds handlers that authenticate (unless open), decode, run and map errors. */
export class Door {
  constructor(private readonly tokens: TokenCheck | null) {}

  private refused(path: string, metadata: Metadata): TurnpointError | null {
    if (this.tokens === null) return null;
    const refusal = this.tokens.refusal(metadata, path);
    return refusal === null ? null : Tokens.error(path, refusal);
  }

  unary<In extends DescMessage, Out extends DescMessage>(
    service: DescService,
    name: string,
    input: In,
    output: Out,
    handler: (request: MessageShape<In>, context: CallContext) => Promise<MessageShape<Out>>,
    open = false,
  ): handleUnaryCall<Buffer, Buffer> {
    const path = methodPath(service, name);
    return (call: ServerUnaryCall<Buffer, Buffer>, callback: sendUnaryData<Buffer>) => {
      const refused = open ? null : this.refused(path, call.metadata);
      if (refused !== null) {
        callback(grpcStatus(refused));
        return;
      }
      const controller = callSignal(call);
      const context: CallContext = { path, timeoutS: timeLeft(call), signal: controller.signal, metadata: call.metadata };
      void (async () => {
        try {
          const request = decode(input, call.request, path);
          callback(null, encode(output, await handler(request, context)));
        } catch (error) {
          const mapped = protocolError(error, name);
          if (mapped !== null) callback(grpcStatus(mapped));
          else callback({ code: 1, details: "cancelled" });
        }
      })();
    };
  }

  serverStream<In extends DescMessage, Out extends DescMessage>(
    service: DescService,
    name: string,
    input: In,
    output: Out,
    handler: (request: MessageShape<In>, send: (message: MessageShape<Out>) => void, context: CallContext, call: ServerWritableStream<Buffer, Buffer>) => Promise<void>,
    open = false,
  ): handleServerStreamingCall<Buffer, Buffer> {
    const path = methodPath(service, name);
    return (call: ServerWritableStream<Buffer, Buffer>) => {
      const refused = open ? null : this.refused(path, call.metadata);
      if (refused !== null) {
        call.emit("error", grpcStatus(refused));
        return;
      }
      const controller = callSignal(call);
      const context: CallContext = { path, timeoutS: timeLeft(call), signal: controller.signal, metadata: call.metadata };
      void (async () => {
        try {
          const request = decode(input, call.request, path);
          await handler(request, (message) => call.write(encode(output, message)), context, call);
          if (!call.cancelled) call.end();
        } catch (error) {
          const mapped = protocolError(error, name);
          if (!call.cancelled) {
            if (mapped !== null) call.emit("error", grpcStatus(mapped));
            else call.end();
          }
        }
      })();
    };
  }

  /** A bidi stream: the handler gets the call once it is authenticated. */
  bidi(
    service: DescService,
    name: string,
    handler: (call: ServerDuplexStream<Buffer, Buffer>, path: string) => void,
    open = false,
  ): handleBidiStreamingCall<Buffer, Buffer> {
    const path = methodPath(service, name);
    return (call: ServerDuplexStream<Buffer, Buffer>) => {
      const refused = open ? null : this.refused(path, call.metadata);
      if (refused !== null) {
        call.emit("error", grpcStatus(refused));
        return;
      }
      handler(call, path);
    };
  }
}

export type Implementation = UntypedServiceImplementation;
