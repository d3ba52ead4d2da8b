"""What a model family's outputs look like, described once: think ids, how the generation prompt ends, stop ids.

A :class:`Family` is detected from the tokenizer by *rendering* its chat template (never from a list of model
names), under the run's ``chat_template_kwargs``:

- the generation prompt is what ``add_generation_prompt=True`` appends to a one-turn conversation;
- it **opens reasoning** (``prompt``: Kimi-K2.5, Qwen3-Thinking-2507, R1 and R1-Distill, MiniMax-M2) when it ends
  with think-open (and perhaps a newline), **closes it** (``off``: a thinking switch turned off) when think-close
  follows, and otherwise **leaves reasoning to the model** (``model``: Qwen3 hybrid, GLM-4.5/4.6, Kimi-K2-Thinking)
  when the template renders a reply's reasoning as ``<think>…</think>``; the ids it writes between the generation
  prompt and ``<think>`` (GLM's ``\\n``) are the output's allowed prefix;
- ``harmony`` (gpt-oss) when the template speaks in ``<|channel|>`` messages; ``none`` when there is no reasoning;
- tool-call markers are the :data:`TOOL_CALL_MARKERS` that a rendered tool call holds as single tokens.

A preset's ``[tokens]`` table (configs/*.toml) states the same facts; :func:`check_preset_tokens` compares them
with what was detected and stops the run on a mismatch, naming both values. A new family needs a preset and, only
when it uses new marker strings, one row in :data:`THINK_TAGS`, :data:`TOOL_CALL_MARKERS` or :data:`HARMONY`.

This module imports nothing from the other stages; the tokenizer is used through its duck-typed
``apply_chat_template``/``convert_tokens_to_ids``/``encode``/``decode``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

#: How the generation prompt leaves reasoning; see the module docstring.
Reasoning = Literal["prompt", "model", "off", "none", "harmony"]
REASONING_VALUES: tuple[str, ...] = ("prompt", "model", "off", "none", "harmony")

# --- the table: marker strings, one row per family that brings new ones ------------------------------------------

#: (think-open, think-close) strings; the first pair that is a pair of single tokens in the vocabulary wins.
THINK_TAGS: tuple[tuple[str, str], ...] = (("<think>", "</think>"),)
#: Tokens that start a tool call (SGLang's reasoning parsers end reasoning at them): Qwen3/GLM/MiniMax, Kimi,
#: DeepSeek V3 vocabularies. Only those a rendered tool call holds as single tokens are used.
TOOL_CALL_MARKERS: tuple[str, ...] = (
    "<tool_call>",
    "<|tool_calls_section_begin|>",
    "<minimax:tool_call>",
    "<｜tool▁calls▁begin｜>",
)
#: gpt-oss harmony markers (role -> string).
HARMONY: dict[str, str] = {
    "start": "<|start|>",
    "channel": "<|channel|>",
    "message": "<|message|>",
    "end": "<|end|>",
    "return": "<|return|>",
    "call": "<|call|>",
    "constrain": "<|constrain|>",
}
HARMONY_CHANNELS: tuple[str, ...] = ("analysis", "commentary", "final")

#: A prompt "opens" reasoning when think-open is among its last 2 ids (``<think>\\n``), and turned thinking off when
#: think-close is among its last 4 (Qwen3 writes ``<think>\\n\\n</think>\\n\\n``).
OPEN_TAIL = 2
CLOSED_TAIL = 4

#: Keys a preset's ``[tokens]`` table may hold (configs/*.toml, docs/reasoning-templates.md).
PRESET_TOKEN_KEYS: dict[str, str] = {
    "reasoning": f"one of {', '.join(REASONING_VALUES)}: how the generation prompt leaves reasoning",
    "think_open": "the <think> id",
    "think_close": "the </think> id",
    "think_open_in_prompt": "true when the generation prompt ends inside reasoning",
    "prompt_tail": "the text the generation prompt ends with",
    "output_prefix": "text the model writes before <think> (GLM: a newline)",
    "stop_token_ids": "ids that end a reply; they join the stop set",
    "tool_call_markers": "strings that start a tool call (single tokens)",
}

_REFERENCE: list[dict[str, Any]] = [{"role": "user", "content": "What is 2+2?"}]
_REPLY: dict[str, Any] = {"role": "assistant", "content": "4", "reasoning_content": "2+2 is 4."}
_TOOL_CALL: dict[str, Any] = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ],
}


@dataclass(frozen=True)
class Harmony:
    """gpt-oss's harmony ids: the markers and the token ids of each channel name and of the ``assistant`` role."""

    start: int
    channel: int
    message: int
    end: int
    return_: int
    call: int
    constrain: int | None
    channels: Mapping[str, tuple[int, ...]]
    role: tuple[int, ...]

    @property
    def markers(self) -> frozenset[int]:
        ids = {self.start, self.channel, self.message, self.end, self.return_, self.call}
        return frozenset(ids | ({self.constrain} if self.constrain is not None else set()))

    def to_json(self) -> dict[str, Any]:
        return {
            "start": self.start,
            "channel": self.channel,
            "message": self.message,
            "end": self.end,
            "return": self.return_,
            "call": self.call,
            "constrain": self.constrain,
            "channels": {k: list(v) for k, v in self.channels.items()},
            "role": list(self.role),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Harmony:
        return cls(
            start=int(data["start"]),
            channel=int(data["channel"]),
            message=int(data["message"]),
            end=int(data["end"]),
            return_=int(data["return"]),
            call=int(data["call"]),
            constrain=None if data.get("constrain") is None else int(data["constrain"]),
            channels={str(k): tuple(int(i) for i in v) for k, v in dict(data["channels"]).items()},
            role=tuple(int(i) for i in data.get("role", ())),
        )


@dataclass(frozen=True)
class Family:
    """Everything the per-record checks need to know about a model family's outputs."""

    name: str
    reasoning: Reasoning
    generation_prompt: tuple[int, ...] = ()
    think_open: int | None = None
    think_close: int | None = None
    output_prefixes: tuple[tuple[int, ...], ...] = ((),)
    tool_call_ids: frozenset[int] = frozenset()
    stop_ids: frozenset[int] = frozenset()
    harmony: Harmony | None = None
    source: str = "detected"
    #: generation prompts after which the output must open reasoning: this family's own when ``reasoning`` is
    #: ``model``, and those of a mix's variants whose kwargs leave reasoning to the model (:meth:`with_variants`).
    model_prompts: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.reasoning == "model" and self.generation_prompt and self.generation_prompt not in self.model_prompts:
            object.__setattr__(self, "model_prompts", (*self.model_prompts, self.generation_prompt))

    @property
    def has_think(self) -> bool:
        return self.think_open is not None and self.think_close is not None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "reasoning": self.reasoning,
            "generation_prompt": list(self.generation_prompt),
            "think_open": self.think_open,
            "think_close": self.think_close,
            "output_prefixes": [list(p) for p in self.output_prefixes],
            "tool_call_ids": sorted(self.tool_call_ids),
            "stop_ids": sorted(self.stop_ids),
            "harmony": self.harmony.to_json() if self.harmony is not None else None,
            "source": self.source,
            "model_prompts": [list(p) for p in self.model_prompts],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Family:
        reasoning = data.get("reasoning")
        if reasoning not in REASONING_VALUES:
            raise ValueError(f"unknown reasoning {reasoning!r}")
        harmony = data.get("harmony")
        return cls(
            name=str(data.get("name", "detected")),
            reasoning=reasoning,
            generation_prompt=tuple(int(i) for i in data.get("generation_prompt") or ()),
            think_open=_opt_int(data.get("think_open")),
            think_close=_opt_int(data.get("think_close")),
            output_prefixes=tuple(tuple(int(i) for i in p) for p in data.get("output_prefixes") or [[]]),
            tool_call_ids=frozenset(int(i) for i in data.get("tool_call_ids") or ()),
            stop_ids=frozenset(int(i) for i in data.get("stop_ids") or ()),
            harmony=Harmony.from_json(harmony) if isinstance(harmony, Mapping) else None,
            source=str(data.get("source", "manifest")),
            model_prompts=tuple(tuple(int(i) for i in p) for p in data.get("model_prompts") or ()),
        )

    def with_variants(self, others: Sequence[Family]) -> Family:
        """This family, also asking an output to open reasoning after any generation prompt of ``others`` (the
        families a mix's variants render: one may turn thinking off, another leave it to the model)."""
        prompts = list(self.model_prompts)
        prefixes = list(self.output_prefixes)
        for other in others:
            prompts += [p for p in other.model_prompts if p not in prompts]
            prefixes += [p for p in other.output_prefixes if p not in prefixes]
        return replace(self, model_prompts=tuple(prompts), output_prefixes=tuple(prefixes))

    def special_ids(self) -> frozenset[int]:
        """Every id with a structural meaning (a fake model's free text avoids them)."""
        ids = set(self.stop_ids) | set(self.tool_call_ids)
        ids |= {i for i in (self.think_open, self.think_close) if i is not None}
        if self.harmony is not None:
            ids |= self.harmony.markers
        return frozenset(ids)


# --- what a prompt asks of its output ----------------------------------------------------------------------------

#: ``inside``: the prompt opened reasoning; ``must_open``: the output must open it at its start; ``off``: thinking is
#: off, no think token may appear; ``harmony``: harmony messages; ``free``: nothing is asked (no generation prompt,
#: as DeepSeek after a tool result, or no reasoning at all).
Expectation = Literal["inside", "must_open", "off", "harmony", "free", "bad_prompt"]


def expectation(family: Family, prompt: Sequence[int]) -> Expectation:
    """What this prompt's end asks of the output, judged on this record alone (no vote across records)."""
    if not prompt:
        return "free"
    gen = family.generation_prompt
    if family.harmony is not None:
        return "harmony" if gen and _ends_with(prompt, gen) else "free"
    if not family.has_think:
        return "free"
    assert family.think_open is not None and family.think_close is not None
    shape = prompt_shape(prompt, family.think_open, family.think_close)
    if shape == "open":
        return "inside"
    if shape == "closed":
        return "off"
    if any(_ends_with(prompt, p) for p in family.model_prompts):
        return "must_open"
    if family.reasoning == "prompt" and family.think_open in gen:
        head = gen[: gen.index(family.think_open)]
        if head and _ends_with(prompt, head):
            return "bad_prompt"
    return "free"


PromptShape = Literal["open", "closed", "plain"]


def prompt_shape(prompt: Sequence[int], think_open: int, think_close: int) -> PromptShape:
    """``open`` when the prompt's end opened reasoning, ``closed`` when it turned thinking off, else ``plain``."""
    if prompt[-1] == think_open:
        return "open"
    tail = list(prompt[-CLOSED_TAIL:])
    last_close = len(tail) - 1 - tail[::-1].index(think_close) if think_close in tail else -1
    last_open = len(tail) - 1 - tail[::-1].index(think_open) if think_open in tail else -1
    if last_close > last_open:
        return "closed"
    if last_open >= len(tail) - OPEN_TAIL:
        return "open"
    return "plain"


def _ends_with(ids: Sequence[int], tail: Sequence[int]) -> bool:
    return len(ids) >= len(tail) and list(ids[len(ids) - len(tail) :]) == list(tail)


def _opt_int(value: Any) -> int | None:
    return value if type(value) is int else None


# --- detection by rendering --------------------------------------------------------------------------------------


def single_token_id(tokenizer: Any, text: str) -> int | None:
    """The id of ``text`` when it is one token of this vocabulary, else ``None``."""
    try:
        token_id = tokenizer.convert_tokens_to_ids(text)
    except Exception:  # a slow tokenizer may raise on an unknown token
        return None
    if not isinstance(token_id, int) or token_id < 0 or token_id == getattr(tokenizer, "unk_token_id", None):
        return None
    return token_id


def _render(tokenizer: Any, messages: list[dict[str, Any]], generation: bool, kwargs: Mapping[str, Any]) -> list[int]:
    result = tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=True, **kwargs)
    if isinstance(result, Mapping) or hasattr(result, "keys"):
        result = result["input_ids"]
    if hasattr(result, "tolist"):
        result = result.tolist()
    if result and isinstance(result[0], Sequence):
        result = result[0]
    return [int(i) for i in result]


