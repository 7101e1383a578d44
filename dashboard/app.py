"""The dashboard's HTTP app: the page and its assets, a JSON API over the log, and live events (SSE).

Every /api route needs an operator key (the gateway's keys, checked as the gateway checks them,
`schemas.keys`): the log holds prompts. The page itself holds no data and asks for the key.
Errors use the project's error shape `{"error": {"message", "type", "code"}}` (`schemas.api_errors`).
One table of routes; each endpoint reads the process's parts (`Dashboard`) from the app's state.
"""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, Literal

import orjson
import polars as pl
from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from fastapi.staticfiles import StaticFiles
from starlette.routing import BaseRoute, Mount

from agentstream.dashboard import compare as compare_
from agentstream.dashboard import overview as overview_
from agentstream.dashboard import rollouts as rollouts_
from agentstream.dashboard.live import Live
from agentstream.dashboard.settings import DashboardSettings
from agentstream.logs.remote import NEXT_CURSOR
from agentstream.schemas.api_errors import ApiError
from agentstream.schemas.keys import is_operator_key, placeholder_secret, presented_key, secret_values
from agentstream.schemas.releases import ordered, summary
from agentstream.schemas.scan import parse_time

STATIC = Path(__file__).parent / "static"


def json_response(body: object, status: int = 200) -> Response:
    return Response(orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS), status, media_type="application/json")


def error_response(error: ApiError) -> Response:
    """The project's error shape (`schemas.api_errors`), as the gateway answers."""
    return Response(orjson.dumps(error.body), error.status, headers=error.headers, media_type="application/json")


def _time(text: str | None, name: str) -> int | None:
    if text is None or text.strip() in ("", "all"):
        return None
    try:
        return parse_time(text)
    except ValueError as exc:
        raise ApiError(400, f"{name}: {exc}", "invalid_time") from None


def _span(since: str | None, until: str | None) -> overview_.Range:
    until_ms = _time(until, "until")
    return overview_.Range(_time(since, "since"), until_ms if until_ms is not None else int(time.time() * 1000))


class OverviewCache:
    """One read of the log per range and `ttl_s`, shared by every page asking meanwhile."""

    def __init__(self, settings: DashboardSettings):
        self.settings = settings
        self.entries: dict[tuple[str | None, str | None], tuple[float, asyncio.Task[dict[str, Any]]]] = {}

    async def get(self, since: str | None, until: str | None) -> dict[str, Any]:
        key = (since, until)
        now = time.monotonic()
        entry = self.entries.get(key)
        if entry is None or entry[0] < now or (entry[1].done() and entry[1].exception()):
            span = _span(since, until)
            task = asyncio.create_task(self._read(span))
            self.entries = {k: v for k, v in self.entries.items() if v[0] >= now}
            self.entries[key] = (now + self.settings.overview_cache_s, task)
            entry = self.entries[key]
        return await asyncio.shield(entry[1])

    async def _read(self, span: overview_.Range) -> dict[str, Any]:
        return await overview_.overview(self.settings, span, self.settings.streams_group)


class Dashboard:
    """The parts the endpoints share: the settings, the operator keys, the live view of the log, the overview cache."""

    def __init__(self, settings: DashboardSettings):
        if not settings.keys:
            raise ValueError("the dashboard shows prompts and needs an operator key: set AGENTSTREAM_API_KEYS "
                             "(the gateway's keys)")
        placeholder = placeholder_secret("dashboard", settings.host, {
            "AGENTSTREAM_API_KEYS": secret_values(settings.api_keys),
            "AGENTSTREAM_READ_KEYS": secret_values(settings.read_keys)})
        if placeholder:
            raise ValueError(placeholder)
        self.settings = settings
        self.key_ring = settings.key_ring  # (a ValueError for a key of two tenants: the command says it, exit 2)
        self.keys = tuple(key.encode() for key in settings.keys)
        self.live = Live(settings)
        self.overview = OverviewCache(settings)


def dashboard(request: Request) -> Dashboard:
    parts: Dashboard = request.app.state.dashboard
    return parts


Parts = Annotated[Dashboard, Depends(dashboard)]


def operator(request: Request, parts: Parts) -> str | None:
    """The viewer's tenant (a tenant's read key: its own trajectories only), None for an operator or a read key of
    no tenant (every trajectory); 401 for any other key."""
    key = presented_key(request.headers)
    if key is None or not is_operator_key(key, parts.keys):
        raise ApiError(401, "the dashboard needs an operator key (one of the gateway's AGENTSTREAM_API_KEYS): "
                       "send 'Authorization: Bearer <key>'", "missing_api_key" if key is None else "invalid_api_key")
    return parts.key_ring.tenant_of(key)


Viewer = Annotated[str | None, Depends(operator)]
"""the viewer's tenant, None: sees every tenant's"""


