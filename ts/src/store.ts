/**
 * The participant's snapshot store (docs/spec.md sections 8.1 to 8.5), writing what the
 * Python reference writes (turnpoint.participant_sdk._store), so that the Python coordinator
 * verifies and a restarted participant restores it:
 *
 *     <root>/<snapshot>/<instance>/records-<sha256>.jsonl
 *     <root>/<snapshot>/<instance>/MANIFEST.json          created last, never replaced
 *
 * A write encodes every record first, writes a dot-named temporary file, fsyncs it,
 * takes an exclusive flock(2) on the instance directory (the same lock the Python store
 * takes, through util-linux flock(1): Node has no flock), deletes records files no
 * manifest names, links the temporary file to its digest name, fsyncs the directory,
 * then creates the manifest from a fsynced temporary file hard-linked into place (a
 * link never replaces: a losing writer cannot overwrite a winner).
 *
 * A read opens files without following symlinks, only regular ones, parses the
 * manifest strictly and checks size, digest, record count and episodes of the whole
 * records file before returning any record.
 *
 * All file I/O goes through fs.promises (libuv's thread pool), never blocking the loop.
 */
import { spawn } from "node:child_process";
import { randomBytes } from "node:crypto";
import { constants, promises as fs } from "node:fs";
import { constants as osConstants } from "node:os";
import path from "node:path";

import { TurnpointError } from "./errors.js";
import type { EpisodeId } from "./ids.js";
import { compareEpisodes, episodeKey, validateId } from "./ids.js";
import type { ArtifactRef } from "./protocol.js";
import { sameArtifact } from "./protocol.js";
import type { Manifest, Record, SnapshotEntry } from "./records.js";
import {
  CorruptSnapshotError,
  MANIFEST_NAME,
  RECORDS_NAME,
  decodeRecords,
  encodeRecords,
  entryOf,
  manifestBytes,
  parseManifest,
  sameManifest,
  sha256Hex,
} from "./records.js";

const MAX_MANIFEST_BYTES = 64 * 1024 * 1024;
const FILE_MODE = 0o644;

/** The directory already holds a published snapshot other than the one being written. */
export class SnapshotConflictError extends TurnpointError {
  constructor(snapshot: string, instance: string, publishedCheckpointId: string, checkpointId: string) {
    const same = publishedCheckpointId === checkpointId;
    super(
      "CHECKPOINT_CONFLICT",
      `snapshot ${JSON.stringify(snapshot)} of instance ${JSON.stringify(instance)} is already published for checkpoint ` +
        `${JSON.stringify(publishedCheckpointId)}${same ? " with other content" : `, not ${JSON.stringify(checkpointId)}`}`,
      { snapshot, published_checkpoint_id: publishedCheckpointId },
    );
    this.name = "SnapshotConflictError";
  }
}

/** The write's ticket was cancelled before publication; nothing of it is left on disk. */
export class WriteCancelled extends TurnpointError {
  constructor(snapshot: string, instance: string, checkpointId: string) {
    super(
      "STALE_CHECKPOINT",
      `write of checkpoint ${JSON.stringify(checkpointId)} into snapshot ${JSON.stringify(snapshot)} of instance ` +
        `${JSON.stringify(instance)} was cancelled before publication`,
      { checkpoint_id: checkpointId },
    );
    this.name = "WriteCancelled";
  }
}

/** The participant's own disk failed: transient, the same id is retried (section 4.8 item 8). */
export function storageError(error: unknown, what: string): TurnpointError {
  if (error instanceof TurnpointError) return error;
  const code = (error as NodeJS.ErrnoException | null)?.code;
  if (typeof code === "string") {
    const errno = (osConstants.errno as { [name: string]: number })[code];
    return new TurnpointError("STORAGE_UNAVAILABLE", `${what} failed on storage: ${code}`, {
      errno: errno === undefined ? code : String(errno),
    });
  }
  throw error;
}

export type WriteState = "writing" | "publishing" | "published" | "failed" | "cancelled";

/**
 * The handshake between one commit write and a Resume that wants to stop it: `cancel()`
 * returns `cancelled` (nothing will be published), `publishing` (under way: wait for
 * it) or a settled state.
 */
export class WriteTicket {
  private _state: WriteState = "writing";
  private claimed = false;
  private readonly settledWaiters: Array<() => void> = [];

  get state(): WriteState {
    return this._state;
  }

  cancel(): WriteState {
    if (this._state === "writing") this.set("cancelled");
    return this._state;
  }

