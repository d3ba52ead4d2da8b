"""The HTTP/1.1 client for the one hot call, ``POST /generate``: a keep-alive pool, framing by h11.

httpx over anyio costs about 1.6 ms of CPU per request here (its pool is rescanned on every
request), which caps a client near 600 requests/s: the tool would starve a fast server. This
transport keeps a stack of idle keep-alive connections per server, each an ``asyncio.Protocol``
feeding an :mod:`h11` state machine (httpx's own HTTP/1.1 parser), so every framing rule is h11's:

- interim ``1xx`` responses (``100 Continue``, ``103 Early Hints``) are skipped, not taken as the answer;
- a body cut short (EOF inside a chunked body or before ``Content-Length``) is a :class:`TransportError`,
  and that connection is closed, never pooled;
- the response is read while the request is still being written, so a server that answers early
  (``413``) and stops reading is heard at once, and a response that arrived before a write error
  still counts.

A connection goes back to the pool only when h11 says both sides finished the exchange and may
reuse it. httpx still serves everything else (health, server info), with the same
:class:`ssl.SSLContext` (:mod:`eagle_datagen.generate.connect`). ``scripts/bench_client.py``
measures this transport against the hand-written parser it replaced, side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import h11

MAX_HEADER_BYTES = 64 * 1024
#: How long opening a connection (TCP, then TLS) may take, at most (and never more than the request's timeout).
CONNECT_TIMEOUT_S = 30.0


class TransportError(Exception):
    """The connection failed or closed before a whole response arrived.

    ``retryable`` is False only when the request itself cannot be framed (sending it again cannot help)."""

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes
    #: Header names lower-cased, as h11 gives them (``(b"retry-after", b"5")``).
    headers: Sequence[tuple[bytes, bytes]] = ()

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (any case), or ``None``."""
        key = name.lower().encode("latin-1")
        for k, v in self.headers:
            if k == key:
                return v.decode("latin-1")
        return None