def every_tenant(tenant: Viewer) -> None:
    """The views over every tenant's traffic (overview, comparisons, live events): not for a tenant."""
    if tenant is not None:
        raise ApiError(403, "a tenant's key reads its own tenant's rollouts, releases and export only: the overview, "
                       "comparisons and live events cover every tenant (an operator key's)", "key_scope")


async def session(parts: Parts) -> Response:
    settings = parts.settings
    return json_response({"prefix": settings.topic_prefix, "bootstrap_servers": settings.bootstrap_servers,
                          "page_size_max": settings.page_size_max})


async def overview(parts: Parts, since: str = "1h", until: str | None = None) -> Response:
    return json_response(await parts.overview.get(since, until))


async def list_rollouts(
    parts: Parts,
    tenant: Viewer,
    q: Annotated[str | None, Query(description="text in the rollout, attempt, task or group id")] = None,
    task: str | None = None,
    status: Annotated[list[rollouts_.Status], Query()] = [],  # noqa: B006 (FastAPI copies it per request)
    split: Literal["train", "validation"] | None = None,
    reward_min: float | None = None,
    reward_max: float | None = None,
    version: int | None = None,
    where: Annotated[str | None, Query(description="a SQL condition over the list's columns")] = None,
    since: str | None = "1h",
    until: str | None = None,
    limit: Annotated[int, Query(ge=1)] = 50,
    cursor: str | None = None,
) -> Response:
    settings = parts.settings
    if limit > settings.page_size_max:
        raise ApiError(400, f"limit: at most {settings.page_size_max} rows a page", "invalid_limit")
    if reward_min is not None and reward_max is not None and reward_min > reward_max:
        raise ApiError(400, f"reward_min ({reward_min}) is above reward_max ({reward_max})", "invalid_filter")
    filters = rollouts_.Filters(text=q or None, task=task or None, statuses=tuple(status), split=split,
                                reward_min=reward_min, reward_max=reward_max, version=version,
                                where=(where or "").strip() or None, tenant=tenant)
    started = time.perf_counter()
    page = await rollouts_.search(settings, filters, _time(since, "since"), _time(until, "until"), limit,
                                  rollouts_.Cursor.parse(cursor) if cursor else None)
    return json_response({"rows": page.rows, "next_cursor": page.next_cursor, "scanned": page.scanned,
                          "complete": page.complete, "took_ms": round((time.perf_counter() - started) * 1000, 1)})


EXPORT_TYPES = {"jsonl": "application/x-ndjson", "parquet": "application/vnd.apache.parquet"}


async def export(
    parts: Parts,
    tenant: Viewer,
    format: Literal["jsonl", "parquet"] = "jsonl",
    of_tenant: Annotated[str | None, Query(alias="tenant", description="an operator's choice of one tenant")] = None,
    where: Annotated[str | None, Query(description="a SQL condition over the trajectories' columns")] = None,
    since: str | None = None,
    until: str | None = None,
    limit: Annotated[int, Query(ge=1)] = 100,
    cursor: str | None = None,
) -> Response:
    """A page of whole trajectories (the `trajectories` table of `agentstream sql`, every column), newest first, as
    JSON lines or Parquet; the next page's cursor in a header. A tenant's key: its own tenant's rows only, filtered
    before `where` sees any (`agentstream sql --dashboard` and `agentstream export` read this)."""
    settings = parts.settings
    if tenant is not None and of_tenant not in (None, tenant):
        raise ApiError(403, "a tenant's key exports its own tenant's trajectories only (leave out tenant=)",
                       "key_scope")
    if limit > settings.page_size_max:
        raise ApiError(400, f"limit: at most {settings.page_size_max} rows a page", "invalid_limit")
    filters = rollouts_.Filters(where=(where or "").strip() or None, tenant=tenant or of_tenant)
    page = await rollouts_.search(settings, filters, _time(since, "since"), _time(until, "until"), limit,
                                  rollouts_.Cursor.parse(cursor) if cursor else None, columns=None)
    headers = {"x-agentstream-rows": str(page.frame.height), "x-agentstream-complete": str(page.complete).lower(),
               **({NEXT_CURSOR: page.next_cursor} if page.next_cursor else {})}
    return Response(_export_body(page.frame, format), headers=headers, media_type=EXPORT_TYPES[format])


def _export_body(frame: pl.DataFrame, format: Literal["jsonl", "parquet"]) -> bytes:
    if format == "jsonl":
        return frame.write_ndjson().encode() if frame.height else b""
    buffer = io.BytesIO()
    frame.write_parquet(buffer, compression="zstd")
    return buffer.getvalue()


