"""Run inside .venv-sglang + .trainers (tests/test_export_trainers.py starts it): export with our CLI, then load
every file with the trainers' own code and print what their loaders produced, as JSON on stdout.

Input on stdin: ``{"runs": {name: dir}, "tokenizer": dir, "work": dir, "draft_sizes": [N, ...], "vocab": V}``.
"""

from __future__ import annotations

import io
import json
import sys
from contextlib import redirect_stderr
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from eagle_datagen.cli import main as cli


def ours(*args: str) -> str:
    """Runs one eagle-datagen command in this process; returns what it printed to stderr."""
    err = io.StringIO()
    with redirect_stderr(err):
        try:
            cli([*args, "--no-progress"], standalone_mode=False)
        except SystemExit as exc:
            if exc.code:
                raise RuntimeError(f"eagle-datagen {' '.join(args)} exited {exc.code}: {err.getvalue()}") from None
    return err.getvalue()


def rows(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[list[list[int]]]:
    for ids, _ in pairs:
        assert ids.dtype == torch.int64, ids.dtype
    return [[ids.reshape(-1).tolist(), mask.reshape(-1).tolist()] for ids, mask in pairs]


# --- SpecForge -----------------------------------------------------------------------------------------


def specforge_rows(path: Path) -> list[list[list[int]]]:
    """prepare_prompt_tasks (data.prompts_path) → DataFlowController ingest/lease → the capture payload."""
    from specforge.data.prompt_builder import prepare_prompt_tasks
    from specforge.inference.adapters.server_capture import ServerCaptureSchema, SGLangServerCaptureAdapter
    from specforge.runtime.control_plane.controller import DataFlowController

    tasks = prepare_prompt_tasks(
        path,
        None,
        chat_template=None,
        max_length=1 << 20,
        is_preformatted=False,
        train_only_last_turn=False,
        cache_dir=None,
        cache_key=None,
        num_proc=None,
    )
    controller = DataFlowController("export-test")
    ids = controller.ingest_prompts(list(tasks))
    leased = controller.lease_prompt_tasks("worker", len(ids))
    store = SimpleNamespace(
        store_id="s",
        adopt=lambda *a, **k: None,
        discard_external_attempts=lambda *a, **k: None,
        track_external_attempt=lambda *a, **k: None,
    )
    schema = ServerCaptureSchema(None, None, (("input_ids", "input_ids", ()), ("loss_mask", "loss_mask", ())))
    adapter = SGLangServerCaptureAdapter("http://unused", store, run_id="r", algorithm="eagle3", schema=schema)
    out = []
    for task in leased:
        payload = {p["name"]: p for p in adapter._spec_capture_payload(task)["passthrough"]}
        tensors = [
            torch.tensor(payload[n]["data"], dtype=getattr(torch, payload[n]["dtype"])).reshape(payload[n]["shape"])
            for n in ("input_ids", "loss_mask")
        ]
        out.append((tensors[0], tensors[1]))
    return rows(out)


def specforge_map(path: Path, vocab: int, n: int) -> dict[str, Any]:
    """Eagle3DraftModel.load_vocab_mapping into a tiny LlamaForCausalLMEagle3, then their consistency check."""
    from specforge.core.compact_teacher import validate_vocab_mapping_consistency
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_hidden_layers=1,
        max_position_embeddings=64,
    )
    config.draft_vocab_size = n
    model = LlamaForCausalLMEagle3(config)
    model.load_vocab_mapping(str(path))
    validate_vocab_mapping_consistency(model.t2d, model.d2t)
    raw = torch.load(path)
    assert raw["d2t"].dtype == torch.int64 and raw["t2d"].dtype == torch.bool, (raw["d2t"].dtype, raw["t2d"].dtype)
    assert tuple(raw["d2t"].shape) == (n,) and tuple(raw["t2d"].shape) == (vocab,)
    return {"d2t": model.d2t.tolist(), "selected": torch.nonzero(model.t2d).flatten().tolist()}


# --- speculators -------------------------------------------------------------------------------------


def speculators_prepare_data(jsonl: Path, out: Path, tokenizer: str) -> list[list[list[int]]]:
    """``speculators prepare-data`` (its typer app, in process), then load_from_disk of what it saved."""
    from datasets import load_from_disk
    from speculators.cli import app
    from typer.testing import CliRunner

    result = CliRunner().invoke(
        app,
        [
            "prepare-data",
            "--model",
            tokenizer,
            "--data",
            str(jsonl),
            "--output",
            str(out),
            "--num-preprocessing-workers",
            "1",
        ],
    )
    if result.exit_code != 0:
        raise RuntimeError(f"prepare-data failed: {result.output}\n{result.exception!r}")
    dataset = load_from_disk(str(out))
    dataset.set_format("torch")
    return rows([(r["input_ids"], r["loss_mask"]) for r in dataset])


