/**
 * turnpoint.v1 participant SDK for TypeScript: the public face (the package's only
 * entry point, `exports["."]`).
 *
 * Implement an `Agent` or a `ResourcesServer` and host it with `serve()` (or a
 * `ParticipantRuntime` over a `SnapshotStore`, served by `ParticipantServer`). Users
 * never need the generated `gen/` modules for common work: everything here speaks plain
 * data. The protocol's machinery (the phase core, its clock, the answer log) stays
 * inside.
 */
export type { Agent, BoundaryReport, RunEvent, RunOutcome, RunResult, SavedTurn } from "./agent.js";
export { EpisodeContext, RunFollower } from "./agent.js";
export { CancelledError, DOMAIN, GrpcCode, REASON_CODES, TransientError, TurnpointError, hookFailure } from "./errors.js";
export type { Reason } from "./errors.js";
export { InvalidIdError, compareEpisodes, episode, episodeKey, supersedes, validateId } from "./ids.js";
export type { EpisodeId } from "./ids.js";
export type {
  ArtifactRef,
  Blocker,
  Capability,
  CompletionReceipt,
  EpisodeState,
  Fence,
  JsonObject,
  JsonValue,
  ParticipantKind,
  Phase,
  ReadinessReport,
  RecoveryLevel,
  RecoveryMode,
  VerifyMode,
} from "./protocol.js";
export { PROTOCOL_VERSION } from "./protocol.js";
export { CorruptSnapshotError, UnserialisableRecordError } from "./records.js";
export type { Corruption, Record, SnapshotEntry } from "./records.js";
export { EffectConflictError, effectKey } from "./effects.js";
export type { CallPosition, Divergence } from "./effects.js";
export { ConfigurationError } from "./resources.js";
export type { ResourcesServer, Verdict } from "./resources.js";
export { ParticipantRuntime } from "./runtime.js";
export type { CallOptions, CommitResult, Description, PrepareResult, RestoreResult, RuntimeOptions, StatusResult, WatchEvent } from "./runtime.js";
export { serve } from "./serve.js";
export type { Hosted, ServeOptions } from "./serve.js";
export { DEFAULT_CONFIG } from "./shared.js";
export type { RuntimeConfig } from "./shared.js";
export { SnapshotConflictError, SnapshotStore, WriteCancelled, WriteTicket } from "./store.js";
export type { FaultHook, FaultPoint } from "./store.js";
export { bearer, loadToken, loadTokenSha256, tokenSha256, validateToken } from "./wire/auth.js";
export { TurnpointClient, callError } from "./wire/client.js";
export { ParticipantServer } from "./wire/server.js";
export type { ServerOptions } from "./wire/server.js";
/** Service descriptors, for `TurnpointClient` calls to peers (an agent's policy and tools). */
export { CheckpointControlService } from "./gen/turnpoint/v1/checkpoint_control_service_pb.js";
export { PolicyService } from "./gen/turnpoint/v1/policy_service_pb.js";
export { ResourcesService } from "./gen/turnpoint/v1/resources_service_pb.js";
export { RolloutService } from "./gen/turnpoint/v1/rollout_service_pb.js";