  /** Resolves once the write published, failed or was cancelled. */
  settled(): Promise<WriteState> {
    if (this._state !== "writing" && this._state !== "publishing") return Promise.resolve(this._state);
    return new Promise((resolve) => this.settledWaiters.push(() => resolve(this._state)));
  }

  /** @internal the writer's side */
  claim(): boolean {
    if (this.claimed) throw new Error("a WriteTicket serves exactly one write");
    this.claimed = true;
    return this._state === "writing";
  }
  /** @internal */
  stillWriting(): boolean {
    return this._state === "writing";
  }
  /** @internal */
  beginPublish(): boolean {
    if (this._state !== "writing") return false;
    this.set("publishing");
    return true;
  }
  /** @internal */
  settle(published: boolean): void {
    if (this._state !== "cancelled") this.set(published ? "published" : "failed");
    else this.set("cancelled");
  }

  private set(state: WriteState): void {
    this._state = state;
    if (state !== "writing" && state !== "publishing") {
      for (const wake of this.settledWaiters.splice(0)) wake();
    }
  }
}

/** Named places in the write path where a test's fault hook strikes. */
export type FaultPoint = "records_write" | "publish" | "manifest_write";
export type FaultHook = (point: FaultPoint, file: string) => void | Promise<void>;

export interface LoadedSnapshot {
  readonly entry: SnapshotEntry;
  readonly records: readonly Record[];
}

export interface ReadExpectations {
  /** The manifest's own reference (a restore request's `entry.manifest`). */
  readonly manifest?: ArtifactRef;
  /** The artifact list, when the caller knows it (non-empty `entry.artifacts`). */
  readonly artifacts?: readonly ArtifactRef[];
  readonly checkpointId?: string;
}

function tempName(prefix: string): string {
  return `${prefix}${randomBytes(8).toString("hex")}.tmp`;
}

async function fsyncDir(dir: string): Promise<void> {
  const handle = await fs.open(dir, constants.O_RDONLY | constants.O_DIRECTORY);
  try {
    await handle.sync();
  } finally {
    await handle.close();
  }
}

async function exists(file: string): Promise<boolean> {
  try {
    await fs.lstat(file);
    return true;
  } catch (error) {
    if ((error as NodeJS.ErrnoException).code === "ENOENT") return false;
    throw error;
  }
}

/** Create `file` exclusively, write and fsync it; on any failure remove it. */
async function writeNew(file: string, data: Buffer, beforeWrite?: () => Promise<void>): Promise<void> {
  const handle = await fs.open(file, constants.O_WRONLY | constants.O_CREAT | constants.O_EXCL, FILE_MODE);
  try {
    try {
      if (beforeWrite !== undefined) await beforeWrite();
      let offset = 0;
      while (offset < data.length) {
        const { bytesWritten } = await handle.write(data, offset, data.length - offset);
        offset += bytesWritten;
      }
      await handle.sync();
    } finally {
      await handle.close();
    }
  } catch (error) {
    await fs.rm(file, { force: true });
    throw error;
  }
}

// One chain per directory inside this process; flock(1) below excludes other processes.
const localLocks = new Map<string, Promise<unknown>>();
let flockMissingWarned = false;

/** Run `work` holding an exclusive flock(2) on `dir`, like the Python store's `_locked_dir`. */
async function withDirLock<T>(dir: string, work: () => Promise<T>): Promise<T> {
  const previous = localLocks.get(dir) ?? Promise.resolve();
  const run = previous.catch(() => undefined).then(async () => {
    const release = await flockDir(dir);
    try {
      return await work();
    } finally {
      await release();
    }
  });
  const settled = run.catch(() => undefined);
  localLocks.set(dir, settled);
  void settled.then(() => {
    if (localLocks.get(dir) === settled) localLocks.delete(dir);
  });
  return run;
}

function flockDir(dir: string): Promise<() => Promise<void>> {
  return new Promise((resolve, reject) => {
    const child = spawn("flock", ["--exclusive", dir, "sh", "-c", "echo locked; exec cat >/dev/null"], {
      stdio: ["pipe", "pipe", "ignore"],
    });
    let locked = false;
    const exited = new Promise<void>((done) => child.once("close", () => done()));
    child.once("error", (error: NodeJS.ErrnoException) => {
      if (error.code === "ENOENT") {
        if (!flockMissingWarned) {
          flockMissingWarned = true;
          console.warn("turnpoint: flock(1) not found; snapshot writes lock within this process only");
        }
        resolve(async () => undefined);
      } else reject(error);
    });
    child.stdout.once("data", () => {
      locked = true;
      resolve(async () => {
        child.stdin.end();
        await exited;
      });
    });
    child.once("close", (code) => {
      if (!locked) reject(new Error(`flock on ${dir} exited ${code} before locking`));
    });
  });
}

