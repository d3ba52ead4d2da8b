"""CPU per /generate exchange of the transport alone: h11 (today's) against the hand-written parser it replaced.

A canned HTTP/1.1 server (its own process, pinned to one core) answers every POST at once with a fixed
1,000-id /generate body and uvicorn's four headers; the client (pinned to the other core) sends
``--requests`` posts, ``--concurrency`` at a time, through one transport, and reports client CPU µs per
exchange. Transports alternate their order between repeats. No rendering, no checks, no shards: this is
the part of ``scripts/bench_client.py``'s figure that the transport owns.

    .venv/bin/python scripts/bench_transport.py --requests 5000 --repeat 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_client import cpu_cores, machine, pin

SERVER = r"""
import asyncio, os, sys
if len(sys.argv) > 1 and sys.argv[1] != "-": os.sched_setaffinity(0, {int(sys.argv[1])})
ids = b",".join(b"%d" % (100 + i % 400) for i in range(1000))
body = (b'{"text":"","output_ids":[' + ids + b'],"meta_info":{"id":"r","finish_reason":{"type":"stop",'
        b'"matched":3},"prompt_tokens":300,"completion_tokens":1000,"cached_tokens":0}}')
resp = (b"HTTP/1.1 200 OK\r\ndate: Tue, 01 Dec 2026 11:00:00 GMT\r\nserver: uvicorn\r\n"
        b"content-length: %d\r\ncontent-type: application/json\r\n\r\n" % len(body) + body)
class P(asyncio.Protocol):
    def connection_made(self, t): self.t = t; self.buf = b""
    def data_received(self, d):
        self.buf += d
        while True:
            i = self.buf.find(b"\r\n\r\n")
            if i < 0: return
            n = int(self.buf[:i].lower().split(b"content-length:")[1].split(b"\r\n")[0])
            if len(self.buf) < i + 4 + n: return
            self.buf = self.buf[i + 4 + n:]
            self.t.write(resp)
async def main():
    s = await asyncio.get_running_loop().create_server(P, "127.0.0.1", 0)
    print(s.sockets[0].getsockname()[1], flush=True)
    await s.serve_forever()
asyncio.run(main())
"""


async def exchanges(transport_cls: Any, url: str, n: int, concurrency: int) -> tuple[float, float]:
    """(client CPU µs per exchange, exchanges per wall second)."""
    transport = transport_cls({"Authorization": "Bearer k"})
    body = b'{"input_ids":[' + b"1," * 300 + b'1],"sampling_params":{"max_new_tokens":1000},"rid":"r"}'
    semaphore = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with semaphore:
            response = await transport.post(url, "/generate", body, 30.0)
            assert response.status == 200

    await one()  # connect outside the clock
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    transport.close()
    return 1e6 * cpu / n, n / wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    import legacy_transport
    from eagle_datagen.generate import transport as h11_transport

    client_core, server_core = cpu_cores()
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(server_core) if server_core is not None else "-"],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": ""},
    )
    try:
        assert server.stdout is not None
        url = f"http://127.0.0.1:{int(server.stdout.readline())}"
        pin(client_core)
        clients = {"h11": h11_transport.Transport, "legacy": legacy_transport.Transport}
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in clients}
        for repeat in range(args.repeat):
            order = list(clients) if repeat % 2 == 0 else list(reversed(clients))
            for name in order:
                cpu_us, rate = asyncio.run(exchanges(clients[name], url, args.requests, args.concurrency))
                results[name].append((cpu_us, rate))
                print(f"{name:8s} {cpu_us:7.1f} µs CPU per exchange, {rate:7.0f} exchanges/s", flush=True)
    finally:
        server.kill()
        server.wait()
    print(f"\n{machine()}\nmedians over {args.repeat} repeats:")
    for name, runs in results.items():
        cpus = [c for c, _ in runs]
        print(
            f"  {name:8s} {statistics.median(cpus):7.1f} µs CPU per exchange (min {min(cpus):.1f}, "
            f"max {max(cpus):.1f}), {statistics.median(r for _, r in runs):7.0f} exchanges/s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
