"""Tiny offline tokenizers and models for tests: byte-level BPE, chat templates, Llama with 2 layers.

`build_tiny_tokenizer` needs only `tokenizers`/`transformers`; `build_tiny_model` also needs torch (imported
lazily). The saved tokenizer loads with transformers 4.x and 5.x through `AutoTokenizer.from_pretrained`.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

Template = Literal["chatml", "kimi"]
Weights = Literal["random", "scripted"]
DType = Literal["float32", "bfloat16"]

THINK = "<think>"
END_THINK = "</think>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
KIMI_EOS = "[EOS]"
TOOL_CALLS_BEGIN = "<|tool_calls_section_begin|>"

CHATML_SPECIALS = (IM_START, IM_END, THINK, END_THINK)
KIMI_SPECIALS = (
    *CHATML_SPECIALS,
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_middle|>",
    "<|im_system|>",
    KIMI_EOS,
    TOOL_CALLS_BEGIN,
)
# Kimi-K2.5's real ids (see docs/reasoning-templates.md §1.1); `<|im_start|>` has no Kimi id, it gets a filler slot.
KIMI_VOCAB_SIZE = 163_840
KIMI_IDS: dict[str, int] = {
    KIMI_EOS: 163585,
    IM_END: 163586,
    "<|im_user|>": 163587,
    "<|im_assistant|>": 163588,
    "<|im_system|>": 163594,
    TOOL_CALLS_BEGIN: 163595,
    "<|im_middle|>": 163601,
    THINK: 163606,
    END_THINK: 163607,
    IM_START: 163608,
}
BPE_VOCAB_SIZE = 512

# The scripted model answers `<think>` with these pieces (repeated tokens are dropped), then EOS.
SCRIPT_TEXT = ("Let me think about the question", END_THINK, "The answer is 42.")

_THINKING_SWITCH = (
    "{%- set ns = namespace(think=true) -%}"
    "{%- if (thinking is defined and thinking is false)"
    " or (enable_thinking is defined and enable_thinking is false) -%}"
    "{%- set ns.think = false -%}{%- endif -%}"
)
_CONTENT_MACRO = (
    "{%- macro content(m) -%}"
    "{%- if m.content is string -%}{{ m.content }}"
    "{%- elif m.content is iterable -%}"
    "{%- for part in m.content -%}{%- if part.type == 'text' -%}{{ part.text }}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
)
_UNKNOWN_ROLE = "{{- raise_exception('Unknown role: ' ~ m.role) -}}"

CHATML_TEMPLATE = (
    _THINKING_SWITCH + _CONTENT_MACRO + "{%- set has_system = messages and messages[0].role == 'system' -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if has_system -%}{{- content(messages[0]) ~ '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n' ~ (tools | tojson) ~ '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if not (loop.first and tools and has_system) -%}"
    "{%- if m.role not in ['system', 'user', 'assistant', 'tool'] -%}" + _UNKNOWN_ROLE + "{%- endif -%}"
    "{{- '<|im_start|>' ~ m.role ~ '\\n' ~ content(m) -}}"
    "{%- if m.role == 'assistant' and m.tool_calls -%}"
    "{{- '\\n<tool_call>' ~ (m.tool_calls | tojson) ~ '</tool_call>' -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if ns.think -%}{{- '<think>' -}}{%- else -%}{{- '<think></think>' -}}{%- endif -%}"
    "{%- endif -%}"
)

KIMI_TEMPLATE = (
    _THINKING_SWITCH + _CONTENT_MACRO + "{%- if tools -%}"
    "{{- '<|im_system|>tool_declare<|im_middle|>' ~ (tools | tojson) ~ '<|im_end|>' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}{{- '<|im_system|>system<|im_middle|>' -}}"
    "{%- elif m.role == 'user' -%}{{- '<|im_user|>user<|im_middle|>' -}}"
    "{%- elif m.role == 'assistant' -%}{{- '<|im_assistant|>assistant<|im_middle|>' -}}"
    "{%- elif m.role == 'tool' -%}{{- '<|im_system|>tool<|im_middle|>' -}}"
    "{%- else -%}" + _UNKNOWN_ROLE + "{%- endif -%}"
    "{%- if m.role == 'tool' and m.tool_call_id -%}{{- '## Return of ' ~ m.tool_call_id ~ '\\n' -}}{%- endif -%}"
    "{{- content(m) -}}"
    "{%- if m.role == 'assistant' and m.tool_calls -%}"
    "{{- '<|tool_calls_section_begin|>' ~ (m.tool_calls | tojson) -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_assistant|>assistant<|im_middle|>' -}}"
    "{%- if ns.think -%}{{- '<think>' -}}{%- else -%}{{- '<think></think>' -}}{%- endif -%}"
    "{%- endif -%}"
)

TEMPLATES: dict[str, str] = {"chatml": CHATML_TEMPLATE, "kimi": KIMI_TEMPLATE}

_WORDS = [
    "Let",
    "me",
    "think",
    "step",
    "by",
    "step",
    "about",
    "the",
    "question",
    ".",
    "The",
    "answer",
    "is",
    "42",
    ",",
    "so",
    "we",
    "are",
    "done",
    "!",
    "hello",
    "world",
    "what",
    "is",
    "two",
    "plus",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "yes",
    "no",
    "maybe",
    "system",
    "user",
    "assistant",
    "tool",
    "tool_declare",
    "name",
    "description",
    "parameters",
    "type",
    "object",
    "string",
    "function",
    "arguments",
    "query",
    "weather",
    "city",
    "Paris",
    "London",
    "Tokyo",
    "today",
    "tomorrow",
    "please",
    "thanks",
    "reason",
    "reasoning",
    "check",
    "verify",
    "first",
    "second",
    "then",
    "finally",
    "because",
    "therefore",
]


def _corpus(seed: int = 0, lines: int = 2000) -> list[str]:
    """Generated training text: random word sequences plus some JSON-ish and numeric lines."""
    rng = random.Random(seed)
    out = [" ".join(SCRIPT_TEXT)] * 50
    for i in range(lines):
        out.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12))))
        if i % 10 == 0:
            out.append(json.dumps({"name": rng.choice(_WORDS), "value": rng.randint(0, 999)}))
    return out


def _merge_pair(merge: str | list[str]) -> tuple[str, str]:
    """A BPE merge as a pair (tokenizers writes "a b" or ["a", "b"] depending on the version)."""
    a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
    return a, b


def _train_bpe(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train a byte-level BPE (no special tokens); return its vocab and merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [_merge_pair(m) for m in model["merges"]]
    return {str(k): int(v) for k, v in model["vocab"].items()}, merges


def _full_vocab(bpe_vocab: dict[str, int], specials: tuple[str, ...], kimi_ids: bool) -> dict[str, int]:
    """BPE vocab plus specials: appended, or at Kimi's ids with `<|reserved_token_N|>` fillers to 163,840."""
    vocab = dict(bpe_vocab)
    if not kimi_ids:
        for tok in specials:
            vocab[tok] = len(vocab)
        return vocab
    by_id = {KIMI_IDS[tok]: tok for tok in specials}
    for idx in range(len(vocab), KIMI_VOCAB_SIZE):
        vocab[by_id.get(idx, f"<|reserved_token_{idx}|>")] = idx
    return vocab


