"""A tiny threaded TCP proxy that can simulate a network outage: a real one, at the socket level.

``NetCut(host, port)`` listens on 127.0.0.1 (a free port) and forwards every connection to ``host:port``.
``cut()`` resets every open connection (both sides) and, until ``restore()``, resets every new connection as soon as
it is accepted, so a client sees exactly what it sees when the network drops: connections reset mid-request, new
ones refused. ``close()`` stops it and closes every socket; all its threads are daemons.

Used by tests that need an object store to become unreachable halfway through an operation (an HTTP client talking
to it through the proxy gets real connection errors, not a mocked exception).
"""

from __future__ import annotations

import socket
import struct
import threading

_LINGER_ZERO = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a RST instead of a FIN


def _abort(sock: socket.socket) -> None:
    """Close ``sock`` abortively (RST), waking any thread blocked reading it."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_ZERO)
    except OSError:
        pass
    _shut(sock)


def _shut(sock: socket.socket) -> None:
    """Shut ``sock`` down and close it, ignoring a socket already closed."""
    try:
        sock.shutdown(socket.SHUT_RDWR)  # wakes a recv() blocked in another thread
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


class NetCut:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self._listener.settimeout(0.1)  # the accept loop polls the stop flag
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._down = False
        self._stopped = threading.Event()
        self._open: set[socket.socket] = set()  # every live socket of every forwarded connection
        self._threads: list[threading.Thread] = []
        self.accepted = 0  # connections accepted (and forwarded or reset): lets a test see traffic went through
        self.refused = 0  # connections reset because the network was down
        self._accepter = threading.Thread(target=self._accept_loop, name="netcut-accept", daemon=True)
        self._accepter.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def is_down(self) -> bool:
        return self._down

    # -- control ------------------------------------------------------------------------------------------------
    def cut(self) -> None:
        """The network drops: every open connection is reset, new ones are reset on arrival."""
        with self._lock:
            self._down = True
            victims = list(self._open)
            self._open.clear()
        for sock in victims:
            _abort(sock)

    def restore(self) -> None:
        """The network is back: new connections are forwarded again (connections cut stay dead)."""
        with self._lock:
            self._down = False

    def close(self) -> None:
        """Stop accepting, reset every connection, wait (briefly) for every thread to end."""
        self._stopped.set()
        self.cut()
        self._accepter.join(timeout=5)
        try:
            self._listener.close()
        except OSError:
            pass
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout=5)

    def __enter__(self) -> NetCut:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- forwarding ---------------------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            self.accepted += 1
            if self._down or self._stopped.is_set():
                self.refused += 1
                _abort(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _abort(client)
                continue
            with self._lock:
                if self._down:  # cut() ran meanwhile: this connection belongs to the outage
                    self.refused += 1
                    _abort(client)
                    _abort(upstream)
                    continue
                self._open.update((client, upstream))
                self._threads = [t for t in self._threads if t.is_alive()]
                pair = [threading.Thread(target=self._pump, args=(client, upstream), name="netcut-up", daemon=True),
                        threading.Thread(target=self._pump, args=(upstream, client), name="netcut-down",
                                         daemon=True)]
                self._threads.extend(pair)
            for t in pair:
                t.start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        """Copy src to dst until either side closes; then close both (an HTTP connection is over)."""
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        with self._lock:
            self._open.discard(src)
            self._open.discard(dst)
        for sock in (src, dst):
            _shut(sock)
