/**
 * Bearer-token authentication (docs/spec.md section 10.1). Every call to a protected
 * service needs exactly one `authorization: Bearer <token>` (scheme case-insensitive),
 * compared in constant time independent of length (SHA-256 digests of both, then
 * timingSafeEqual). A refusal is UNAUTHENTICATED with metadata `method` and `cause`,
 * decided before a byte of the request is parsed. The token is never logged or shown.
 *
 * Roles (section 10.2): the token is the control credential and opens every protected
 * service; a data-plane token, when configured, opens only the data-plane services and
 * is refused PERMISSION_DENIED anywhere else, so its holder cannot fence anything.
 */
import { createHash, timingSafeEqual } from "node:crypto";
import { readFileSync } from "node:fs";

import type { Metadata } from "@grpc/grpc-js";

import { TurnpointError } from "../errors.js";

export const TOKEN_ENV = "TURNPOINT_TOKEN";
export const TOKEN_FILE_ENV = "TURNPOINT_TOKEN_FILE";
/** Section 10.2 item 8: the control token's SHA-256 (hex), checked instead of the token. */
export const CONTROL_TOKEN_SHA256_ENV = "TURNPOINT_CONTROL_TOKEN_SHA256";
const MAX_TOKEN_CHARS = 4096;
/**
 * Node's HTTP/2 layer keeps only the first `authorization` header of a request; the
 * server (server.ts) reads the raw headers first and puts this mark in their place
 * when there were several, so that the call is refused as section 10.1 item 1 says.
 */
export const DUPLICATE_AUTHORIZATION = "turnpoint-duplicate-authorization";

/** The token if it can travel in metadata; the error never quotes it (section 10.1 item 2). */
export function validateToken(token: string): string {
  if (!token) throw new RangeError("the bearer token is empty");
  if (token.length > MAX_TOKEN_CHARS) throw new RangeError(`the bearer token is longer than ${MAX_TOKEN_CHARS} characters`);
  if (!/^[!-~]+$/.test(token)) throw new RangeError("the bearer token must be visible ASCII without spaces");
  return token;
}

/**
 * The server's token: `tokenFile`, else $TURNPOINT_TOKEN, else the file named by
 * $TURNPOINT_TOKEN_FILE; null when none is configured. A trailing newline is dropped.
 */
export function loadToken(tokenFile: string | null = null, env: NodeJS.ProcessEnv = process.env): string | null {
  let file = tokenFile;
  if (file === null) {
    const inline = env[TOKEN_ENV];
    if (inline) return validateToken(inline);
    file = env[TOKEN_FILE_ENV] || null;
    if (file === null) return null;
  }
  let text: string;
  try {
    text = readFileSync(file, "ascii");
  } catch (error) {
    throw new RangeError(`cannot read the token file ${JSON.stringify(file)}: ${(error as Error).message}`);
  }
  return validateToken(text.trim());
}

/** The control token's digest a participant checks calls against: SHA-256, 64 hex digits. */
export function tokenSha256(token: string): string {
  return createHash("sha256").update(Buffer.from(validateToken(token), "ascii")).digest("hex");
}

/** `text` as 64 lower-case hex digits; the error never quotes it. */
export function validateTokenSha256(text: string): string {
  const normalized = text.trim().toLowerCase();
  if (!/^[0-9a-f]{64}$/.test(normalized)) throw new RangeError("a control token digest is 64 hex digits (SHA-256 of the token)");
  return normalized;
}

/** The control token's digest: `digestFile`, else $TURNPOINT_CONTROL_TOKEN_SHA256; null when neither is set. */
export function loadTokenSha256(digestFile: string | null = null, env: NodeJS.ProcessEnv = process.env): string | null {
  if (digestFile === null) {
    const inline = env[CONTROL_TOKEN_SHA256_ENV];
    return inline ? validateTokenSha256(inline) : null;
  }
  let text: string;
  try {
    text = readFileSync(digestFile, "ascii");
  } catch (error) {
    throw new RangeError(`cannot read the digest file ${JSON.stringify(digestFile)}: ${(error as Error).message}`);
  }
  return validateTokenSha256(text);
}

/** Call metadata that authenticates one call. */
export function bearer(token: string): string {
  return `Bearer ${validateToken(token)}`;
}

function digest(value: Buffer): Buffer {
  return createHash("sha256").update(value).digest();
}

/** Why a call is refused: no valid credential, or one whose role may not call it. */
export interface Refusal {
  readonly reason: "UNAUTHENTICATED" | "PERMISSION_DENIED";
  readonly cause: string;
}

/** Checks the bearer token of incoming calls. */
export class TokenCheck {
  private readonly expected: Buffer;
  private readonly dataExpected: Buffer | null;
  private readonly dataServices: ReadonlySet<string>;

  /**
   * `token` is the control credential, or `{ sha256 }` its digest (section 10.2 item 8:
   * checked without holding the token). `dataToken` (distinct from it) opens only the
   * services named in `dataServices` (full names, `turnpoint.v1.RolloutService`).
   */
  constructor(token: string | { readonly sha256: string }, dataToken: string | null = null, dataServices: Iterable<string> = []) {
    this.expected =
      typeof token === "string" ? digest(Buffer.from(validateToken(token), "ascii")) : Buffer.from(validateTokenSha256(token.sha256), "hex");
    this.dataExpected = dataToken === null ? null : digest(Buffer.from(validateToken(dataToken), "ascii"));
    if (this.dataExpected !== null && timingSafeEqual(this.dataExpected, this.expected)) {
      throw new RangeError("the data-plane token must differ from the control token");
    }
    this.dataServices = new Set(dataServices);
  }

  /** Why the metadata does not authorize a call of `path` (`/package.Service/Method`); null when it does. */
  refusal(metadata: Metadata, path = ""): Refusal | null {
    const presented = this.presented(metadata);
    if (typeof presented === "string") return { reason: "UNAUTHENTICATED", cause: presented };
    // Both comparisons always run: timing does not tell which credential matched.
    const isControl = timingSafeEqual(presented, this.expected);
    const isData = this.dataExpected !== null && timingSafeEqual(presented, this.dataExpected);
    if (isControl) return null;
    if (!isData) return { reason: "UNAUTHENTICATED", cause: "bearer token not accepted" };
    if (this.dataServices.has(path.split("/")[1] ?? "")) return null;
    return { reason: "PERMISSION_DENIED", cause: "a data-plane credential cannot call this service" };
  }

  /** The digest of the presented token, or why there is none to check. */
  private presented(metadata: Metadata): Buffer | string {
    const values = metadata.get("authorization");
    if (values.length === 0) return "missing bearer token";
    if (values.length > 1) return "more than one authorization header";
    const value = values[0];
    if (typeof value !== "string") return "malformed authorization header";
    if (value === DUPLICATE_AUTHORIZATION) return "more than one authorization header";
    const space = value.indexOf(" ");
    const scheme = space < 0 ? value : value.slice(0, space);
    const presented = space < 0 ? "" : value.slice(space + 1);
    if (scheme.toLowerCase() !== "bearer" || !presented) return "authorization is not a bearer token";
    // Fixed-length digests: the comparison reveals neither the token's bytes nor its length.
    return digest(Buffer.from(presented, "utf8"));
  }

  /** The error a refused call ends with (section 10.1 item 4, section 10.2). */
  static error(method: string, refusal: Refusal): TurnpointError {
    const { reason, cause } = refusal;
    return new TurnpointError(reason, `${method}: ${cause}`, { method, cause });
  }
}
