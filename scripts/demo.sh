#!/usr/bin/env bash
# The CPU demo: a tiny model served by real SGLang 0.5.23 on this CPU, eagle-datagen run on
# examples/prompts.jsonl, then verify-shard, show and stats on the result. Run through `make demo` (it sets up both venvs).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
MODEL="$ROOT/.cache/demo-model"
OUT="${DEMO_OUT:-$ROOT/demo-out}"

if [[ ! -f "$MODEL/config.json" ]]; then
    echo "[demo] building a tiny Kimi-K2.5-style model (scripted weights, float32) in $MODEL"
    PYTHONPATH="$ROOT/tests/sglang_shims" .venv-sglang/bin/python scripts/make_tiny_model.py "$MODEL" \
        --template kimi --weights scripted --dtype float32
fi
rm -rf "$OUT"

# The SGLang CPU shims (tests/sglang_shims) and SGLANG_USE_CPU_ENGINE reach the launched server through
# the environment; on a GPU node none of this is needed (see docs/gpu-node.md).
export SGLANG_USE_CPU_ENGINE=1 HF_HUB_OFFLINE=1 PYTHONPATH="$ROOT/tests/sglang_shims"
export TMPDIR="${TMPDIR:-/tmp}"
start=$(date +%s)
.venv/bin/eagle-datagen run \
    --prompts examples/prompts.jsonl \
    --model "$MODEL" \
    --server-python .venv-sglang/bin/python \
    --tp-size 1 \
    --server-arg=--device=cpu --server-arg=--dtype=float32 --server-arg=--max-total-tokens=8192 \
    --server-arg=--sleep-on-idle \
    --max-new-tokens 64 --shard-size 25 --no-progress \
    --out "$OUT"
.venv/bin/eagle-datagen verify-shard "$OUT"
echo
echo "[demo] one record as a person reads it (eagle-datagen show):"
.venv/bin/eagle-datagen show "$OUT" --limit 1
echo
echo "[demo] what the data holds (eagle-datagen stats; --plots DIR / --html FILE draw it):"
.venv/bin/eagle-datagen stats "$OUT"
echo
echo "[demo] done in $(( $(date +%s) - start )) s. Shards are in $OUT/shards/; read one with:"
echo "  head -n 1 $OUT/shards/shard_00000.jsonl | python3 -m json.tool | head -40"
echo "[demo] manifest (the pinned plan): $OUT/manifest.json; server log: $OUT/server.log"
