"""The log through the dashboard's HTTP API, for a key without broker credentials (a tenant's, `docs/sessions.md`).

`agentstream sql`, `replay` and `archive` read Kafka itself: operator tools. A tenant's read key reaches its own
trajectories through the dashboard instead, which filters by the key's tenant before anything else runs
(`GET /api/export`, a page of whole trajectories at a time, newest first). `agentstream export --dashboard`
writes them to a file; `agentstream sql --dashboard` runs a query over them here, on this machine: the rows it
can read are the rows the dashboard gave.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx
import polars as pl

from agentstream.logs.query import tables_in
from agentstream.logs.results import QueryFailed
from agentstream.schemas.errors import ConfigurationError

NEXT_CURSOR = "x-agentstream-next-cursor"
"""the export's header naming where its next page starts (absent on the last page)"""
Format = Literal["jsonl", "parquet"]
TIMEOUT = httpx.Timeout(300.0, connect=10.0)
"""a page may read much of the topic when the key's tenant has few of its rows"""


class DashboardRefused(ConfigurationError):
    """The dashboard answered an error (a wrong key, a bad filter): its message, which names the fix."""


@dataclass(frozen=True)
class Dashboard:
    """A dashboard and the key to read it with."""

    url: str
    key: str

    def pages(self, format: Format, since: str | None = None, until: str | None = None, where: str | None = None,
              page_size: int = 200) -> Iterator[bytes]:
        """Every page of the key's trajectories (each a JSONL or Parquet body), following the cursors."""
        params = {"format": format, "limit": str(page_size), "since": since or "all", **({"until": until} if until else {}),
                  **({"where": where} if where else {})}
        headers = {"authorization": f"Bearer {self.key}"}
        with httpx.Client(base_url=self.url.rstrip("/"), headers=headers, timeout=TIMEOUT) as client:
            cursor: str | None = None
            while True:
                response = client.get("/api/export", params={**params, **({"cursor": cursor} if cursor else {})})
                if response.status_code != 200:
                    raise DashboardRefused(f"the dashboard at {self.url} answered {response.status_code}: "
                                           f"{_message(response)}")
                yield response.content
                cursor = response.headers.get(NEXT_CURSOR)
                if not cursor:
                    return

    def trajectories(self, since: str | None = None, until: str | None = None, where: str | None = None) -> pl.DataFrame:
        """The key's trajectories as one frame (the `trajectories` table of `agentstream sql`)."""
        frames = [pl.read_parquet(io.BytesIO(body)) for body in self.pages("parquet", since, until, where)]
        frames = [frame for frame in frames if frame.width]
        return pl.concat(frames, how="diagonal_relaxed") if frames else pl.DataFrame()

    def export(self, output: Path, format: Format, since: str | None = None, until: str | None = None,
               where: str | None = None) -> int:
        """Write the key's trajectories to `output`; how many."""
        if format == "parquet":
            frame = self.trajectories(since, until, where)
            frame.write_parquet(output, compression="zstd")
            return frame.height
        count = 0
        with output.open("wb") as out:
            for body in self.pages("jsonl", since, until, where):
                out.write(body)
                count += body.count(b"\n")
        return count

    def query(self, sql: str, since: str | None = None, until: str | None = None) -> pl.DataFrame:
        """Run `sql` over the key's trajectories (the one table the dashboard exports)."""
        others = set(tables_in(sql)) - {"trajectories"}
        if others:
            raise ConfigurationError(f"through the dashboard a query reads the trajectories table only (your "
                                     f"tenant's); it names {', '.join(sorted(others))}: the other topics are an "
                                     "operator's (agentstream sql without --dashboard, with broker credentials)")
        if "trajectories" not in tables_in(sql):
            raise ConfigurationError("through the dashboard a query reads the trajectories table (your tenant's): "
                                     "name it, e.g. SELECT status, AVG(reward) FROM trajectories GROUP BY status")
        frame = self.trajectories(since, until)
        if not frame.height:
            return pl.DataFrame()
        try:
            return pl.SQLContext({"trajectories": frame}, eager=True).execute(sql)
        except Exception as exc:  # polars' SQL and column errors have types of their own
            raise QueryFailed(f"query failed: {exc}") from exc


def _message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:300]