def _try_render(
    tokenizer: Any, messages: list[dict[str, Any]], generation: bool, kwargs: Mapping[str, Any]
) -> list[int] | None:
    try:
        return _render(tokenizer, messages, generation, kwargs)
    except Exception:  # a template may reject a shape (DeepSeek wants string arguments): the fact stays unknown
        return None


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def detect_family(
    tokenizer: Any,
    template_kwargs: Mapping[str, Any] | None = None,
    *,
    stop_ids: Sequence[int] = (),
    name: str = "detected",
) -> Family:
    """The family of ``tokenizer``'s chat template under ``template_kwargs``, found by rendering."""
    kwargs = dict(template_kwargs or {})
    with_gen = _render(tokenizer, _REFERENCE, True, kwargs)
    without = _render(tokenizer, _REFERENCE, False, kwargs)
    gen = tuple(with_gen[_common(with_gen, without) :])
    stops = frozenset(stop_ids)
    harmony = _detect_harmony(tokenizer, gen)
    if harmony is not None:
        return Family(name, "harmony", gen, stop_ids=stops, harmony=harmony)
    think = next(
        (
            (o, c)
            for o, c in ((single_token_id(tokenizer, a), single_token_id(tokenizer, b)) for a, b in THINK_TAGS)
            if o is not None and c is not None
        ),
        None,
    )
    tools = _detect_tool_markers(tokenizer, kwargs)
    if think is None:
        return Family(name, "none", gen, tool_call_ids=tools, stop_ids=stops)
    think_open, think_close = think
    prefixes: tuple[tuple[int, ...], ...] = ((),)
    if think_open in gen:
        after = gen[len(gen) - 1 - gen[::-1].index(think_open) :]
        reasoning: Reasoning = "off" if think_close in after else "prompt"
    else:
        reply = _try_render(tokenizer, [*_REFERENCE, _REPLY], False, kwargs) or []
        start = _common(reply, with_gen)
        if think_open in reply[start:]:
            reasoning = "model"
            at = reply.index(think_open, start)
            if start == len(with_gen) and at > start:
                prefixes = ((), tuple(reply[start:at]))
        else:
            reasoning = "none"
    return Family(
        name,
        reasoning,
        gen,
        think_open,
        think_close,
        output_prefixes=prefixes,
        tool_call_ids=tools,
        stop_ids=stops,
    )


