"""Writes docs/troubleshooting.md: each mistake a user can make, run for real, with the line vitrain prints.

    python benchmarks/troubleshooting.py            # about a minute: every case is its own `python -m vitrain`

The cases run in a scratch folder against a tiny digits run (two checkpoints), copies of it damaged or cut short,
and a zip with undecodable images. Paths in the printed lines are shown as RUN, STEP, ZIP, OUT and FILE.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the test suite's image-zip maker: the doc's cases are the tests' cases

from tests.data_helpers import make_tree, zip_with_bad_images  # noqa: E402

TINY = ["model.image_size=16", "model.patch_size=4", "model.width=32", "model.depth=2", "model.heads=2",
        "train.epochs=1", "train.batch_size=90", "train.checkpoint_every_steps=10", "log.progress=false",
        "precision.mode=fp32"]  # fmt: skip


def vitrain(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "VITRAIN_AUTOTUNE": "0", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "vitrain", *args], capture_output=True, text=True, cwd=cwd, env=env)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="vitrain-mistakes-") as scratch:
        work = Path(scratch)
        done = vitrain("train", *TINY, "log.out_dir=runs", "name=run", cwd=work)
        assert done.returncode == 0, done.stderr
        run = work / "runs" / "run"
        damaged = work / "runs" / "damaged"
        shutil.copytree(run, damaged)
        newest = sorted((damaged / "checkpoints").glob("step_*"))[-1]
        shard = next(newest.glob("*.distcp"))
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 1
        shard.write_bytes(bytes(data))
        cut = work / "runs" / "cut"
        shutil.copytree(run, cut)
        cut_step = sorted((cut / "checkpoints").glob("step_*"))[-1]
        (cut_step / "COMPLETE").unlink()
        short = work / "runs" / "short"
        shutil.copytree(run, short)
        short_step = sorted((short / "checkpoints").glob("step_*"))[-1]
        short_shard = next(short_step.glob("*.distcp"))
        os.truncate(short_shard, short_shard.stat().st_size // 2)
        all_short = work / "runs" / "all-short"
        shutil.copytree(run, all_short)
        for step in (all_short / "checkpoints").glob("step_*"):
            for shard_file in step.glob("*.distcp"):
                os.truncate(shard_file, shard_file.stat().st_size // 2)
        no_saves = work / "runs" / "no-saves"
        shutil.copytree(run, no_saves)
        shutil.rmtree(no_saves / "checkpoints")
        (no_saves / "checkpoints").write_text("not a folder")
        tree = work / "tree"
        make_tree(tree, {"train": 2, "test": 1})
        (tree / "test" / "dog").rename(tree / "test" / "dgo")
        no_config = work / "runs" / "no-config"
        shutil.copytree(run, no_config)
        (no_config / "config.yaml").unlink()
        zip_path = zip_with_bad_images(work / "images.zip", bad=1)
        out = work / "out"
        assert vitrain("export", str(run), str(out), cwd=work).returncode == 0
        a_file = work / "notes.txt"
        a_file.write_text("a file of the user's")
        folder = ["data.source=folder", f"data.root={zip_path}", "model.image_size=8", "model.num_classes=2",
                  "train.batch_size=8", "log.out_dir=runs"]  # fmt: skip
        cases = [
            ("a misspelt key", ["train", "model.dpeth=6"]),
            ("a key in the wrong section", ["train", "data.batch_size=32"]),
            ("a key without its value", ["train", "model.depth"]),
            ("a misspelt recipe", ["train", "digitz"]),
            ("an override without `=`", ["train", "digits", "depth"]),
            ("a value of the wrong type", ["train", "train.epochs=ten"]),
            ("a value not among the choices", ["train", "precision.mode=fp8"]),
            ("a shape that cannot be built", ["train", "model.width=100", "model.heads=3"]),
            ("an unknown task", ["train", "task.name=nosuchtask"]),
            ("a model import path that does not import", ["train", "model.name=mypkg.models:my_vit"]),
            ("a data folder that does not exist", ["train", "data.source=folder", "data.root=/no/such/folder"]),
            ("a batch larger than the data", ["train", "train.batch_size=5000"]),
            ("an undecodable image", ["train", *folder]),
            ("a negative skip_bad", ["train", "data.skip_bad=-1"]),
            ("a value that is not a finite number", ["train", "optim.lr=nan"]),
            ("a list cut short", ["train", "data.mean=[0.5"]),
            ("an optimizer beta outside [0, 1)", ["train", "optim.betas=[1.5,0.9]"]),
            ("a negative step limit", ["train", "train.max_steps=-1"]),
            ("an engine path to something that is not an engine", ["train", "train.engine=os:system"]),
            ("a config path that is a folder", ["config", "show", "runs"]),
            ("EMA under zero3", ["train", "train.ema=0.999", "parallel.strategy=zero3"]),
            ("a DeepSpeed JSON under the native engine", ["train", "train.deepspeed_config=ds.json"]),
            ("more pipeline stages than blocks", ["train", "parallel.pipeline_stages=8", "parallel.strategy=ddp"]),
            ("--resume of a run that does not exist", ["train", "--resume", "runs/nothing"]),
            ("--resume with another model", ["train", "--resume", str(run), "model.depth=3"]),
            ("--resume with another seed (data order)", ["train", "--resume", str(run), "train.seed=1"]),
            ("--resume with another optimizer", ["train", "--resume", str(run), "optim.name=sgd"]),
            ("a recipe beside --resume RUN", ["train", "face-orl", "--resume", str(run)]),
            ("--resume of a run whose config.yaml is gone", ["train", "--resume", str(no_config)]),
            ("--resume of a run whose checkpoints/ is a file", ["train", "--resume", str(no_saves)]),
            ("--resume of a run whose every checkpoint was cut short", ["train", "--resume", str(all_short)]),
            ("eval of a damaged checkpoint", ["eval", str(damaged)]),
            ("eval of a step whose write was cut short", ["eval", str(cut_step)]),
            ("eval of a step whose file was cut short later", ["eval", str(short_step)]),
            ("eval of a file", ["eval", str(a_file)]),
            ("eval --pairs on a classification run", ["eval", str(run), "--pairs", "cfp-fp"]),
            ("eval --show on a classification run", ["eval", str(run), "--show", "3"]),
            ("export into a folder that holds an export", ["export", str(run), str(out)]),
            ("export to a file", ["export", str(run), str(a_file)]),
            ("export under a file", ["export", str(run), str(a_file / "sub")]),
            ("checkpoint verify of a damaged run", ["checkpoint", "verify", str(damaged)]),
            ("a pack whose test classes differ from train's", ["data", "pack", "tree", "out2", "--format", "shards"]),
            ("config keys of a misspelt section", ["config", "keys", "trian"]),
            ("lr-find with start above end", ["lr-find", "--start", "1", "--end", "0.1"]),
            ("estimate of a misspelt preset", ["estimate", "vit_hgue_patch14"]),
        ]
        rows = []
        names = {str(newest): "STEP", str(cut_step): "STEP", str(short_step): "STEP", str(damaged): "RUN",
                 str(no_config): "RUN", str(no_saves): "RUN", str(short): "RUN", str(all_short): "RUN", str(cut): "RUN",
                 str(run): "RUN", str(zip_path): "ZIP",
                 str(out): "OUT", str(a_file): "FILE", str(work): "."}  # fmt: skip
        for what, args in cases:
            result = vitrain(*args, cwd=work)
            lines = [line for line in result.stderr.splitlines() if line.startswith("vitrain: error:")]
            line = lines[-1] if lines else "(no error)"
            for path, name in names.items():
                line = line.replace(path, name)
            assert "Traceback" not in result.stderr, (what, result.stderr)
            shown = " ".join(("vitrain", *args)).replace(str(work) + "/", "").replace(str(work), ".")
            for path, name in names.items():
                shown = shown.replace(path, name)
            rows.append((what, shown, result.returncode, line))
            print(f"{result.returncode} {what}: {line}", flush=True)
    text = [
        "# Troubleshooting: every mistake gets one line",
        "",
        "Each row was run for real by `python benchmarks/troubleshooting.py` (which writes this page): the command,",
        "its exit code and the one line it printed. Nothing the user had is changed by a refused command",
        "(`tests/test_mistakes.py` and `tests/test_cli.py` check that case by case).",
        "",
        "Not mistakes, but worth knowing:",
        "- `vitrain train --resume RUN` continues the run with its own `config.yaml`; a `section.key=value` on the",
        "  command line is applied on top, printed and logged (`train.epochs: 1 -> 3 (command line)`), the old config",
        "  kept as `config.before-resume-at-step_N.yaml` and the change in `config_history.jsonl`.",
        "- A damaged newest checkpoint (a file that does not match its XXH3-64) is skipped by `--resume`, which says",
        "  so and continues from the step before it; the damaged step is moved aside as `superseded-step_N`.",
        "- `--resume` of a run that already trained all its epochs says there is nothing left to train (and how to",
        "  train longer: `train.epochs=<more>`), keeps its `summary.json` and exits 0.",
        "- `parallel.strategy=ddp|zero1|zero2|zero3` without torchrun runs as one process and says so in the log.",
        "- `data.skip_bad=N` lets a folder or zip source skip up to N undecodable images, each named in `log.txt` and",
        "  counted in `summary.json` (`skipped_files`); files without an image suffix are never read and are counted",
        "  (`non_image_files`) and named too. Images in folders below a class folder (`<split>/<class>/<sub>/<image>`)",
        "  are not read either (vitrain reads `<split>/<class>/<image>`); the log names them. A prepared source",
        "  (`vitrain data prepare`) lists its undecodable files in `failed.txt` when it is made.",
        "- The process that trains a run holds `RUN/.lock`: a second `--resume` of it while it trains stops in one",
        "  line naming that process and its host, before anything in the folder changes.",
        "- `vitrain config keys [SECTION]` lists every key with its type, default and meaning.",
        "",
        "| mistake | command | exit | what vitrain prints |",
        "|---|---|---:|---|",
    ]
    for what, shown, code, line in rows:
        text.append(f"| {what} | `{shown}` | {code} | {line.replace('|', '/')} |")
    (REPO / "docs" / "troubleshooting.md").write_text("\n".join(text) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
