"""Tiny offline tokenizers and models for tests: byte-level BPE, chat templates, Llama with 2 layers.

`build_tiny_tokenizer` needs only `tokenizers`/`transformers`; `build_tiny_model` also needs torch (imported
lazily). The saved tokenizer loads with transformers 4.x and 5.x through `AutoTokenizer.from_pretrained`.

Two scripts for `weights="scripted"` (the model is a bigram chain: each token of the script maps to the next):

* `script="answer"` (default): `<think>` -> reasoning, `</think>`, an answer -> EOS (`SCRIPT_TEXT`, repeated
  tokens dropped).
* `script="tool_call"`: reasoning, `</think>`, a short answer and one `get_weather` call in the template family's
  markup, then EOS (`tool_script(template)` has the reply text, the tool, the call and SGLang's parser names).
  Its tokenizer gains the family's tool-call markers (Kimi-K2's `<|tool_call_begin|>`... as specials, Qwen's
  `<tool_call>`/`</tool_call>` as added tokens) and the call's id/argument strings as added tokens, so that no
  token repeats in the chain. Every id of the `answer` build keeps its value (the new tokens come after, or at
  Kimi's real ids with `kimi_ids=True`).
"""

from __future__ import annotations

import copy
import itertools
import json
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Template = Literal["chatml", "kimi"]
Weights = Literal["random", "scripted"]
Script = Literal["answer", "tool_call"]
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

# Kimi-K2's tool-call markers (`<|tool_calls_section_begin|>` is in every Kimi build), ids as in Kimi-K2.5. Special
# here like `<|tool_calls_section_begin|>` (Kimi-K2.5 has them as added non-special tokens; decode keeps either).
TOOL_CALLS_END = "<|tool_calls_section_end|>"
TOOL_CALL_BEGIN = "<|tool_call_begin|>"
TOOL_CALL_ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
TOOL_CALL_END = "<|tool_call_end|>"
KIMI_TOOL_SPECIALS = (TOOL_CALLS_END, TOOL_CALL_BEGIN, TOOL_CALL_ARGUMENT_BEGIN, TOOL_CALL_END)
KIMI_TOOL_IDS: dict[str, int] = {
    TOOL_CALLS_END: 163596,
    TOOL_CALL_BEGIN: 163597,
    TOOL_CALL_ARGUMENT_BEGIN: 163598,
    TOOL_CALL_END: 163599,
}
# Qwen's tool-call tags: added tokens, not special ones (as in Qwen3's tokenizer).
QWEN_TOOL_CALL = "<tool_call>"
QWEN_TOOL_CALL_END = "</tool_call>"

TOOL_REASONING = "Let me check the weather first"
TOOL_ANSWER = "Checking Paris."
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
WEATHER_ARGUMENTS = '{"city": "Paris"}'
_KIMI_CALL_ID = "functions.get_weather:0"
_QWEN_CALL_BODY = '\n{"name": "get_weather", "arguments": ' + WEATHER_ARGUMENTS + "}\n"
TOOL_CALL_MARKUP: dict[str, str] = {
    "kimi": (
        f"{TOOL_CALLS_BEGIN}{TOOL_CALL_BEGIN}{_KIMI_CALL_ID}{TOOL_CALL_ARGUMENT_BEGIN}{WEATHER_ARGUMENTS}"
        f"{TOOL_CALL_END}{TOOL_CALLS_END}"
    ),
    "chatml": f"{QWEN_TOOL_CALL}{_QWEN_CALL_BODY}{QWEN_TOOL_CALL_END}",
}
# Per template: (extra special tokens, extra non-special added tokens) of the `tool_call` tokenizer. The id and
# argument strings are single tokens so that no BPE token repeats in the chain (a bigram chain cannot repeat one).
_TOOL_TOKENS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "kimi": (KIMI_TOOL_SPECIALS, (_KIMI_CALL_ID, WEATHER_ARGUMENTS)),
    "chatml": ((), (QWEN_TOOL_CALL, QWEN_TOOL_CALL_END, _QWEN_CALL_BODY)),
}
# SGLang 0.5.23's parser names for each template's markup (`--reasoning-parser`, `--tool-call-parser`).
_TOOL_PARSERS: dict[str, tuple[str, str]] = {"kimi": ("kimi_k2", "kimi_k2"), "chatml": ("qwen3", "qwen25")}


