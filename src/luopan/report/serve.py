"""``luopan report --serve``: the report page on 127.0.0.1, generated afresh for every request (the standard
library's threading HTTP server). The served page polls ``/state`` and reloads when the repository changed, so it
follows runs while they save. The repository is opened once (``opener()``, at the first request), read afresh for
every page and state poll, one request at a time, and closed with the server; nothing is written."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from html import escape
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ..errors import LuopanError
from .page import build_report, state_token


class ReportServer:
    """Serves the report of the repository ``opener()`` returns (called once, at the first request) on
    ``host:port`` (port 0: a free one). ``start()`` runs it in a daemon thread; ``serve_forever()`` in the caller's;
    ``close()`` stops it and closes the repository."""

    def __init__(self, opener: Callable[[], Any], targets: list[str] | None = None, *, host: str = "127.0.0.1",
                 port: int = 0, poll_ms: int = 3000) -> None:
        self.opener, self.targets, self.poll_ms = opener, list(targets or []), poll_ms
        self.httpd = ThreadingHTTPServer((host, port), _handler(self))
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None
        self._repo: Any = None
        self._lock = threading.Lock()  # one reader of the repository at a time

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/"

    def start(self) -> ReportServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="luopan-report", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def close(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join(10)
        self.httpd.server_close()
        with self._lock:
            if self._repo is not None:
                self._repo.close()
                self._repo = None

    def __enter__(self) -> ReportServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _opened(self) -> Any:
        if self._repo is None:
            self._repo = self.opener()
        return self._repo

    def page(self) -> str:
        with self._lock:
            page, _data = build_report(self._opened(), self.targets, served=True)
            return page

    def token(self) -> str:
        with self._lock:
            return state_token(self._opened())


def _handler(server: ReportServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "luopan-report"

        def do_GET(self) -> None:  # noqa: N802  (http.server's name)
            path = self.path.split("?", 1)[0]
            try:
                if path in ("/", "/index.html"):
                    self._send(200, "text/html; charset=utf-8", server.page().encode())
                elif path == "/state":
                    self._send(200, "application/json", json.dumps({"token": server.token()}).encode())
                elif path == "/favicon.ico":
                    self._send(204, "image/x-icon", b"")
                else:
                    self._send(404, "text/plain; charset=utf-8", b"not found\n")
            except (LuopanError, OSError) as exc:
                msg = f"<!DOCTYPE html><title>luopan report</title><p>error: {escape(str(exc))}</p>"
                self._send(500, "text/html; charset=utf-8", msg.encode())

        def _send(self, code: int, ctype: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (quiet: the CLI prints the URL)
            return

    return Handler