def _detect_harmony(tokenizer: Any, gen: Sequence[int]) -> Harmony | None:
    ids = {role: single_token_id(tokenizer, text) for role, text in HARMONY.items()}
    needed = ("start", "channel", "message", "end", "return", "call")
    template = tokenizer.chat_template if isinstance(getattr(tokenizer, "chat_template", None), str) else ""
    if any(ids[r] is None for r in needed) or HARMONY["channel"] not in template:
        return None
    start = ids["start"]
    assert start is not None
    role = tuple(gen[gen.index(start) + 1 :]) if start in gen else ()
    channels = {name: tuple(tokenizer.encode(name, add_special_tokens=False)) for name in HARMONY_CHANNELS}
    return Harmony(
        start=start,
        channel=int(ids["channel"] or 0),
        message=int(ids["message"] or 0),
        end=int(ids["end"] or 0),
        return_=int(ids["return"] or 0),
        call=int(ids["call"] or 0),
        constrain=ids["constrain"],
        channels=channels,
        role=role,
    )


def _detect_tool_markers(tokenizer: Any, kwargs: Mapping[str, Any]) -> frozenset[int]:
    markers = {i for i in (single_token_id(tokenizer, m) for m in TOOL_CALL_MARKERS) if i is not None}
    if not markers:
        return frozenset()
    found: set[int] = set()
    call = _TOOL_CALL["tool_calls"][0]
    as_string = {**call, "function": {**call["function"], "arguments": '{"city": "Paris"}'}}
    for tool_call in (call, as_string):
        rendered = _try_render(tokenizer, [*_REFERENCE, {**_TOOL_CALL, "tool_calls": [tool_call]}], False, kwargs)
        if rendered is not None:
            found |= markers.intersection(rendered)
    return frozenset(found)