class _Stale(Exception):
    """A reused keep-alive connection had been closed by the server; nothing was received."""


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection: bytes in go to h11; the exchange waits on :meth:`_wait`."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEADER_BYTES)
        self.closed = False
        self.error: BaseException | None = None
        self.busy = False
        #: Bytes (or EOF) arrived while idle in the pool: unsafe to reuse.
        self.dirty = False
        self.received = False
        self.timed_out = False
        self._waiter: asyncio.Future[None] | None = None

    # asyncio.Protocol ------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if not self.busy:
            self.dirty = True
            return
        self.received = True
        self.h11.receive_data(data)
        self._wake()

    def eof_received(self) -> bool:
        self._closed(None)
        return False  # let the transport close itself

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed(exc)

    def _closed(self, exc: BaseException | None) -> None:
        if not self.closed:
            self.closed = True
            self.error = exc
            if not self.busy:
                self.dirty = True
            with contextlib.suppress(RuntimeError):  # h11 already closed
                self.h11.receive_data(b"")
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _time_out(self) -> None:
        self.timed_out = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(TimeoutError())

    async def _wait(self) -> None:
        if self.timed_out:
            raise TimeoutError
        self._waiter = self.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    # the exchange ----------------------------------------------------------------------------------

    async def exchange(self, request: _Request, body: bytes, timeout_s: float) -> tuple[Response, bool]:
        """Sends one request and reads its response; returns it and whether the connection may be reused.

        Raises ``asyncio.TimeoutError`` when no whole response came in ``timeout_s`` (a timer, not a task
        per request as ``asyncio.wait_for`` makes on 3.11: this is the hot path)."""
        timer = self.loop.call_later(timeout_s, self._time_out)
        try:
            return await self._exchange(request, body)
        finally:
            timer.cancel()

    async def _exchange(self, request: _Request, body: bytes) -> tuple[Response, bool]:
        transport = self.transport
        if transport is None or self.closed or transport.is_closing():
            raise _Stale
        self.busy = True
        self.received = False
        h = self.h11
        h.send(request.event)  # h11 now expects the response to exactly this request (see _Request)
        h.send(h11.EndOfMessage())
        transport.write(request.frame(body))  # one write: one send(2) when the socket takes it all
        if not self.received and not self.closed:
            await self._wait()  # asking h11 before any byte came would only cost a NEED_DATA round
        status = 0
        headers: Sequence[tuple[bytes, bytes]] = ()
        chunks: list[bytes] = []
        while True:
            event = h.next_event()
            if event is h11.NEED_DATA:
                await self._wait()
                continue
            kind = type(event)
            if kind is h11.Data:
                chunks.append(event.data)  # type: ignore[union-attr]
            elif kind is h11.Response:
                status = event.status_code  # type: ignore[union-attr]
                headers = event.headers  # type: ignore[union-attr]  # iterated only if asked (header())
            elif kind is h11.EndOfMessage:
                break
            elif kind is h11.ConnectionClosed:
                raise h11.RemoteProtocolError("the server closed the connection without a response")
            # h11.InformationalResponse (1xx): an interim answer; the real one follows.
        reuse = (
            h.our_state is h11.DONE
            and h.their_state is h11.DONE
            and not self.closed
            and transport.get_write_buffer_size() == 0
        )
        if reuse:
            h.start_next_cycle()
        self.busy = False
        return Response(status, b"".join(chunks), headers), reuse

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class _Request:
    """One kind of request (``POST path`` with this pool's headers), validated by h11 once.

    ``event`` is the h11 request the state machine is told about; it differs from the bytes sent only in
    its ``Content-Length: 0``. A request's framing changes nothing h11 does with the response (that
    depends on the method, the HTTP version and ``Connection``, all the same), so h11 still parses,
    frames and keep-alive-checks every response exactly, while the per-request cost stays one format of
    a fixed head and the length (letting h11 build and validate a request event per call cost about as
    much as all of its response parsing: docs/performance.md §1.2)."""

    __slots__ = ("event", "head")

    def __init__(self, target: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        try:  # h11's message for a bad header value would hold the value (an API key): not shown
            self.event = h11.Request(method=b"POST", target=target, headers=[*headers, (b"Content-Length", b"0")])
        except h11.LocalProtocolError:
            raise ValueError("a request header (name or value) is not valid in HTTP/1.1") from None
        lines = b"".join(b"%s: %s\r\n" % (name, value) for name, value in headers)
        self.head = b"POST %s HTTP/1.1\r\n%sContent-Length: " % (target, lines)

    def frame(self, body: bytes) -> bytes:
        return b"%s%d\r\n\r\n%s" % (self.head, len(body), body)


class HostPool:
    """Idle keep-alive connections to one server (``scheme://host:port``)."""

    def __init__(self, base_url: str, headers: dict[str, str], ssl_context: ssl.SSLContext | None = None) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = None
        if parts.scheme == "https":
            self.ssl = ssl_context or ssl.create_default_context()
        self.prefix = parts.path.rstrip("/")
        host_header = parts.netloc.rsplit("@", 1)[-1]
        if not host_header.isascii():
            raise ValueError(f"{base_url!r}: write a non-ASCII host name in its ASCII (xn--) form")
        self._headers = [
            (b"Host", host_header.encode("ascii")),
            *((k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()),
            (b"Content-Type", b"application/json"),
        ]
        self._requests: dict[str, _Request] = {}
        self._request("/")  # refuses bad headers now, not at the first request
        self._idle: list[_Connection] = []

    async def post(self, path: str, body: bytes, timeout_s: float) -> Response:
        """POSTs ``body`` (JSON); a stale idle connection is retried once on a fresh one.

        Raises :class:`TransportError` or ``asyncio.TimeoutError`` (no whole response in ``timeout_s``)."""
        request = self._requests.get(path) or self._request(path)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._idle:
            connection = self._idle.pop()
            if connection.dirty or connection.closed:
                connection.close()
                continue
            try:
                return await self._exchange(connection, request, body, timeout_s, fresh=False)
            except _Stale:
                continue
        connection = await asyncio.wait_for(self._open(loop), min(CONNECT_TIMEOUT_S, timeout_s))
        remaining = max(0.001, deadline - loop.time())
        return await self._exchange(connection, request, body, remaining, fresh=True)

    def _request(self, path: str) -> _Request:
        request = self._requests[path] = _Request(f"{self.prefix}{path}".encode(), self._headers)
        return request

    async def _open(self, loop: asyncio.AbstractEventLoop) -> _Connection:
        try:
            _, protocol = await loop.create_connection(lambda: _Connection(loop), self.host, self.port, ssl=self.ssl)
        except (OSError, ssl.SSLError) as exc:
            raise TransportError(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        return protocol

    async def _exchange(
        self, connection: _Connection, request: _Request, body: bytes, timeout_s: float, *, fresh: bool
    ) -> Response:
        reuse = False
        try:
            response, reuse = await connection.exchange(request, body, timeout_s)
            return response
        except _Stale as exc:
            if not fresh:
                raise
            # a new connection the server closed at once (it went down, or drops connections)
            raise TransportError(f"{self.host}:{self.port} closed a new connection before answering") from exc
        except h11.RemoteProtocolError as exc:
            if not fresh and not connection.received:
                raise _Stale from exc  # closed while idle (the keep-alive race): nothing was answered
            reason = connection.error or exc
            raise TransportError(f"broken response from {self.host}:{self.port}: {reason}") from exc
        except h11.LocalProtocolError as exc:  # a bug of ours, or a request h11 refuses to frame
            raise TransportError(f"cannot send to {self.host}:{self.port}: {exc}", retryable=False) from exc
        finally:
            if reuse:
                self._idle.append(connection)
            else:
                connection.close()

    def close(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()


class Transport:
    """One :class:`HostPool` per server URL, all with the run's one :class:`ssl.SSLContext`."""

    def __init__(self, headers: dict[str, str] | None = None, ssl_context: ssl.SSLContext | None = None) -> None:
        self.headers = dict(headers or {})
        self.ssl_context = ssl_context
        self._pools: dict[str, HostPool] = {}

    async def post(self, base_url: str, path: str, body: bytes, timeout_s: float) -> Response:
        pool = self._pools.get(base_url)
        if pool is None:
            pool = self._pools[base_url] = HostPool(base_url, self.headers, self.ssl_context)
        return await pool.post(path, body, timeout_s)

    def drop(self, base_url: str) -> None:
        """Closes idle connections to a server that went down."""
        pool = self._pools.get(base_url)
        if pool is not None:
            pool.close()

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
