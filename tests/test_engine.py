"""The engine seam: train.engine picks what sets up, steps and checkpoints the model; DeepSpeed's config mapping."""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed_helpers import losses, tiny_config
from vitrain.cli import main
from vitrain.config import load_config
from vitrain.engine import Trainer
from vitrain.engine.deepspeed import deepspeed_config, resolve_precision
from vitrain.engine.native import NativeEngine
from vitrain.errors import ConfigError


def test_the_native_engine_is_the_default_and_owns_model_optimizer_and_precision(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, "native"))
    assert trainer.cfg.train.engine == "native"
    assert isinstance(trainer.engine, NativeEngine)
    assert trainer.model is trainer.engine.model and trainer.engine.optimizer is not None
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
    assert all(
        torch.equal(state[k], expected[k].to(state[k].device)) and state[k].dtype == torch.float32 for k in expected
    )


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
    # Gradients are averaged in precision.reduce_dtype, not in DeepSpeed's default (the low dtype).
    assert config["communication_data_type"] == "fp32"
    cfg = _ds("precision.mode=amp_o2", "precision.dtype=bf16", "precision.reduce_dtype=bf16")
    assert deepspeed_config(cfg, resolve_precision(cfg, torch.device("cpu")))["communication_data_type"] == "bf16"


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
        # not the native engine's line, which names zero2 as well
        (["parallel.strategy=ddp", "parallel.offload=params"], r"deepspeed needs parallel.strategy=zero3 \(DeepSpeed"),
        (["precision.mode=pure"], r"precision.mode=pure under train.engine=deepspeed .* precision.mode=amp_o2"),
        (["precision.mode=amp_o1", "precision.dtype=fp16"], r"amp_o1 precision.dtype=fp16 .* without loss scaling"),
        (["train.compile=true"], r"train.compile=true under train.engine=deepspeed"),
        (
            ["task.name=face", "precision.mode=amp_o2", "precision.dtype=fp16"],
            r"task.name=face with precision.mode=amp_o2 precision.dtype=fp16 .* use precision.dtype=bf16",
        ),
    ],
)
def test_what_deepspeed_cannot_run_is_refused_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=["train.engine=deepspeed", "parallel.strategy=ddp", *overrides])


def test_an_unknown_engine_is_refused():
    with pytest.raises(ConfigError, match="train.engine"):
        load_config(overrides=["train.engine=megatron"])


