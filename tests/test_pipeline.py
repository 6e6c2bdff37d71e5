"""Pipeline parallelism trains, evaluates and checkpoints like one process: gpipe, 1f1b, interleaved, PP x DP."""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed_helpers import losses, run_ranks, run_two_ranks, tiny_config
from vitrain import checkpoint as ckpt
from vitrain.config import load_config
from vitrain.engine import Trainer
from vitrain.errors import ConfigError
from vitrain.models import create_model
from vitrain.models.plan import stage_blocks
from vitrain.models.vit import ViTStage
from vitrain.parallel import shutdown

MODEL = {"depth": 4}
AMP_O2 = {"mode": "amp_o2", "dtype": "bf16"}  # 4 blocks: 2 stages of 2, or 4 interleaved stages of 1 on 2 ranks


def _pipelined(schedule: str = "1f1b", stages: int = 2, strategy: str = "ddp") -> dict:
    return {"strategy": strategy, "pipeline_stages": stages, "pipeline_schedule": schedule}


# name -> (parallel section, train section); all run in one spawned 2-process job, one stage per rank (interleaved:
# two). Every rank reads the whole batch of 16: one data-parallel replica, the single process's global batch.
TWO_RANKS = {
    "gpipe": (_pipelined("gpipe"), {"eval_flip": True}),  # each stage runs the mirror images' forward as well
    "1f1b": (_pipelined("1f1b"), {}),
    "interleaved_1f1b": (_pipelined("interleaved_1f1b", stages=4), {}),
    "1f1b_accum": (_pipelined("1f1b"), {"accum_steps": 2}),
}
STOP, END = 3, 5  # the resume tests stop after STOP steps and continue to END in the other layout


def _train_two_ranks(out_dir):
    for name, (parallel, train) in TWO_RANKS.items():
        batch = 16 // train.get("accum_steps", 1)
        Trainer(tiny_config(out_dir, name, batch_size=batch, model=MODEL, parallel=parallel, train=train)).fit()
    # A pipelined run stops at STOP (checkpointed there); one process continues it below.
    Trainer(tiny_config(out_dir, "pp_then_one", model=MODEL, parallel=_pipelined(), train={"max_steps": STOP})).fit()
    # One process's checkpoint at STOP (written before this job) continued by the pipeline.
    Trainer(tiny_config(out_dir, "one_then_pp", model=MODEL, parallel=_pipelined()), resume=True).fit()
    # amp_o2: FSDP2 computes each stage in bf16 on its fp32 (here one-replica) shards.
    parallel = _pipelined(strategy="zero3")
    Trainer(tiny_config(out_dir, "1f1b_zero3_o2", model=MODEL, parallel=parallel, precision=AMP_O2)).fit()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("pipeline")
    Trainer(tiny_config(out_dir, "single", model=MODEL, train={"eval_flip": True})).fit()
    Trainer(tiny_config(out_dir, "single_accum", batch_size=8, model=MODEL, train={"accum_steps": 2})).fit()
    Trainer(tiny_config(out_dir, "one_then_pp", model=MODEL, train={"max_steps": STOP})).fit()
    Trainer(tiny_config(out_dir, "single_o2", model=MODEL, precision=AMP_O2)).fit()
    run_two_ranks(_train_two_ranks, out_dir)
    Trainer(tiny_config(out_dir, "pp_then_one", model=MODEL), resume=True).fit()
    return out_dir


def _assert_same_losses(got: dict[int, float], reference: dict[int, float], steps: range) -> None:
    assert sorted(got) == list(steps)
    for step in steps:
        assert got[step] == pytest.approx(reference[step], abs=1e-5), f"step {step}"
    assert len({round(v, 6) for v in got.values()}) > 1  # training moved


@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_two_stages_on_two_ranks_match_one_process_for_five_steps(runs, name):
    reference = "single_accum" if name.endswith("accum") else "single"
    _assert_same_losses(losses(runs / name), losses(runs / reference), range(1, 6))


@pytest.mark.parametrize("name", ["single_accum", "1f1b_accum"])
def test_an_accumulated_step_logs_the_loss_of_its_whole_batch(runs, name):
    # 2 micro-steps of 8 (the pipeline's each in its micro-batches) log the mean over the 16 images, as one batch of
    # 16 does; before, the last micro-step's loss alone.
    _assert_same_losses(losses(runs / name), losses(runs / "single"), range(1, 6))