def _make_fast_tokenizer(template: Template, kimi_ids: bool) -> Any:
    """Build the `PreTrainedTokenizerFast` (transformers) for a template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = KIMI_SPECIALS if template == "kimi" else CHATML_SPECIALS
    bpe_vocab, merges = _train_bpe(BPE_VOCAB_SIZE)
    tok = Tokenizer(models.BPE(vocab=_full_vocab(bpe_vocab, specials, kimi_ids), merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        eos_token=IM_END,
        additional_special_tokens=[s for s in specials if s != IM_END],
        chat_template=TEMPLATES[template],
        model_max_length=4096,
    )


def _rewrite_tokenizer_config(out_dir: Path, template: Template) -> None:
    """Make tokenizer_config.json loadable by transformers 4.x and 5.x (class, specials, template inside)."""
    path = out_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    specials = KIMI_SPECIALS if template == "kimi" else CHATML_SPECIALS
    for key in ("extra_special_tokens", "backend"):  # 5.x-only keys
        cfg.pop(key, None)
    cfg.update(
        tokenizer_class="PreTrainedTokenizerFast",
        eos_token=IM_END,
        additional_special_tokens=[s for s in specials if s != IM_END],
        chat_template=TEMPLATES[template],
    )
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)


def build_tiny_tokenizer(out_dir: Path, *, template: Template = "kimi", kimi_ids: bool = False) -> Path:
    """Train and save a tiny tokenizer with a chat template into `out_dir`; return `out_dir`."""
    if kimi_ids and template != "kimi":
        raise ValueError("kimi_ids=True needs template='kimi'")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _make_fast_tokenizer(template, kimi_ids).save_pretrained(str(out_dir))
    _rewrite_tokenizer_config(out_dir, template)
    return out_dir


def _vocab_size(tokenizer_dir: Path) -> int:
    """Number of ids (max id + 1) in a saved tokenizer.json."""
    data = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    ids = [*data["model"]["vocab"].values(), *(t["id"] for t in data["added_tokens"])]
    return int(max(ids)) + 1


def _token_ids(tokenizer_dir: Path) -> dict[str, int]:
    """Token string -> id for every entry of a saved tokenizer.json."""
    data = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    return {**data["model"]["vocab"], **{t["content"]: t["id"] for t in data["added_tokens"]}}


def script_ids(tokenizer_dir: Path) -> list[int]:
    """The scripted model's chain: `<think>`, the distinct script tokens, then EOS (`<|im_end|>`)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    ids = _token_ids(Path(tokenizer_dir))
    chain: list[int] = [ids[THINK]]
    for piece in SCRIPT_TEXT:
        for tid in tok.encode(piece, add_special_tokens=False).ids:
            if tid not in chain:
                chain.append(tid)
    return [*chain, ids[IM_END]]