/** Writes and reads participant snapshots under one configured root directory. */
export class SnapshotStore {
  readonly root: string;

  constructor(
    root: string,
    private readonly faults?: FaultHook,
  ) {
    this.root = path.resolve(root);
  }

  private async hit(point: FaultPoint, file: string): Promise<void> {
    if (this.faults !== undefined) await this.faults(point, file);
  }

  instanceDir(snapshot: string, instance: string): string {
    return path.join(this.root, validateId(snapshot, "snapshot"), validateId(instance, "instance"));
  }

  // ---------------------------------------------------------------- writing

  /**
   * Write `records` and publish them for `checkpointId`; return what was published. The
   * same records give the same bytes, so a retry returns the published entry; another
   * checkpoint or other content is a SnapshotConflictError. Disk errors propagate
   * (NodeJS.ErrnoException) with nothing of this write left behind.
   */
  async write(snapshot: string, instance: string, checkpointId: string, records: Iterable<Record>, ticket = new WriteTicket()): Promise<SnapshotEntry> {
    if (!ticket.claim()) throw new WriteCancelled(snapshot, instance, checkpointId);
    let published = false;
    try {
      validateId(snapshot, "snapshot");
      validateId(instance, "instance");
      validateId(checkpointId, "checkpoint_id");
      const entry = await this.writeClaimed(snapshot, instance, checkpointId, records, ticket);
      published = true;
      return entry;
    } finally {
      ticket.settle(published);
    }
  }

  private async writeClaimed(
    snapshot: string,
    instance: string,
    checkpointId: string,
    records: Iterable<Record>,
    ticket: WriteTicket,
  ): Promise<SnapshotEntry> {
    const { data, ref, episodes } = encodeRecords(instance, records);
    const manifest: Manifest = { checkpointId, instance, artifacts: [ref], episodes };
    const bytes = manifestBytes(manifest);
    const dir = await this.makeDir(snapshot, instance);
    const manifestPath = path.join(dir, MANIFEST_NAME);
    // A published directory never changes: a retry needs no lock.
    if (await exists(manifestPath)) return this.settleAgainstPublished(snapshot, instance, dir, manifest, ticket);
    if (!ticket.stillWriting()) throw new WriteCancelled(snapshot, instance, checkpointId);
    const temp = path.join(dir, tempName(".records-"));
    await writeNew(temp, data, async () => {
      await this.hit("records_write", temp);
      if (!ticket.stillWriting()) throw new WriteCancelled(snapshot, instance, checkpointId);
    });
    try {
      return await withDirLock(dir, async () => {
        if (await exists(manifestPath)) return this.settleAgainstPublished(snapshot, instance, dir, manifest, ticket);
        return this.publish(snapshot, dir, temp, ref, manifest, bytes, ticket);
      });
    } finally {
      await fs.rm(temp, { force: true });
    }
  }

  private async publish(
    snapshot: string,
    dir: string,
    temp: string,
    ref: ArtifactRef,
    manifest: Manifest,
    bytes: Buffer,
    ticket: WriteTicket,
  ): Promise<SnapshotEntry> {
    const instance = manifest.instance;
    // Under the lock and without a manifest, a digest-named file can only be the remains
    // of a writer that died mid-publish: nothing names it, so it goes.
    for (const name of await fs.readdir(dir)) {
      if (RECORDS_NAME.test(name)) await fs.rm(path.join(dir, name), { force: true });
    }
    const final = path.join(dir, path.basename(ref.path));
    await fs.link(temp, final);
    let keepRecords = false;
    try {
      await fs.rm(temp, { force: true });
      await fsyncDir(dir);
      await this.hit("publish", final);
      if (!ticket.beginPublish()) throw new WriteCancelled(snapshot, instance, manifest.checkpointId);
      const manifestTemp = path.join(dir, tempName(".manifest-"));
      await writeNew(manifestTemp, bytes, () => this.hit("manifest_write", manifestTemp));
      try {
        await fs.link(manifestTemp, path.join(dir, MANIFEST_NAME));
        // From the instant the manifest exists it names the records file: keep it.
        keepRecords = true;
      } catch (error) {
        if ((error as NodeJS.ErrnoException).code !== "EEXIST") throw error;
        // Only a writer that ignores the lock gets here; its manifest stands.
        const [published] = await this.loadManifest(snapshot, instance, dir);
        keepRecords = published.artifacts.some((a) => sameArtifact(a, ref));
        return await this.settleAgainstPublished(snapshot, instance, dir, manifest, ticket, true);
      } finally {
        await fs.rm(manifestTemp, { force: true });
      }
      await fsyncDir(dir);
    } finally {
      if (!keepRecords) {
        await fs.rm(final, { force: true });
        await fsyncDir(dir).catch(() => undefined);
      }
    }
    return entryOf(manifest, bytes);
  }

