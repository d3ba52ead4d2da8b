"""Build a tiny offline tokenizer (and model) directory for tests and demos.

Usage: python scripts/make_tiny_model.py OUT_DIR [--template kimi|chatml] [--kimi-ids]
       [--weights random|scripted] [--dtype float32|bfloat16] [--seed N] [--tokenizer-only]
       [--generation-defaults '{"temperature": 0.6, "top_p": 0.95}'] [--script answer|tool_call]
Runs with any interpreter that has transformers (+ torch unless --tokenizer-only); src/ need not be installed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

try:
    from eagle_datagen.testing import tiny
except ImportError:  # run from a venv without the package installed (e.g. .venv-sglang)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from eagle_datagen.testing import tiny


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--template", choices=["kimi", "chatml"], default="kimi")
    p.add_argument("--kimi-ids", action="store_true", help="Kimi-K2.5 special ids in a 163,840 vocab")
    p.add_argument("--weights", choices=["random", "scripted"], default="random")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--generation-defaults", type=json.loads, default=None, help="JSON object")
    p.add_argument("--tokenizer-only", action="store_true", help="no model (needs no torch)")
    p.add_argument(
        "--script",
        choices=["answer", "tool_call"],
        default="answer",
        help="what --weights scripted replies: reasoning and an answer, or reasoning, an answer and a get_weather "
        "call (tiny.tool_script)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Build the directory and print its path."""
    a = parse_args(argv)
    if a.tokenizer_only:
        out = tiny.build_tiny_tokenizer(a.out_dir, template=a.template, kimi_ids=a.kimi_ids, script=a.script)
    else:
        out = tiny.build_tiny_model(
            a.out_dir,
            template=a.template,
            kimi_ids=a.kimi_ids,
            weights=a.weights,
            dtype=a.dtype,
            seed=a.seed,
            generation_defaults=a.generation_defaults,
            script=a.script,
        )
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