# --- presets -----------------------------------------------------------------------------------------------------


class PresetMismatch(ValueError):
    """A preset's ``[tokens]`` fact disagrees with the tokenizer (the message names both values)."""


def apply_preset_tokens(family: Family, tokens: Mapping[str, Any], tokenizer: Any, preset: str) -> Family:
    """Checks a preset's ``[tokens]`` facts against what was detected; returns the family with the preset's
    stop ids and tool-call markers joined in. Raises :class:`PresetMismatch` naming both values."""
    where = f"the preset {preset!r} [tokens]"
    unknown = sorted(set(tokens) - set(PRESET_TOKEN_KEYS))
    if unknown:
        raise PresetMismatch(
            f"{where} has unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(PRESET_TOKEN_KEYS))}"
        )

    def mismatch(key: str, said: Any, found: Any) -> PresetMismatch:
        return PresetMismatch(
            f"{where} says {key} = {said!r}, but the tokenizer gives {found!r}: this preset is not for this "
            "model; use the model's own preset or remove --config"
        )

    # The preset describes the template under its own [chat_template_kwargs]; kwargs that switch thinking off
    # (detected "off") change how the prompt ends, so the facts about the prompt's end are then not compared.
    switched_off = family.reasoning == "off" and tokens.get("reasoning") in (None, "prompt", "model")
    reasoning = tokens.get("reasoning")
    if reasoning is not None and reasoning != family.reasoning and not switched_off:
        raise mismatch("reasoning", reasoning, family.reasoning)
    for key, found in (("think_open", family.think_open), ("think_close", family.think_close)):
        if key in tokens and tokens[key] != found:
            raise mismatch(key, tokens[key], found)
    in_prompt = family.reasoning == "prompt"
    if "think_open_in_prompt" in tokens and bool(tokens["think_open_in_prompt"]) != in_prompt and not switched_off:
        raise mismatch("think_open_in_prompt", tokens["think_open_in_prompt"], in_prompt)
    decode = _decoder(tokenizer)
    tail = tokens.get("prompt_tail")
    if isinstance(tail, str) and not switched_off:
        rendered = decode(family.generation_prompt)
        if not rendered.endswith(tail):
            raise mismatch("prompt_tail", tail, rendered)
    prefixes = family.output_prefixes
    prefix = tokens.get("output_prefix")
    if isinstance(prefix, str):
        written = [decode(p) for p in family.output_prefixes if p]
        if prefix and prefix not in written:
            raise mismatch("output_prefix", prefix, written[0] if written else "")
    tools = set(family.tool_call_ids)
    for marker in tokens.get("tool_call_markers") or ():
        marker_id = single_token_id(tokenizer, str(marker))
        if marker_id is None:
            raise mismatch("tool_call_markers", marker, "no single token")
        tools.add(marker_id)
    stops = set(family.stop_ids)
    preset_stops = tokens.get("stop_token_ids")
    if preset_stops is not None:
        vocab = len(tokenizer)
        for stop in preset_stops:
            if type(stop) is not int or not 0 <= stop < vocab:
                raise mismatch("stop_token_ids", list(preset_stops), f"ids in [0, {vocab})")
        missing = sorted(set(family.stop_ids) - set(preset_stops))
        if missing:
            raise mismatch("stop_token_ids", list(preset_stops), sorted(family.stop_ids))
        stops |= set(preset_stops)
    return Family(
        name=preset,
        reasoning=family.reasoning,
        generation_prompt=family.generation_prompt,
        think_open=family.think_open,
        think_close=family.think_close,
        output_prefixes=prefixes,
        tool_call_ids=frozenset(tools),
        stop_ids=frozenset(stops),
        harmony=family.harmony,
        source=f"preset {preset} (checked against the tokenizer)",
        model_prompts=family.model_prompts,
    )


def _decoder(tokenizer: Any) -> Any:
    def decode(ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=False))

    return decode


def describe_family(family: Family) -> str:
    """One line for the start of a run."""
    what = {
        "prompt": "the prompt opens reasoning",
        "model": "the model opens reasoning",
        "off": "thinking is off",
        "none": "no reasoning",
        "harmony": "harmony channels",
    }[family.reasoning]
    think = f"; think ids {family.think_open}/{family.think_close}" if family.has_think else ""
    tools = f"; tool-call ids {sorted(family.tool_call_ids)}" if family.tool_call_ids else ""
    return f"{family.name} ({what}{think}{tools}; {family.source})"