def speculators_arrow(directory: Path) -> list[list[list[int]]]:
    """speculators.train.data.ArrowDataset over our directory, with cached hidden states written for each
    row (hs_{i}.safetensors, token_ids = the row's ids): its torch.equal guard must accept every row; then
    CollateFn packs them."""
    from datasets import load_from_disk
    from safetensors.torch import save_file
    from speculators.train.data import ArrowDataset, CollateFn

    plain = load_from_disk(str(directory))
    hidden = directory / "hidden_states"
    hidden.mkdir(exist_ok=True)
    for i, row in enumerate(plain.with_format(None)):
        n = len(row["input_ids"])
        save_file(
            {"hidden_states": torch.zeros(n, 4, 2), "token_ids": torch.tensor(row["input_ids"], dtype=torch.long)},
            str(hidden / f"hs_{i}.safetensors"),
        )
    dataset = ArrowDataset(max_len=1 << 16, datapath=directory, on_missing="raise")
    items = [dataset[i] for i in range(len(dataset))]
    for item in items:
        assert isinstance(item, dict), f"ArrowDataset refused a row: {item!r}"
    assert dataset.approx_lengths == [len(item["input_ids"]) for item in items]
    batch = CollateFn(max_len=sum(dataset.approx_lengths), hidden_size=2, num_target_layers=3)(items)
    packed = batch["input_ids"].reshape(-1).tolist()
    assert packed == [t for item in items for t in item["input_ids"].tolist()]
    return rows([(item["input_ids"], item["loss_mask"]) for item in items])


def speculators_map(directory: Path, vocab: int, n: int) -> dict[str, Any]:
    """parse_vocab_mappings finds d2t-N/t2d-N in --data-path; compared with its own builder on token_freq.pt."""
    from speculators.train.cli import parse_vocab_mappings
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    args = SimpleNamespace(
        d2t_path=None,
        t2d_path=None,
        data_path=str(directory),
        draft_vocab_size=n,
        token_freq_path=None,
        verifier_name_or_path=None,
        trust_remote_code=False,
    )
    d2t, t2d, size = parse_vocab_mappings(args)
    assert size == n
    freq = torch.load(directory / "token_freq.pt", weights_only=True)
    their_d2t, their_t2d = build_vocab_mappings_from_distribution(freq, n, vocab)
    assert torch.equal(d2t, their_d2t) and torch.equal(t2d, their_t2d), "our map differs from speculators' own"
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    return {"d2t": d2t.tolist(), "selected": torch.nonzero(t2d).flatten().tolist(), "freq": sorted(freq.items())}


def main() -> None:
    request = json.load(sys.stdin)
    work = Path(request["work"])
    vocab = request["vocab"]
    out: dict[str, Any] = {"rows": {}, "maps": {}, "messages": {}}
    for name, run in request["runs"].items():
        merge = ["--merge-turns"] if name.endswith("merged") else []
        for fmt in ("specforge", "speculators", "speculators-dataset"):
            target = work / f"{name}-{fmt}"
            out["messages"][f"{name}-{fmt}"] = ours("export", run, "--format", fmt, "--out", str(target), *merge)
        out["rows"][f"{name}/specforge"] = specforge_rows(work / f"{name}-specforge" / "train.jsonl")
        out["rows"][f"{name}/prepare-data"] = speculators_prepare_data(
            work / f"{name}-speculators" / "train.jsonl", work / f"{name}-prepared", request["tokenizer"]
        )
        out["rows"][f"{name}/arrow"] = speculators_arrow(work / f"{name}-speculators-dataset")
    single = request["runs"]["single"]
    for n in request["draft_sizes"]:
        sf = work / f"map-sf-{n}"
        out["messages"][f"map-sf-{n}"] = ours(
            "vocab-map", single, "--draft-vocab-size", str(n), "--format", "specforge", "--out", str(sf)
        )
        out["maps"][f"specforge/{n}"] = specforge_map(sf / f"vocab_mapping_{n}.pt", vocab, n)
        ds = work / "single-speculators-dataset"
        out["messages"][f"map-sp-{n}"] = ours(
            "vocab-map", single, "--draft-vocab-size", str(n), "--format", "speculators", "--out", str(ds)
        )
        out["maps"][f"speculators/{n}"] = speculators_map(ds, vocab, n)
        out["maps"][f"report/{n}"] = json.loads((ds / "vocab-map.json").read_text())
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