  private async settleAgainstPublished(
    snapshot: string,
    instance: string,
    dir: string,
    ours: Manifest,
    ticket: WriteTicket,
    publishing = false,
  ): Promise<SnapshotEntry> {
    const [published, bytes] = await this.loadManifest(snapshot, instance, dir);
    if (!sameManifest(published, ours)) throw new SnapshotConflictError(snapshot, instance, published.checkpointId, ours.checkpointId);
    for (const ref of published.artifacts) {
      let size = -1;
      try {
        size = (await fs.stat(path.join(dir, path.basename(ref.path)))).size;
      } catch (error) {
        if ((error as NodeJS.ErrnoException).code !== "ENOENT") throw error;
      }
      if (size !== ref.sizeBytes) throw new CorruptSnapshotError(snapshot, instance, "size_mismatch", `${ref.path} is damaged`);
    }
    if (!publishing && !ticket.beginPublish()) throw new WriteCancelled(snapshot, instance, ours.checkpointId);
    // The earlier writer may have failed between linking and fsyncing the directory.
    await fsyncDir(dir);
    return entryOf(published, bytes);
  }

  private async makeDir(snapshot: string, instance: string): Promise<string> {
    const dir = await this.checkedDir(snapshot, instance);
    await fs.mkdir(this.root, { recursive: true });
    for (const component of [path.dirname(dir), dir]) {
      try {
        await fs.mkdir(component);
      } catch (error) {
        if ((error as NodeJS.ErrnoException).code === "EEXIST") continue;
        throw error;
      }
      // A new directory entry is only durable once its parent is fsynced.
      await fsyncDir(path.dirname(component));
    }
    // Re-check now that the components exist: one could be a symlink planted meanwhile.
    return this.checkedDir(snapshot, instance);
  }

  // ---------------------------------------------------------------- reading

  /**
   * Verify a published instance directory whole (section 8.5), then return the records
   * whose episode `select` keeps. Every mismatch raises CorruptSnapshotError first.
   */
  async read(snapshot: string, instance: string, expected: ReadExpectations = {}, select?: (e: EpisodeId) => boolean): Promise<LoadedSnapshot> {
    const dir = await this.checkedDir(snapshot, instance);
    const [manifest, bytes] = await this.loadManifest(snapshot, instance, dir);
    const entry = entryOf(manifest, bytes);
    const unexpected = (what: string): never => {
      throw new CorruptSnapshotError(snapshot, instance, "unexpected_content", what);
    };
    if (expected.manifest !== undefined && !sameArtifact(expected.manifest, entry.manifest)) {
      unexpected(`manifest ${JSON.stringify(entry.manifest)} differs from the expected ${JSON.stringify(expected.manifest)}`);
    }
    if (expected.checkpointId !== undefined && expected.checkpointId !== manifest.checkpointId) {
      unexpected(`holds checkpoint ${JSON.stringify(manifest.checkpointId)}, not ${JSON.stringify(expected.checkpointId)}`);
    }
    if (
      expected.artifacts !== undefined &&
      (expected.artifacts.length !== manifest.artifacts.length ||
        expected.artifacts.some((ref, i) => !sameArtifact(ref, manifest.artifacts[i] as ArtifactRef)))
    ) {
      unexpected("the artifacts differ from the expected ones");
    }
    const loaded: Record[] = [];
    for (const ref of manifest.artifacts) {
      const data = await this.readVerified(snapshot, instance, dir, ref);
      loaded.push(...decodeRecords(snapshot, instance, ref, data));
    }
    const found = new Map<string, EpisodeId>();
    for (const record of loaded) found.set(episodeKey(record.episode), record.episode);
    const foundKeys = [...found.values()].sort(compareEpisodes).map(episodeKey);
    const listed = manifest.episodes.map(episodeKey);
    if (foundKeys.join("\n") !== listed.join("\n")) {
      throw new CorruptSnapshotError(
        snapshot,
        instance,
        "episodes_mismatch",
        `records hold episodes ${JSON.stringify(foundKeys)}, the manifest lists ${JSON.stringify(listed)}`,
      );
    }
    return { entry, records: select === undefined ? loaded : loaded.filter((r) => select(r.episode)) };
  }

