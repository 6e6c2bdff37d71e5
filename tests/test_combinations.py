"""Every engine x strategy x precision x stem of the digits recipe trains two steps or is refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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