async def rollout(parts: Parts, tenant: Viewer, rollout_id: str, partition: Annotated[int | None, Query(ge=0)] = None,
                  offset: Annotated[int | None, Query(ge=0)] = None, attempt: str | None = None) -> Response:
    settings, live = parts.settings, parts.live
    found, read = await rollouts_.find_trajectories(settings, rollout_id, partition, offset,
                                                    budget=settings.scan_records_max)
    if tenant is not None:  # another tenant's rollout is one this viewer cannot tell from a missing one
        found = [trajectory for trajectory in found if trajectory.data.tenant == tenant]
    if not found:
        where = f"at partition {partition}, offset {offset}" if offset is not None else \
            f"in the newest {read:,} records of its partition"
        raise ApiError(404, f"no trajectory of rollout {rollout_id!r} {where}", "rollout_not_found")
    chosen = next((t for t in found if t.attempt_id == attempt), found[0]) if attempt else found[0]
    related = await rollouts_.related(settings, chosen)
    return json_response({
        "trajectory": chosen.model_dump(mode="json"),
        "attempts": [{"attempt_id": t.attempt_id, "status": t.data.status, "reward": t.data.reward,
                      "attempt_number": t.data.attempt_number} for t in found],
        "rollout_events": [e.model_dump(mode="json") for e in related["rollouts"]],
        "calls": [e.model_dump(mode="json") for e in related["calls"] if e.attempt_id == chosen.attempt_id],
        "rewards": [e.model_dump(mode="json") for e in related["rewards"] if e.attempt_id == chosen.attempt_id],
        "trained_by": [live.versions.get(v, {"version": v}) for v in live.trained_by.get(chosen.id, [])],
        "read": read,
    })


async def releases(parts: Parts, tenant: Viewer) -> Response:
    """Each model's canary release and each tenant's adapter's, live: arms, sessions, mean reward, p-value,
    decision. A tenant's key: its own tenant's only."""
    states = ordered(parts.live.releases)
    return json_response({"releases": [summary(state) for state in states
                                       if tenant is None or state.current.tenant == tenant]})


async def compare(parts: Parts, a: int, b: int, since: str | None = "1h", until: str | None = None,
                  split: Literal["train", "validation"] | None = None) -> Response:
    span = _span(since, until)
    return json_response(await compare_.compare(parts.settings, a, b, span.bounds, split))


async def events(request: Request, parts: Parts) -> StreamingResponse:
    return StreamingResponse(_notices(request, parts.live), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


async def _notices(request: Request, live: Live) -> AsyncIterator[bytes]:
    """Server-sent events: each live notice, and the topics' rates every second without one."""
    queue = live.subscribe()
    try:
        yield b"retry: 2000\n\n"
        while not await request.is_disconnected():
            try:
                notice = await asyncio.wait_for(queue.get(), timeout=1.0)
            except TimeoutError:
                notice = {"kind": "rates", "rates": live.rates(), "error": live.error}
            yield b"data: " + orjson.dumps(notice) + b"\n\n"
    finally:
        live.unsubscribe(queue)


async def healthz(parts: Parts) -> Response:
    return json_response({"ok": True, "following": parts.live.error is None})


async def index() -> FileResponse:
    return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})


def _api(path: str, endpoint: Any, tenants: bool = False) -> APIRoute:
    """A GET under /api, for keys the dashboard takes; `tenants`: a tenant's key too (the endpoint shows it its
    own tenant's rows), else only the keys that see every tenant."""
    check = operator if tenants else every_tenant
    return APIRoute("/api" + path, endpoint, methods=["GET"], dependencies=[Depends(check)])


routes: list[BaseRoute] = [
    _api("/session", session, tenants=True),
    _api("/overview", overview),
    _api("/rollouts", list_rollouts, tenants=True),
    _api("/rollouts/{rollout_id}", rollout, tenants=True),
    _api("/releases", releases, tenants=True),
    _api("/export", export, tenants=True),
    _api("/compare", compare),
    _api("/events", events),
    APIRoute("/healthz", healthz, methods=["GET"], include_in_schema=False),
    APIRoute("/", index, methods=["GET"], include_in_schema=False),
    Mount("/static", StaticFiles(directory=STATIC), name="static"),
]


async def api_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, ApiError)
    return error_response(error)


async def invalid(request: Request, error: Exception) -> Response:
    """FastAPI's validation errors, as one readable message: `name: problem (got value)` each."""
    assert isinstance(error, RequestValidationError)
    problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'request'}: {e['msg']}"
                         + (f" (got {e['input']!r})" if e.get("input") is not None else "")
                         for e in error.errors())
    return error_response(ApiError(400, problems, "invalid_filter"))


async def bad_filter(request: Request, error: Exception) -> Response:
    return error_response(ApiError(400, str(error), "invalid_filter"))


async def missing(request: Request, error: Exception) -> Response:
    return error_response(ApiError(404, str(error), "not_found"))


def create_app(settings: DashboardSettings) -> FastAPI:
    parts = Dashboard(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await parts.live.start()
        yield
        await parts.live.stop()

    app = FastAPI(title="agentstream dashboard", routes=routes, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None, exception_handlers={ApiError: api_error, RequestValidationError: invalid,
                                                        rollouts_.FilterError: bad_filter, LookupError: missing})
    app.state.dashboard = parts
    return app