def test_amp_o2_stages_under_zero3_stay_within_1e_2_of_one_process(runs):
    reference, got = losses(runs / "single_o2"), losses(runs / "1f1b_zero3_o2")
    assert sorted(got) == [1, 2, 3, 4, 5]
    for step, loss in reference.items():
        assert got[step] == pytest.approx(loss, rel=1e-2), f"step {step}"


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _last_eval(run_dir) -> dict:
    """The run's last evaluation record (a checkpoint's own record may follow it)."""
    return [r for r in _records(run_dir) if "val_loss" in r][-1]


@pytest.mark.parametrize("name", ["1f1b", "interleaved_1f1b"])
def test_pipelined_gradient_norm_is_the_whole_models(runs, name):
    reference = [r["grad_norm"] for r in _records(runs / "single") if "grad_norm" in r]
    got = [r["grad_norm"] for r in _records(runs / name) if "grad_norm" in r]
    assert got == pytest.approx(reference, abs=1e-5)


@pytest.mark.parametrize("name", ["gpipe", "interleaved_1f1b"])
def test_pipelined_evaluation_matches_one_process(runs, name):
    reference, got = _last_eval(runs / "single"), _last_eval(runs / name)
    assert got["step"] == reference["step"] == 5 and got["val_samples"] == reference["val_samples"] == 6
    assert got["val_loss"] == pytest.approx(reference["val_loss"], abs=1e-5)
    assert got["val_top1"] == reference["val_top1"]
    if name == "gpipe":  # with train.eval_flip: a stage that skipped the mirror's forward left the last one astray
        assert got["val_loss_flip"] == pytest.approx(reference["val_loss_flip"], abs=1e-5)
        assert got["val_top1_flip"] == reference["val_top1_flip"]


def test_a_pipelined_summary_counts_the_whole_model_and_the_global_batch(runs):
    single = json.loads((runs / "single" / "summary.json").read_text())
    pipelined = json.loads((runs / "1f1b" / "summary.json").read_text())
    assert pipelined["params"] == single["params"] and pipelined["global_batch"] == single["global_batch"] == 16
    assert pipelined["world_size"] == 2


def test_a_pipelined_checkpoint_resumes_in_one_process(runs):
    expected, got = losses(runs / "single"), losses(runs / "pp_then_one")
    _assert_same_losses(got, expected, range(1, END + 1))
    meta = ckpt.read_meta(ckpt.latest(runs / "pp_then_one"))
    assert meta["step"] == END and meta["world_size"] == 1


def test_a_one_process_checkpoint_resumes_pipelined(runs):
    _assert_same_losses(losses(runs / "one_then_pp"), losses(runs / "single"), range(1, END + 1))
    meta = ckpt.read_meta(ckpt.latest(runs / "one_then_pp"))
    assert meta["step"] == END and meta["world_size"] == 2


# ------------------------------------------------------------------------------------------ PP x DP, 4 processes


def _four_rank_job(out_dir):
    for strategy in ("ddp", "zero3"):
        # 2 stages x 2 replicas of 8 images: the single process's global batch of 16.
        cfg = tiny_config(out_dir, f"pp_dp_{strategy}", batch_size=8, model=MODEL, parallel=_pipelined("1f1b"))
        cfg.parallel.strategy = strategy
        Trainer(cfg).fit()


@pytest.fixture(scope="module")
def four_rank_runs(runs):
    run_ranks(4, _four_rank_job, runs)
    return runs


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_two_stages_by_two_replicas_match_one_process(four_rank_runs, strategy):
    run_dir = four_rank_runs / f"pp_dp_{strategy}"
    _assert_same_losses(losses(run_dir), losses(four_rank_runs / "single"), range(1, 6))
    reference, got = _last_eval(four_rank_runs / "single"), _last_eval(run_dir)
    assert got["val_samples"] == 6 and got["val_loss"] == pytest.approx(reference["val_loss"], abs=1e-5)


# ------------------------------------------------------------------------------------------ the split