def _user_json(tmp_path, config, *overrides: str):
    """A config whose train.deepspeed_config is `config` written as JSON, and the merged DeepSpeed dict on 2 ranks."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    cfg = _ds(f"train.deepspeed_config={path}", "precision.mode=fp32", *overrides)
    return cfg, path


def _merged(cfg, world_size: int = 2):
    return deepspeed_config(cfg, resolve_precision(cfg, torch.device("cpu")), world_size)


def test_a_user_jsons_auto_values_are_filled_from_vitrains_config_and_its_own_keys_pass_through(tmp_path):
    user = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": "auto", "overlap_comm": True, "reduce_bucket_size": 5e7},
        "bf16": {"enabled": "auto"},
        "steps_per_print": 10,
    }
    cfg, _ = _user_json(tmp_path, user, "parallel.strategy=zero2", "train.batch_size=8", "train.accum_steps=3")
    config = _merged(cfg)
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (8, 3)
    assert config["train_batch_size"] == 8 * 3 * 2
    assert config["gradient_clipping"] == cfg.optim.clip_grad_norm
    assert config["zero_optimization"] == {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 5e7}
    assert config["bf16"] == {"enabled": False} and config["fp16"] == {"enabled": False}  # fp32
    assert config["steps_per_print"] == 10  # a setting vitrain only defaults: the file's value wins
    assert config["zero_allow_untested_optimizer"] is True  # vitrain's optimizer needs it, file or not


def test_a_user_jsons_offload_choice_passes_through(tmp_path):
    offload = {"device": "cpu", "pin_memory": False, "ratio": 0.5}
    cfg, _ = _user_json(tmp_path, {"zero_optimization": {"offload_optimizer": offload}}, "parallel.strategy=zero2")
    assert _merged(cfg)["zero_optimization"] == {"stage": 2, "offload_optimizer": offload}


def test_concrete_values_that_agree_with_vitrains_config_are_accepted(tmp_path):
    user = {
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1,
        "train_batch_size": 64,
        "fp16": {"enabled": False},
    }
    cfg, _ = _user_json(tmp_path, user, "train.batch_size=16", "train.accum_steps=2", "optim.clip_grad_norm=1.0")
    config = _merged(cfg)
    assert (config["gradient_accumulation_steps"], config["gradient_clipping"], config["train_batch_size"]) == (
        2,
        1,
        64,
    )


@pytest.mark.parametrize(
    ("user", "overrides", "message"),
    [
        (
            {"gradient_accumulation_steps": 4},
            ["train.accum_steps=2"],
            r"^deepspeed_config gradient_accumulation_steps=4 but train.accum_steps=2; "
            r'set one of them to match or "auto"$',
        ),
        ({"train_micro_batch_size_per_gpu": 32}, ["train.batch_size=16"], r"=32 but train.batch_size=16;"),
        (
            {"train_batch_size": 32},
            ["train.batch_size=16", "train.accum_steps=2"],
            r"train_batch_size=32 but train.batch_size=16 .* = 64;",
        ),
        ({"gradient_clipping": 1.0}, ["optim.clip_grad_norm=0"], r"gradient_clipping=1.0 but optim.clip_grad_norm=0;"),
        ({"zero_optimization": {"stage": 3}}, [], r"zero_optimization.stage=3 but parallel.strategy=ddp \(stage 0\)"),
        ({"bf16": {"enabled": True}}, [], r"bf16.enabled=true but precision.mode=fp32 .* gives false"),
        (
            {"zero_allow_untested_optimizer": False},
            [],
            r"zero_allow_untested_optimizer=false but vitrain passes its own",
        ),
    ],
)
def test_a_user_json_value_that_disagrees_with_vitrains_config_is_refused_naming_both(
    tmp_path, user, overrides, message
):
    cfg, _ = _user_json(tmp_path, user, *overrides)
    with pytest.raises(ConfigError, match=message):
        _merged(cfg)


@pytest.mark.parametrize("section", ["optimizer", "scheduler"])
def test_a_user_jsons_optimizer_or_scheduler_is_refused_since_vitrain_passes_its_own(tmp_path, section):
    cfg, _ = _user_json(tmp_path, {section: {"type": "AdamW"}})
    with pytest.raises(ConfigError, match=rf'has an "{section}" section, but vitrain passes its own .* remove'):
        _merged(cfg)


def test_an_auto_value_vitrain_does_not_fill_is_refused_by_name(tmp_path):
    cfg, _ = _user_json(tmp_path, {"zero_optimization": {"reduce_bucket_size": "auto"}})
    with pytest.raises(ConfigError, match=r'zero_optimization.reduce_bucket_size="auto" is not a value vitrain fills'):
        _merged(cfg)


def test_a_deepspeed_json_needs_the_deepspeed_engine(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text("{}")
    with pytest.raises(ConfigError, match=r"train.deepspeed_config=.* set train.engine=deepspeed"):
        load_config(overrides=[f"train.deepspeed_config={path}"])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, r"is not a file"),
        ("{ not json", r"is not valid JSON \(.*\); fix the file"),
        ("[1]", r"holds a JSON list"),
    ],
)
def test_a_missing_or_malformed_deepspeed_json_is_refused_naming_the_file(tmp_path, text, message):
    path = tmp_path / "ds.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=rf"train.deepspeed_config={path} {message}"):
        _ds(f"train.deepspeed_config={path}")


def test_the_cli_exits_2_with_one_line_for_a_missing_deepspeed_json(tmp_path, capsys):
    args = ["train", "train.engine=deepspeed", "parallel.strategy=ddp", f"train.deepspeed_config={tmp_path}/no.json"]
    assert main(args) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
