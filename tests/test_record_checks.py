"""The one record check (eagle_datagen.record.checks): D4's four responses the client used to write and verify then
rejected, refused by the client with the kind verify gives them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from eagle_datagen.errors import RequestFailed
from eagle_datagen.generate.client import parse_generate_response
from eagle_datagen.record.checks import RecordSpec, check_record
from eagle_datagen.store.manifest import MANIFEST_NAME, Manifest
from eagle_datagen.verify.verify import verify

SPEC = RecordSpec(vocab_size=522, stop_ids=frozenset({513}))
PROMPT = [1, 2, 3]


@pytest.mark.parametrize(
    ("output", "finish", "kind"),
    [
        ([7, 8, 9], {"type": "stop", "matched": "\n\nUser:"}, "stop_token"),  # r04 stopstr: cut by a server-side stop
        ([7, 8, 9], {"type": "stop", "matched": None}, "stop_token"),  # r04 stopnull
        ([7, -5, 513], {"type": "stop", "matched": 513}, "out_of_vocab"),  # r04 negative
        ([7, 10**9, 513], {"type": "stop", "matched": 513}, "out_of_vocab"),  # r04 bigid
        ([7, 513, 8, 513], {"type": "stop", "matched": 513}, "stop_token"),  # ignore_eos/min_new_tokens went past EOS
        ([7, 513, 8, 9], {"type": "length", "length": 4}, "stop_token"),
        ([7, 8, 600], {"type": "stop", "matched": 600}, "out_of_vocab"),
        ([7, 8, 9], {"type": "stop", "matched": 9}, "stop_token"),  # matched an id that is no stop id
    ],
)
def test_the_client_refuses_what_verify_rejects_with_the_same_kind(
    output: list[int], finish: dict[str, Any], kind: str, tmp_path: Path
) -> None:
    verdict = check_record(SPEC, PROMPT, output, finish, len(output), max_new_tokens=4)
    assert [k for k, _ in verdict.errors] == [kind]
    body = orjson.dumps(
        {"output_ids": output, "meta_info": {"finish_reason": finish, "completion_tokens": len(output)}}
    )
    with pytest.raises(RequestFailed) as caught:
        parse_generate_response(body, PROMPT, {"max_new_tokens": 4}, SPEC, 0.0)
    assert caught.value.kind == f"check_{kind}" and not caught.value.retryable

    manifest = Manifest(tmp_path / MANIFEST_NAME, {"sampling_params": {"max_new_tokens": 4}, "samples_per_prompt": 1})
    manifest.facts = {"vocab_size": 522, "stop_token_ids": [513]}
    manifest.save()
    (tmp_path / "shards").mkdir()
    record = {"id": "a", "key": "a", "sample": 0, "prompt_ids": PROMPT, "output_ids": output, "finish_reason": finish,
              "completion_tokens": len(output)}  # fmt: skip
    (tmp_path / "shards" / "shard_00000.jsonl.partial").write_bytes(orjson.dumps(record) + b"\n")
    assert set(verify([tmp_path], rerender=False).errors) == {kind}


def test_a_text_stop_is_accepted_only_when_the_plan_has_stop_strings() -> None:
    finish = {"type": "stop", "matched": "\n\nUser:"}
    with_strings = RecordSpec(vocab_size=522, stop_ids=frozenset({513}), stop_strings=True)
    assert check_record(with_strings, PROMPT, [7, 8, 9], finish, 3, max_new_tokens=8).ok
    assert not check_record(SPEC, PROMPT, [7, 8, 9], finish, 3, max_new_tokens=8).ok


def test_an_abort_is_retried_and_a_clean_stop_passes() -> None:
    body = orjson.dumps({"output_ids": [7], "meta_info": {"finish_reason": {"type": "abort"}, "completion_tokens": 1}})
    with pytest.raises(RequestFailed) as caught:
        parse_generate_response(body, PROMPT, {"max_new_tokens": 4}, SPEC, 0.0)
    assert caught.value.kind == "check_abort" and caught.value.retryable
    assert check_record(SPEC, PROMPT, [7, 8, 513], {"type": "stop", "matched": 513}, 3, max_new_tokens=8).ok
