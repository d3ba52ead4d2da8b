"""The hand-written HTTP/1.1 client that sent ``POST /generate`` up to 0.1 (kept only for the benchmark).

``scripts/bench_client.py --transports h11 legacy`` runs it side by side with the h11 transport that
replaced it (``eagle_datagen.generate.transport``). Do not use it: it mistakes a 1xx for the answer,
returns a chunked body cut by EOF as complete, and loses early responses (review D13). Its docstring was:


httpx over anyio costs about 1.6 ms of CPU per request here (its pool is rescanned on every
request), which caps a client near 600 requests/s: the tool would starve a fast server. This
transport keeps a stack of idle keep-alive connections per server and parses just what SGLang
sends (status line, headers, a Content-Length or chunked body). httpx still serves everything
else (health, server info). ``scripts/bench_client.py`` measures the difference side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_HEADER_BYTES = 64 * 1024


class TransportError(Exception):
    """The connection failed or closed before a whole response arrived."""


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes


class _Connection:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class HostPool:
    """Idle keep-alive connections to one server (``scheme://host:port``)."""

    def __init__(self, base_url: str, headers: dict[str, str]) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/")
        host_header = parts.netloc.rsplit("@", 1)[-1]
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self._head = f"Host: {host_header}\r\n{extra}Connection: keep-alive\r\n"
        self._idle: list[_Connection] = []

    async def post(self, path: str, body: bytes, timeout_s: float) -> Response:
        """POSTs ``body`` (JSON); a stale idle connection is retried once on a fresh one."""
        request = (
            f"POST {self.prefix}{path} HTTP/1.1\r\n{self._head}Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode("latin-1") + body
        while self._idle:
            connection = self._idle.pop()
            try:
                return await asyncio.wait_for(self._exchange(connection, request, fresh=False), timeout_s)
            except _Stale:
                continue
        connection = await asyncio.wait_for(self._open(), timeout_s)
        return await asyncio.wait_for(self._exchange(connection, request, fresh=True), timeout_s)

    async def _open(self) -> _Connection:
        try:
            reader, writer = await asyncio.open_connection(self.host, self.port, ssl=self.ssl, limit=MAX_HEADER_BYTES)
        except OSError as exc:
            raise TransportError(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        return _Connection(reader, writer)

    async def _exchange(self, connection: _Connection, request: bytes, *, fresh: bool) -> Response:
        keep = False
        try:
            try:
                connection.writer.write(request)
                await connection.writer.drain()
                status_line = await connection.reader.readline()
            except (OSError, asyncio.IncompleteReadError) as exc:
                if not fresh:
                    raise _Stale from exc
                raise TransportError(f"connection to {self.host}:{self.port} failed: {exc}") from exc
            if not status_line:
                if not fresh:
                    raise _Stale
                raise TransportError(f"{self.host}:{self.port} closed the connection without a response")
            response, keep = await self._read_response(connection.reader, status_line)
            return response
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            raise TransportError(f"broken response from {self.host}:{self.port}: {exc}") from exc
        finally:
            if keep:
                self._idle.append(connection)
            else:
                connection.close()

    async def _read_response(self, reader: asyncio.StreamReader, status_line: bytes) -> tuple[Response, bool]:
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise ValueError(f"bad status line {status_line[:80]!r}")
        status = int(parts[1])
        length: int | None = None
        chunked = False
        keep = parts[0] == b"HTTP/1.1"
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n"):
                break
            if not line:
                raise asyncio.IncompleteReadError(b"", None)
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            value = value.strip()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"connection":
                keep = value.lower() == b"keep-alive" or (keep and value.lower() != b"close")
        if chunked:
            body = await _read_chunked(reader)
        elif length is not None:
            body = await reader.readexactly(length)
        else:
            body = await reader.read()
            keep = False
        return Response(status, body), keep

    def close(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()


class _Stale(Exception):
    """A reused keep-alive connection had been closed by the server; nothing was received."""


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    while True:
        size_line = await reader.readline()
        size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass
            return bytes(body)
        body += await reader.readexactly(size)
        await reader.readexactly(2)


class Transport:
    """One :class:`HostPool` per server URL."""

    def __init__(self, headers: dict[str, str] | None = None, ssl_context: object = None) -> None:
        self.headers = dict(headers or {})
        self._pools: dict[str, HostPool] = {}

    async def post(self, base_url: str, path: str, body: bytes, timeout_s: float) -> Response:
        pool = self._pools.get(base_url)
        if pool is None:
            pool = self._pools[base_url] = HostPool(base_url, self.headers)
        return await pool.post(path, body, timeout_s)

    def drop(self, base_url: str) -> None:
        """Closes idle connections to a server that went down."""
        pool = self._pools.get(base_url)
        if pool is not None:
            pool.close()

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