def _llama_config(vocab_size: int, eos_id: int) -> Any:
    """Config of the tiny Llama: hidden 64, 2 layers, 2 heads, 1 KV head (head_dim 32)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        pad_token_id=None,
        eos_token_id=eos_id,
    )


def _script_weights(model: Any, chain: list[int], margin: float = 64.0) -> None:
    """Make `model` a deterministic script: chain[i] -> chain[i+1], every other token -> EOS."""
    import torch

    hidden = model.config.hidden_size
    if len(chain) > hidden:
        raise ValueError(f"script of {len(chain)} tokens does not fit hidden size {hidden}")
    other, eos = hidden - 1, chain[-1]
    # After the final RMSNorm a one-hot embedding becomes sqrt(hidden) on its dimension.
    scale = margin / hidden**0.5
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()
        embed = model.get_input_embeddings().weight
        embed.zero_()
        embed[:, other] = 1.0
        head = model.get_output_embeddings().weight
        head.zero_()
        head[eos, other] = scale
        for dim, (tid, nxt) in enumerate(itertools.pairwise(chain)):
            embed[tid, other] = 0.0
            embed[tid, dim] = 1.0
            head[nxt, dim] = scale


def _write_generation_config(out_dir: Path, eos_id: int, defaults: Mapping[str, Any] | None) -> None:
    """generation_config.json with the EOS id and optional sampling defaults (as real models ship them)."""
    cfg: dict[str, Any] = {"eos_token_id": eos_id, "pad_token_id": eos_id}
    if defaults:
        cfg["do_sample"] = True
        cfg.update(defaults)
    (out_dir / "generation_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def build_tiny_model(
    out_dir: Path,
    *,
    template: Template = "kimi",
    kimi_ids: bool = False,
    weights: Weights = "random",
    dtype: DType = "float32",
    seed: int = 0,
    generation_defaults: Mapping[str, Any] | None = None,
) -> Path:
    """Save a tiny LlamaForCausalLM (safetensors) plus its tokenizer into `out_dir`; return `out_dir`."""
    import torch
    from transformers import LlamaForCausalLM

    out_dir = build_tiny_tokenizer(out_dir, template=template, kimi_ids=kimi_ids)
    eos_id = _token_ids(out_dir)[IM_END]
    torch.manual_seed(seed)
    model = LlamaForCausalLM(_llama_config(_vocab_size(out_dir), eos_id)).to(torch.float32)
    if weights == "scripted":
        _script_weights(model, script_ids(out_dir))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(str(out_dir), safe_serialization=True)
    _write_generation_config(out_dir, eos_id, generation_defaults)
    meta: dict[str, Any] = {
        "template": template,
        "kimi_ids": kimi_ids,
        "weights": weights,
        "dtype": dtype,
        "seed": seed,
    }
    if weights == "scripted":
        meta["script_ids"] = script_ids(out_dir)
    (out_dir / "tiny_model.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out_dir
