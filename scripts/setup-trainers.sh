#!/usr/bin/env bash
# Install the trainers' own code (speculators 0.9.0, SpecForge 0.2.0 and the few packages their data modules
# import) with --no-deps into .trainers/, used on top of .venv-sglang's CPU torch by the export tests:
#   PYTHONPATH=.trainers:tests/sglang_shims:src .venv-sglang/bin/python ...
# Idempotent: a stamp holds a hash of the pin file and this script. Usage: scripts/setup-trainers.sh [--force]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SGLANG_VENV:-$ROOT/.venv-sglang}"
TARGET="${TRAINERS_DIR:-$ROOT/.trainers}"
PINS="$ROOT/requirements/trainers.txt"
STAMP="$TARGET/.setup-trainers.stamp"
SHIMS="$ROOT/tests/sglang_shims"

export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

log() { printf '[setup-trainers] %s\n' "$*" >&2; }

wanted_hash() { cat "$PINS" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1; }

imports_work() {
    PYTHONPATH="$TARGET:$SHIMS" "$VENV/bin/python" -c '
import speculators.data_generation.preprocessing, speculators.train.data, speculators.train.vocab_mapping
import specforge.data.prompt_builder, specforge.runtime.control_plane.controller, specforge.core.compact_teacher
' >/dev/null 2>&1
}

main() {
    if [[ "${1:-}" == "--force" ]]; then
        rm -f "$STAMP"
    fi
    if [[ -f "$STAMP" ]] && [[ "$(cat "$STAMP")" == "$(wanted_hash)" ]] && imports_work; then
        log "up to date: $TARGET"
        return 0
    fi
    if ! "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
        log "error: $VENV has no torch; run scripts/setup-sglang-cpu.sh (make sglang) first"
        exit 1
    fi
    log "installing ${PINS#"$ROOT"/} into ${TARGET#"$ROOT"/} (--no-deps)"
    rm -rf "$TARGET.tmp"
    "$VENV/bin/python" -m pip install -qq --no-deps --no-warn-conflicts --target "$TARGET.tmp" -r "$PINS"
    rm -rf "$TARGET"
    mv "$TARGET.tmp" "$TARGET"
    imports_work || {
        log "error: the trainers' data modules do not import; run: PYTHONPATH=$TARGET:$SHIMS $VENV/bin/python -c 'import speculators.train.data'"
        exit 1
    }
    wanted_hash >"$STAMP"
    log "ready: $TARGET"
}

main "$@"
