"""The lean /generate transport: keep-alive reuse, chunked bodies, stale connections, timeouts."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import pytest

from eagle_datagen.generate.transport import Transport, TransportError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def serve(handler: Handler) -> tuple[asyncio.Server, str]:
    async def closing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    server = await asyncio.start_server(closing, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    return await reader.readexactly(length)


def run(coro: Awaitable[None]) -> None:
    async def main() -> None:
        await coro
        await asyncio.sleep(0.01)  # let closed transports finish closing before the loop does

    asyncio.run(main())


def test_keep_alive_connection_is_reused() -> None:
    connections = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        while True:
            try:
                body = await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)

    async def main() -> None:
        server, url = await serve(handler)
        transport = Transport({"Authorization": "Bearer k"})
        for i in range(5):
            response = await transport.post(url, "/generate", b'{"i": %d}' % i, 5.0)
            assert response.status == 200 and response.body == b'{"i": %d}' % i
        transport.close()
        server.close()
        await server.wait_closed()

    run(main())
    assert len(connections) == 1


def test_chunked_body_and_connection_close() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 400 Bad Request\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        writer.write(b'5\r\n{"a":\r\n3\r\n 1}\r\n0\r\n\r\n')
        await writer.drain()
        writer.close()

    async def main() -> None:
        server, url = await serve(handler)
        response = await Transport().post(url, "/generate", b"{}", 5.0)
        assert response.status == 400 and response.body == b'{"a": 1}'
        server.close()
        await server.wait_closed()

    run(main())


def test_a_stale_idle_connection_is_retried_on_a_fresh_one() -> None:
    served = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        served.append(1)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()  # closes without saying Connection: close

    async def main() -> None:
        server, url = await serve(handler)
        transport = Transport()
        assert (await transport.post(url, "/generate", b"{}", 5.0)).body == b"ok"
        await asyncio.sleep(0.05)
        assert (await transport.post(url, "/generate", b"{}", 5.0)).body == b"ok"
        transport.close()
        server.close()
        await server.wait_closed()

    run(main())
    assert len(served) == 2


def test_a_dropped_connection_and_a_refused_one_are_transport_errors() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.close()

    async def main() -> None:
        server, url = await serve(handler)
        with pytest.raises(TransportError):
            await Transport().post(url, "/generate", b"{}", 5.0)
        server.close()
        await server.wait_closed()
        with pytest.raises(TransportError, match="cannot connect"):
            await Transport().post(url, "/generate", b"{}", 5.0)

    run(main())


def test_a_silent_server_times_out() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(10)

    async def main() -> None:
        server, url = await serve(handler)
        with pytest.raises(asyncio.TimeoutError):
            await Transport().post(url, "/generate", b"{}", 0.2)
        server.close()
        await server.wait_closed()

    run(main())