  private async loadManifest(snapshot: string, instance: string, dir: string): Promise<[Manifest, Buffer]> {
    const data = await readFileChecked(snapshot, instance, path.join(dir, MANIFEST_NAME), MAX_MANIFEST_BYTES);
    if (data.length > MAX_MANIFEST_BYTES) throw new CorruptSnapshotError(snapshot, instance, "manifest_invalid", "manifest is too large");
    return [parseManifest(snapshot, instance, data), data];
  }

  private async readVerified(snapshot: string, instance: string, dir: string, ref: ArtifactRef): Promise<Buffer> {
    // One byte more than promised, so a file that grew is caught without reading it all.
    const data = await readFileChecked(snapshot, instance, path.join(dir, path.basename(ref.path)), ref.sizeBytes);
    if (data.length !== ref.sizeBytes) {
      throw new CorruptSnapshotError(
        snapshot,
        instance,
        "size_mismatch",
        `${ref.path} has ${data.length > ref.sizeBytes ? "more than " : ""}${data.length} bytes, the manifest says ${ref.sizeBytes}`,
      );
    }
    const digest = sha256Hex(data);
    if (digest !== ref.sha256) {
      throw new CorruptSnapshotError(snapshot, instance, "digest_mismatch", `${ref.path} has sha256 ${digest}, the manifest says ${ref.sha256}`);
    }
    return data;
  }

  // ---------------------------------------------------------------- paths

  private async checkedDir(snapshot: string, instance: string): Promise<string> {
    const dir = this.instanceDir(snapshot, instance);
    // Valid ids cannot leave the root, but a symlink planted under it still could: the
    // resolved path must be exactly where the ids say (section 8.1).
    const realRoot = await realpathPrefix(this.root);
    const expected = path.join(realRoot, snapshot, instance);
    const resolved = await realpathPrefix(dir);
    if (resolved !== expected) throw new CorruptSnapshotError(snapshot, instance, "path_escape", `${dir} resolves to ${resolved}`);
    return dir;
  }
}

/** realpath of the longest existing prefix, with the missing rest appended (Path.resolve). */
async function realpathPrefix(target: string): Promise<string> {
  let existing = target;
  const rest: string[] = [];
  for (;;) {
    try {
      return path.join(await fs.realpath(existing), ...rest.reverse());
    } catch (error) {
      if ((error as NodeJS.ErrnoException).code !== "ENOENT") throw error;
      const parent = path.dirname(existing);
      if (parent === existing) return target;
      rest.push(path.basename(existing));
      existing = parent;
    }
  }
}

/** Read at most `limit + 1` bytes of a regular file that is not a symlink. */
async function readFileChecked(snapshot: string, instance: string, file: string, limit: number): Promise<Buffer> {
  let handle: fs.FileHandle;
  try {
    // O_NONBLOCK: opening a planted FIFO must fail the check below, not hang.
    handle = await fs.open(file, constants.O_RDONLY | constants.O_NOFOLLOW | constants.O_NONBLOCK);
  } catch (error) {
    const code = (error as NodeJS.ErrnoException).code;
    if (code === "ENOENT") throw new CorruptSnapshotError(snapshot, instance, "missing", `${path.basename(file)} does not exist`);
    if (code === "ELOOP") throw new CorruptSnapshotError(snapshot, instance, "path_escape", `${path.basename(file)} is a symlink`);
    throw error;
  }
  try {
    const stats = await handle.stat();
    if (!stats.isFile()) {
      throw new CorruptSnapshotError(snapshot, instance, "record_invalid", `${path.basename(file)} is not a regular file`);
    }
    const buffer = Buffer.alloc(Math.min(limit, stats.size) + 1);
    let total = 0;
    while (total < buffer.length) {
      const { bytesRead } = await handle.read(buffer, total, buffer.length - total, total);
      if (bytesRead === 0) break;
      total += bytesRead;
    }
    return buffer.subarray(0, total);
  } finally {
    await handle.close();
  }
}