@dataclass(frozen=True)
class ToolScript:
    """What a `script="tool_call"` model replies to a prompt ending in `<think>`, and how SGLang parses it.

    `reply` is the decoded output (special tokens kept) less the final EOS; the prompt holds the opening
    `<think>`, so the parsers need `"<think>" + reply`. SGLang's `reasoning_parser` and `tool_call_parser`
    (given `tools`) split that into exactly `reasoning`, `answer` and one call of `call_name` whose arguments
    are the JSON text `call_arguments` (measured on SGLang 0.5.23).
    """

    template: Template
    reply: str
    reasoning: str
    answer: str
    call_name: str
    call_arguments: str
    reasoning_parser: str
    tool_call_parser: str
    tools: list[dict[str, Any]] = field(default_factory=lambda: [copy.deepcopy(WEATHER_TOOL)])


def tool_script(template: Template) -> ToolScript:
    """The `tool_call` script of `template` (`kimi`: Kimi-K2 markup; `chatml`: Qwen's `<tool_call>` JSON)."""
    reasoning_parser, tool_call_parser = _TOOL_PARSERS[template]
    return ToolScript(
        template=template,
        reply=f"{TOOL_REASONING}{END_THINK}{TOOL_ANSWER}{TOOL_CALL_MARKUP[template]}",
        reasoning=TOOL_REASONING,
        answer=TOOL_ANSWER,
        call_name="get_weather",
        call_arguments=WEATHER_ARGUMENTS,
        reasoning_parser=reasoning_parser,
        tool_call_parser=tool_call_parser,
    )


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


