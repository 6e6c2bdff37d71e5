"""The engine seam: train.engine picks what sets up, steps and checkpoints the model; DeepSpeed's config mapping."""

from __future__ import annotations

import pytest
import torch

from tests.distributed_helpers import losses, tiny_config
from vitrain.config import load_config
from vitrain.engine import Trainer
from vitrain.engine.deepspeed_engine import deepspeed_config, resolve_precision
from vitrain.engine.engines import NativeEngine
from vitrain.errors import ConfigError


def test_the_native_engine_is_the_default_and_owns_model_optimizer_and_precision(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, "native"))
    assert trainer.cfg.train.engine == "native"
    assert isinstance(trainer.engine, NativeEngine)
    assert trainer.model is trainer.engine.model and trainer.optimizer is trainer.engine.optimizer
    assert trainer.precision is trainer.engine.precision


def test_the_native_engine_steps_the_trainer_and_records_its_name(tmp_path):
    cfg = tiny_config(tmp_path, "native")
    summary = Trainer(cfg).fit()
    assert summary["engine"] == "native" and summary["steps"] == 5
    assert len({round(v, 6) for v in losses(cfg.run_dir).values()}) > 1  # the engine's steps moved the weights


def test_the_native_engines_full_state_dict_is_the_fp32_model(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, "native"))
    state = trainer.engine.full_state_dict()
    expected = trainer.model.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], expected[k]) and state[k].dtype == torch.float32 for k in expected)


def _ds(*overrides: str):
    return load_config(overrides=["train.engine=deepspeed", "parallel.strategy=ddp", *overrides])


@pytest.mark.parametrize(("strategy", "stage"), [("ddp", 0), ("zero1", 1), ("zero2", 2), ("zero3", 3)])
def test_parallel_strategy_picks_the_zero_stage(strategy, stage):
    cfg = _ds(f"parallel.strategy={strategy}", "precision.mode=fp32")
    config = deepspeed_config(cfg, resolve_precision(cfg, torch.device("cpu")))
    assert config["zero_optimization"] == {"stage": stage}
    assert "bf16" not in config and "fp16" not in config


@pytest.mark.parametrize("clip", [0.0, 1.0, 2.5])
def test_gradient_clipping_is_always_written_from_optim_clip_grad_norm(clip):
    cfg = _ds(f"optim.clip_grad_norm={clip}", "precision.mode=fp32")
    assert deepspeed_config(cfg, resolve_precision(cfg, torch.device("cpu")))["gradient_clipping"] == clip


def test_batch_size_and_accumulation_map_to_deepspeeds_micro_batch_and_accumulation_steps():
    cfg = _ds("train.batch_size=24", "train.accum_steps=3", "precision.mode=fp32")
    config = deepspeed_config(cfg, resolve_precision(cfg, torch.device("cpu")))
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (24, 3)


def test_amp_o2_bf16_maps_to_deepspeed_bf16():
    cfg = _ds("precision.mode=amp_o2", "precision.dtype=bf16")
    config = deepspeed_config(cfg, resolve_precision(cfg, torch.device("cpu")))
    assert config["bf16"] == {"enabled": True} and "fp16" not in config


def test_amp_o2_fp16_maps_to_dynamic_loss_scaling_from_the_precision_config():
    cfg = _ds("precision.mode=amp_o2", "precision.dtype=fp16", "precision.init_scale=1024", "precision.min_scale=4")
    config = deepspeed_config(cfg, resolve_precision(cfg, torch.device("cpu")))
    assert config["fp16"] == {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 10,
        "loss_scale_window": cfg.precision.growth_interval,
        "min_loss_scale": 4.0,
        "hysteresis": 1,
    }


def test_an_init_scale_that_is_no_power_of_two_is_refused_with_the_nearest_one():
    cfg = _ds("precision.mode=amp_o2", "precision.dtype=fp16", "precision.init_scale=1000")
    with pytest.raises(ConfigError, match=r"precision.init_scale=1000 must be a power of 2 .* use 1024"):
        deepspeed_config(cfg, resolve_precision(cfg, torch.device("cpu")))


def test_offload_maps_to_deepspeeds_cpu_offload():
    cfg = _ds("parallel.strategy=zero2", "parallel.offload=optimizer", "precision.mode=fp32")
    zero = deepspeed_config(cfg, resolve_precision(cfg, torch.device("cpu")))["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "cpu" and "offload_param" not in zero
    cfg = _ds("parallel.strategy=zero3", "parallel.offload=params", "precision.mode=fp32")
    zero = deepspeed_config(cfg, resolve_precision(cfg, torch.device("cpu")))["zero_optimization"]
    assert zero["offload_param"]["device"] == "cpu" and zero["stage"] == 3


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.strategy=single"], r"parallel.strategy=single under train.engine=deepspeed.*parallel.strategy=ddp"),
        (["parallel.strategy=zero2", "parallel.offload=params"], r"parallel.offload=params .* parallel.strategy=zero3"),
        (["precision.mode=pure"], r"precision.mode=pure under train.engine=deepspeed .* precision.mode=amp_o2"),
        (["precision.mode=amp_o1", "precision.dtype=fp16"], r"amp_o1 precision.dtype=fp16 .* without loss scaling"),
        (["train.compile=true"], r"train.compile=true under train.engine=deepspeed"),
    ],
)
def test_what_deepspeed_cannot_run_is_refused_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=["train.engine=deepspeed", "parallel.strategy=ddp", *overrides])


def test_an_unknown_engine_is_refused():
    with pytest.raises(ConfigError, match="train.engine"):
        load_config(overrides=["train.engine=megatron"])
