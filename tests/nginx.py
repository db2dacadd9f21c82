"""A real nginx serving a directory on 127.0.0.1, for tests and benchmarks of HTTP downloads (luopan pull).

    with Nginx(root_dir, limit_rate="2m") as web:      # starts it on a free port; web.url is http://127.0.0.1:PORT
        ...                                             # GET web.url + "/index.json", Range requests work
        web.stop(); web.start()                         # a server restart, same port
        web.requests()                                  # the access log: [(path, status, body bytes, Range header)]

nginx runs in the foreground (``daemon off``) as a single process (``master_process off``, so it neither forks
workers nor switches user: it reads what the test user can read) with its own config, pid, temp and log files in a
fresh temporary directory; ``stop()`` ends it by its process id (SIGQUIT, then SIGKILL). ``NGINX`` is the binary
found (``$NGINX``, ``nginx`` on PATH or ``/usr/sbin/nginx``), None when nginx is not installed: callers skip then.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["NGINX", "Nginx", "free_port"]


def _find() -> str | None:
    for cand in (os.environ.get("NGINX"), shutil.which("nginx"), "/usr/sbin/nginx"):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


NGINX = _find()
SKIP_REASON = ("nginx is not installed (the Debian package nginx-light, or nginx: apt-get install nginx-light; "
               "or set $NGINX to the binary)")

_CONF = """\
daemon off;
master_process off;
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 256; }}
http {{
    log_format luopan '$uri $status $body_bytes_sent "$http_range"';
    access_log {tmp}/access.log luopan;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    types {{ application/json json; }}
    default_type application/octet-stream;
    sendfile on;
    keepalive_timeout 5;
    server {{
        listen 127.0.0.1:{port};
        root {root};
        location / {{ {location} }}
    }}
}}
"""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Nginx:
    """nginx serving ``root`` on 127.0.0.1:``port`` (a free one when None). ``limit_rate`` (nginx syntax, e.g.
    ``"2m"`` = 2 MiB/s per connection) slows responses down so a test can interrupt a download halfway;
    ``ignore_range=True`` makes it answer every Range request with the whole file (200), as some servers do."""

    def __init__(self, root: str | os.PathLike[str], *, port: int | None = None, limit_rate: str | None = None,
                 ignore_range: bool = False) -> None:
        if NGINX is None:
            raise RuntimeError(SKIP_REASON)
        self.root = Path(root).resolve()
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="luopan-nginx-"))
        location = (f"limit_rate {limit_rate}; " if limit_rate else "") + ("max_ranges 0; " if ignore_range else "")
        (self.dir / "nginx.conf").write_text(_CONF.format(tmp=self.dir, port=self.port, root=self.root,
                                                          location=location))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> Nginx:
        """Start nginx and wait until it accepts connections; RuntimeError with its error log if it does not."""
        if self.proc is not None:
            return self
        self.proc = subprocess.Popen([NGINX, "-p", str(self.dir), "-c", str(self.dir / "nginx.conf"),
                                      "-e", str(self.dir / "error.log")],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.proc = None
                raise RuntimeError(f"nginx exited at start: {self.error_log()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"nginx did not listen on port {self.port} within {timeout} s: {self.error_log()}")

    def stop(self) -> None:
        """Stop nginx (graceful SIGQUIT, SIGKILL after 5 s): open connections are closed."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGQUIT)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def kill(self) -> None:
        """Kill nginx at once (SIGKILL): connections are dropped as in a crash."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def error_log(self) -> str:
        try:
            return (self.dir / "error.log").read_text(errors="replace")[-2000:]
        except OSError:
            return "(no error log)"

    def requests(self, at_least: int = 0, timeout: float = 5.0) -> list[tuple[str, int, int, str]]:
        """The access log so far: (path, status, body bytes sent, Range header or "-") of each request. nginx logs a
        request when it ends, which may be a moment after the client saw its last byte (or gave up): with
        ``at_least``, wait up to ``timeout`` seconds for that many entries."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                lines = (self.dir / "access.log").read_text().splitlines()
            except FileNotFoundError:
                lines = []
            if len(lines) >= at_least or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        out = []
        for line in lines:
            path, status, sent, rng = line.split(" ", 3)
            out.append((path, int(status), int(sent), rng.strip('"')))
        return out

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Nginx:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
