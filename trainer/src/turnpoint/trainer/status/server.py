"""The status page, the REST API and ``/metrics`` on one port (docs/spec.md section 7.13).

An aiohttp application on the trainer's event loop. Every handler only reads: the
history (:class:`~turnpoint.trainer.status.history.CheckpointHistory`, plain state), the
coordinator's topology and the prepare under way, and the snapshot root, whose listing
and digests are read in a thread (one verification at a time). Nothing here is called by
the snapshot path; the snapshot path never waits for it.

Every answer under ``/api/`` is JSON with ``api_version``; every error, including bad
input and a bug, is JSON ``{"api_version", "error": {"status", "message"}}`` with a 4xx
or 500 status, never a traceback. Snapshot names are checked as protocol ids before any
path is built, so no request reaches a file outside the snapshot root; the page's files
are served from a fixed table built at start, never from a path in the request.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from aiohttp import web

from turnpoint.ids import InvalidIdError, validate_id
from turnpoint.storage import StorageError
from turnpoint.trainer.restore.choice import Candidate, RestoreChoice, rank_candidates
from turnpoint.trainer.restore.restorer import published_candidates
from turnpoint.trainer.status.history import STATUSES, CheckpointHistory
from turnpoint.trainer.storage.layout import SnapshotLayout
from turnpoint.trainer.storage.manifest import JSONValue, ManifestError
from turnpoint.trainer.storage.objects import StoreLayout
from turnpoint.trainer.storage.verify import snapshot_mismatch

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from turnpoint.trainer.config import CoordinatorConfig
    from turnpoint.trainer.control.coordinator import Coordinator

_LOG = logging.getLogger(__name__)

API_VERSION: Final = 1
MAX_LIMIT: Final = 1000
_TRUE: Final = {"1": True, "true": True, "0": False, "false": False}
_TYPES: Final = {
    ".html": "text/html",
    ".js": "text/javascript",
    ".css": "text/css",
    ".svg": "image/svg+xml",
}


@dataclass
class StatusSources:
    """What the API reads; ``coordinator`` is None until the facade has discovered."""

    history: CheckpointHistory
    layout: SnapshotLayout | StoreLayout
    config: CoordinatorConfig
    registry: CollectorRegistry | None = None
    coordinator: Coordinator | None = None


def _page_files() -> dict[str, tuple[bytes, str]]:
    """The page's static files, by name, read once from the package data."""
    files: dict[str, tuple[bytes, str]] = {}
    folder = importlib.resources.files("turnpoint.trainer.status") / "static"
    for item in folder.iterdir():
        suffix = "." + item.name.rsplit(".", 1)[-1]
        if item.is_file() and suffix in _TYPES:
            files[item.name] = (item.read_bytes(), _TYPES[suffix])
    return files


def _error(status: int, message: str) -> web.Response:
    body = {"api_version": API_VERSION, "error": {"status": status, "message": message}}
    return web.json_response(body, status=status)


def _ok(body: dict[str, JSONValue]) -> web.Response:
    return web.json_response(
        {"api_version": API_VERSION, **body}, dumps=lambda v: json.dumps(v, allow_nan=False)
    )


class _BadRequest(Exception):
    """A request the API refuses (400), with what to change."""


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except _BadRequest as error:
        return _error(400, str(error))
    except web.HTTPException as error:
        if error.status < 400:
            raise
        return _error(error.status, error.reason)
    except asyncio.CancelledError:
        raise
    # A bug in a read must answer 500 with a message, not a traceback (logged here).
    except Exception:  # noqa: BLE001
        _LOG.exception("status API: %s %s failed", request.method, request.path)
        return _error(500, "internal error (see the trainer's log)")


def _query(request: web.Request, allowed: frozenset[str]) -> Mapping[str, str]:
    unknown = sorted(set(request.query) - allowed)
    if unknown:
        raise _BadRequest(
            f"unknown query parameter(s) {', '.join(unknown)}; allowed: "
            + (", ".join(sorted(allowed)) or "none")
        )
    for name in request.query:
        if len(request.query.getall(name)) > 1:
            raise _BadRequest(f"query parameter {name} given more than once")
    return request.query


def _flag(query: Mapping[str, str], name: str) -> bool:
    raw = query.get(name, "0")
    if raw not in _TRUE:
        raise _BadRequest(f"{name} must be 0, 1, true or false, got {raw[:32]!r}")
    return _TRUE[raw]


def _snapshot_name(raw: str) -> str:
    try:
        return validate_id(raw, "snapshot")
    except InvalidIdError as error:
        raise _BadRequest(str(error)[:300]) from None


