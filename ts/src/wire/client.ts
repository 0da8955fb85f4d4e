/**
 * A small typed client for the turnpoint services, for agents that call their policy
 * and resources servers (and for tests). Every call carries the bearer token as call
 * metadata (section 10.1 item 7), has a deadline, honours an AbortSignal, and fails
 * with the TurnpointError its status carries (a refusal with ADMISSION_CLOSED is what
 * `ctx.modelCall` parks on) or, below the protocol, a plain grpc-js ServiceError.
 */
import type { DescMessage, DescMethod, DescService, MessageInitShape, MessageShape } from "@bufbuild/protobuf";
import { create, fromBinary, toBinary } from "@bufbuild/protobuf";
import { Client, Metadata, credentials } from "@grpc/grpc-js";
import type { ChannelCredentials, ClientReadableStream, ServiceError } from "@grpc/grpc-js";

import { CancelledError } from "../errors.js";
import { bearer } from "./auth.js";
import { KEEPALIVE_TIMEOUT_MS, KEEPALIVE_TIME_MS, MAX_MESSAGE_BYTES } from "./server.js";
import { errorFromServiceError } from "./status.js";

export interface ClientOptions {
  readonly token?: string | null;
  readonly credentials?: ChannelCredentials;
  /** Separates control from data connections to the same target (section 3.5 item 2). */
  readonly role?: "control" | "data";
}

export interface CallOptionsOf {
  readonly timeoutS?: number;
  readonly signal?: AbortSignal;
  readonly metadata?: Metadata;
}

const DEFAULT_TIMEOUT_S = 60;

/** Turn a failed call into the protocol error it carries, else keep the transport error. */
export function callError(error: ServiceError): Error {
  return errorFromServiceError(error) ?? error;
}

export class TurnpointClient {
  private readonly client: Client;
  private readonly token: string | null;

  constructor(target: string, options: ClientOptions = {}) {
    this.token = options.token ?? null;
    this.client = new Client(target, options.credentials ?? credentials.createInsecure(), {
      "grpc.keepalive_time_ms": KEEPALIVE_TIME_MS,
      "grpc.keepalive_timeout_ms": KEEPALIVE_TIMEOUT_MS,
      "grpc.keepalive_permit_without_calls": 1,
      "grpc.max_receive_message_length": MAX_MESSAGE_BYTES,
      "grpc.max_send_message_length": MAX_MESSAGE_BYTES,
      "grpc.initial_reconnect_backoff_ms": 200,
      "grpc.max_reconnect_backoff_ms": 5000,
      "turnpoint.channel_role": options.role ?? "data",
    });
  }

  private metadata(extra?: Metadata): Metadata {
    const metadata = extra?.clone() ?? new Metadata();
    if (this.token !== null) metadata.set("authorization", bearer(this.token));
    return metadata;
  }

  private static path(service: DescService, method: DescMethod): string {
    return `/${service.typeName}/${method.name}`;
  }

  unary<I extends DescMessage, O extends DescMessage>(
    service: DescService,
    method: DescMethod & { input: I; output: O },
    request: MessageInitShape<I>,
    options: CallOptionsOf = {},
  ): Promise<MessageShape<O>> {
    const input = method.input as I;
    const output = method.output as O;
    return new Promise((resolve, reject) => {
      if (options.signal?.aborted) return reject(new CancelledError());
      const call = this.client.makeUnaryRequest(
        TurnpointClient.path(service, method),
        (value: MessageShape<I>) => Buffer.from(toBinary(input, value)),
        (bytes: Buffer) => fromBinary(output, bytes),
        create(input, request),
        this.metadata(options.metadata),
        { deadline: Date.now() + (options.timeoutS ?? DEFAULT_TIMEOUT_S) * 1000 },
        (error, value) => {
          options.signal?.removeEventListener("abort", cancel);
          if (error !== null) reject(options.signal?.aborted ? new CancelledError() : callError(error));
          else resolve(value as MessageShape<O>);
        },
      );
      const cancel = (): void => call.cancel();
      options.signal?.addEventListener("abort", cancel, { once: true });
    });
  }

  /** A server stream, read to its end. */
  async *serverStream<I extends DescMessage, O extends DescMessage>(
    service: DescService,
    method: DescMethod & { input: I; output: O },
    request: MessageInitShape<I>,
    options: CallOptionsOf = {},
  ): AsyncGenerator<MessageShape<O>, void, undefined> {
    const input = method.input as I;
    const output = method.output as O;
    if (options.signal?.aborted) throw new CancelledError();
    const call: ClientReadableStream<MessageShape<O>> = this.client.makeServerStreamRequest(
      TurnpointClient.path(service, method),
      (value: MessageShape<I>) => Buffer.from(toBinary(input, value)),
      (bytes: Buffer) => fromBinary(output, bytes),
      create(input, request),
      this.metadata(options.metadata),
      { deadline: Date.now() + (options.timeoutS ?? DEFAULT_TIMEOUT_S) * 1000 },
    );
    const cancel = (): void => call.cancel();
    options.signal?.addEventListener("abort", cancel, { once: true });
    try {
      for await (const message of call) yield message as MessageShape<O>;
    } catch (error) {
      if (options.signal?.aborted) throw new CancelledError();
      throw callError(error as ServiceError);
    } finally {
      options.signal?.removeEventListener("abort", cancel);
      call.cancel();
    }
  }

  close(): void {
    this.client.close();
  }
}
