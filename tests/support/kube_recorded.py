"""A recorded Kubernetes API: record a real API server's answers once, replay them in CI.

`Recorder` is a proxy in front of a real kube-apiserver: it forwards every request and keeps
the exchange (method, path, query, JSON body, status, JSON response; for watches, each event
line with the exchange that preceded it). `Replayer` serves those exchanges to a client that
makes the same requests: a request matches a recording when its method, path, query and body
agree (rollout tokens and resourceVersions aside, which differ by nature), so a change to the
manifests the launcher renders shows up as a mismatch, with both bodies. Watch lines are
released only after the last exchange sent before them in the recording has been replayed,
which keeps cause before effect (a Job's Complete event after the status write that completed it).

Nothing here imitates Kubernetes: every response body was written by a real API server (minus
`managedFields`, stripped to keep the recording small).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import httpx

VOLATILE_QUERY = {"resourceVersion", "timeoutSeconds", "allowWatchBookmarks", "watch"}
TOKEN_VARIABLE = "OPENAI_API_KEY"


def normalize(body: Any) -> Any:
    """The body with what legitimately differs between runs masked: rollout tokens (they expire)."""
    if isinstance(body, dict):
        if body.get("name") == TOKEN_VARIABLE and "value" in body:
            return {**body, "value": "<rollout token>"}
        return {key: normalize(value) for key, value in body.items()}
    if isinstance(body, list):
        return [normalize(item) for item in body]
    return body


def request_key(method: str, path: str, query: list[tuple[str, str]], body: Any, content_type: str | None) -> str:
    kept = sorted((k, v) for k, v in query if k not in VOLATILE_QUERY)
    return json.dumps([method, path, kept, content_type, normalize(body)], sort_keys=True)


def is_watch(query: list[tuple[str, str]]) -> bool:
    return any(k == "watch" and v in ("true", "1") for k, v in query)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, *args) -> None:  # quiet
        pass

    def _request(self) -> tuple[str, list[tuple[str, str]], Any]:
        parts = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        return parts.path, parse_qsl(parts.query), (json.loads(raw) if raw else None)

    def _handle(self) -> None:
        path, query, body = self._request()
        self.server.handle_exchange(self, path, query, body)

    @property
    def content_type(self) -> str | None:
        return self.headers.get("Content-Type") if self.command in ("POST", "PATCH", "PUT") else None

    do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _handle

    def send_json(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode() if payload is not None else b""  # e.g. 204: no body at all
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def start_stream(self, status: int) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def send_line(self, line: str) -> None:
        data = (line + "\n").encode()
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()

    def handle_exchange(self, handler: _Handler, path: str, query, body) -> None:
        raise NotImplementedError


class Recorder(_Server):
    def __init__(self, upstream: str, ca_file: Path, token: str):
        super().__init__()
        self.client = httpx.Client(base_url=upstream, verify=str(ca_file), headers={"Authorization": f"Bearer {token}"},
                                   timeout=httpx.Timeout(30, read=None))
        self.lock = threading.Lock()
        self.exchanges: list[dict] = []
        self.watch_lines: list[dict] = []

    def handle_exchange(self, handler, path, query, body) -> None:
        method = handler.command
        headers = {"Content-Type": handler.content_type} if handler.content_type else {}
        request = self.client.build_request(method, path, params=query, headers=headers,
                                            content=json.dumps(body).encode() if body is not None else None)
        if is_watch(query):
            response = self.client.send(request, stream=True)
            handler.start_stream(response.status_code)
            try:
                for line in response.iter_lines():
                    if not line:
                        continue
                    with self.lock:
                        self.watch_lines.append({"after": len(self.exchanges) - 1,
                                                 "event": _without_managed_fields(json.loads(line))})
                    handler.send_line(line)
            finally:
                response.close()
            handler.end_stream()
            return
        with self.lock:  # numbered when sent: an event it causes can only come after this
            index = len(self.exchanges)
            self.exchanges.append({"method": method, "path": path, "query": query, "content_type": handler.content_type,
                                   "body": body})
        response = self.client.send(request)
        payload = response.json() if response.content else None
        self.exchanges[index].update(status=response.status_code, response=_without_managed_fields(payload))
        handler.send_json(response.status_code, payload)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"exchanges": self.exchanges, "watch_lines": self.watch_lines}, indent=1) + "\n")


def _without_managed_fields(payload: Any) -> Any:
    """The response minus `metadata.managedFields` (server-side-apply bookkeeping no client here reads),
    which would otherwise be most of the recording."""
    if isinstance(payload, dict):
        return {k: _without_managed_fields(v) for k, v in payload.items() if k != "managedFields"}
    if isinstance(payload, list):
        return [_without_managed_fields(item) for item in payload]
    return payload


class Replayer(_Server):
    def __init__(self, recording: Path):
        super().__init__()
        data = json.loads(recording.read_text())
        self.exchanges = data["exchanges"]
        self.watch_lines = data["watch_lines"]
        self.by_key: dict[str, list[int]] = {}
        for index, exchange in enumerate(self.exchanges):
            key = request_key(exchange["method"], exchange["path"], exchange["query"], exchange["body"],
                              exchange["content_type"])
            self.by_key.setdefault(key, []).append(index)
        self.served: set[int] = set()
        self.next_line = 0
        self.mismatches: list[str] = []
        self.changed = threading.Condition()

    def handle_exchange(self, handler, path, query, body) -> None:
        if is_watch(query):
            self._replay_watch(handler, query)
            return
        key = request_key(handler.command, path, query, body, handler.content_type)
        with self.changed:
            indexes = self.by_key.get(key)
            if not indexes:
                explained = self._explain(handler.command, path, query, body)
                self.mismatches.append(explained)
                handler.send_json(599, {"kind": "Status", "status": "Failure", "code": 599,
                                        "message": f"no recorded exchange matches this request: {explained}"})
                return
            pending = [i for i in indexes if i not in self.served]
            index = pending[0] if pending else indexes[-1]  # asked again (polling): the last answer again
            self.served.add(index)
            self.changed.notify_all()
        exchange = self.exchanges[index]
        handler.send_json(exchange["status"], exchange["response"])

    def _replay_watch(self, handler, query) -> None:
        timeout = float(dict(query).get("timeoutSeconds", 5))
        deadline = time.monotonic() + timeout
        handler.start_stream(200)
        while True:
            with self.changed:
                ready = self.changed.wait_for(lambda: self._line_ready() or time.monotonic() >= deadline,
                                              timeout=max(0.0, deadline - time.monotonic()))
                if not ready or not self._line_ready():
                    break
                line = self.watch_lines[self.next_line]
                self.next_line += 1
            handler.send_line(json.dumps(line["event"]))
        handler.end_stream()

    def _line_ready(self) -> bool:
        if self.next_line >= len(self.watch_lines):
            return False
        after = self.watch_lines[self.next_line]["after"]
        return after < 0 or after in self.served

    def _explain(self, method, path, query, body) -> str:
        same_path = [e for e in self.exchanges if e["method"] == method and e["path"] == path]
        recorded = json.dumps(normalize(same_path[0]["body"]), sort_keys=True) if same_path else "(none)"
        return (f"{method} {path} {query}\n  sent:     {json.dumps(normalize(body), sort_keys=True)}\n"
                f"  recorded: {recorded}")

    @property
    def unserved(self) -> list[str]:
        return [f"{e['method']} {e['path']}" for i, e in enumerate(self.exchanges) if i not in self.served]
