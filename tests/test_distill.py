"""Distillation (train.distill): DeiT's token and heads, the two losses, teachers from every source, the run."""

from __future__ import annotations

import dataclasses
import json
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from tests.conftest import TINY_MODEL, run_cli, tiny_overrides
from tests.distributed_helpers import MODEL, losses, run_two_ranks, tiny_config, whole_and_resumed
from vitrain.config import load_config, resolve_config_path
from vitrain.engine import Trainer
from vitrain.engine.runs import resumed_config
from vitrain.errors import CheckpointError, ConfigError
from vitrain.models import VisionTransformer, count_parameters
from vitrain.tasks import build_task
from vitrain.tasks.distill import Taught, distillation_loss, load_teacher
from vitrain.weights import export, load_pretrained

IMAGES = torch.randn(4, 1, 16, 16)
QUIET = ["log.progress=false", "precision.mode=fp32"]


def _export_teacher(out_dir, seed=1, model=MODEL, **train):
    """A vitrain export of a random ViT over `model`'s classes (the distributed helpers' 8x8 colour images)."""
    cfg = dataclasses.replace(tiny_config(out_dir, "teacher-cfg"), model=model)
    torch.manual_seed(seed)
    teacher = VisionTransformer(model)
    export(teacher, cfg, out_dir / "teacher", overwrite=True)
    return teacher


# ---------------------------------------------------------------------------------------------- the student


def test_a_distilled_vit_gains_only_the_token_and_its_head():
    plain, distilled = VisionTransformer(TINY_MODEL), VisionTransformer(TINY_MODEL, distilled=True)
    assert set(distilled.state_dict()) - set(plain.state_dict()) == {"dist_token", "head_dist.weight", "head_dist.bias"}
    assert set(plain.state_dict()) <= set(distilled.state_dict())
    assert distilled.state_dict()["pos_embed"].shape == plain.state_dict()["pos_embed"].shape
    assert distilled.complexity().params == count_parameters(distilled)


def test_a_distilled_vit_gives_both_heads_in_training_and_their_average_in_eval():
    model = VisionTransformer(TINY_MODEL, distilled=True)
    logits, distilled = model(IMAGES)
    tokens = model.forward_features(IMAGES)
    assert tokens.shape[1] == 2 + 16  # class, distillation, 16 patches
    torch.testing.assert_close(logits, model.head(tokens[:, 0]))
    torch.testing.assert_close(distilled, model.head_dist(tokens[:, 1]))
    model.eval()
    torch.testing.assert_close(model(IMAGES), (logits + distilled) / 2)


