"""Every engine x strategy x precision x stem of the digits recipe trains two steps or is refused in one line; on two
ranks, every engine x strategy x precision resumes to the uninterrupted run's losses."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.distributed_helpers import free_port, gpu_free_env

# One process runs them all, one vitrain.train after another (the library's own use): a combination that raised
# anything but vitrain's one-line errors was a bug (DeepSpeed bf16 with BatchNorm, fp16 on its CPU accelerator, SGD's
# fused kernel under FSDP2, found this way).
MATRIX = """
import itertools, json, sys
import vitrain
from vitrain.errors import VitrainError

rows = [("native", s) for s in ("single", "ddp", "zero1", "zero2", "zero3")]
rows += [("deepspeed", s) for s in ("ddp", "zero1", "zero2", "zero3")]
precisions = ["fp32", "amp_o1", "amp_o2", "pure", "amp_o2 precision.dtype=fp16"]
for i, ((engine, strategy), precision, stem, optim) in enumerate(
    itertools.product(rows, precisions, ("linear", "conv"), ("adamw", "sgd"))
):
    overrides = [f"name=run{i}", f"log.out_dir={sys.argv[1]}", "train.max_steps=2", "train.threads=1",
                 "model.depth=1", "log.progress=false", f"train.engine={engine}", f"parallel.strategy={strategy}",
                 f"precision.mode={precision}", f"model.patch_embed={stem}", f"optim.name={optim}"]
    try:
        vitrain.train("digits", [o for item in overrides for o in item.split()])
        outcome = "trained"
    except VitrainError as error:
        outcome = "refused" if "\\n" not in str(error) else f"refused in several lines: {error}"
    except Exception as error:
        outcome = f"{type(error).__name__}: {error}"
    print(json.dumps({"run": f"{engine} {strategy} {precision} {stem} {optim}", "outcome": outcome}), flush=True)
"""


@pytest.mark.slow  # 180 runs in one process: 2.5 minutes on a Zen 4
def test_every_combination_of_engine_strategy_precision_stem_and_optimizer_trains_or_is_refused(tmp_path):
    script = tmp_path / "matrix.py"
    script.write_text(MATRIX)
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 9 * 5 * 2 * 2
    failed = [f"{r['run']}: {r['outcome']}" for r in results if r["outcome"] not in ("trained", "refused")]
    assert not failed, "\n".join(failed)
    assert sum(r["outcome"] == "trained" for r in results) >= 100


# Two ranks under torchrun, autotune on (its own cache): each combination trains 5 steps straight, then 3 and a
# resume to 5, whose losses must equal the straight run's bit for bit. A resume once raced attention again and could
# pick the other kernel by the race's noise (2.4e-7 off under zero2 in fp32; at batch 32, zero2 and zero3 in amp_o2
# failed here in one run without that fix, not in every run: tests/test_tune.py holds its deterministic test).
RESUMES = """
import itertools, json, os, sys
from pathlib import Path
import vitrain

def losses(run):
    records = map(json.loads, (Path(run) / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if "loss" in r and "step" in r}

def main():
    rows = [("native", s) for s in ("ddp", "zero1", "zero2", "zero3")] + [("deepspeed", s) for s in ("zero2", "zero3")]
    for i, ((engine, strategy), precision) in enumerate(itertools.product(rows, ("fp32", "amp_o2"))):
        overrides = [f"log.out_dir={sys.argv[1]}", "train.threads=1", "model.depth=1", "log.progress=false",
                     "log.every_steps=1", "model.patch_embed=conv", "train.batch_size=32", f"train.engine={engine}",
                     f"parallel.strategy={strategy}", f"precision.mode={precision}"]
        vitrain.train("digits", [f"name=straight{i}", "train.max_steps=5", *overrides])
        vitrain.train("digits", [f"name=resumed{i}", "train.max_steps=3", *overrides])
        vitrain.train("digits", [f"name=resumed{i}", "train.max_steps=5", *overrides], resume=True)
        if os.environ["RANK"] == "0":
            straight, resumed = (losses(f"{sys.argv[1]}/{kind}{i}") for kind in ("straight", "resumed"))
            row = {"run": f"{engine} {strategy} {precision}", "straight": straight, "resumed": resumed}
            print(json.dumps(row), flush=True)

if __name__ == "__main__":
    main()
"""


@pytest.mark.slow  # 12 combinations x 3 runs on 2 ranks: about 1.5 minutes on a Zen 4
def test_every_engine_strategy_and_precision_resumes_on_two_ranks_to_the_uninterrupted_losses(tmp_path):
    script = tmp_path / "resumes.py"
    script.write_text(RESUMES)
    env = {**os.environ, **gpu_free_env(2), "VITRAIN_AUTOTUNE": "1", "VITRAIN_CACHE_DIR": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), str(script), str(tmp_path / "runs")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=1500, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 12
    differ = [row["run"] for row in rows if row["resumed"] != row["straight"] or len(row["straight"]) != 5]
    assert not differ, differ
