"""D9: no key or token reaches manifest.json, a log or the terminal; a key a header cannot carry is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from conftest import varied_rows, write_jsonl
from eagle_datagen.cli import main
from eagle_datagen.errors import UsageError
from eagle_datagen.options import build_run_config, savable
from eagle_datagen.redaction import check_api_key, is_secret_flag, redact
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