def _vocab_tokens(template: Template, script: Script) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(special tokens, non-special added tokens) of a tokenizer, in id order."""
    specials = KIMI_SPECIALS if template == "kimi" else CHATML_SPECIALS
    if script == "answer":
        return specials, ()
    tool_specials, added = _TOOL_TOKENS[template]
    return (*specials, *tool_specials), added


def _full_vocab(
    bpe_vocab: dict[str, int], specials: tuple[str, ...], kimi_ids: bool, added: tuple[str, ...] = ()
) -> dict[str, int]:
    """BPE vocab plus specials then `added`: appended, or specials at Kimi's ids with `<|reserved_token_N|>`
    fillers to 163,840 (`added` take the first filler slots, where Kimi's ordinary tokens are)."""
    vocab = dict(bpe_vocab)
    if not kimi_ids:
        for tok in (*specials, *added):
            vocab[tok] = len(vocab)
        return vocab
    real_ids = {**KIMI_IDS, **KIMI_TOOL_IDS}
    by_id = {real_ids[tok]: tok for tok in specials}
    by_id.update({len(vocab) + i: tok for i, tok in enumerate(added)})
    for idx in range(len(vocab), KIMI_VOCAB_SIZE):
        vocab[by_id.get(idx, f"<|reserved_token_{idx}|>")] = idx
    return vocab


def _make_fast_tokenizer(template: Template, kimi_ids: bool, script: Script = "answer") -> Any:
    """Build the `PreTrainedTokenizerFast` (transformers) for a template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials, added = _vocab_tokens(template, script)
    bpe_vocab, merges = _train_bpe(BPE_VOCAB_SIZE)
    tok = Tokenizer(models.BPE(vocab=_full_vocab(bpe_vocab, specials, kimi_ids, added), merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    if added:
        tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in added])
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        eos_token=IM_END,
        additional_special_tokens=[s for s in specials if s != IM_END],
        chat_template=TEMPLATES[template],
        model_max_length=4096,
    )


def _rewrite_tokenizer_config(out_dir: Path, template: Template, script: Script = "answer") -> None:
    """Make tokenizer_config.json loadable by transformers 4.x and 5.x (class, specials, template inside)."""
    path = out_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    specials, _ = _vocab_tokens(template, script)
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


def build_tiny_tokenizer(
    out_dir: Path, *, template: Template = "kimi", kimi_ids: bool = False, script: Script = "answer"
) -> Path:
    """Train and save a tiny tokenizer with a chat template into `out_dir`; return `out_dir`.

    `script="tool_call"` adds the tokens of the tool-call script (see the module docstring); `"answer"` builds
    the plain vocabulary."""
    if kimi_ids and template != "kimi":
        raise ValueError("kimi_ids=True needs template='kimi'")
    if script not in ("answer", "tool_call"):
        raise ValueError(f"script={script!r}: use 'answer' or 'tool_call'")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _make_fast_tokenizer(template, kimi_ids, script).save_pretrained(str(out_dir))
    _rewrite_tokenizer_config(out_dir, template, script)
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


def _saved_template(tokenizer_dir: Path) -> Template:
    """Which of `TEMPLATES` a saved tiny tokenizer carries."""
    chat_template = json.loads((tokenizer_dir / "tokenizer_config.json").read_text()).get("chat_template")
    if chat_template == KIMI_TEMPLATE:
        return "kimi"
    if chat_template == CHATML_TEMPLATE:
        return "chatml"
    raise ValueError(f"{tokenizer_dir}: not a tiny tokenizer (its chat template is neither 'kimi' nor 'chatml')")


def _tool_script_ids(tokenizer_dir: Path) -> list[int]:
    """`<think>`, the tokens of `tool_script(template).reply`, EOS; every token once, decoding to the reply."""
    from tokenizers import Tokenizer

    template = _saved_template(tokenizer_dir)
    reply = tool_script(template).reply
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    ids = _token_ids(tokenizer_dir)
    missing = [t for t in _vocab_tokens(template, "tool_call")[1] if t not in ids]
    if missing:
        raise ValueError(f"{tokenizer_dir}: no tool-call tokens {missing}; build it with script='tool_call'")
    body = tok.encode(reply, add_special_tokens=False).ids
    chain = [ids[THINK], *body, ids[IM_END]]
    if len(set(chain)) != len(chain):
        raise ValueError(f"the tool-call script repeats a token ({chain}): a bigram chain cannot hold it")
    decoded = tok.decode(body, skip_special_tokens=False)
    if decoded != reply:
        raise ValueError(f"the tool-call script decodes to {decoded!r}, not {reply!r}")
    return chain


def script_ids(tokenizer_dir: Path, script: Script = "answer") -> list[int]:
    """The scripted model's chain: `<think>`, the script's tokens, then EOS (`<|im_end|>`).

    `"answer"`: the distinct tokens of `SCRIPT_TEXT`; `"tool_call"`: those of `tool_script(template).reply`
    (the template read from the saved tokenizer), which holds no repeated token."""
    from tokenizers import Tokenizer

    if script == "tool_call":
        return _tool_script_ids(Path(tokenizer_dir))
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
    script: Script = "answer",
) -> Path:
    """Save a tiny LlamaForCausalLM (safetensors) plus its tokenizer into `out_dir`; return `out_dir`.

    With `weights="scripted"` the model replies `script` (`"answer"`, or `"tool_call"`: see `tool_script`) to a
    prompt ending in `<think>`; `tiny_model.json` records the chain (`script_ids`)."""
    import torch
    from transformers import LlamaForCausalLM

    out_dir = build_tiny_tokenizer(out_dir, template=template, kimi_ids=kimi_ids, script=script)
    eos_id = _token_ids(out_dir)[IM_END]
    torch.manual_seed(seed)
    model = LlamaForCausalLM(_llama_config(_vocab_size(out_dir), eos_id)).to(torch.float32)
    if weights == "scripted":
        _script_weights(model, script_ids(out_dir, script))
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
    if script != "answer":  # the plain build's metadata stays as it was
        meta["script"] = script
    if weights == "scripted":
        meta["script_ids"] = script_ids(out_dir, script)
    (out_dir / "tiny_model.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out_dir
