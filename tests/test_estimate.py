"""The memory model: ZeRO stage arithmetic, activations with and without checkpointing, devices needed, the CLI."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vitrain.cli import main
from vitrain.config import load_config
from vitrain.errors import ConfigError
from vitrain.models import PRESETS, complexity
from vitrain.models.memory import activation_bytes, devices_needed, estimate, preset_models

REPO = Path(__file__).resolve().parent.parent


def _preset(name):
    return load_config(base={"model": {"preset": name}}).model


BASE = _preset("ViT-B/16")
P = complexity(BASE).params


def test_ddp_holds_sixteen_bytes_per_parameter_in_fp32():
    est = estimate(BASE, devices=8, strategy="ddp")
    assert (est.weights, est.gradients, est.optimizer, est.master) == (4 * P, 4 * P, 8 * P, 0)


def test_amp_o2_holds_fp32_master_weights_and_gradients_beside_the_working_copy():
    est = estimate(BASE, devices=1, strategy="ddp", precision="bf16")
    # bf16 working weights and DDP's bf16 gradient buckets, fp32 moments, the fp32 master weights and the fp32
    # gradients precision.py makes from the bf16 ones at each step: 20 bytes per parameter, not the ZeRO paper's 16.
    assert (est.weights, est.gradients, est.optimizer, est.master, est.master_gradients) == (
        2 * P,
        2 * P,
        8 * P,
        4 * P,
        4 * P,
    )


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_amp_o2_adds_four_bytes_per_parameter_to_ddp_and_zero1(strategy):
    # Measured (audit s19, 26.1M parameters, 2 gloo ranks): fp32 -> bf16 added 98 MiB, +3.9 bytes per parameter,
    # under both; the estimate said -0.7 MiB under ddp and -50 MiB under zero1.
    fp32 = estimate(BASE, devices=2, strategy=strategy)
    bf16 = estimate(BASE, devices=2, strategy=strategy, precision="bf16")
    assert bf16.model_states - fp32.model_states == 4 * P


def test_zero1_shards_only_the_moments_of_the_fp32_master():
    # ZeroRedundancyOptimizer is over the whole fp32 model: each rank holds all of it and all its gradients, and only
    # its own slice's moments.
    est = estimate(BASE, devices=4, strategy="zero1", precision="bf16")
    assert (est.weights, est.gradients, est.optimizer, est.master, est.master_gradients) == (
        2 * P,
        2 * P,
        8 * P // 4,
        4 * P,
        4 * P,
    )


@pytest.mark.parametrize(
    ("strategy", "divided"),
    [
        ("zero1", {"optimizer"}),
        ("zero2", {"optimizer", "gradients", "weights"}),
        ("zero3", {"optimizer", "gradients", "weights"}),
    ],
)
def test_each_zero_stage_divides_its_states_by_the_devices(strategy, divided):
    one = estimate(BASE, devices=4, strategy="ddp")
    sharded = estimate(BASE, devices=4, strategy=strategy)
    for term in ("weights", "gradients", "optimizer"):
        expected = getattr(one, term) // 4 if term in divided else getattr(one, term)
        assert getattr(sharded, term) == expected, term


def test_zero3_gathers_two_blocks_where_zero2_keeps_all_weights():
    zero2 = estimate(BASE, devices=4, strategy="zero2", wrap="block")
    zero3 = estimate(BASE, devices=4, strategy="zero3")
    d, h = 768, 3072
    block = (3 * d * d + 3 * d) + (d * d + d) + (d * h + h) + (h * d + d) + 4 * d  # qkv, proj, fc1, fc2, norms
    # zero2 holds all gathered fp32 weights when backward starts, before any gradient shard exists.
    assert zero2.gathered + zero2.gradients == 4 * P + 4 * (2 * block)
    root = P - 12 * block  # patch embedding, class token, positions, final norm, head
    # fp32: two blocks' weights in flight, one block's gradients plus its reduce-scatter buffer, the root unit.
    assert zero3.gathered == 4 * (2 * block + 2 * block + root)


def test_the_default_wrap_is_what_a_run_with_wrap_auto_uses():
    # parallel.wrap=auto without autotune (models/plan.py auto_wrap): the whole model under zero2, blocks under zero3.
    assert estimate(BASE, devices=4, strategy="zero2") == estimate(BASE, devices=4, strategy="zero2", wrap="model")
    assert estimate(BASE, devices=4, strategy="zero3") == estimate(BASE, devices=4, strategy="zero3", wrap="block")


@pytest.mark.parametrize("config", [None, "vit-huge-fsdp"])  # the recipe: zero3, wrap=block
def test_cli_estimates_zero2_with_the_wrap_auto_gives_it_and_says_so(config, capsys, tmp_path):
    # Audit s19: `--strategy zero2` was estimated with block units, which a zero2 run with wrap=auto does not use.
    command = ["estimate", "ViT-B/16", "--devices", "2", "--strategy", "zero2", "--batch", "1"]
    if config:
        recipe = tmp_path / "recipe.yaml"
        recipe.write_text("model: {preset: vit_base_patch16}\nparallel: {strategy: zero3, wrap: auto}\n")
        command += ["--config", str(recipe)]
    assert main(command) == 0
    out = capsys.readouterr().out
    assert "wrap=model (parallel.wrap=auto without autotune)" in out
    gathered = estimate(BASE, devices=2, strategy="zero2", wrap="model").gathered
    assert f"{'FSDP units in flight':<22}{gathered / 2**30:>10.2f} GiB" in out


@pytest.mark.parametrize(("precision", "per_param"), [("fp32", 14), ("bf16", 12)])
@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_one_fsdp_unit_frees_its_weights_before_its_reduce_scatter_buffer(strategy, precision, per_param):
    # wrap=model, 2 ranks: fp32 shards 2 + moments 4, then at backward's end the whole gathered model (fp32 4, bf16 2)
    # and its unsharded gradients (4 or 2), or, once FSDP2 has resharded, those gradients and the fp32 buffer (4)
    # they are reduce-scattered from. Measured (26.1M parameters, 2 gloo ranks, zero2): fp32 387.3 MiB, bf16
    # 341.2 MiB per rank, the per-process overhead (~37 MiB) above 14 and 12 bytes per parameter; 18 and 14 before.
    est = estimate(BASE, devices=2, strategy=strategy, wrap="model", precision=precision)
    assert est.model_states == per_param * P


def test_sublayer_wrap_gathers_less_than_block_wrap():
    block = estimate(BASE, devices=2, strategy="zero3", wrap="block").gathered
    sublayer = estimate(BASE, devices=2, strategy="zero3", wrap="sublayer").gathered
    d, h = 768, 3072
    mlp = (d * h + h) + (h * d + d)  # the larger of a block's two units (attention has 4d^2 + 4d)
    root = P - 12 * ((3 * d * d + 3 * d) + (d * d + d) + mlp + 4 * d)
    # fp32: two MLP units' weights in flight, one unit's gradients plus its reduce-scatter buffer, the root unit.
    assert sublayer == 4 * (2 * mlp + 2 * mlp + root)
    assert sublayer < 0.7 * block


def test_offload_moves_the_sharded_states_to_the_host():
    est = estimate(BASE, devices=4, strategy="zero3", offload=True)
    assert est.weights == est.gradients == est.optimizer == 0
    assert est.host_bytes == 16 * P // 4
    # zero2 holds every gathered weight in device memory when backward starts, and no gradient shard there to
    # stand for part of them: the shards are in host memory.
    assert estimate(BASE, devices=4, strategy="zero2", wrap="block", offload=True).gathered > 4 * P


def test_checkpointing_keeps_a_fraction_of_the_activations():
    full = activation_bytes(BASE, batch=32, ac=False, bytes_per_element=4)
    kept = activation_bytes(BASE, batch=32, ac=True, bytes_per_element=4)
    assert kept < full / 5
    assert activation_bytes(BASE, batch=64, ac=False, bytes_per_element=4) == 2 * full


def _block_and_outside(cfg, batch):
    """fp32 bytes of one block's saved activations, of one block's input and of everything outside the blocks."""
    full = activation_bytes(cfg, batch=batch, ac=False, bytes_per_element=4)
    block = full - activation_bytes(dataclasses.replace(cfg, depth=cfg.depth - 1), batch, False, 4)
    block_input = 4 * batch * (cfg.num_patches + 1) * cfg.width  # the class token beside the patches
    return block, block_input, full - cfg.depth * block


@pytest.mark.parametrize(
    ("every_k", "kept", "recomputed"),
    [
        (1, 1, 12),  # every block: the inputs, and one block's tensors while it is recomputed
        (4, 9, 3),  # blocks 0, 4, 8: nine blocks keep theirs; backward frees 9-11 before block 8 is recomputed
        (11, 11, 2),  # blocks 0, 11: block 11 is recomputed first, beside the ten kept blocks
    ],
)
def test_checkpointing_every_kth_block_keeps_the_others_activations(every_k, kept, recomputed):
    block, block_input, outside = _block_and_outside(BASE, 32)
    expected = outside + kept * block + recomputed * block_input
    assert activation_bytes(BASE, batch=32, ac=True, bytes_per_element=4, every_k=every_k) == expected
    est = estimate(BASE, devices=2, strategy="zero3", ac=True, batch=32, checkpoint_every_k=every_k)
    assert est.activations == expected


def test_cli_counts_a_configs_every_k_checkpointing(tmp_path, capsys):
    # Audit s19: parallel.activation_checkpointing=every_k was estimated as checkpointing every block.
    config = tmp_path / "everyk.yaml"
    config.write_text(
        "model: {preset: vit_base_patch16}\n"
        "parallel: {strategy: zero3, activation_checkpointing: every_k, checkpoint_every_k: 4}\n"
        "train: {batch_size: 32}\n"
    )
    assert main(["estimate", "ViT-B/16", "--config", str(config), "--devices", "8"]) == 0
    out = capsys.readouterr().out
    assert "ac=True" in out and "checkpoint_every_k=4" in out
    block, block_input, outside = _block_and_outside(BASE, 32)
    gib = (outside + 9 * block + 3 * block_input) / 2**30
    assert f"{'activations':<22}{gib:>10.2f} GiB" in out
    # --ac asks for every block, over the config's every_k (review s19: the config's k was kept)
    assert main(["estimate", "ViT-B/16", "--config", str(config), "--devices", "8", "--ac"]) == 0
    out = capsys.readouterr().out
    assert "ac=True" in out and "checkpoint_every_k" not in out
    gib = (outside + block + 12 * block_input) / 2**30  # every block: as every_k=1
    assert f"{'activations':<22}{gib:>10.2f} GiB" in out


def test_devices_needed_is_the_smallest_count_that_fits():
    big = _preset("ViT-120B/14")
    setting = {"strategy": "zero3", "ac": True, "precision": "bf16", "build": "sharded"}
    n = devices_needed(big, 80 * 2**30, **setting)
    assert estimate(big, devices=n, **setting).peak <= 80 * 2**30 < estimate(big, devices=n - 1, **setting).peak
    assert devices_needed(big, 80 * 2**30, strategy="ddp") is None


def test_building_the_whole_model_on_each_process_caps_what_sharding_can_fit():
    big = _preset("ViT-22B/14")
    est = estimate(big, devices=1024, strategy="zero3", ac=True, precision="bf16")
    assert est.build == 4 * complexity(big).params  # the fp32 model, before fully_shard
    assert est.peak == est.build > est.total
    assert devices_needed(big, 80 * 2**30, strategy="zero3", ac=True, precision="bf16") is None


def test_unknown_strategy_is_refused():
    with pytest.raises(ConfigError, match="strategy=zero4 is unknown"):
        estimate(BASE, devices=2, strategy="zero4")


def test_cli_prints_every_preset_up_to_120b_with_devices_needed(capsys):
    setting = ["--strategy", "zero3", "--ac", "--precision", "bf16", "--build", "sharded"]
    assert main(["estimate", "--devices", "8", *setting]) == 0
    out = capsys.readouterr().out
    assert "devices@80GiB" in out
    for preset in PRESETS.values():  # all but MViTv2, whose stages it does not model (tests/test_mvit.py)
        assert (preset.alias in out) != bool(preset.stages)
    last = out.strip().splitlines()[-1].split()
    assert last[0] == "ViT-120B/14" and int(last[-1]) > 8


def test_cli_breaks_one_preset_down(capsys):
    assert main(["estimate", "ViT-B/16", "--devices", "2", "--strategy", "zero3", "--memory", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "optimizer states" in out and "devices of 0.5 GiB needed: 5" in out


@pytest.mark.slow
def test_estimate_is_within_ten_percent_of_measured_peak_for_vit_b16(tmp_path):
    """Runs benchmarks/memory_per_rank.py (2 gloo ranks, ~3 minutes); run it under the timing lock."""
    results = tmp_path / "memory.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "memory_per_rank.py"),
            "--strategies",
            "ddp",
            "zero3",
            "--wrap",
            "sublayer",
            "--results",
            str(results),
            "--out-dir",
            str(tmp_path),
        ],
        check=True,
        env=env,
        timeout=900,
    )
    rows = {r["strategy"]: r for r in json.loads(results.read_text())["rows"]}
    for row in rows.values():
        assert abs(row["error"]) <= 0.10, row["strategy"]
    # The issue's bar: zero3's per-rank peak at most 0.55x DDP's with 2 ranks (attention and MLP as FSDP units).
    assert rows["zero3"]["measured_peak_bytes"] <= 0.55 * rows["ddp"]["measured_peak_bytes"]


def test_fsdp_mixed_precision_keeps_fp32_shards_and_gathers_in_bf16():
    fp32 = estimate(BASE, devices=4, strategy="zero3")
    bf16 = estimate(BASE, devices=4, strategy="zero3", precision="bf16")
    # The fp32 shards are the master weights: no second copy, the same 16 bytes per parameter / N.
    assert (bf16.weights, bf16.gradients, bf16.optimizer, bf16.master) == (P, P, 2 * P, 0)
    assert bf16.model_states - bf16.gathered == fp32.model_states - fp32.gathered
    assert bf16.gathered < fp32.gathered


def test_each_pipeline_stage_holds_a_quarter_of_the_blocks():
    one = estimate(BASE, devices=1, strategy="ddp")
    staged = estimate(BASE, devices=4, strategy="ddp", pipeline_stages=4)
    d, h = 768, 3072
    block = (3 * d * d + 3 * d) + (d * d + d) + (d * h + h) + (h * d + d) + 4 * d
    head = 2 * d + d * 1000 + 1000  # the last stage: 3 blocks, final norm and head (larger than the embeddings)
    assert staged.weights == 4 * (3 * block + head)
    assert staged.build == one.weights  # each process builds the whole model before keeping its stage


def test_the_peak_adds_the_process_baseline_to_training_or_build():
    est = estimate(BASE, devices=4, strategy="zero3", baseline_bytes=2**28)
    assert est.peak == 2**28 + max(est.total, est.build)
    assert estimate(BASE, devices=4, strategy="zero3", build="sharded").build == 0


def test_cli_reads_a_recipes_settings_for_a_grid_of_presets_and_devices(capsys):
    command = ["estimate", "--config", "vit-huge-fsdp", "--devices", "64", "1024", "--memory", "40", "80"]
    assert main([*command, "--from", "ViT-H/14"]) == 0
    out = capsys.readouterr().out
    assert "strategy=zero3" in out and "ac=True" in out and "batch=32" in out and "precision=bf16" in out
    assert "build=sharded" in out  # the recipe sets parallel.sharded_init
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("ViT-")}
    assert list(rows)[0] == "ViT-H/14" and "ViT-B/16" not in rows
    assert "ViViT" not in out  # the video presets, listed among the image ones, are another kind
    assert rows["ViT-120B/14"][-1] == "40" and rows["ViT-120B/14"][3] == "80"  # 1024 GPUs: 40 GB; 64: 80 GB


def test_presets_from_one_keep_to_its_kind():
    assert list(preset_models("ViT-G/14")) == ["ViT-G/14", "ViT-10B/14", "ViT-22B/14", "ViT-60B/14", "ViT-120B/14"]
    assert list(preset_models("ViViT-S/16x2")) == ["ViViT-S/16x2", "ViViT-B/16x2"]
    assert "ViViT-Ti/16x2" in preset_models() and "ViT-Ti/16" in preset_models()  # without --from: every preset


def test_cli_names_the_largest_model_that_fits(capsys):
    base = ["--devices", "4", "--memory", "5", "--baseline-gib", "0.33", "--image-size", "32", "--patch-size", "16"]
    assert main(["estimate", "--largest", "--strategy", "ddp", *base]) == 0
    assert "width 1024, depth 24" in capsys.readouterr().out  # ViT-L/16's shape: 16 bytes per parameter in 4.67 GiB


def test_a_flag_overrides_the_recipes_sharded_build(capsys):
    command = [
        "estimate",
        "--config",
        "vit-huge-fsdp",
        "--devices",
        "64",
        "1024",
        "--memory",
        "80",
        "--from",
        "ViT-120B/14",
    ]
    assert main([*command, "--build", "whole"]) == 0
    out = capsys.readouterr().out
    assert "build=whole" in out and out.splitlines()[2].split()[-1] == "-"  # 120B never fits with a whole build


def test_ema_holds_an_fp32_copy_of_the_weights_on_every_rank():
    # train.ema (vitrain/engine/ema.py): a deep copy of the model in fp32, whole on every rank (single, ddp, zero1).
    for strategy, precision in [("single", "fp32"), ("ddp", "bf16"), ("zero1", "bf16")]:
        plain = estimate(BASE, devices=4, strategy=strategy, precision=precision)
        averaged = estimate(BASE, devices=4, strategy=strategy, precision=precision, ema=True)
        assert averaged.ema == averaged.model_states - plain.model_states == 4 * P
    with pytest.raises(ConfigError, match="train.ema"):
        estimate(BASE, devices=4, strategy="zero3", ema=True)  # the engine refuses it too


def test_cli_counts_a_configs_ema(tmp_path, capsys):
    config = tmp_path / "ema.yaml"
    config.write_text("parallel: {strategy: ddp}\ntrain: {ema: 0.999}\n")
    assert main(["estimate", "ViT-B/16", "--config", str(config), "--devices", "2"]) == 0
    out = capsys.readouterr().out
    assert "ema=True" in out and f"{'EMA weights (fp32)':<22}{4 * P / 2**30:>10.2f} GiB" in out


def test_cli_refuses_a_deepspeed_config_it_does_not_model(capsys):
    # DeepSpeed's ZeRO partitions other states than the native engine (and offloads the optimizer on its own).
    assert main(["estimate", "ViT-B/16", "--config", "face-deepspeed", "--devices", "2"]) == 2
    assert "train.engine=deepspeed" in capsys.readouterr().err


@pytest.mark.parametrize("named", [["ViT-B/16"], ["--largest"]])
def test_cli_refuses_a_start_where_no_table_of_presets_is_printed(named, capsys):
    assert main(["estimate", *named, "--from", "ViT-L/16"]) == 2
    err = capsys.readouterr().err
    assert "--from starts the table of presets" in err and len(err.strip().splitlines()) == 1
