"""The restore side of the coordinator (docs/spec.md section 7.7).

:class:`RestoreOperations` restores every participant from a published snapshot while
they stay closed, and cleans up whatever happens: a restore that fails on any
participant has an uncertain outcome on all of them, so the replacement attempts are
retired everywhere and every participant is resumed.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from types import MappingProxyType

from turnpoint._convert import duration_from_seconds, episode_to_proto
from turnpoint.ids import EpisodeId, validate_id
from turnpoint.protocol import ArtifactRef
from turnpoint.trainer.control.failures import Failure, MalformedReplyError, classify
from turnpoint.trainer.control.operations import (
    JOINING_ATTEMPTS,
    ControlOperations,
    Renewer,
    episodes_of,
)
from turnpoint.trainer.control.outcomes import OperationFailed, RestoredCheckpoint, RestoreFailed
from turnpoint.trainer.snapshots.core import installed_problem
from turnpoint.trainer.storage.manifest import ParticipantEntry, SnapshotManifest
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import types_pb2

_LOG = logging.getLogger(__name__)


class RestoreOperations(ControlOperations):
    """Restore, and the cleanup every restore ends with (see the module docstring)."""

    async def restore(
        self,
        restore_id: str,
        snapshot: str,
        manifest: SnapshotManifest,
        scope: Mapping[str, Iterable[EpisodeId]],
    ) -> dict[str, tuple[EpisodeId, ...]]:
        """Restore every participant from ``<root>/<snapshot>/`` as ``manifest`` describes.

        ``scope`` gives each instance the saved episodes (attempt N) to continue; each
        must install exactly their attempt N+1 and stay closed until :meth:`resume`.
        Raises :class:`RestoreFailed` (nothing cleaned up; :meth:`restored` does that).
        """
        validate_id(restore_id, "restore_id")
        validate_id(snapshot, "snapshot")
        self.topology.check_manifest(manifest)
        unknown = sorted(set(scope) - set(self._clients))
        if unknown:
            raise ValueError(f"restore scope names unknown instance(s): {', '.join(unknown)}")
        scopes = {name: tuple(sorted(set(scope.get(name, ())))) for name in self._clients}
        requests = {
            name: pb.RestoreRequest(
                fence=self.fence,
                request_id=self.request_id("restore", restore_id, name),
                restore_id=restore_id,
                snapshot=snapshot,
                entry=_manifest_entry(manifest.participant(name)),
                scope=[episode_to_proto(e) for e in episodes],
                lease=duration_from_seconds(self.config.lease_s),
            )
            for name, episodes in scopes.items()
        }
        result = await self._fan_out_once("restore", requests, attempts=JOINING_ATTEMPTS)
        failures = dict(result.failures)
        installed: dict[str, tuple[EpisodeId, ...]] = {}
        for name, response in result.responses.items():
            try:
                installed[name] = _check_installed(name, response, scopes[name])
            except MalformedReplyError as error:
                failures[name] = classify(error)
        if failures:
            replacements = {e.next_attempt() for episodes in scopes.values() for e in episodes}
            raise RestoreFailed(restore_id, failures, replacements)
        return installed

    async def _discard_restore(
        self, restore_id: str, replacements: Sequence[EpisodeId]
    ) -> dict[str, Failure]:
        """Retire the replacement attempts everywhere, then resume everywhere."""
        failures: dict[str, Failure] = {}
        if replacements:
            retired = await self.retire(
                {name: replacements for name in self._clients}, key=f"{restore_id}-discard"
            )
            failures.update(retired.failures)
        resumed = await self.resume(restore_id)
        for name, failure in resumed.failures.items():
            failures.setdefault(name, failure)
        if failures:
            _LOG.warning(
                "cleaning up restore %s left %d participant(s) to their leases: %s",
                restore_id,
                len(failures),
                OperationFailed("cleanup", restore_id, failures),
            )
        return failures

    @asynccontextmanager
    async def restored(
        self,
        restore_id: str,
        snapshot: str,
        manifest: SnapshotManifest,
        scope: Mapping[str, Iterable[EpisodeId]],
    ) -> AsyncIterator[RestoredCheckpoint]:
        """Restore everywhere for the body, then always reopen every participant once.

        A restore that fails on ANY participant has an uncertain outcome on all of them:
        the replacement attempts (N+1) are retired everywhere, every participant is
        resumed, and :class:`RestoreFailed` tells the caller to start those rollouts over
        from their prompts. A body that fails could not take the restored attempts
        over: they are retired everywhere before the participants reopen, and the body's
        error propagates.
        """
        replacements = tuple(
            sorted({e.next_attempt() for episodes in scope.values() for e in episodes})
        )
        renewer = Renewer(self, restore_id, self.instances)
        renewer.start()
        try:
            installed = await self.restore(restore_id, snapshot, manifest, scope)
        except RestoreFailed as error:
            await renewer.stop()
            cleanup = await self._discard_restore(restore_id, replacements)
            raise RestoreFailed(restore_id, error.failures, replacements, cleanup) from error
        except BaseException:
            await renewer.stop()
            await self._discard_restore(restore_id, replacements)
            raise
        restored = RestoredCheckpoint(restore_id, MappingProxyType(installed))
        try:
            yield restored
        except BaseException:
            await renewer.stop()
            await self._discard_restore(restore_id, replacements)
            raise
        await renewer.stop()
        restored.release = await self.resume(restore_id)


def _manifest_entry(entry: ParticipantEntry) -> pb.ManifestEntry:
    def ref(artifact: ArtifactRef) -> types_pb2.ArtifactRef:
        return types_pb2.ArtifactRef(
            path=artifact.path,
            sha256=artifact.sha256,
            size_bytes=artifact.size_bytes,
            record_count=artifact.record_count,
        )

    message = pb.ManifestEntry(artifacts=[ref(a) for a in entry.artifacts])
    if entry.manifest is not None:
        message.manifest.CopyFrom(ref(entry.manifest))
    return message


def _check_installed(
    instance: str, response: pb.RestoreResponse, scope: Sequence[EpisodeId]
) -> tuple[EpisodeId, ...]:
    installed = episodes_of(response.installed, instance, "Restore")
    problem = installed_problem(installed, scope)
    if problem is not None:
        raise MalformedReplyError(instance, "Restore", problem)
    if response.phase != types_pb2.PHASE_RESTORED:
        raise MalformedReplyError(
            instance, "Restore", f"restore answered phase {types_pb2.Phase.Name(response.phase)}"
        )
    return tuple(sorted(installed))