def test_stages_split_the_blocks_evenly_with_the_remainder_after_the_first():
    assert stage_blocks(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_blocks(12, 5) == [range(0, 2), range(2, 5), range(5, 8), range(8, 10), range(10, 12)]


@pytest.mark.parametrize("layout", ["batch_first", "seq_first"])
def test_stages_in_a_row_compute_the_model_and_keep_its_parameter_names(tmp_path, layout):
    cfg = tiny_config(tmp_path, "split", model={"depth": 5, "layout": layout})
    model = create_model(cfg.model)
    images = torch.randn(3, 3, 8, 8)
    expected = model(images)
    parts = [ViTStage(model, blocks) for blocks in stage_blocks(5, 3)]
    x = images
    for part in parts:
        x = part(x)
    assert torch.equal(x, expected)
    names = [name for part in parts for name in part.state_dict()]
    assert sorted(names) == sorted(model.state_dict()) and len(names) == len(set(names))
    assert "blocks.4.mlp.fc1.weight" in parts[2].state_dict() and "head.weight" in parts[2].state_dict()


@pytest.mark.parametrize(("layout", "pool"), [("batch_first", "gap"), ("seq_first", "cls"), ("seq_first", "gap")])
def test_a_stage_sends_contiguous_tokens(tmp_path, layout, pool):
    # Point-to-point sends refuse strided tensors: without a class token the token stream is a transposed view.
    cfg = tiny_config(tmp_path, "contiguous", model={"depth": 2, "layout": layout, "pool": pool})
    model = create_model(cfg.model)
    expected = model(torch.randn(3, 3, 8, 8, generator=torch.Generator().manual_seed(0)))
    first, last = (ViTStage(model, blocks) for blocks in stage_blocks(2, 2))
    tokens = first(torch.randn(3, 3, 8, 8, generator=torch.Generator().manual_seed(0)))
    assert tokens.is_contiguous()
    assert torch.equal(last(tokens), expected)


# ------------------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.depth=2", "parallel.pipeline_stages=3"], "parallel.pipeline_stages=3 must be <= model.depth=2"),
        (["parallel.pipeline_stages=2"], "parallel.strategy=single with parallel.pipeline_stages=2"),
        (["parallel.strategy=zero1", "parallel.pipeline_stages=2"], "parallel.strategy=zero1 with"),
        (
            ["parallel.strategy=ddp", "parallel.pipeline_stages=2", "train.batch_size=10"],
            r"train.batch_size=10 is not divisible by parallel.microbatches=0 \(= 4\)",
        ),
        (
            ["parallel.strategy=ddp", "parallel.pipeline_stages=2", "parallel.microbatches=1"],
            "parallel.microbatches=1 must be >= parallel.pipeline_stages=2 under 1f1b",
        ),
        (
            ["parallel.strategy=ddp", "parallel.pipeline_stages=2", "parallel.pipeline_schedule=interleaved_1f1b"],
            "parallel.pipeline_stages=2 must be even and >= 4",
        ),
        (
            ["parallel.strategy=zero3", "parallel.pipeline_stages=4", "parallel.pipeline_schedule=interleaved_1f1b"],
            "use parallel.strategy=ddp or parallel.pipeline_schedule=1f1b",
        ),
        (["parallel.strategy=ddp", "parallel.pipeline_stages=2", "train.compile=true"], "set train.compile=false"),
        (["parallel.strategy=ddp", "parallel.pipeline_stages=2", "optim.layer_decay=0.7"], "set optim.layer_decay=1"),
        (
            ["parallel.strategy=ddp", "parallel.pipeline_stages=2", "precision.mode=amp_o2"],
            "or amp_o2 with parallel.strategy=zero2 or zero3",
        ),
        (["parallel.strategy=zero3", "parallel.pipeline_stages=2", "precision.mode=pure"], "precision.mode=pure with"),
    ],
)
def test_impossible_pipelines_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides)


def test_a_pipeline_needs_a_multiple_of_its_processes(tmp_path):
    cfg = tiny_config(tmp_path, "alone", model=MODEL, parallel=_pipelined())
    try:
        with pytest.raises(ConfigError, match=r"runs 2 processes per pipeline .* but 1 were launched"):
            Trainer(cfg)
    finally:
        shutdown()