def test_a_student_starts_from_a_plain_export_with_a_fresh_token_and_head(tmp_path):
    plain = _export_teacher(tmp_path, model=TINY_MODEL)
    student = VisionTransformer(TINY_MODEL, distilled=True)
    fresh = student.head_dist.weight.detach().clone()
    load_pretrained(student, tmp_path / "teacher" / "model.safetensors")
    torch.testing.assert_close(student.blocks[1].mlp.fc2.weight, plain.blocks[1].mlp.fc2.weight, rtol=0, atol=0)
    torch.testing.assert_close(student.head_dist.weight, fresh, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- the losses


def _cfg(**distill):
    return load_config(None, [*[f"train.distill.{k}={v}" for k, v in distill.items()], "train.label_smoothing=0"])


def test_hard_distillation_learns_the_labels_and_the_teachers_top_class():
    logits, distilled = torch.randn(4, 10), torch.randn(4, 10)
    labels, teacher = torch.tensor([1, 2, 3, 4]), torch.randn(4, 10)
    got = distillation_loss((logits, distilled), Taught(labels, teacher), _cfg(type="hard", alpha=0.25))
    expected = 0.75 * F.cross_entropy(logits, labels) + 0.25 * F.cross_entropy(distilled, teacher.argmax(-1))
    torch.testing.assert_close(got, expected)


def test_soft_distillation_is_zero_where_the_student_matches_the_softened_teacher():
    labels, teacher = torch.tensor([1, 2, 3, 4]), torch.randn(4, 10)
    cfg = _cfg(type="soft", alpha=1.0, tau=3.0)
    same = distillation_loss((torch.randn(4, 10), teacher + 5.0), Taught(labels, teacher), cfg)  # softmax: shift-free
    assert same.item() == pytest.approx(0.0, abs=1e-6)
    off = torch.randn(4, 10)
    p, q = (F.softmax(x / 3.0, dim=-1) for x in (teacher, off))
    kl = (p * (p.log() - q.log())).sum(-1).mean() * 9.0  # KL(teacher || student) per image, x tau^2
    torch.testing.assert_close(distillation_loss((torch.randn(4, 10), off), Taught(labels, teacher), cfg), kl)


# ---------------------------------------------------------------------------------------------- teachers


def test_a_teacher_loads_from_an_export_its_weights_file_and_a_run(tmp_path):
    teacher = _export_teacher(tmp_path).eval()
    cfg = tiny_config(tmp_path, "student")
    run = tiny_config(tmp_path, "run", train={"max_steps": 1})
    trainer = Trainer(run)  # sets train.threads=1: the references below are computed with it too
    trainer.fit()
    images = torch.randn(2, 3, 8, 8)
    expected = teacher(images)
    for source in (tmp_path / "teacher", tmp_path / "teacher" / "model.safetensors"):
        cfg.train.distill.teacher = str(source)
        loaded = load_teacher(cfg)
        assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
        torch.testing.assert_close(loaded(images), expected, rtol=0, atol=0)
    cfg.train.distill.teacher = str(run.run_dir)  # its newest checkpoint, read through the safe DCP reader
    trained = trainer.model.eval().cpu()  # a teacher is loaded on the CPU, wherever its run trained
    torch.testing.assert_close(load_teacher(cfg)(images), trained(images), rtol=0, atol=0)


TIMM = "timm is not installed (pip install 'vitrain[peers]'): a timm teacher cannot be built"


def _timm():
    """timm as vitrain imports it (torchvision's CUDA-only operators declared first), or the test skips."""
    from vitrain.models.external import import_timm

    try:
        return import_timm()
    except ConfigError:
        pytest.skip(TIMM)


def test_a_timm_cnn_teacher_loads_from_a_local_weights_file(tmp_path):
    timm = _timm()
    cnn = timm.create_model("test_resnet", pretrained=False, num_classes=4, in_chans=3).eval()
    save_file(cnn.state_dict(), str(tmp_path / "resnet.safetensors"))
    cfg = tiny_config(tmp_path, "student")
    cfg.train.distill.teacher = "timm:test_resnet"
    cfg.train.distill.teacher_weights = str(tmp_path / "resnet.safetensors")
    images = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(load_teacher(cfg)(images), cnn(images), rtol=0, atol=0)
    cfg.model = dataclasses.replace(cfg.model, num_classes=10)
    with pytest.raises(ConfigError, match=r"^train.distill.teacher=timm:test_resnet predicts 4 classes, the task has"):
        load_teacher(cfg)


def test_a_timm_teacher_without_weights_offline_says_how_to_get_them(tmp_path, monkeypatch):
    _timm()
    constants = pytest.importorskip("huggingface_hub.constants", reason="huggingface_hub comes with timm")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # read when a download is asked, not from the environment
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))  # an empty cache
    cfg = tiny_config(tmp_path, "student")
    cfg.train.distill.teacher = "timm:test_resnet"
    with pytest.raises(ConfigError, match="timm cannot get its pretrained weights .*teacher_weights=PATH"):
        load_teacher(cfg)


# slow: 9 s on a Zen 4
@pytest.mark.slow
def test_a_teacher_of_other_classes_is_refused_in_one_line_with_exit_2(tmp_path):
    _export_teacher(tmp_path, model=dataclasses.replace(TINY_MODEL, num_classes=7))
    done = run_cli("train", "digits", f"train.distill.teacher={tmp_path / 'teacher'}", f"log.out_dir={tmp_path}")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"vitrain: error: train.distill.teacher={tmp_path / 'teacher'} predicts 7 classes, the task has "
        "model.num_classes=10; distil from a teacher trained on the task's classes"
    )


# ---------------------------------------------------------------------------------------------- the run


def test_the_teacher_runs_frozen_under_inference_mode_in_the_steps_precision(tmp_path):
    _export_teacher(tmp_path)
    cfg = tiny_config(
        tmp_path, "o1", train={"max_steps": 1, "distill": {"teacher": str(tmp_path / "teacher")}},
        precision={"mode": "amp_o1", "dtype": "bf16"},
    )  # fmt: skip
    trainer = Trainer(cfg)
    teacher = trainer.train_step.teacher.frozen.module
    seen = {}
    teacher.blocks[0].mlp.fc1.register_forward_hook(
        lambda layer, args, out: seen.update(inference=torch.is_inference_mode_enabled(), dtype=out.dtype)
    )
    images, labels = next(iter(trainer.train_loader.epoch(0)))
    taught = trainer.train_step.teacher(images, labels)
    assert seen == {"inference": True, "dtype": torch.bfloat16}
    assert taught.teacher_logits.dtype == torch.float32 and not taught.teacher_logits.is_inference()
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    trainer.fit()
    assert torch.isfinite(torch.tensor(list(losses(cfg.run_dir).values()))).all()


