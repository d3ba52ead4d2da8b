#!/usr/bin/env bash
# The CPU demo: a tiny model served by real SGLang 0.5.23 on this CPU.
#  1. eagle-datagen run on examples/prompts.jsonl (one reply per prompt), then verify-shard, show and stats;
#  2. a multi-turn run (--turns all) on examples/conversations.jsonl, its verify-shard and one conversation's turns.
# The multi-turn run starts in the background at once (its own server), so its SGLang start-up overlaps the first
# run's; its output is printed after the first run's. Run through `make demo` (it sets up both venvs).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
MODEL="$ROOT/.cache/demo-tool-model"
DEMO="${DEMO_OUT:-$ROOT/demo-out}"
OUT="$DEMO/single"  # run 1
TURNS_OUT="$DEMO/turns"  # run 2 (--turns all)
TURNS_LOG="$DEMO/turns-run.txt"  # run 2's terminal output

if [[ ! -f "$MODEL/config.json" ]]; then
    echo "[demo] building a tiny Kimi-K2.5-style model (scripted weights, float32) in $MODEL:"
    echo "       to every prompt it replies reasoning, </think>, 'Checking Paris.' and one get_weather call"
    PYTHONPATH="$ROOT/tests/sglang_shims" .venv-sglang/bin/python scripts/make_tiny_model.py "$MODEL" \
        --template kimi --weights scripted --dtype float32 --script tool_call
fi
rm -rf "$DEMO"
mkdir -p "$DEMO"

# The SGLang CPU shims (tests/sglang_shims) and SGLANG_USE_CPU_ENGINE reach the launched server through
# the environment; on a GPU node none of this is needed (see docs/gpu-node.md).
export SGLANG_USE_CPU_ENGINE=1 HF_HUB_OFFLINE=1 PYTHONPATH="$ROOT/tests/sglang_shims"
export TMPDIR="${TMPDIR:-/tmp}"
SERVER=(--model "$MODEL" --server-python .venv-sglang/bin/python --tp-size 1
        --server-arg=--device=cpu --server-arg=--dtype=float32 --server-arg=--max-total-tokens=8192
        --server-arg=--sleep-on-idle --max-new-tokens 64 --no-progress)
start=$(date +%s)

# Run 2 in the background. A background job of a script ignores Ctrl-C: stop it (and so its server) on any exit.
.venv/bin/eagle-datagen run --prompts examples/conversations.jsonl "${SERVER[@]}" \
    --turns all --reasoning-parser-name kimi_k2 --tool-call-parser-name kimi_k2 \
    --out "$TURNS_OUT" >"$TURNS_LOG" 2>&1 &
turns_pid=$!
trap 'kill -TERM "$turns_pid" 2>/dev/null || true; wait "$turns_pid" 2>/dev/null || true' EXIT

.venv/bin/eagle-datagen run --prompts examples/prompts.jsonl "${SERVER[@]}" --shard-size 25 --out "$OUT"
.venv/bin/eagle-datagen verify-shard "$OUT"
echo
echo "[demo] one record as a person reads it (eagle-datagen show):"
.venv/bin/eagle-datagen show "$OUT" --limit 1
echo
echo "[demo] what the data holds (eagle-datagen stats; --plots DIR / --html FILE draw it):"
.venv/bin/eagle-datagen stats "$OUT"

echo
echo "[demo] multi-turn (--turns all): every assistant turn of examples/conversations.jsonl regenerated in order,"
echo "       each reply split by SGLang's own parsers (kimi_k2) and fed back as the next turn's history, the"
echo "       source's tool results spliced after the calls they answer; a conversation stops where they do not pair."
echo "       Its run (started with the first one):"
turns_rc=0
wait "$turns_pid" || turns_rc=$?
trap - EXIT
cat "$TURNS_LOG"
if [[ $turns_rc -ne 0 ]]; then
    echo "[demo] the multi-turn run failed (exit $turns_rc); its server log: $TURNS_OUT/server.log" >&2
    exit "$turns_rc"
fi
.venv/bin/eagle-datagen verify-shard "$TURNS_OUT"
echo
echo "[demo] one conversation's turns (eagle-datagen show --where key=weather-01): each prompt holds the earlier"
echo "       replies as the template renders history, and the tool results answering their call ids"
.venv/bin/eagle-datagen show "$TURNS_OUT" --where key=weather-01 --limit 3
echo
echo "[demo] how each conversation ended ($TURNS_OUT/conversations.jsonl):"
cat "$TURNS_OUT/conversations.jsonl"
echo
echo "[demo] done in $(( $(date +%s) - start )) s. Shards are in $OUT/shards/ and $TURNS_OUT/shards/; read one with:"
echo "  head -n 1 $TURNS_OUT/shards/shard_00000.jsonl | python3 -m json.tool | head -60"
echo "[demo] manifests (the pinned plans): $OUT/manifest.json, $TURNS_OUT/manifest.json; server logs beside them"
