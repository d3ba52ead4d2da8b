"""The lean /generate transport: keep-alive reuse, chunked bodies, stale connections, timeouts."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import orjson
import pytest

from eagle_datagen.generate.transport import HostPool, Transport, TransportError

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


# ----------------------------------------------------------------------------------------------------
# D13: framing by h11 (each of these failed with the hand-written parser)
# ----------------------------------------------------------------------------------------------------

OK_BODY = b'{"output_ids":[1,2,3],"meta_info":{"finish_reason":{"type":"stop","matched":3},"completion_tokens":3}}'


def test_interim_1xx_responses_are_skipped_on_a_keep_alive_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>; rel=preload\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(OK_BODY) + OK_BODY)
            await writer.drain()  # and the connection stays open (keep-alive)

    async def main() -> None:
        server, url = await serve(handler)
        transport = Transport()
        for _ in range(2):  # the old parser read the 100's "body" until EOF: a timeout
            response = await transport.post(url, "/generate", b"{}", 3.0)
            assert response.status == 200 and response.body == OK_BODY
        transport.close()
        server.close()
        await server.wait_closed()

    run(main())


def test_a_chunked_body_cut_by_eof_is_an_error_and_the_connection_is_not_pooled() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        half = len(OK_BODY) // 2
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n" % half + OK_BODY[:half] + b"\r\n")
        await writer.drain()  # then the server dies: EOF between chunks

    async def main() -> None:
        server, url = await serve(handler)
        transport = Transport()
        with pytest.raises(TransportError, match="incomplete chunked read"):
            await transport.post(url, "/generate", b"{}", 3.0)
        assert transport._pools[url]._idle == []
        server.close()
        await server.wait_closed()

    run(main())


def test_a_content_length_body_cut_short_is_an_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(OK_BODY) + OK_BODY[:10])
        await writer.drain()

    async def main() -> None:
        server, url = await serve(handler)
        with pytest.raises(TransportError, match="broken response"):
            await Transport().post(url, "/generate", b"{}", 3.0)
        server.close()
        await server.wait_closed()

    run(main())


def test_an_early_response_to_an_unread_body_is_read_and_not_retried() -> None:
    """A proxy's body limit: 413 after the headers, then it stops reading (the old client blocked in drain)."""
    from eagle_datagen.errors import RequestFailed
    from eagle_datagen.generate.client import generate

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")  # the headers only
        message = b'{"error":"body too large"}'
        writer.write(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: %d\r\n\r\n" % len(message) + message)
        await writer.drain()
        await asyncio.sleep(5)  # holds the connection open without reading the body

    async def main() -> None:
        server, url = await serve(handler)
        transport = Transport()
        with pytest.raises(RequestFailed) as caught:
            await generate(transport, url, [7] * 2_000_000, {"max_new_tokens": 4}, "r1", timeout_s=3.0)
        assert caught.value.kind == "http_413" and not caught.value.retryable
        assert "body too large" in caught.value.message
        assert transport._pools[url]._idle == []  # the request was not all written: never reused
        server.close()

    run(main())


def test_bytes_sent_while_a_connection_was_idle_make_it_unusable() -> None:
    """A server that answers 408 to an idle keep-alive connection: that stale 408 is no answer to the next request."""
    connections = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            await read_request(reader)  # never answered on this connection
            await asyncio.sleep(5)

    async def main() -> None:
        server, url = await serve(handler)
        transport = Transport()
        assert (await transport.post(url, "/generate", b"{}", 3.0)).body == b"ok"
        await asyncio.sleep(0.2)
        response = await transport.post(url, "/generate", b"{}", 3.0)
        assert response.status == 200 and response.body == b"ok"
        transport.close()
        server.close()

    run(main())
    assert len(connections) == 2


def test_response_headers_are_kept() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 7\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()

    async def main() -> None:
        server, url = await serve(handler)
        response = await Transport().post(url, "/generate", b"{}", 3.0)
        assert response.status == 429 and response.header("retry-after") == "7" and response.header("x") is None
        server.close()
        await server.wait_closed()

    run(main())


def test_a_header_h11_refuses_is_reported_without_its_value() -> None:
    with pytest.raises(ValueError) as caught:
        HostPool("http://127.0.0.1:1", {"Authorization": "Bearer S3CRET\n"})
    assert "S3CRET" not in str(caught.value)


@pytest.mark.parametrize("ids", [[1, True, 3], [1, 2.0], [1, "2"], [None], "123"])
def test_output_ids_must_be_a_list_of_integers(ids: object) -> None:
    from eagle_datagen.errors import RequestFailed
    from eagle_datagen.generate.client import parse_generate_response

    body = orjson.dumps({"output_ids": ids, "meta_info": {"finish_reason": {"type": "length", "length": 3}}})
    with pytest.raises(RequestFailed, match="list of integer 'output_ids'"):
        parse_generate_response(body, [5], {"max_new_tokens": 3}, None, 0.0)