def test_a_runs_set_up_reads_its_teacher_once_and_shows_its_load_lines_once(tmp_path, monkeypatch):
    # autotune sets up a teacher for each candidate and the run one more for its step: the teacher was read, and the
    # lines its load prints shown, once for each (here 2 attention candidates + the run: the line below 3 times).
    monkeypatch.setenv("VITRAIN_AUTOTUNE", "1")  # the suite's default is 0: auto values by their rules
    monkeypatch.setenv("VITRAIN_CACHE_DIR", str(tmp_path / "cache"))  # autotune races rather than reads its cache
    teacher = tiny_config(tmp_path, "teacher", train={"max_steps": 1})
    Trainer(teacher).fit()
    broken = teacher.run_dir / "checkpoints" / "step_00000009"  # a write that was interrupted: skipped with a line
    broken.mkdir()
    (broken / "meta.json").write_text("{")
    cfg = tiny_config(
        tmp_path, "student", train={"max_steps": 1, "distill": {"teacher": str(teacher.run_dir)}},
        model={"pool": "cls", "attention": "auto"},
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        trainer = Trainer(cfg)
    assert trainer.tuned is not None and len(trainer.tuned.images_per_s) == 2  # two candidates raced
    assert [str(w.message) for w in shown if "incomplete" in str(w.message)] == [
        f"checkpoint {broken} is incomplete (its write was interrupted or it was damaged); skipped"
    ]
    trainer.fit()


# slow: 9 s on a Zen 4; distillation and token dropping each resume in the default suite
@pytest.mark.slow
def test_a_distilled_run_with_token_drop_resumes_exactly_and_exports(tmp_path):
    _export_teacher(tmp_path)
    both = {"epochs": 4, "max_steps": 6, "checkpoint_every_steps": 3, "token_drop": 0.5}
    both["distill"] = {"teacher": str(tmp_path / "teacher"), "type": "soft", "tau": 2.0}
    whole, part, _ = whole_and_resumed(tmp_path, both, stop_at=3)
    expected, got = losses(whole.run_dir), losses(part.run_dir)
    assert [got[s] for s in (4, 5, 6)] == [expected[s] for s in (4, 5, 6)]  # exactly
    done = run_cli("export", str(whole.run_dir), str(tmp_path / "student"))
    assert done.returncode == 0, done.stderr
    student = load_config(None, [f"train.distill.teacher={tmp_path / 'student'}", *tiny_overrides(tmp_path)])
    student.model = MODEL  # a distilled student is itself a teacher: both heads averaged
    assert load_teacher(student)(torch.zeros(1, 3, 8, 8)).shape == (1, 4)
    refused = run_cli("export", str(whole.run_dir), str(tmp_path / "timm"), "--format", "timm")
    assert refused.returncode == 2 and "no distillation token; this student was trained with train.distill" in (
        refused.stderr
    )


def test_a_resume_cannot_turn_distillation_on(tmp_path):
    cfg = tiny_config(tmp_path, "plain", train={"max_steps": 1})
    Trainer(cfg).fit()
    with pytest.raises(CheckpointError, match=re.escape("--resume: train.distill.teacher=")):
        resumed_config(cfg, True, [f"train.distill.teacher={tmp_path}"])


def test_the_digits_recipe_trains_with_a_teacher_from_the_cli(tmp_path):
    digits = load_config(resolve_config_path("digits"))
    _export_teacher(tmp_path, model=digits.model)
    done = run_cli(
        "train", "digits", "train.epochs=1", f"train.distill.teacher={tmp_path / 'teacher'}", f"log.out_dir={tmp_path}",
        *QUIET,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "digits" / "summary.json").read_text())
    # The student: the recipe's ViT plus DeiT's token (width) and its classifier (width x 10 + 10).
    width = digits.model.width
    assert summary["steps"] == 22 and summary["params"] == count_parameters(VisionTransformer(digits.model)) + (
        width + width * 10 + 10
    )
    log = (tmp_path / "digits" / "log.txt").read_text()
    assert f"distillation: hard from {tmp_path / 'teacher'} (alpha=0.5)" in log


