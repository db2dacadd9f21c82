"""A real S3-protocol server for tests: moto's standalone server, started on 127.0.0.1 in a child process (not a
mocked client: s3fs talks HTTP to it like to any S3 endpoint). Import ``s3_endpoint`` (a module-scoped fixture)
and ``fresh_url`` into a test module.

moto checks ``If-None-Match: *`` and then stores the object without a lock; S3 itself makes that conditional
create atomic. The harness serializes the server's requests so that moto keeps S3's guarantee under racing writers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import moto  # noqa: F401  (a dev dependency: tests using it must fail, not skip, where it is missing)
import pytest

BUCKET = "luopan-test"

SERVER = r"""
import sys, threading
from werkzeug.serving import make_server
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app

app = DomainDispatcherApplication(create_backend_app)
lock = threading.Lock()

def serialized(environ, start_response):  # moto's conditional create is check-then-store: make it atomic
    with lock:
        return list(app(environ, start_response))

server = make_server("127.0.0.1", 0, serialized, threaded=True, request_handler=MotoRequestHandler)
print(server.server_address[1], flush=True)
threading.Thread(target=server.serve_forever, daemon=True).start()
sys.stdin.read()  # runs until the test process closes the pipe (or dies)
server.shutdown()
"""


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory):
    """Start moto's S3 server on 127.0.0.1 (a free port), point the AWS environment at it, create BUCKET."""
    log = tmp_path_factory.mktemp("moto") / "server.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=err)
    line = proc.stdout.readline()
    if not line.strip().isdigit():
        proc.kill()
        proc.wait()
        pytest.fail(f"moto server did not start: {log.read_text()[-3000:]}")
    endpoint = f"http://127.0.0.1:{int(line)}"
    env = {
        "LUOPAN_S3_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true", "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1",
    }
    with pytest.MonkeyPatch.context() as mp:
        for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
                  "HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
            mp.delenv(k, raising=False)
        for k, v in env.items():
            mp.setenv(k, v)
        import s3fs

        s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True).mkdir(BUCKET)
        try:
            yield endpoint
        finally:
            proc.stdin.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def fresh_url() -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"
