"""Where a device reads a channel from: an ``http://``/``https://`` URL (any static web server; stdlib http only) or
a local directory (a path or ``file://`` URL: a mounted share, a USB stick).

Two operations, both naming files relative to the channel's root (names were checked by the index parser):
``read(name, limit)`` returns a small file whole (at most ``limit + 1`` bytes: the caller refuses more), and
``open(name, offset, size)`` streams a file from ``offset`` — over HTTP with ``Range: bytes=offset-``; a server that
ignores the range answers with the whole file, which the returned ``Body.start`` (0) tells the caller.

Errors: ChannelDownloadError for anything a retry may cure (unreachable, cut — fewer bytes than the Content-Length
—, timeout, HTTP 5xx/408/429; ``missing`` set for a 404/410: the channel changed since its index was read), and with
``retryable`` false for what a retry cannot cure: a refused redirect, another HTTP 4xx, a response sent
``Content-Encoding``-encoded although luopan asks for the plain bytes. CorruptDownloadError when the server's file is
not the size the index says (a wrong Content-Range or Content-Length, or HTTP 416 to a Range request: the file is
shorter). Redirects stay on the same host and port (or go from http to https on it), and never from https to http:
a redirect elsewhere is refused (a mirror is configured by giving its URL, not by being redirected to it).
"""

from __future__ import annotations

import http.client
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, BinaryIO, Protocol

from ..errors import ChannelDownloadError, CorruptDownloadError, LuopanError, UsageError

TIMEOUT = 30.0  # seconds without a byte before a connection counts as cut
# ASCII digits only and at most 20 of them (int() takes other Unicode digits, and refuses > 4300 digits)
_CONTENT_RANGE = re.compile(r"bytes ([0-9]{1,20})-([0-9]{1,20})/([0-9]{1,20})")
_LENGTH = re.compile(r"[0-9]{1,20}")
_RETRY_CODES = (408, 429)  # and 5xx: a retry may cure them; any other 4xx is the server's refusal


def final(err: ChannelDownloadError) -> ChannelDownloadError:
    """``err`` marked as one a retry cannot cure (``retryable`` false): the pull gives up at once."""
    err.retryable = False  # type: ignore[attr-defined]
    return err


def retryable(err: ChannelDownloadError) -> bool:
    return not err.missing and getattr(err, "retryable", True)


class Body(Protocol):
    start: int  # the offset of the first byte read(): the offset asked for, or 0 when the server sent everything

    def read(self, n: int) -> bytes: ...  # 1 to n bytes (what has arrived); b"" at the end

    def close(self) -> None: ...


class Source(Protocol):
    location: str

    def read(self, name: str, limit: int) -> bytes: ...

    def open(self, name: str, offset: int, size: int) -> Body: ...


def open_source(location: str) -> Source:
    """The source for a channel URL or directory (a trailing ``/index.json`` is dropped)."""
    loc = re.sub(r"/index\.json$", "", location.strip())
    scheme = urllib.parse.urlsplit(loc).scheme.lower()
    if scheme in ("http", "https"):
        return HttpSource(loc.rstrip("/"))
    if scheme == "file":
        return DirSource(urllib.parse.unquote(urllib.parse.urlsplit(loc).path))
    if scheme and len(scheme) > 1:  # "c:" is a drive, not a scheme
        raise UsageError(f"cannot read a channel from {location!r}: use an http://, https:// or file:// URL or a "
                         "directory path")
    return DirSource(loc)


def _origin(url: str) -> tuple[str, str, int | None]:
    u = urllib.parse.urlsplit(url)
    scheme = u.scheme.lower()
    try:
        port = u.port or {"http": 80, "https": 443}.get(scheme)
    except ValueError:
        port = -1
    return scheme, (u.hostname or "").lower(), port


