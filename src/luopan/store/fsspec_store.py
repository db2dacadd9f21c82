"""Object-store backend through fsspec: ``s3://bucket/prefix`` (s3fs), and the other object stores fsspec knows.

Object stores have no rename, no directories and no temporaries, so the rules of docs/format.md §10 take their
object-store form (§10.1 there):

* ``put`` is one whole-object PUT (a multipart upload only becomes visible when completed): a reader sees the old
  object or the new one, never a part. There are no temporary objects, so ``cleanup_temporaries`` has nothing to do.
* ``put_if_absent`` first asks whether the key exists (HEAD), then writes with a conditional create
  (``If-None-Match: *``) where the backend has one (S3; the server answers 412 if another writer won the race).
  A server that answers "not implemented" drops this store to check-then-put, which is not atomic against a second
  writer of the same key, exactly as on filesystems without hard links (docs/format.md §10 rule 11).
* ``list`` lists objects (never directory placeholders) under the root prefix, recursively; keys are relative.

fsspec and the backend package (s3fs) are imported only when such a store is opened; a missing one is a
``MissingDependencyError`` saying what to install. Errors other than a missing key become ``ObjectStoreError``
(an ``OSError``) naming the URL and the key.
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
from collections.abc import Iterator
from typing import Any

from ..errors import InvalidNameError, MissingDependencyError, ObjectStoreError
from .base import Data, KeyNotFound, Store, Stray, as_parts, check_key, too_large, valid_key

# scheme -> (fsspec protocol, package that implements it, pip extra or package to install)
OBJECT_STORE_SCHEMES: dict[str, tuple[str, str, str]] = {
    "s3": ("s3", "s3fs", '"luopan[s3]"'),
    "s3a": ("s3", "s3fs", '"luopan[s3]"'),
    "gs": ("gcs", "gcsfs", "fsspec gcsfs"),
    "gcs": ("gcs", "gcsfs", "fsspec gcsfs"),
    "az": ("abfs", "adlfs", "fsspec adlfs"),
    "abfs": ("abfs", "adlfs", "fsspec adlfs"),
    "abfss": ("abfs", "adlfs", "fsspec adlfs"),
}
# Protocols whose fsspec backend sends a conditional create (If-None-Match: *) for pipe_file(mode="create").
_CONDITIONAL_CREATE = {"s3"}
_TMP_MARK = ".tmp-"  # docs/format.md §2: readers ignore such names (e.g. copied up from a local repository)


__all__ = ["FsspecStore", "MissingDependencyError", "OBJECT_STORE_SCHEMES", "ObjectStoreError", "is_object_url"]


def is_object_url(location: object) -> bool:
    """Whether ``location`` is an object-store URL (``s3://…``, ``gs://…``, ``az://…``): the one such check."""
    return isinstance(location, str) and "://" in location and \
        location.split("://", 1)[0].lower() in OBJECT_STORE_SCHEMES


def _s3_code(exc: BaseException) -> str | None:
    """The S3 error code behind an exception s3fs translated (its ``__cause__`` is botocore's ClientError)."""
    seen = 0
    cur: BaseException | None = exc
    while cur is not None and seen < 5:
        response = getattr(cur, "response", None)
        if isinstance(response, dict):
            return response.get("Error", {}).get("Code")
        cur = cur.__cause__
        seen += 1
    return None


class FsspecStore(Store):
    """A Store on an fsspec filesystem rooted at ``<protocol>://<bucket>[/<prefix>]``.

    ``storage_options`` go to the fsspec filesystem (for S3: ``endpoint_url``, ``key``, ``secret``, ``client_kwargs``
    …). For S3 the endpoint defaults to ``$LUOPAN_S3_ENDPOINT_URL``, else what botocore reads itself
    (``$AWS_ENDPOINT_URL``, ``$AWS_ENDPOINT_URL_S3``, the AWS config); credentials come from the usual AWS chain.
    """

    def __init__(self, url: str, **storage_options: Any) -> None:
        if "://" not in url:
            raise InvalidNameError(f"not an object-store URL: {url!r}")
        scheme, rest = url.split("://", 1)
        scheme = scheme.lower()
        root = rest.strip("/")
        if not root or not valid_key(root):
            raise InvalidNameError(f"object-store URL {url!r} needs a bucket and an optional prefix without empty, "
                                   f"'.' or '..' parts: {scheme}://<bucket>[/<prefix>], e.g. {scheme}://my-bucket/ckpts")
        protocol = OBJECT_STORE_SCHEMES.get(scheme, (scheme, "", ""))[0]
        self.url = f"{scheme}://{root}"
        self.protocol = protocol
        self.prefix = root  # "bucket" or "bucket/some/prefix"; keys live at prefix + "/" + key
        self._fs = _filesystem(scheme, protocol, storage_options)
        self._conditional: bool = protocol in _CONDITIONAL_CREATE
        self._lock = threading.Lock()

    # -- helpers ------------------------------------------------------------------------------------------------
    def _path(self, key: str) -> str:
        return f"{self.prefix}/{check_key(key)}"

    def _error(self, exc: BaseException, op: str, key: str) -> OSError:
        code = _s3_code(exc)
        detail = f"{exc}" + (f" ({code})" if code and code not in str(exc) else "")
        if code == "NoSuchBucket":
            detail = f"bucket {self.prefix.split('/', 1)[0]!r} does not exist"
        err = ObjectStoreError(getattr(exc, "errno", None) or errno.EIO,
                               f"{op} {key or '/'} in {self.url} failed: {detail}")
        return err

    def _call(self, op: str, key: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run an fsspec call; a missing key stays FileNotFoundError (callers map it), anything else becomes an
        ObjectStoreError naming the URL."""
        try:
            return fn(*args, **kwargs)
        except (FileNotFoundError, FileExistsError) as exc:
            if _s3_code(exc) == "NoSuchBucket":
                raise self._error(exc, op, key) from exc
            raise
        except InvalidNameError:
            raise
        except Exception as exc:  # botocore/aiohttp connection errors are not OSErrors: give them our name
            raise self._error(exc, op, key) from exc

    def _info(self, key: str) -> dict[str, Any]:
        path = self._path(key)
        try:
            if self.protocol == "s3":  # one HEAD; fs.info would also list the prefix to look for a "directory"
                bucket, _, name = path.partition("/")
                out = self._call("stat", key, self._fs.call_s3, "head_object", self._fs.kwargs, Bucket=bucket,
                                 Key=name)
                return {"type": "file", "size": out["ContentLength"], "ETag": out.get("ETag"),
                        "LastModified": out.get("LastModified")}
            info = self._call("stat", key, self._fs.info, path)
        except FileNotFoundError:
            raise KeyNotFound(key) from None
        if info.get("type") != "file":  # a "directory" (common prefix) is not an object
            raise KeyNotFound(key)
        return info

    # -- primitives ---------------------------------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        try:
            # Whole-object reads are small JSON files: one GET, not s3fs's HEAD + parallel ranged GETs.
            extra = {"max_concurrency": 1} if self.protocol == "s3" else {}
            return self._call("get", key, self._fs.cat_file, self._path(key), **extra)
        except FileNotFoundError:
            raise KeyNotFound(key) from None

    def get_limited(self, key: str, limit: int) -> bytes:
        data = self.get_range(key, 0, limit + 1)  # one ranged GET: the server sends at most limit + 1 bytes
        if len(data) > limit:
            raise too_large(key, self.size(key), limit, self.url)
        return data

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        path = self._path(key)
        if length <= 0:  # an empty Range header is invalid HTTP: servers answer with the whole object
            self.size(key)  # KeyNotFound when missing
            return b""
        try:
            return self._call("get", key, self._fs.cat_file, path, start=offset, end=offset + length)
        except FileNotFoundError:
            raise KeyNotFound(key) from None
        except OSError:
            # 416 (range not satisfiable) when offset is at or past the end: the contract is "the bytes that exist"
            if offset >= self.size(key):
                return b""
            raise

    def put(self, key: str, data: Data) -> None:
        path = self._path(key)
        value = b"".join(as_parts(data))
        self._call("put", key, self._fs.pipe_file, path, value)

    def put_if_absent(self, key: str, data: Data) -> bool:
        path = self._path(key)
        if self.exists(key):  # cheap HEAD; also spares uploading a pack that is already there
            return False
        value = b"".join(as_parts(data))
        for _attempt in range(5):
            if not self._conditional:
                # Check-then-put: not atomic against a second writer of this key (docs/format.md §10.1).
                self._call("put", key, self._fs.pipe_file, path, value)
                return True
            try:
                self._call("put", key, self._fs.pipe_file, path, value, mode="create")
                return True
            except FileExistsError:  # 412 Precondition Failed: another writer created it first
                return False
            except ObjectStoreError as exc:
                code = _s3_code(exc)
                if code == "ConditionalRequestConflict":  # 409: a concurrent conditional write; S3 says retry
                    if self.exists(key):
                        return False
                    continue
                if code in ("NotImplemented", "InvalidArgument", "InvalidRequest") or exc.errno == errno.ENOSYS:
                    with self._lock:
                        self._conditional = False  # this server has no conditional create: check-then-put
                    if self.exists(key):
                        return False
                    continue
                raise
        if self.exists(key):
            return False
        raise ObjectStoreError(errno.EAGAIN, f"put {key} in {self.url} failed: conditional writes kept conflicting")

    def delete(self, key: str) -> None:
        try:
            self._call("delete", key, self._fs.rm_file, self._path(key))
        except FileNotFoundError:
            pass

    def list(self, prefix: str = "") -> Iterator[str]:
        return iter([k for k in self._keys(prefix) if valid_key(k)])

    def strays(self, prefix: str = "") -> list[Stray]:
        return [Stray(k, "an object whose name is not a valid key (empty, '.' or '..' parts)")
                for k in self._keys(prefix) if not valid_key(k)]

    def _keys(self, prefix: str) -> list[str]:
        """Every object name under ``prefix``, relative to the root, valid as a key or not."""
        base = self.prefix + ("/" + prefix.strip("/") if prefix.strip("/") else "")
        try:
            found = self._call("list", prefix, self._fs.find, base)
        except FileNotFoundError:
            return []
        strip = self._fs._strip_protocol  # the backend's own spelling of paths (memory: "/bucket/…")
        root = strip(self.prefix).rstrip("/") + "/"
        keys = []
        for full in found:
            if full.endswith("/"):
                continue  # a "directory" placeholder object
            full = strip(full)
            if not full.startswith(root):
                continue
            key = full[len(root):]
            if not key or key.endswith("/") or not key.startswith(prefix) or _TMP_MARK in key.rsplit("/", 1)[-1]:
                continue  # directory placeholders and temporaries copied from a filesystem are not keys
            keys.append(key)
        return keys

    def exists(self, key: str) -> bool:
        try:
            self._info(key)
        except KeyNotFound:
            return False
        return True

    def size(self, key: str) -> int:
        return int(self._info(key)["size"])

    def signature(self, key: str) -> tuple[int, ...] | None:
        """(size, ETag digest, LastModified ns) from one HEAD: replaced or rewritten objects get a new ETag or time."""
        info = self._info(key)
        etag = info.get("ETag") or info.get("etag")
        if not etag:
            return None
        tag = int.from_bytes(hashlib.blake2b(str(etag).encode(), digest_size=8).digest(), "little")
        modified = info.get("LastModified") or info.get("last_modified") or info.get("mtime")
        stamp = int(modified.timestamp() * 1e9) if hasattr(modified, "timestamp") else 0
        return (int(info["size"]), tag, stamp)

    def modified(self, key: str) -> float | None:
        info = self._info(key)
        stamp = info.get("LastModified") or info.get("last_modified") or info.get("mtime") or info.get("created")
        if hasattr(stamp, "timestamp"):
            return float(stamp.timestamp())
        return float(stamp) if isinstance(stamp, (int, float)) else None

    def cleanup_temporaries(self) -> int:
        return 0  # objects are written whole: no temporaries on object stores

    def describe(self) -> str:
        return self.url


def _filesystem(scheme: str, protocol: str, storage_options: dict[str, Any]) -> Any:
    package, install = OBJECT_STORE_SCHEMES.get(scheme, ("", "", "fsspec"))[1:]
    try:
        import fsspec
    except ImportError as exc:
        raise MissingDependencyError(
            f"{scheme}:// repositories need fsspec{' and ' + package if package else ''}: pip install {install}"
        ) from exc
    if package:
        try:
            __import__(package)
        except ImportError as exc:
            raise MissingDependencyError(
                f"{scheme}:// repositories need {package}: pip install {install}"
            ) from exc
    options = dict(storage_options)
    if protocol == "s3":
        endpoint = os.environ.get("LUOPAN_S3_ENDPOINT_URL")
        if endpoint and "endpoint_url" not in options and "endpoint_url" not in options.get("client_kwargs", {}):
            options["endpoint_url"] = endpoint
        # Another writer's new objects must show up in list(). (fsspec shares one instance, so one client and
        # connection pool, between stores with the same options.)
        options.setdefault("use_listings_cache", False)
    return fsspec.filesystem(protocol, **options)