class StatusApi:
    """The routes (see the module docstring and docs/spec.md section 7.13)."""

    def __init__(self, sources: StatusSources) -> None:
        self.sources = sources
        self._files = _page_files()
        self._verifying = asyncio.Lock()
        # Published manifests never change: each is read once (the listing thread's).
        self._candidates: dict[str, Candidate] = {}

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_errors_as_json], client_max_size=1024)
        app.router.add_get("/", self.page)
        app.router.add_get("/static/{name}", self.static)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/api/job", self.job)
        app.router.add_get("/api/checkpoints", self.checkpoints)
        app.router.add_get("/api/checkpoints/{checkpoint_id}", self.checkpoint)
        app.router.add_get("/api/snapshots", self.snapshots)
        app.router.add_get("/api/snapshots/{snapshot}", self.snapshot)
        return app

    # -- the page and /metrics ---------------------------------------------------------

    async def page(self, request: web.Request) -> web.StreamResponse:
        body, content_type = self._files["index.html"]
        return web.Response(body=body, content_type=content_type, charset="utf-8")

    async def static(self, request: web.Request) -> web.StreamResponse:
        found = self._files.get(request.match_info["name"])
        if found is None:
            raise web.HTTPNotFound(reason="no such file")
        return web.Response(body=found[0], content_type=found[1], charset="utf-8")

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        registry = self.sources.registry
        if registry is None:
            raise web.HTTPNotFound(reason="this trainer keeps no metrics")
        from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

        body = generate_latest(registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # -- the job -----------------------------------------------------------------------

    async def job(self, request: web.Request) -> web.StreamResponse:
        _query(request, frozenset())
        sources = self.sources
        history = sources.history
        now = time.monotonic()
        coordinator = sources.coordinator
        participants: dict[str, JSONValue] = {}
        identity: dict[str, JSONValue] = {"epoch": history.epoch}
        if coordinator is not None:
            identity = {
                "coordinator_id": coordinator.identity.coordinator_id,
                "epoch": coordinator.identity.epoch,
            }
            topology = coordinator.discovered
            statuses = coordinator.statuses()
            for name, address in sorted(coordinator.endpoints.items()):
                info = topology.participants.get(name) if topology is not None else None
                seen = statuses.get(name)
                participants[name] = {
                    "address": address,
                    "kind": info.kind.value.lower() if info is not None else None,
                    "incarnation": info.incarnation if info is not None else None,
                    "environment": info.environment if info is not None else None,
                    "status": None
                    if seen is None
                    else {
                        "phase": seen.phase,
                        "active_checkpoint_id": seen.active_checkpoint_id or None,
                        "lease_expires_at": seen.lease_expires_at,
                        "admission_open": seen.admission_open,
                        "lease_expiries": seen.lease_expiries,
                        "answered_at": history.wall(seen.answered_at),
                    },
                }
        config = sources.config
        return _ok(
            {
                "job": {
                    **identity,
                    "snapshot_root": str(config.snapshot_root),
                    "restore_from": config.restore_from,
                    "participants": participants,
                    "leases": {
                        "lease_s": config.lease_s,
                        "renew_interval_s": config.renew_interval_s,
                    },
                    "admission": {
                        "open": history.admission_open,
                        "since": history.wall(history.admission_since),
                    },
                    "open_snapshot": self._open_snapshot(now),
                    "overview": history.overview(),
                    "events": history.events_json(),
                    "configuration": json.loads(config.model_dump_json()),
                }
            }
        )

    def _open_snapshot(self, now: float) -> JSONValue:
        history = self.sources.history
        row = history.open_attempt
        if row is None:
            return None
        shown = history.row_json(row, now=now, participants=False)
        coordinator = self.sources.coordinator
        progress = coordinator.prepare_progress() if coordinator is not None else None
        waiting: dict[str, JSONValue] = {}
        if progress is not None and progress.checkpoint_id == row.checkpoint_id:
            for name, report in sorted(progress.waiting.items()):
                if report is None:
                    waiting[name] = {"why": "no answer yet", "blocker_count": None, "blockers": []}
                    continue
                waiting[name] = {
                    "why": f"{report.blocker_count} episode(s) not parked",
                    "blocker_count": report.blocker_count,
                    "blockers": [
                        {
                            "rollout_id": b.episode.rollout_id,
                            "attempt": b.episode.attempt,
                            "state": b.state.name.lower(),
                            "detail": b.detail,
                        }
                        for b in report.blockers
                    ],
                }
            shown["ready"] = list[JSONValue](sorted(progress.ready))
        shown["waiting_for"] = waiting
        return shown

    # -- the history -------------------------------------------------------------------

    async def checkpoints(self, request: web.Request) -> web.StreamResponse:
        query = _query(request, frozenset({"status", "limit"}))
        status = query.get("status")
        if status is not None and status not in STATUSES:
            raise _BadRequest(
                f"status must be one of {', '.join(sorted(STATUSES))}, got {status[:32]!r}"
            )
        limit = 100
        if "limit" in query:
            raw = query["limit"]
            if not raw.isdigit() or len(raw) > 6 or not 1 <= int(raw) <= MAX_LIMIT:
                raise _BadRequest(f"limit must be an integer from 1 to {MAX_LIMIT}")
            limit = int(raw)
        history = self.sources.history
        now = time.monotonic()
        rows: list[JSONValue] = list(history.rows_json(now=now, status=status, limit=limit))
        return _ok(
            {"overview": history.overview(), "summary": history.summary(), "checkpoints": rows}
        )

    async def checkpoint(self, request: web.Request) -> web.StreamResponse:
        _query(request, frozenset())
        checkpoint_id = _snapshot_name(request.match_info["checkpoint_id"])
        row = self.sources.history.get_json(checkpoint_id, now=time.monotonic())
        if row is None:
            raise web.HTTPNotFound(reason=f"no checkpoint {checkpoint_id} in the job's history")
        return _ok({"checkpoint": row})

    # -- what is on storage ------------------------------------------------------------

    async def snapshots(self, request: web.Request) -> web.StreamResponse:
        verify = _flag(_query(request, frozenset({"verify"})), "verify")
        listing, snapshots = await asyncio.to_thread(self._listing)
        if verify:
            async with self._verifying:
                for item in snapshots:
                    name = str(item["checkpoint_id"])
                    item["verified"] = await asyncio.to_thread(self._verify, name)
        return _ok({**listing, "snapshots": list(snapshots)})

    async def snapshot(self, request: web.Request) -> web.StreamResponse:
        verify = _flag(_query(request, frozenset({"verify"})), "verify")
        name = _snapshot_name(request.match_info["snapshot"])
        _listing, snapshots = await asyncio.to_thread(self._listing)
        found = [item for item in snapshots if item["checkpoint_id"] == name]
        if not found:
            raise web.HTTPNotFound(reason=f"no published snapshot {name}")
        item = found[0]
        if verify:
            async with self._verifying:
                item["verified"] = await asyncio.to_thread(self._verify, name)
        return _ok({"snapshot": item})

    def _listing(self) -> tuple[dict[str, JSONValue], list[dict[str, JSONValue]]]:
        """Blocking: the restore order and the published snapshots, newest first."""
        layout = self.sources.layout
        try:
            latest = layout.latest()
        except ManifestError:
            latest = None
        candidates, unreadable = published_candidates(layout, dict(self._candidates))
        self._candidates = {c.checkpoint_id: c for c in candidates}
        choice = RestoreChoice.parse(self.sources.config.restore_from)
        snapshots: list[dict[str, JSONValue]] = [
            {
                "checkpoint_id": c.checkpoint_id,
                "step": c.step,
                "created_at": c.created_at,
                "metrics": dict(c.metrics),
                "latest": c.checkpoint_id == latest,
                "readable": True,
                "verified": None,
            }
            for c in candidates
        ]
        snapshots += [
            {"checkpoint_id": name, "readable": False, "problem": why, "verified": None}
            for name, why in unreadable
        ]
        listing: dict[str, JSONValue] = {
            "snapshot_root": str(layout.root),
            "latest": latest,
            "restore": {
                "restore_from": str(choice),
                "order": [c.checkpoint_id for c in rank_candidates(choice, candidates)],
            },
        }
        return listing, snapshots

    def _verify(self, name: str) -> JSONValue:
        layout = self.sources.layout
        try:
            manifest = layout.load(name)
        except (ManifestError, OSError, StorageError) as error:
            return {"ok": False, "files_checked": 0, "problem": str(error)}
        checked, problem = snapshot_mismatch(layout, name, manifest)
        return {"ok": problem is None, "files_checked": checked, "problem": problem}


class StatusServer:
    """Serves :class:`StatusApi` on ``host:port`` (0: a free port) until :meth:`close`."""

    def __init__(
        self,
        sources: StatusSources,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        reuse_port: bool = False,
    ) -> None:
        self.api = StatusApi(sources)
        self._host = host
        self._port = port
        self._reuse_port = reuse_port
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    @property
    def address(self) -> str:
        if self.port is None:
            raise RuntimeError("the status server is not started")
        return f"http://{self._host}:{self.port}/"

    async def start(self) -> str:
        runner = web.AppRunner(self.api.app(), access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(
            runner, self._host, self._port, reuse_address=True, reuse_port=self._reuse_port or None
        )
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        # The bound port (port 0 picks a free one).
        self.port = int(runner.addresses[0][1])
        return self.address

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
