"""D14: one trust store for every connection (https with a private CA), and proxies refused, not ignored.

The TLS front is tests/data/tls (a throw-away CA and a 127.0.0.1 certificate; make-tls.sh remakes them)
before the fake SGLang server, so /server_info, /health_generate and /generate all go through TLS.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shlex
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from conftest import read_records, varied_rows, write_jsonl
from eagle_datagen.cli import main
from eagle_datagen.errors import UsageError
from eagle_datagen.generate.connect import refuse_proxies, ssl_context
from eagle_datagen.testing.fake_sglang import FakeConfig, FakeSGLangServer, family_config

TLS = Path(__file__).resolve().parent / "data" / "tls"
PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")


@pytest.fixture(autouse=True)
def no_proxy_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)


@contextlib.contextmanager
def tls_front(backend_url: str) -> Iterator[str]:
    """An https URL whose connections are piped to ``backend_url`` (TLS ends here)."""
    backend_port = int(backend_url.rsplit(":", 1)[1])
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(TLS / "srv.pem", TLS / "srv.key")
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict[str, Any] = {}

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (OSError, ssl.SSLError):
            pass
        finally:
            writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        back_reader, back_writer = await asyncio.open_connection("127.0.0.1", backend_port)
        try:
            await asyncio.gather(pipe(reader, back_writer), pipe(back_reader, writer))
        finally:
            back_writer.close()
            writer.close()

    async def start() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)
        holder["server"] = server
        holder["port"] = server.sockets[0].getsockname()[1]
        ready.set()

    def main() -> None:
        loop.run_until_complete(start())
        loop.run_forever()

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield f"https://127.0.0.1:{holder['port']}"
    finally:

        async def stop() -> None:
            holder["server"].close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            loop.stop()

        asyncio.run_coroutine_threadsafe(stop(), loop)
        thread.join(5)
        loop.close()


def run_args(prompts: Path, out: Path, tokenizer: Path, url: str, *extra: str) -> list[str]:
    return ["run", "--prompts", str(prompts), "--out", str(out), "--tokenizer", str(tokenizer),
            "--server-url", url, "--no-progress", "--max-new-tokens", "16", *extra]  # fmt: skip


@pytest.fixture
def https_server(hf_tokenizer: Any) -> Iterator[str]:
    config = FakeConfig(
        vocab_size=len(hf_tokenizer),
        eos_id=hf_tokenizer.eos_token_id,
        max_running_requests=8,
        family=family_config(hf_tokenizer),
    )
    with FakeSGLangServer(config) as server, tls_front(server.url) as url:
        yield url


def test_a_private_ca_in_ssl_cert_file_serves_every_endpoint(
    tmp_path: Path, tiny_tokenizer: Path, https_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The /generate transport trusted SSL_CERT_FILE and httpx (certifi) did not: /server_info failed."""
    monkeypatch.setenv("SSL_CERT_FILE", str(TLS / "ca.pem"))
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(6))
    result = CliRunner().invoke(main, run_args(prompts, tmp_path / "out", tiny_tokenizer, https_server))
    assert result.exit_code == 0, result.output
    assert len(read_records(tmp_path / "out")) == 6


def test_ca_bundle_names_the_trust_store(tmp_path: Path, tiny_tokenizer: Path, https_server: str) -> None:
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(4))
    untrusted = CliRunner().invoke(main, run_args(prompts, tmp_path / "a", tiny_tokenizer, https_server))
    assert untrusted.exit_code == 1 and "CERTIFICATE_VERIFY_FAILED" in untrusted.output
    args = run_args(prompts, tmp_path / "b", tiny_tokenizer, https_server, "--ca-bundle", str(TLS / "ca.pem"))
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert len(read_records(tmp_path / "b")) == 4


def test_a_ca_bundle_that_is_not_pem_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "ca.pem"
    bad.write_text("not a certificate\n")
    with pytest.raises(UsageError, match=re.escape(f"--ca-bundle {bad} is not a readable PEM file")):
        ssl_context(bad)


def test_a_proxy_that_would_apply_is_refused_with_advice_that_works(
    tmp_path: Path, tiny_tokenizer: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://user:pw@proxy.example:3128")
    monkeypatch.setenv("NO_PROXY", ".corp")
    url = "https://192.0.2.10:30000"
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(2))
    result = CliRunner().invoke(main, run_args(prompts, tmp_path / "out", tiny_tokenizer, url))
    assert result.exit_code == 2, result.output  # before: the proxy was ignored in silence
    assert "HTTPS_PROXY=http://***@proxy.example:3128" in result.output and "pw" not in result.output
    advice = result.output.split("export ", 1)[1].split()[0]  # NO_PROXY='192.0.2.10,.corp'
    name, _, value = advice.partition("=")
    monkeypatch.setenv(name, shlex.split(value)[0])
    refuse_proxies([url])  # followed literally, it lets the run through


def test_loopback_and_plain_settings_are_not_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("https_proxy", "http://proxy.example:3128")
    refuse_proxies(["https://127.0.0.1:30000", "https://localhost:1", "https://[::1]:2", "http://node1:30000"])
    monkeypatch.setenv("ALL_PROXY", "socks5://proxy.example:1080")
    with pytest.raises(
        UsageError, match=re.escape("ALL_PROXY=socks5://proxy.example:1080 is set and would route http://node1")
    ):
        refuse_proxies(["http://node1:30000"])
