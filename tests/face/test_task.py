"""The face task end to end: sharded-head training on 1 and 2 ranks, resumes, verification, export and eval."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch

from tests.distributed_helpers import losses, run_two_ranks
from tests.face.helpers import face_config, make_faces
from vitrain.cli import main
from vitrain.engine import Trainer
from vitrain.parallel import broadcast_object
from vitrain.parallel.distributed import rank


def _fork(out_dir, source, name):
    step3 = out_dir / source / "checkpoints" / "step_00000003"
    target = out_dir / name / "checkpoints" / step3.name
    shutil.copytree(step3, target)
    return str(target)


STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


def _two_rank_job(out_dir, root):
    for strategy in STRATEGIES:
        cfg = face_config(out_dir, root, f"two_{strategy}", batch_size=8, parallel={"strategy": strategy})
        Trainer(cfg).fit()
    resume = broadcast_object(_fork(out_dir, "one", "one_to_two") if rank() == 0 else None)
    Trainer(face_config(out_dir, root, "one_to_two", batch_size=8, parallel={"strategy": "ddp"}), resume).fit()
    sampled = {"sample_rate": 0.5, "name": "face", "embed_dim": 16, "scale": 8.0, "verify_identities": 3}
    cfg = face_config(
        out_dir, root, "two_sampled", batch_size=8, parallel={"strategy": "ddp"}, task=sampled, train={"max_steps": 12}
    )
    Trainer(cfg).fit()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("face")
    root = make_faces(out_dir / "faces")
    Trainer(face_config(out_dir, root, "one")).fit()
    run_two_ranks(_two_rank_job, out_dir, root)
    Trainer(face_config(out_dir, root, "two_to_one"), _fork(out_dir, "two_ddp", "two_to_one")).fit()
    return out_dir


def _assert_same_losses(got, expected, steps):
    for step in steps:
        assert got[step] == pytest.approx(expected[step], abs=1e-5), step


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sharded_head_on_two_ranks_trains_like_one_process(runs, strategy):
    _assert_same_losses(losses(runs / f"two_{strategy}"), losses(runs / "one"), range(1, 7))


def test_two_rank_sharded_head_checkpoint_resumes_in_one_process(runs):
    _assert_same_losses(losses(runs / "two_to_one"), losses(runs / "one"), range(4, 7))


def test_one_process_head_checkpoint_resumes_on_two_ranks(runs):
    _assert_same_losses(losses(runs / "one_to_two"), losses(runs / "one"), range(4, 7))


def test_a_sampled_head_on_two_ranks_trains(runs):
    got = losses(runs / "two_sampled")
    assert len(got) == 12 and all(math.isfinite(v) for v in got.values())
    assert np.mean([got[s] for s in (10, 11, 12)]) < np.mean([got[s] for s in (1, 2, 3)])


def test_training_reports_verification_beside_a_raw_pixel_baseline(runs):
    summary = json.loads((runs / "one" / "summary.json").read_text())
    assert summary["task"] == "face" and 0.0 <= summary["val_acc"] <= 1.0
    assert summary["best_val_acc"] >= summary["val_acc"]
    for key in ("val_generated_acc", "val_generated_raw_pixels_acc", "val_generated_tpr@far=0.1"):
        assert key in summary
    report = json.loads((runs / "one" / "verification.json").read_text())
    assert set(report["reports"]) == {"generated", "generated raw pixels"}
    assert report["reports"]["generated"]["matched"] == report["reports"]["generated"]["mismatched"] == 20
    assert len(report["verify_identities"]) == 3


def test_a_face_checkpoint_holds_the_head_by_identity_rows(runs):
    from vitrain import checkpoint as ckpt

    index = ckpt.read_index(runs / "two_ddp" / "checkpoints" / "step_00000003")
    assert tuple(index["head.weight"].size) == (5, 16)  # 8 identities, 3 held out: 5 training identities
    assert tuple(index["head.state.exp_avg"].size) == (5, 16)


# slow: 7 s on a Zen 4; fp16 and export are tested for images in the default suite
@pytest.mark.slow
def test_fp16_amp_o2_face_run_exports_finite_fp32_weights_and_statistics(tmp_path):
    from safetensors.torch import load_file

    root = make_faces(tmp_path / "faces")
    cfg = face_config(tmp_path, root, "fp16", precision={"mode": "amp_o2", "dtype": "fp16"})
    Trainer(cfg).fit()
    assert main(["export", str(tmp_path / "fp16"), str(tmp_path / "export")]) == 0
    weights = load_file(tmp_path / "export" / "model.safetensors")
    assert {"neck.bn.running_var", "neck.bn.running_mean", "neck.fc.weight"} <= set(weights)
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32 and bool(torch.isfinite(tensor).all()), name


def test_eval_verifies_a_trained_model_on_another_face_folder_with_a_pairs_file(runs, tmp_path, capsys):
    other = make_faces(tmp_path / "other", identities=4, per_identity=3, seed=7)
    pairs = tmp_path / "pairs.txt"
    pairs.write_text("2\nperson00 1 2\nperson01 2 3\nperson00 1 person02 3\nperson01 1 person03 2\n")
    code = main(["eval", str(runs / "one"), "--root", str(other), "--pairs", str(pairs), "--out", str(tmp_path / "ev")])
    assert code == 0
    result = json.loads(capsys.readouterr().out.split("\n", 2)[-1])
    assert result["reports"]["pairs"]["pairs"] == 4
    assert (tmp_path / "ev" / "verification.json").exists()


def test_eval_refuses_a_pairs_file_naming_an_unknown_identity(runs, tmp_path, capsys):
    other = make_faces(tmp_path / "other", identities=2, per_identity=2)
    pairs = tmp_path / "pairs.txt"
    pairs.write_text("1\nnobody 1 2\nperson00 1 person01 2\n")
    assert main(["eval", str(runs / "one"), "--root", str(other), "--pairs", str(pairs)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pairs.txt line 2" in err[0] and "nobody" in err[0]
