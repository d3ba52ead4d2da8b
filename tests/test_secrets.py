"""D9: no key or token reaches manifest.json, a log or the terminal; a key a header cannot carry is refused."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from conftest import varied_rows, write_jsonl
from eagle_datagen.cli import main
from eagle_datagen.errors import UsageError
from eagle_datagen.options import build_run_config, savable
from eagle_datagen.redaction import (
    check_api_key,
    environment_secrets,
    is_secret_flag,
    mask_forms,
    redact,
    secret_values,
)
from eagle_datagen.server import logmask
from eagle_datagen.server.logmask import Masker
from eagle_datagen.testing.fake_sglang import FakeConfig, FakeSGLangServer, family_config


def invoke(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def files_holding(root: Path, secret: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


def test_server_arg_secrets_are_kept_out_of_manifest_logs_and_terminal(tmp_path: Path, tiny_tokenizer: Path) -> None:
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(3))
    out = tmp_path / "out"
    result = invoke(
        "run", "--prompts", str(prompts), "--model", str(tiny_tokenizer), "--server-python", "/bin/false",
        "--out", str(out), "--no-progress", "--server-arg=--admin-api-key=ADMIN-SECRET-1",
        "--server-arg=--hf-token", "--server-arg=HF-SECRET-2", "--server-arg=--context-length=4096",
    )  # fmt: skip
    assert result.exit_code == 1, result.output  # /bin/false is not an SGLang server
    assert (out / "manifest.json").is_file() and (out / "server.log").is_file()
    for secret in ("ADMIN-SECRET-1", "HF-SECRET-2"):
        assert secret not in result.output
        assert files_holding(out, secret) == []
    assert "--admin-api-key=***" in result.output and "--context-length=4096" in result.output


def test_resume_asks_for_server_arg_secrets_again(tmp_path: Path) -> None:
    saved = savable({"server_arg": ("--admin-api-key=A-1", "--context-length=4096"), "api_key": "k"})
    assert saved == {"server_arg": ["--admin-api-key=***", "--context-length=4096"]}
    options = {"prompts": tmp_path / "p.jsonl", "out": tmp_path / "out", "model": tmp_path / "M", **saved}
    with pytest.raises(UsageError) as caught:
        build_run_config(options)
    message = str(caught.value)
    assert "--admin-api-key" in message and "--server-arg=--admin-api-key=VALUE" in message
    assert f"eagle-datagen resume --out {tmp_path / 'out'}" in message


@pytest.mark.parametrize(
    ("key", "what"),
    [("S3CRET-KEY\n", "a newline at its end"), ("S3CRET KEY", "a space at character 7"), ("S3CRET\x01", "U+0001")],
)
def test_a_key_a_header_cannot_carry_is_refused_without_printing_it(
    tmp_path: Path, tiny_tokenizer: Path, hf_tokenizer: Any, monkeypatch: pytest.MonkeyPatch, key: str, what: str
) -> None:
    monkeypatch.setenv("EAGLE_DATAGEN_API_KEY", key)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(3))
    config = FakeConfig(
        vocab_size=len(hf_tokenizer),
        eos_id=hf_tokenizer.eos_token_id,
        api_key="S3CRET-KEY",
        family=family_config(hf_tokenizer),
    )
    with FakeSGLangServer(config) as server:
        result = invoke(
            "run", "--prompts", str(prompts), "--out", str(tmp_path / "out"), "--tokenizer", str(tiny_tokenizer),
            "--server-url", server.url, "--no-progress",
        )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "S3CRET" not in result.output
    assert "EAGLE_DATAGEN_API_KEY" in result.output and what in result.output


def test_which_flags_are_secret() -> None:
    for flag in ("--api-key", "--admin-api-key", "--admin-api", "--hf-token", "--apikey", "--ssl-keyfile-password"):
        assert is_secret_flag(flag), flag
    for flag in ("--max-total-tokens", "--tokenizer-path", "--context-length", "--ssl-keyfile", "-k"):
        assert not is_secret_flag(flag), flag
    assert redact(["p", "--admin-api-key", "A", "--hf-token=T", "--max-total-tokens", "9", "--api-key", "--x"]) == [
        "p", "--admin-api-key", "***", "--hf-token=***", "--max-total-tokens", "9", "--api-key", "--x",
    ]  # fmt: skip
    assert check_api_key("sk-abc_123.XYZ", "--api-key") == "sk-abc_123.XYZ"
    with pytest.raises(UsageError, match="non-ASCII"):
        check_api_key("clé", "--api-key")


def test_credentials_in_a_server_url_are_refused_without_showing_them(tmp_path: Path) -> None:
    options = {"prompts": tmp_path / "p.jsonl", "out": tmp_path / "out", "tokenizer": tmp_path / "T"}
    with pytest.raises(UsageError) as caught:
        build_run_config({**options, "server_url": ("https://bob:PW-SECRET@node1:30000",)})
    assert "PW-SECRET" not in str(caught.value) and "bob" not in str(caught.value)
    assert "--server-url https://***@node1:30000" in str(caught.value) and "--api-key" in str(caught.value)


# ----------------------------------------------------------------------------------------------------
# The log masker: a launched server's output, with the secrets we gave it replaced
# ----------------------------------------------------------------------------------------------------


def test_the_secret_values_of_a_command_and_an_environment() -> None:
    command = ["py", "--api-key", "K1", "--admin-api-key=A2", "--hf-token", "--x", "--context-length", "9"]
    assert secret_values(command) == ["K1", "A2"]  # what redact hides, nothing else
    env = {"HF_TOKEN": "hf_abcdefgh", "EAGLE_DATAGEN_API_KEY": "sk-12345678", "USE_AUTH_TOKEN": "true",
           "PATH": "/usr/bin:/bin", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    assert environment_secrets(env) == ["hf_abcdefgh", "sk-12345678"]
    # As a Python repr and JSON string show it too (SGLang prints ServerArgs(api_key='...')).
    forms = mask_forms(["q'\"\\"])
    assert set(forms) == {b"q'\"\\", b"q\\'\"\\\\", b"q'\\\"\\\\"} and len(forms[-1]) == 4  # longest first
    assert mask_forms(["caf\u00e9", ""]) == [b"caf\\u00e9", "caf\u00e9".encode()]


def mask_at_once(secrets: list[bytes], data: bytes) -> bytes:
    pattern = re.compile(b"|".join(re.escape(s) for s in sorted(secrets, key=len, reverse=True)))
    return pattern.sub(b"***", data)


def test_masking_does_not_depend_on_how_the_output_is_cut() -> None:
    rng = random.Random(20261201)
    # Overlapping secrets, one inside another, one the start of another, one across a newline.
    secrets = [b"sk-abc", b"sk-abcdef", b"cdef", b"aaa", b"ab\ncd"]
    pieces = [*secrets, b"s", b"k-", b"a", b"c", b"d", b"\n", b"\r", b"\xff", b" "]
    for _ in range(2000):
        data = b"".join(rng.choice(pieces) for _ in range(rng.randrange(0, 30))) + b"."
        masker = Masker(secrets)
        out, pos = b"", 0
        while pos < len(data):
            step = rng.randrange(1, 9)
            out += masker.feed(data[pos : pos + step])
            pos += step
        out += masker.finish()
        assert out == mask_at_once(secrets, data), data


def test_bytes_that_may_start_a_secret_wait_for_the_next_write() -> None:
    masker = Masker([b"abcd", b"cdef"])
    assert masker.feed(b"xabcd") == b"x***"  # "cd" may start "cdef", but "abcd" is already whole
    masker = Masker([b"sk-LIVE-KEY"])
    assert masker.feed(b"api_key='sk-LI") == b"api_key='" and masker.held == 5
    assert masker.feed(b"VE-KEY'\n") == b"***'\n"
    assert masker.feed(b"end: sk-LIV") == b"end: "
    assert masker.finish() == b"***"  # cut off by the end of the output: still the start of a secret
    assert masker.feed(b"ok s") == b"ok " and masker.finish() == b"s"  # too short to say
    assert Masker([]).feed(b"\xff\r as is") == b"\xff\r as is"


def start_masker(tmp_path: Path, secrets: list[bytes]) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp_path / "server.log"
    read_fd, write_fd = os.pipe()
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-I", logmask.__file__, str(read_fd), "0.05", str(log)],
            stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, pass_fds=(read_fd,),
        )  # fmt: skip
    os.close(read_fd)
    with os.fdopen(write_fd, "wb") as channel:
        channel.write(b"\0".join(secrets))
    return process, log


def wait_until(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + 30
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_the_masker_process_copies_everything_else_byte_for_byte(tmp_path: Path) -> None:
    process, log = start_masker(tmp_path, [b"sk-LIVE-KEY", b"ADMIN-9"])
    assert process.stdin is not None

    def send(data: bytes) -> None:
        assert process.stdin is not None
        process.stdin.write(data)
        process.stdin.flush()

    send(b"ServerArgs(api_key='sk-LIVE-KEY', admin_api_key='ADMIN-9', x=1)\n\xff\xfe not UTF-8\n")
    send(b"\rLoading: 50%")  # a partial line goes out after a quiet moment
    wait_until(lambda: log.read_bytes().endswith(b"\rLoading: 50%"), "the partial line")
    send(b"\rLoading: 100%\nkey: sk-LIVE")  # the key's start is held back, however long we wait
    wait_until(lambda: log.read_bytes().endswith(b"key: "), "the line before the key")
    time.sleep(0.3)
    assert log.read_bytes().endswith(b"key: ")
    send(b"-KEY and a last line without end")
    process.stdin.close()
    assert process.wait(timeout=30) == 0
    assert log.read_bytes() == (
        b"ServerArgs(api_key='***', admin_api_key='***', x=1)\n\xff\xfe not UTF-8\n"
        b"\rLoading: 50%\rLoading: 100%\nkey: *** and a last line without end"
    )


def test_a_stopped_masker_writes_what_it_holds_masked(tmp_path: Path) -> None:
    process, log = start_masker(tmp_path, [b"sk-LIVE-KEY"])
    assert process.stdin is not None
    process.stdin.write(b"line one\nhalf a line, then sk-LI")
    process.stdin.flush()
    wait_until(lambda: log.read_bytes().startswith(b"line one\n"), "the first line")
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    process.stdin.close()
    assert log.read_bytes() == b"line one\nhalf a line, then ***"
