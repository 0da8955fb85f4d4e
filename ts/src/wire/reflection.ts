/**
 * Server reflection (docs/spec.md section 3.8), `grpc.reflection.v1` and `v1alpha`, so
 * that `buf curl --list-services` and the conformance kit see what is served. Answers
 * from the descriptors protobuf-es generated: list_services, file_by_filename and
 * file_containing_symbol (each file with its dependencies); extensions are NOT_FOUND.
 * Open: it needs no token (section 10.2).
 */
import { create, createRegistry, toBinary } from "@bufbuild/protobuf";
import type { DescFile, DescService } from "@bufbuild/protobuf";
import { FileDescriptorProtoSchema } from "@bufbuild/protobuf/wkt";
import type { ServerDuplexStream } from "@grpc/grpc-js";

import * as v1 from "../gen/grpc/reflection/v1/reflection_pb.js";
import * as v1alpha from "../gen/grpc/reflection/v1alpha/reflection_pb.js";
import type { Door, Implementation } from "./door.js";
import { decode, encode } from "./door.js";

type Module = typeof v1 | typeof v1alpha;

function withDependencies(file: DescFile, into: Map<string, DescFile>): void {
  if (into.has(file.proto.name)) return;
  into.set(file.proto.name, file);
  for (const dependency of file.dependencies) withDependencies(dependency, into);
}

export class ReflectionService {
  private readonly files = new Map<string, DescFile>();
  private readonly registry;
  private readonly serviceNames: string[];

  constructor(services: readonly DescService[]) {
    for (const service of [...services, v1.ServerReflection, v1alpha.ServerReflection]) withDependencies(service.file, this.files);
    this.registry = createRegistry(...this.files.values());
    this.serviceNames = [...services, v1.ServerReflection, v1alpha.ServerReflection].map((s) => s.typeName);
  }

  private fileOfSymbol(symbol: string): DescFile | undefined {
    const found = this.registry.get(symbol);
    if (found !== undefined) return found.file;
    // A method is named <service>.<method>.
    const dot = symbol.lastIndexOf(".");
    const service = this.registry.getService(symbol.slice(0, dot));
    return service?.methods.some((m) => m.name === symbol.slice(dot + 1)) ? service.file : undefined;
  }

  private answer(module: Module, request: v1.ServerReflectionRequest | v1alpha.ServerReflectionRequest): Buffer {
    const m = module as typeof v1;
    const base = { validHost: request.host, originalRequest: request as v1.ServerReflectionRequest };
    const notFound = (what: string): v1.ServerReflectionResponse =>
      create(m.ServerReflectionResponseSchema, {
        ...base,
        messageResponse: { case: "errorResponse", value: create(m.ErrorResponseSchema, { errorCode: 5, errorMessage: `${what} not found` }) },
      });
    const files = (file: DescFile | undefined, what: string): v1.ServerReflectionResponse => {
      if (file === undefined) return notFound(what);
      const all = new Map<string, DescFile>();
      withDependencies(file, all);
      return create(m.ServerReflectionResponseSchema, {
        ...base,
        messageResponse: {
          case: "fileDescriptorResponse",
          value: create(m.FileDescriptorResponseSchema, { fileDescriptorProto: [...all.values()].map((f) => toBinary(FileDescriptorProtoSchema, f.proto)) }),
        },
      });
    };
    let response: v1.ServerReflectionResponse;
    switch (request.messageRequest.case) {
      case "listServices":
        response = create(m.ServerReflectionResponseSchema, {
          ...base,
          messageResponse: {
            case: "listServicesResponse",
            value: create(m.ListServiceResponseSchema, { service: this.serviceNames.map((name) => create(m.ServiceResponseSchema, { name })) }),
          },
        });
        break;
      case "fileByFilename":
        response = files(this.files.get(request.messageRequest.value), `file ${request.messageRequest.value}`);
        break;
      case "fileContainingSymbol":
        response = files(this.fileOfSymbol(request.messageRequest.value), `symbol ${request.messageRequest.value}`);
        break;
      default:
        response = notFound("extension");
    }
    return encode(m.ServerReflectionResponseSchema, response);
  }

  private serve(module: Module, call: ServerDuplexStream<Buffer, Buffer>): void {
    const m = module as typeof v1;
    call.on("data", (bytes: Buffer) => {
      try {
        call.write(this.answer(module, decode(m.ServerReflectionRequestSchema, bytes)));
      } catch {
        call.emit("error", { code: 3, details: "not a ServerReflectionRequest" });
      }
    });
    call.on("end", () => call.end());
  }

  /** [service, implementation] for v1 and v1alpha. */
  implementations(door: Door): Array<[DescService, Implementation]> {
    return [v1, v1alpha].map((module) => [
      module.ServerReflection,
      { ServerReflectionInfo: door.bidi(module.ServerReflection, "ServerReflectionInfo", (call) => this.serve(module, call), true) },
    ]);
  }
}
