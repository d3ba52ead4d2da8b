#!/usr/bin/env bash
# Create .venv-sglang: a separate venv with SGLang on a CPU torch, used only by the real-server tests.
# Idempotent: a stamp holds a hash of the pin file and this script; when it matches (and `import sglang`
# works) nothing is installed again. Usage: scripts/setup-sglang-cpu.sh [--force]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SGLANG_VENV:-$ROOT/.venv-sglang}"
PINS="$ROOT/requirements/sglang-cpu.txt"
BASE_PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
SGLANG_VERSION="0.5.23"
TORCHVISION_VERSION="0.28.0"
STAMP="$VENV/.setup-sglang-cpu.stamp"
SHIMS="$ROOT/tests/sglang_shims"

export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

log() { printf '[setup-sglang-cpu] %s\n' "$*" >&2; }

wanted_hash() { cat "$PINS" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1; }

# sglang imports torchvision, which needs the test shims (tests/sglang_shims/sitecustomize.py) on CPU.
venv_imports_sglang() {
    SGLANG_USE_CPU_ENGINE=1 PYTHONPATH="$SHIMS" "$VENV/bin/python" -c 'import sglang' >/dev/null
}

is_up_to_date() {
    [[ -f "$STAMP" ]] && [[ "$(cat "$STAMP")" == "$(wanted_hash)" ]] && venv_imports_sglang 2>/dev/null
}

ensure_venv() {
    if ! "$VENV/bin/python" -c 'import sys' >/dev/null 2>&1; then
        log "creating $VENV"
        rm -rf "$VENV"
        "$BASE_PYTHON" -m venv "$VENV"
    fi
}

install_packages() {
    local pip=("$VENV/bin/python" -m pip)
    local torch_pin="$VENV/torch-constraint.txt"
    echo "torch==$TORCH_VERSION" >"$torch_pin"
    log "installing torch==$TORCH_VERSION (CPU wheel)"
    "${pip[@]}" install -qq "torch==$TORCH_VERSION"
    "$VENV/bin/python" -W ignore -c 'import sys, torch; sys.exit(torch.version.cuda is not None)' \
        || { log "error: a CUDA torch was installed; expected the CPU wheel"; exit 1; }
    log "installing sglang==$SGLANG_VERSION torchvision==$TORCHVISION_VERSION (--no-deps)"
    "${pip[@]}" install -qq --no-deps "sglang==$SGLANG_VERSION" "torchvision==$TORCHVISION_VERSION"
    log "installing pins from ${PINS#"$ROOT"/}"
    "${pip[@]}" install -qq --no-warn-conflicts -c "$torch_pin" -r "$PINS"
}

main() {
    if [[ "${1:-}" == "--force" ]]; then
        rm -f "$STAMP"
    fi
    if is_up_to_date; then
        log "up to date: $VENV"
        return 0
    fi
    ensure_venv
    install_packages
    venv_imports_sglang || { log "error: 'import sglang' fails in $VENV"; exit 1; }
    wanted_hash >"$STAMP"
    log "ready: $VENV ($("$VENV/bin/python" -m pip list 2>/dev/null | grep -E '^(sglang|torch) ' | tr -s ' ' | paste -sd,))"
}

main "$@"