class _SafeRedirect(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only on the same host and port, or from http to https on the same host."""

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> Any:
        old, new = _origin(req.full_url), _origin(urllib.parse.urljoin(req.full_url, newurl))
        why = None
        if new[0] not in ("http", "https"):
            why = "which is not an http(s) URL"
        elif old[0] == "https" and new[0] == "http":
            why = "which would drop https for plain http"
        elif new[1] != old[1] or (new[0] == old[0] and new[2] != old[2]):
            why = "on another host or port"
        if why is not None:
            raise final(ChannelDownloadError(
                f"{req.full_url} redirects to {newurl[:200]!r}, {why}: refused (a pull follows redirects only on the "
                "same host, or from http to https). Give the channel's final URL instead"))
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class HttpSource:
    def __init__(self, url: str, timeout: float = TIMEOUT) -> None:
        self.location = url
        self.timeout = timeout
        self._opener = urllib.request.build_opener(_SafeRedirect)

    def _get(self, name: str, headers: dict[str, str], size: int | None = None) -> Any:
        url = f"{self.location}/{name}"
        request = urllib.request.Request(url, headers={"Accept-Encoding": "identity", "User-Agent": "luopan-pull",
                                                       **headers})
        try:
            resp = self._opener.open(request, timeout=self.timeout)
        except urllib.error.HTTPError as exc:
            exc.close()
            if exc.code == 416 and size is not None:
                raise CorruptDownloadError(
                    f"{url}: the server answered HTTP 416 (range not satisfiable) to {headers.get('Range')}: its file "
                    f"is shorter than that, not the {size}-byte file the index names") from None
            again = exc.code >= 500 or exc.code in _RETRY_CODES
            err = ChannelDownloadError(f"{url}: the server answered HTTP {exc.code} {str(exc.reason)[:100]}"
                                       + ("; run the pull again (a download resumes where it stopped)" if again
                                          else ""))
            err.missing = exc.code in (404, 410)
            if not (err.missing or again):
                final(err)
            raise err from None
        except LuopanError:  # a refused redirect
            raise
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            reason = getattr(exc, "reason", None) or exc
            raise ChannelDownloadError(f"cannot fetch {url}: {reason}; run the pull again (a download resumes "
                                       "where it stopped)") from None
        encoding = resp.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("identity", ""):
            resp.close()
            raise final(ChannelDownloadError(
                f"{url} was sent {encoding[:40]!r}-encoded although luopan asked for the plain bytes "
                "(Accept-Encoding: identity): serve the channel's files as they are (nginx: no gzip for them)"))
        return resp

    def read(self, name: str, limit: int) -> bytes:
        url = f"{self.location}/{name}"
        # no-cache: a cache between device and server must revalidate, so a device never acts on a stale index
        with self._get(name, {"Cache-Control": "no-cache"}) as resp:
            try:
                data = resp.read(limit + 1)  # fewer bytes only at the end of the body, or when it was cut
            except (OSError, http.client.HTTPException) as exc:
                raise ChannelDownloadError(f"the connection to {url} was cut ({exc}); run the pull again") from None
            length = _length(resp)
            if length is not None and len(data) < min(length, limit + 1):
                raise ChannelDownloadError(f"the connection to {url} was cut after {len(data)} of the {length} "
                                           "bytes the server announced; run the pull again")
            return data

    def open(self, name: str, offset: int, size: int) -> Body:
        url = f"{self.location}/{name}"
        resp = self._get(name, {"Range": f"bytes={offset}-"} if offset else {}, size)
        try:
            if resp.status == 206:
                m = _CONTENT_RANGE.fullmatch(resp.headers.get("Content-Range", "").strip())
                if m is None or int(m.group(1)) != offset or int(m.group(3)) != size:
                    raise CorruptDownloadError(
                        f"{url}: the server sent the range {str(resp.headers.get('Content-Range'))[:100]!r} for "
                        f"bytes {offset}- of a {size}-byte file: the file on the server is not the one the index "
                        "names")
                return _HttpBody(resp, offset, url)
            length = _length(resp)
            if length is not None and length != size:
                raise CorruptDownloadError(f"{url} is {length} bytes on the server, but the index says {size}: the "
                                           "file on the server is not the one the index names")
            return _HttpBody(resp, 0, url)  # 200: the server ignored the range (or none was asked)
        except BaseException:
            resp.close()
            raise


def _length(resp: Any) -> int | None:
    """The response's Content-Length; None when it is absent or not a plain number (then the body's end tells)."""
    m = _LENGTH.fullmatch((resp.headers.get("Content-Length") or "").strip())
    return int(m.group()) if m else None


class _HttpBody:
    def __init__(self, resp: Any, start: int, url: str) -> None:
        self.resp, self.start, self.url = resp, start, url

    def read(self, n: int) -> bytes:
        try:
            return self.resp.read1(n)  # what has arrived, so a cut loses no byte already received
        except (OSError, http.client.HTTPException) as exc:  # reset, timeout, IncompleteRead
            raise ChannelDownloadError(f"the connection to {self.url} was cut ({type(exc).__name__}: {exc}); run "
                                       "the pull again: it downloads only the rest") from None

    def close(self) -> None:
        self.resp.close()


class DirSource:
    def __init__(self, path: str) -> None:
        self.location = path

    def _open(self, name: str) -> BinaryIO:
        path = os.path.join(self.location, *name.split("/"))
        try:
            return open(path, "rb")
        except FileNotFoundError:
            err = ChannelDownloadError(f"{path} does not exist (the channel changed, or this is not a channel "
                                       "directory)")
            err.missing = True
            raise err from None
        except OSError as exc:
            raise ChannelDownloadError(f"cannot read {path}: {exc.strerror or exc}") from None

    def read(self, name: str, limit: int) -> bytes:
        with self._open(name) as f:
            return f.read(limit + 1)

    def open(self, name: str, offset: int, size: int) -> Body:
        f = self._open(name)
        actual = os.fstat(f.fileno()).st_size
        if actual != size:
            f.close()
            raise CorruptDownloadError(f"{f.name} is {actual} bytes, but the index says {size}: it is not the file "
                                       "the index names")
        f.seek(offset)
        return _FileBody(f, offset)


class _FileBody:
    def __init__(self, f: BinaryIO, start: int) -> None:
        self.f, self.start = f, start

    def read(self, n: int) -> bytes:
        try:
            return self.f.read(n)
        except OSError as exc:
            raise ChannelDownloadError(f"cannot read {self.f.name}: {exc.strerror or exc}") from None

    def close(self) -> None:
        self.f.close()


__all__ = ["Body", "DirSource", "HttpSource", "Source", "final", "open_source", "retryable"]