@pytest.mark.slow
def test_a_student_of_a_trained_digits_teacher_learns_from_the_cli(tmp_path):
    teacher = load_config(resolve_config_path("digits"), [f"log.out_dir={tmp_path}", "name=teacher", *QUIET])
    teacher.train.epochs = 3
    Trainer(teacher).fit()  # a teacher of 3 epochs (~30% top-1): its run folder is the source
    done = run_cli(
        "train", "digits", "train.epochs=3", f"train.distill.teacher={teacher.run_dir}", "train.distill.type=soft",
        f"log.out_dir={tmp_path}", *QUIET,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "digits" / "summary.json").read_text())
    assert summary["steps"] == 66 and summary["val_top1"] > 0.2  # ten classes: well above chance


def _two_rank_job(out_dir):
    teacher = {"teacher": str(out_dir / "teacher")}
    Trainer(
        tiny_config(out_dir, "zero3", batch_size=8, train={"distill": teacher}, parallel={"strategy": "zero3"})
    ).fit()
    both = {"distill": {**teacher, "type": "soft"}, "token_drop": 0.5}
    for strategy in ("ddp", "zero2", "zero3"):
        trainer = Trainer(
            tiny_config(out_dir, f"{strategy}-both", batch_size=8, train=both, parallel={"strategy": strategy})
        )
        kinds = {type(p).__name__ for p in trainer.train_step.teacher.frozen.module.parameters()}
        (out_dir / f"{strategy}-teacher.json").write_text(json.dumps(sorted(kinds)))
        trainer.fit()


# slow: 16 s on a Zen 4; distillation and sharding each run in the default suite
@pytest.mark.slow
def test_two_ranks_shard_the_teacher_like_the_student_and_train_like_one_process(tmp_path):
    _export_teacher(tmp_path)
    Trainer(tiny_config(tmp_path, "single", train={"distill": {"teacher": str(tmp_path / "teacher")}})).fit()
    run_two_ranks(_two_rank_job, tmp_path)
    reference = losses(tmp_path / "single")
    for step, loss in reference.items():
        assert losses(tmp_path / "zero3")[step] == pytest.approx(loss, abs=1e-5)
    # Token dropping draws per rank: the strategies match each other (same ranks, same draws), not one process.
    ddp = losses(tmp_path / "ddp-both")
    for strategy in ("zero2", "zero3"):
        assert losses(tmp_path / f"{strategy}-both") == pytest.approx(ddp, abs=1e-5)
    assert json.loads((tmp_path / "zero3-teacher.json").read_text()) == ["DTensor"]
    assert json.loads((tmp_path / "zero2-teacher.json").read_text()) == ["DTensor"]
    assert json.loads((tmp_path / "ddp-teacher.json").read_text()) == ["Parameter"]


@pytest.mark.parametrize(
    "overrides, line",
    [
        (["train.distill.alpha=1.5"], "train.distill.alpha=1.5 weighs the teacher's loss and must be in [0, 1]"),
        (["train.distill.tau=0"], "train.distill.tau=0.0 is a temperature and must be positive"),
        (
            ["train.distill.teacher_weights=w.safetensors"],
            "gives a timm teacher its weights; set train.distill.teacher",
        ),
        (["train.distill.teacher=t", "model.pool=gap"], "it needs model.name=vit and model.pool=cls"),
        (["train.distill.teacher=t", "task.name=face"], "train.distill.teacher=t distils a classifier; task.name=face"),
        (["train.distill.teacher=t", "parallel.pipeline_stages=2", "parallel.strategy=ddp"], "pipeline_stages=2: the"),
        (["train.distill.type=warm"], "train.distill.type=warm is not allowed"),
    ],
)
def test_bad_distillation_settings_are_refused_in_one_line(tmp_path, overrides, line):
    with pytest.raises(ConfigError, match=re.escape(line)):
        load_config(None, tiny_overrides(tmp_path, *overrides))


def test_a_model_handed_to_the_library_cannot_be_distilled(tmp_path):
    cfg = tiny_config(tmp_path, "student", train={"distill": {"teacher": str(tmp_path)}})
    with pytest.raises(ConfigError, match="a model handed to the library has none"):
        build_task(cfg, model=VisionTransformer(MODEL)).build_model()


def test_a_missing_teacher_is_named(tmp_path):
    cfg = tiny_config(tmp_path, "student")
    cfg.train.distill.teacher = str(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=re.escape(f"train.distill.teacher={tmp_path / 'nowhere'} does not exist")):
        load_teacher(cfg)
