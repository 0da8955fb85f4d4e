/**
 * JSON as the snapshot files need it (docs/spec.md sections 8.2, 8.3, 8.5):
 *
 * - `parseStrict`: a parser that refuses what the Python reference refuses: duplicate
 *   keys, NaN/Infinity, nesting past a bound, anything after the document.
 * - `encodeCompact` / `encodeIndented`: the bytes the Python reference writes
 *   (`json.dumps(..., ensure_ascii=True)`): every character outside space..tilde is a
 *   lowercase `\uXXXX` escape (DEL and astral characters as UTF-16 pairs included), so
 *   the output is ASCII and the same in both languages for strings, integers, booleans,
 *   null, objects and arrays.
 *
 * Known differences from the Python writer, all equal in meaning: JavaScript has one
 * number type, so a float that happens to be integral is written `1`, not `1.0`, and
 * exponents are written `1e-7` / `1e+21`, not `1e-07` / `1e+16`. Object keys that look
 * like array indices (`"7"`) are ordered first by every JavaScript object, so a payload
 * that mixes such keys with others does not keep its key order through this SDK.
 */

export class StrictJsonError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "StrictJsonError";
  }
}

const NOT_ASCII_PRINTABLE = /[\u007f-\uffff]/g;

function asciiString(text: string): string {
  // JSON.stringify escapes quotes, backslashes, control characters and lone surrogates
  // (lowercase hex); what is left above '~' is escaped here as Python does.
  return JSON.stringify(text).replace(NOT_ASCII_PRINTABLE, (c) => `\\u${c.charCodeAt(0).toString(16).padStart(4, "0")}`);
}

function encodeNumber(value: number): string {
  if (!Number.isFinite(value)) throw new StrictJsonError(`${value} is not a JSON number`);
  return Object.is(value, -0) ? "-0.0" : JSON.stringify(value);
}

function encode(value: unknown, indent: string | null, level: number): string {
  if (value === null) return "null";
  switch (typeof value) {
    case "boolean":
      return value ? "true" : "false";
    case "number":
      return encodeNumber(value);
    case "string":
      return asciiString(value);
    case "object":
      break;
    default:
      throw new StrictJsonError(`${typeof value} is not JSON`);
  }
  const inner = indent === null ? "" : `\n${indent.repeat(level + 1)}`;
  const outer = indent === null ? "" : `\n${indent.repeat(level)}`;
  const sep = indent === null ? ":" : ": ";
  if (Array.isArray(value)) {
    if (value.length === 0) return "[]";
    const items = value.map((item) => inner + encode(item, indent, level + 1));
    return `[${items.join(",")}${outer}]`;
  }
  const entries = Object.entries(value as Record<string, unknown>);
  if (entries.length === 0) return "{}";
  const items = entries.map(([key, item]) => `${inner}${asciiString(key)}${sep}${encode(item, indent, level + 1)}`);
  return `{${items.join(",")}${outer}}`;
}

/** `json.dumps(value, ensure_ascii=True, separators=(",", ":"))`. */
export function encodeCompact(value: unknown): string {
  return encode(value, null, 0);
}

/** `json.dumps(value, indent=2, ensure_ascii=True)`. */
export function encodeIndented(value: unknown): string {
  return encode(value, "  ", 0);
}

/** Parse one JSON document strictly; `maxDepth` bounds nesting of objects and arrays. */
export function parseStrict(text: string, maxDepth = 100): unknown {
  let pos = 0;
  const fail = (why: string): never => {
    throw new StrictJsonError(`${why} at offset ${pos}`);
  };
  const ws = (): void => {
    while (pos < text.length) {
      const c = text.charCodeAt(pos);
      if (c === 0x20 || c === 0x09 || c === 0x0a || c === 0x0d) pos++;
      else break;
    }
  };
  const str = (): string => {
    const start = pos;
    pos++; // opening quote
    for (;;) {
      if (pos >= text.length) fail("unterminated string");
      const c = text.charCodeAt(pos);
      if (c === 0x22) break;
      if (c < 0x20) fail("control character in a string");
      if (c === 0x5c) pos++;
      pos++;
    }
    pos++;
    try {
      return JSON.parse(text.slice(start, pos)) as string;
    } catch {
      return fail("invalid string escape");
    }
  };
  const num = (): number => {
    const match = /^-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?/.exec(text.slice(pos, pos + 400));
    if (match === null) return fail("invalid value");
    pos += match[0].length;
    const value = Number(match[0]);
    if (!Number.isFinite(value)) fail("number out of range");
    return value;
  };
  const value = (depth: number): unknown => {
    ws();
    const c = text[pos];
    if (c === "{") {
      if (depth >= maxDepth) fail(`nested deeper than ${maxDepth}`);
      pos++;
      const result: Record<string, unknown> = {};
      const seen = new Set<string>();
      ws();
      if (text[pos] === "}") {
        pos++;
        return result;
      }
      for (;;) {
        ws();
        if (text[pos] !== '"') fail("expected a key");
        const key = str();
        if (seen.has(key)) fail(`duplicate key ${JSON.stringify(key)}`);
        seen.add(key);
        ws();
        if (text[pos] !== ":") fail("expected ':'");
        pos++;
        Object.defineProperty(result, key, { value: value(depth + 1), enumerable: true, writable: true, configurable: true });
        ws();
        if (text[pos] === ",") {
          pos++;
          continue;
        }
        if (text[pos] === "}") {
          pos++;
          return result;
        }
        fail("expected ',' or '}'");
      }
    }
    if (c === "[") {
      if (depth >= maxDepth) fail(`nested deeper than ${maxDepth}`);
      pos++;
      const result: unknown[] = [];
      ws();
      if (text[pos] === "]") {
        pos++;
        return result;
      }
      for (;;) {
        result.push(value(depth + 1));
        ws();
        if (text[pos] === ",") {
          pos++;
          continue;
        }
        if (text[pos] === "]") {
          pos++;
          return result;
        }
        fail("expected ',' or ']'");
      }
    }
    if (c === '"') return str();
    if (text.startsWith("true", pos)) {
      pos += 4;
      return true;
    }
    if (text.startsWith("false", pos)) {
      pos += 5;
      return false;
    }
    if (text.startsWith("null", pos)) {
      pos += 4;
      return null;
    }
    if (c === "N" || c === "I" || (c === "-" && text[pos + 1] === "I")) fail("NaN and Infinity are not JSON");
    return num();
  };
  const result = value(0);
  ws();
  if (pos !== text.length) fail("extra data after the document");
  return result;
}

export function isPlainObject(value: unknown): value is Record<string, unknown> {
  if (value === null || typeof value !== "object" || Array.isArray(value)) return false;
  const proto = Object.getPrototypeOf(value) as unknown;
  return proto === Object.prototype || proto === null;
}

/** A deep copy of plain JSON data (what a boundary's state or a session export is). */
export function cloneJson<T>(value: T): T {
  return structuredClone(value);
}
