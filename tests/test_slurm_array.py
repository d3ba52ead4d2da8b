"""scripts/slurm/datagen-array.sbatch run as SLURM would run two array tasks (against the SGLang stand-in):
each launches its server, generates its partition and leaves nothing running; a rerun resumes; merge proves
the array covered the prompts once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import python_with_env, read_records, varied_rows, write_jsonl
from eagle_datagen.testing.fake_sglang import family_config
from eagle_datagen.verify.merge import merge_runs
from test_launcher import STANDIN

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "slurm" / "datagen-array.sbatch"


def task(index: int, count: int, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT)],
        env={**env, "SLURM_ARRAY_TASK_ID": str(index), "SLURM_ARRAY_TASK_COUNT": str(count)},
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip


def test_two_array_tasks_cover_the_prompts_and_leave_the_node_clean(
    tmp_path: Path, tiny_tokenizer: Path, hf_tokenizer: Any
) -> None:
    prompts = write_jsonl(tmp_path / "prompts.jsonl", varied_rows(40))
    fake = json.dumps(
        {"vocab_size": len(hf_tokenizer), "eos_id": hf_tokenizer.eos_token_id, "family": family_config(hf_tokenizer)}
    )
    src = STANDIN.parents[1] / "src"  # the stand-in imports this checkout's package
    server_python = python_with_env(
        tmp_path / "standin-python", sys.executable, PYTHONPATH=f"{STANDIN}:{src}", FAKE_SGLANG_CONFIG_JSON=fake
    )
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PROMPTS": str(prompts),
        "MODEL": str(tiny_tokenizer),  # the stand-in serves any path; the tokenizer renders the prompts
        "OUT_ROOT": str(tmp_path / "array"),
        "SERVER_PYTHON": server_python,
        "EXTRA_ARGS": "--tp-size 1 --max-new-tokens 8",
    }
    for index in range(2):
        done = task(index, 2, env)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"array task {index} of 2" in done.stdout
    outs = sorted((tmp_path / "array").iterdir())
    assert [o.name for o in outs] == ["part-00000-of-00002", "part-00001-of-00002"]
    # Nothing of either task's server is left (the launcher's own group check).
    for out in outs:
        log = (out / "server.log").read_text()
        assert "stopping: SIGTERM to process group" in log
        pgid = int(log.split("=== eagle-datagen: process group ")[1].split()[0])
        assert not Path(f"/proc/{pgid}").exists()

    # Submitting a finished task again resumes it: nothing is generated twice.
    again = task(1, 2, env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resume --out" in again.stdout

    report = merge_runs(tmp_path / "all", outs)
    assert report.records == 40 and report.partitions == 2
    assert len({r["id"] for r in read_records(tmp_path / "all")}) == 40
