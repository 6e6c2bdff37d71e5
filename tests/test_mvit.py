"""MViTv2 (model.name=mvit): its published size, its stage shapes, its exact cost, and training on clips."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch
from safetensors.torch import save_file
from torch.utils.flop_counter import FlopCounterMode

from tests.conftest import run_cli
from tests.distributed_helpers import losses, run_two_ranks, tiny_config, whole_and_resumed
from tests.video_helpers import make_clip_tree
from vitrain.config import CONFIG_DIR, load_config
from vitrain.errors import CheckpointError, ConfigError
from vitrain.models import build_model, config_complexity, count_parameters, plan_of
from vitrain.models.mvit import MultiscaleBlock, block_shapes, offsets, pool_tokens
from vitrain.weights import load_pretrained

# A tiny MViT: 4-frame clips of 16 px in 3x7x7 / 2x4x4 tubes (a 2x4x4 grid), three stages of one block each.
TINY = {"name": "mvit", "stages": [1, 1, 1], "depth": 3, "width": 16, "heads": 1, "mlp_dim": 64, "patch_size": 4,
        "image_size": 16, "num_frames": 4, "tubelet_size": 2, "in_chans": 3, "num_classes": 2}  # fmt: skip


def _model_cfg(**fields):
    return load_config(base={"model": {**TINY, **fields}}).model


def _flops(model, clips) -> int:
    with FlopCounterMode(display=False) as counter:
        model(clips)
    return counter.get_total_flops()


def test_mvitv2_small_has_the_published_parameters_and_multiply_adds():
    # torchvision's MViT_V2_S_Weights.KINETICS400_V1 (ported from the paper's SlowFast release): num_params 34,537,744
    # and 64.224 GMACs ("_ops") for a 16-frame 224 px clip, Kinetics-400's 400 classes (Li et al. 2022, Table 5: 34.5M).
    cfg = load_config(overrides=["model.preset=mvitv2_small", "model.num_classes=400"]).model
    assert (cfg.name, cfg.stages, cfg.depth, cfg.pool) == ("mvit", (1, 2, 11, 2), 16, "cls")
    with torch.device("meta"):
        model = build_model(cfg)
    cost = config_complexity(cfg)
    assert count_parameters(model) == cost.params == 34_537_744
    assert round(cost.macs / 1e9, 3) == 64.224
    assert _flops(model, torch.empty(1, 48, 224, 224, device="meta")) == cost.flops  # torch's own count agrees


def test_mvitv2_base_has_the_papers_size_on_32_frame_clips():
    # Li et al. 2022, Table 5 (Kinetics-400): MViTv2-B 32x3, 51.2M parameters and 225 GFLOPs (multiply-adds) per view.
    cfg = load_config(overrides=["model.preset=mvitv2_base", "model.num_classes=400"]).model
    assert (cfg.stages, cfg.depth, cfg.num_frames, cfg.drop_path, cfg.dropout) == ((2, 3, 16, 3), 24, 32, 0.3, 0.5)
    cost = config_complexity(cfg)
    assert round(cost.params / 1e6, 1) == 51.2 and abs(cost.macs / 1e9 - 225) < 0.6
    with torch.device("meta"):
        assert count_parameters(build_model(cfg)) == cost.params


def test_the_stages_pool_queries_once_each_and_attend_to_the_last_stages_grid():
    shapes = block_shapes(load_config(overrides=["model.preset=mvitv2_small"]).model)
    assert [s.dim_out for s in shapes] == [96] + [192] * 2 + [384] * 11 + [768] * 2
    assert [s.heads for s in shapes] == [1] + [2] * 2 + [4] * 11 + [8] * 2 and {s.head_dim for s in shapes} == {96}
    assert [s.dim_in for s in shapes][:4] == [96, 96, 192, 192] and shapes[14].dim_in == 384
    assert [s.grid_q[1] for s in shapes] == [56] + [28] * 2 + [14] * 11 + [7] * 2
    assert [i for i, s in enumerate(shapes) if s.q_stride == 2] == [1, 3, 14]  # each later stage's first block
    # Keys and values: 7x7 everywhere but in a stage's first block, which reads the grid before its own pooling.
    assert [s.grid_kv[1] for s in shapes] == [7, 14, 7, 14] + [7] * 10 + [14, 7]
    assert {s.grid_q[0] for s in shapes} == {8} and shapes[14].table_size == 27  # 2 x max(7, 14) - 1


@pytest.mark.parametrize(("image_size", "stages"), [(40, [1, 1, 1]), (16, [1, 1, 1]), (32, [2, 1])])
def test_its_cost_is_exact_where_the_grid_does_not_halve_evenly(image_size, stages):
    # 40 px: a 10x10 grid pools to 5x5, then 3x3; every relative row stays inside its table.
    cfg = _model_cfg(image_size=image_size, stages=stages, depth=sum(stages))
    model = build_model(cfg)
    cost = config_complexity(cfg)
    assert count_parameters(model) == cost.params
    assert _flops(model, torch.randn(2, 12, image_size, image_size)) == 2 * cost.flops
    for s in block_shapes(cfg):
        for q, k, rows in (
            (s.grid_q[1], s.grid_kv[1], s.table_size),
            (s.grid_q[0], s.grid_kv[0], 2 * s.grid_in[0] - 1),
        ):
            table = offsets(q, k)
            assert table.shape == (q, k) and 0 <= table.min() and table.max() < rows


def test_sdpa_and_manual_attention_compute_the_same_function():
    torch.manual_seed(0)
    manual = build_model(_model_cfg(attention="manual", image_size=32))
    sdpa = build_model(_model_cfg(attention="sdpa", image_size=32))
    sdpa.load_state_dict(manual.state_dict())
    clips = torch.randn(3, 12, 32, 32)
    a, b = manual(clips), sdpa(clips)
    a.sum().backward()
    b.sum().backward()
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(manual.named_parameters(), sdpa.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    # The class token is neither pooled nor given relative positions: the logits depend on where things are.
    shifted = clips.roll(shifts=4, dims=-1)
    assert not torch.allclose(manual(shifted), manual(clips))


def test_its_blocks_are_the_sharding_and_checkpointing_units():
    model = build_model(_model_cfg())
    plan = plan_of(model, "block")
    assert plan.checkpoint_units == list(model.blocks) and all(isinstance(b, MultiscaleBlock) for b in plan.shard_units)
    shape = plan.block_input_shape(5)
    assert shape == (5, 1 + 2 * 4 * 4, 16) and model.blocks[0](torch.randn(shape)).shape == shape
    assert len(plan.norms) == 3 * 5 + 1  # per block: two norms and one after each of the q, k, v poolings; the last


def test_the_precision_probe_times_one_block_of_each_shape_and_weighs_it_by_their_number(monkeypatch):
    # Stages of 2 and 3 blocks: the first stage's two are alike; the second's first pools the grid, its others alike.
    from vitrain.engine import native
    from vitrain.parallel.distributed import DistInfo

    cfg = load_config(base={"model": {**TINY, "stages": [2, 3], "depth": 5}, "parallel": {"wrap": "block"}})
    model = build_model(cfg.model)
    probes = plan_of(model, "block").probes(4)
    assert [(list(model.blocks).index(b), shape, n) for b, shape, n in probes] == [
        (0, (4, 1 + 2 * 4 * 4, 16), 2), (2, (4, 1 + 2 * 4 * 4, 16), 1), (3, (4, 1 + 2 * 2 * 2, 32), 2)
    ]  # fmt: skip
    for (block, shape, _), width in zip(probes, (16, 32, 32), strict=True):
        assert block(torch.randn(shape)).shape[-1] == width  # each takes the input it is given
    seconds = {0: 1.0, 2: 4.0, 3: 10.0}  # a block's time in every mode, by its index
    monkeypatch.setattr(native, "time_block_modes", lambda block, shape, **_: dict.fromkeys(
        ("fp32", "amp_o1"), seconds[list(model.blocks).index(block)]))  # fmt: skip
    timed = native.time_modes(cfg, model, DistInfo(0, 1, 0, torch.device("cpu")))
    assert timed == {"fp32": (2 * 1.0 + 4.0 + 2 * 10.0) / 5, "amp_o1": (2 * 1.0 + 4.0 + 2 * 10.0) / 5}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"depth": 4}, "model.depth=4 must equal the blocks of model.stages=[1, 1, 1] (3)"),
        ({"stages": [], "depth": 3}, "model.stages=[] must give each stage's blocks"),
        ({"image_size": 8}, "model.image_size=8 gives a 2x2 grid; 3 stages halve it 2 times"),
        ({"pool": "gap"}, "classifies from its class token"),
        ({"name": "vit", "num_frames": 1, "tubelet_size": 1}, "model.stages=[1, 1, 1] are MViTv2's"),
        ({"heads": 0}, "model.heads=0 must be positive"),
        ({"tubelet_size": 0}, "model.tubelet_size=0 must be positive"),
        ({"drop_path": 1.0}, "model.drop_path=1.0 must be in [0, 1)"),
        ({"layout": "seq_first"}, "leave model.layout, pos_embed, patch_embed and stem_channels at their defaults"),
        ({"pos_embed": "sincos"}, "leave model.layout, pos_embed, patch_embed and stem_channels at their defaults"),
    ],
)
def test_a_model_section_it_cannot_build_is_one_line_naming_the_field(fields, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as refused:
        load_config(base={"model": {**TINY, **fields}})  # the config's validation asks the model section
    assert "\n" not in str(refused.value)


def test_progressive_resizing_is_refused_for_its_fixed_grids():
    with pytest.raises(ConfigError, match=re.escape("model.name=mvit pools grids built for model.image_size=16")):
        load_config(base={"model": TINY, "data": {"min_size": 8}})


def test_naming_a_preset_on_the_command_line_replaces_the_recipes_stages():
    recipe = CONFIG_DIR / "video-weizmann-mvit.yaml"
    big = load_config(recipe, ["model.preset=mvitv2_small"]).model
    assert (big.stages, big.depth, big.width, big.num_frames, big.dropout) == ((1, 2, 11, 2), 16, 96, 16, 0.5)
    assert big.drop_path == 0.2  # the preset's stochastic depth, not the recipe's 0.1 for its 4 blocks
    assert load_config(recipe, ["model.preset=mvitv2_base", "model.drop_path=0.05"]).model.drop_path == 0.05
    from_vivit = load_config(CONFIG_DIR / "video-weizmann.yaml", ["model.preset=mvitv2_small"]).model
    assert (from_vivit.name, from_vivit.pos_embed, from_vivit.pool) == ("mvit", "learned", "cls")  # not its sincos
    vivit = load_config(recipe, ["model.preset=video_vit_small_patch16"]).model
    assert (vivit.name, vivit.stages, vivit.width) == ("video_vit", (), 384)


def test_relative_rows_follow_the_papers_offsets_scaled_to_the_finer_grid():
    # Query i, key j on grids of q and k positions: row (i * max(k/q, 1) - j * max(q/k, 1)) shifted by the largest
    # key offset, so that rows run from 0 (Li et al. 2022, eq. 4 with the pooled grids' spacing).
    assert offsets(3, 3).tolist() == [[2, 1, 0], [3, 2, 1], [4, 3, 2]]
    assert offsets(4, 2).tolist() == [[2, 0], [3, 1], [4, 2], [5, 3]]  # keys pooled 2x: each key step is 2 rows
    assert offsets(2, 4).tolist() == [[3, 2, 1, 0], [5, 4, 3, 2]]  # queries pooled 2x


def test_muon_leaves_the_relative_position_tables_to_adamw():
    from vitrain.optim.optimizers import uses_muon

    model = build_model(_model_cfg())
    muon = {name for name, p in model.named_parameters() if uses_muon(name, p)}
    assert "blocks.0.attn.qkv.weight" in muon and "blocks.2.mlp.fc2.weight" in muon
    assert not any("rel_pos" in name for name in muon)


def test_pooling_keeps_the_class_token_out_of_the_grid():
    tokens = torch.randn(2, 3, 1 + 2 * 4 * 4, 5)
    seen = []

    def pool(grid):
        seen.append(grid.shape)
        return grid[:, :, :, ::2, ::2] * 0 + 7

    pooled, grid = pool_tokens(tokens, pool, (2, 4, 4))
    assert seen == [(6, 5, 2, 4, 4)] and grid == (2, 2, 2)  # (batch x heads, channels, t, h, w): no class token
    assert torch.equal(pooled[:, :, 0], tokens[:, :, 0]) and (pooled[:, :, 1:] == 7).all()


@pytest.mark.parametrize("drop_path", [0.0, 0.2])
def test_the_memory_model_counts_what_autograd_keeps(drop_path):
    from vitrain.engine.autotune import _memory_check
    from vitrain.models.memory import PRECISIONS

    cfg = _model_cfg(image_size=32, num_frames=8, drop_path=drop_path)
    model = build_model(cfg).train()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randn(3, 24, 32, 32))
    counted = config_complexity(cfg).activations * 3 * 4  # fp32
    assert 0.95 < counted / sum(kept.values()) < 1.05
    # Autotune's memory check asks the same count: weights, gradients, AdamW's moments and these activations.
    full = load_config(base={"model": {**TINY, "image_size": 32, "num_frames": 8}, "train": {"batch_size": 3}})
    need = _memory_check(full, None)[1]("fp32")
    per_param = sum(PRECISIONS["fp32"][:5])
    cost = config_complexity(full.model)
    assert need == cost.params * per_param + cost.activations * 3 * 4


def test_estimate_breaks_down_an_mvit_with_whole_weights_and_refuses_what_it_does_not_model():
    from vitrain.models.memory import estimate

    cfg = load_config(overrides=["model.preset=mvitv2_small"]).model
    cost = config_complexity(cfg)
    ddp = estimate(cfg, devices=8, strategy="ddp", batch=4, precision="bf16")
    assert (ddp.weights, ddp.master, ddp.optimizer) == (cost.params * 2, cost.params * 4, cost.params * 8)
    assert ddp.activations == cost.activations * 4 * 2  # four clips in bf16
    zero1 = estimate(cfg, devices=8, strategy="zero1", batch=4, precision="bf16")
    assert zero1.optimizer == cost.params * 8 // 8 and zero1.total == ddp.total - ddp.optimizer + zero1.optimizer
    done = run_cli(
        "estimate", "mvitv2_small", "--strategy", "zero1", "--devices", "8", "--batch", "64", "--memory", "16"
    )
    assert done.returncode == 0 and "optimizer states" in done.stdout and "activations" in done.stdout, done.stderr
    assert (
        "needed: none suffice with whole weights: a smaller batch, or measure other layouts with `vitrain bench run "
        "model.preset=mvitv2_small model.image_size=224" in done.stdout
    )
    done = run_cli("estimate", "mvitv2_small", "--devices", "1", "8")  # ddp where no strategy is given; this preset
    assert "strategy=ddp" in done.stdout and done.stdout.count("\nMViTv2-S         0.03B") == 1, done.stdout
    done = run_cli("estimate", "mvitv2_small", "--largest", "--devices", "8")  # the ViT ladder: its own default
    assert done.returncode == 0 and "strategy=zero3" in done.stdout, done.stdout + done.stderr
    with pytest.raises(ConfigError, match=re.escape("(asked: strategy=zero3, ac=False, pipeline_stages=1)")):
        estimate(cfg, devices=8, strategy="zero3")
    with pytest.raises(ConfigError, match=re.escape("(asked: strategy=ddp, ac=True, pipeline_stages=1)")):
        estimate(cfg, devices=8, strategy="ddp", ac=True)


def test_the_cli_trains_evaluates_resumes_and_exports_an_mvit_and_estimate_refuses_what_it_cannot_model(tmp_path):
    make_clip_tree(tmp_path / "clips")
    (tmp_path / "frames-run").mkdir()  # a finished image baseline's run folder, named relative to where it trains
    (tmp_path / "frames-run" / "summary.json").write_text(json.dumps({"val_video_top1": 0.25}))
    model = [f"model.{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in TINY.items()]
    common = ["task.name=video", "task.eval_clips=2", "task.baseline_run=frames-run", "data.source=video",
              "data.root=clips", "data.video_frames=true", "data.val_match=actor3_", "data.decode_workers=1",
              "train.batch_size=4", "train.max_steps=4", "train.threads=1", "log.progress=false",
              f"log.out_dir={tmp_path / 'runs'}", "name=mvit", "precision.mode=amp_o2",
              "parallel.activation_checkpointing=block"]  # fmt: skip
    done = run_cli("train", *model, *common, cwd=tmp_path)  # data.root relative to the folder it trains in
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "runs" / "mvit" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["val_videos"] == 4 and 0.0 <= summary["val_video_top1"] <= 1.0
    assert "GFLOPs/clip" in done.stderr
    done = run_cli("eval", str(tmp_path / "runs" / "mvit"))  # from another folder: the clips are read where it trained
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["val_video_top1"] == summary["val_video_top1"]
    assert f"data.root=clips read from the folder the run trained in: {tmp_path / 'clips'}" in done.stderr
    assert json.loads(done.stdout)["baseline"]["val_video_top1"] == 0.25  # its baseline read there too
    done = run_cli("train", "--resume", str(tmp_path / "runs" / "mvit"), "train.max_steps=5")  # from elsewhere too
    assert done.returncode == 0 and json.loads(done.stdout)["steps"] == 5, done.stderr
    assert f'data.root: "clips" -> "{tmp_path / "clips"}" (read from the folder the run trained in)' in done.stderr
    history = (tmp_path / "runs" / "mvit" / "config_history.jsonl").read_text()
    assert json.loads(history)["changes"]["task.baseline_run"] == ["frames-run", str(tmp_path / "frames-run")]
    done = run_cli("export", str(tmp_path / "runs" / "mvit"), str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "out" / "classes.json").read_text()) == ["a", "b"]  # the clip folders' classes
    for estimate in (["mvitv2_small", "--strategy", "zero3"], ["--from", "mvitv2_small"]):  # one line, exit 2
        done = run_cli("estimate", *estimate, warnings="")
        assert done.returncode == 2 and "MViTv2 (model.name=mvit)" in done.stderr, done.stderr
        assert len(done.stderr.splitlines()) == 1 and "data.source=synthetic task.name=video" in done.stderr
    listed = run_cli("models").stdout
    assert "mvitv2_small" in listed and "34,999,144" in listed  # with the default 1000 classes


def test_a_run_stopped_mid_epoch_resumes_with_the_losses_of_the_whole_run(tmp_path):
    make_clip_tree(tmp_path / "clips", frames=8)
    model = {**TINY, "drop_path": 0.1}
    data = {"source": "video", "root": str(tmp_path / "clips"), "video_frames": True, "val_match": "actor3_",
            "decode_workers": 1, "hflip": 0.5}  # fmt: skip
    whole, part, _ = whole_and_resumed(tmp_path, {"max_steps": 5, "batch_size": 4}, 2, model=model, data=data,
                                       task={"name": "video"})  # fmt: skip
    got, want = losses(part.run_dir), losses(whole.run_dir)
    assert sorted(got) == [1, 2, 3, 4, 5] and got == want  # bit for bit: drop-path masks and clips alike


def _sharded(out_dir, root, max_steps: int, strategy: str = "zero3"):
    return tiny_config(
        out_dir,
        "sharded",
        batch_size=2,
        model=TINY,
        task={"name": "video", "eval_clips": 2},
        data={"source": "video", "root": str(root), "video_frames": True, "val_match": "actor3_", "decode_workers": 1},
        train={"max_steps": max_steps, "epochs": 5, "checkpoint_every_steps": 1},
        parallel={"strategy": strategy, "activation_checkpointing": "block"},
        precision={"mode": "amp_o2", "dtype": "bf16"},
    )


def _zero3_three_steps(out_dir, root) -> None:
    from vitrain.engine import Trainer

    Trainer(_sharded(out_dir, root, 3)).fit()


# slow: about 20 s on a Zen 4; zero3 and resharding resume are tested for images and the video ViT as well
@pytest.mark.slow
def test_zero3_amp_o2_and_checkpointing_on_two_ranks_resume_in_one_process_and_export(tmp_path):
    from safetensors.torch import load_file

    from vitrain.cli import main
    from vitrain.engine import Trainer

    make_clip_tree(tmp_path / "clips", frames=6)
    run_two_ranks(_zero3_three_steps, tmp_path / "runs", tmp_path / "clips")
    Trainer(_sharded(tmp_path / "runs", tmp_path / "clips", 5, strategy="single"), resume=True).fit()
    logged = losses(tmp_path / "runs" / "sharded")
    assert sorted(logged) == [1, 2, 3, 4, 5] and all(torch.isfinite(torch.tensor(v)) for v in logged.values())
    assert main(["export", str(tmp_path / "runs" / "sharded"), str(tmp_path / "out")]) == 0
    weights = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert weights["patch_embed.weight"].shape == (16, 3, 3, 7, 7)  # the overlapping embedding, in fp32
    assert weights["blocks.2.attn.rel_pos_t"].shape == (3, 16)  # 2 x 2 time steps - 1 rows, 16 wide (the heads)
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in weights.values())


def test_the_weizmann_recipe_is_an_mvit_with_the_video_vits_data_and_budget():
    mvit = load_config(CONFIG_DIR / "video-weizmann-mvit.yaml")
    vit = load_config(CONFIG_DIR / "video-weizmann.yaml")
    assert mvit.model.name == "mvit" and mvit.model.stages == (1, 2, 1)
    assert config_complexity(mvit.model).params == count_parameters(build_model(mvit.model))
    # The grid the embedding makes is the space-time ViT's: 4 x 8 x 8 tokens from 8 frames of 64 px.
    assert block_shapes(mvit.model)[0].grid_in == (4, 8, 8) and vit.model.num_patches == 4 * 8 * 8
    for section in ("data", "optim", "schedule", "train", "task"):
        assert getattr(mvit, section) == getattr(vit, section), section


def test_the_bench_line_names_it_an_mvit():
    from vitrain.bench.step import _model_label

    label = _model_label(load_config(base={"model": TINY}))
    assert label == "MViTv2 w16 h1 stages [1, 1, 1]/4x2 @ 4 frames x 16px"


def test_bf16_pooling_gradients_are_right_and_repeatable():
    # torch 2.13's CPU bf16 depthwise Conv3d computes its weight gradient wrong (and differently each call) when
    # its input has channels-last strides, as the heads' token grids permuted to (C, T, H, W) do; the pools copy
    # them contiguous first. Without that copy this failed: errors near the gradients' own size, runs differing.
    torch.manual_seed(0)
    exact = build_model(_model_cfg(attention="manual")).double()
    low = build_model(_model_cfg(attention="manual")).to(torch.bfloat16)
    low.load_state_dict(exact.state_dict())
    clips = torch.randn(4, 12, 16, 16, dtype=torch.float64)
    exact(clips).sum().backward()
    grads = []
    for _ in range(3):
        low.zero_grad()
        low(clips.to(torch.bfloat16)).float().sum().backward()
        grads.append({n: p.grad.double() for n, p in low.named_parameters() if ".conv." in n})
    for name, grad in grads[0].items():
        want = exact.get_parameter(name).grad
        assert (grad - want).abs().max() <= 0.05 * want.abs().max(), name
        assert all(torch.equal(grad, other[name]) for other in grads[1:]), name


# torchvision's MViTv2 names for vitrain's (torchvision/models/video/mvit.py, as its mvit_v2_s weights file has them),
# written out here apart from vitrain's own table, so that a wrong entry there shows.
def _torchvision_name(key: str) -> str:
    swaps = [("patch_embed.", "conv_proj."), ("cls_token", "pos_encoding.class_token"), ("head.", "head.1."),
             (".attn.proj.", ".attn.project.0."), (".conv.", ".pool."), (".mlp.fc1.", ".mlp.0."),
             (".mlp.fc2.", ".mlp.3.")]  # fmt: skip
    swaps += [(f".attn.pool_{x}.norm.", f".attn.pool_{x}.norm_act.0.") for x in "qkv"]
    for mine, theirs in swaps:
        if key.startswith(mine) or (mine.startswith(".") and mine in key):
            key = key.replace(mine, theirs, 1)
    return key


def _torchvision_file(model, path):
    state = {_torchvision_name(k): v.clone() for k, v in model.state_dict().items()}
    state["pos_encoding.class_token"] = state["pos_encoding.class_token"].reshape(-1)  # a vector in torchvision's
    torch.save(state, path)
    return state


def test_torchvision_weights_start_it_under_their_own_names(tmp_path):
    torch.manual_seed(0)
    source = build_model(_model_cfg()).eval()
    state = _torchvision_file(source, tmp_path / "mvit_v2_s.pth")
    assert "blocks.1.attn.pool_k.norm_act.0.weight" in state and "blocks.1.project.weight" in state
    model = build_model(_model_cfg(init_from=str(tmp_path / "mvit_v2_s.pth"))).eval()  # the config takes it now
    load_pretrained(model, tmp_path / "mvit_v2_s.pth")
    clips = torch.randn(2, 12, 16, 16)
    assert torch.equal(model(clips), source(clips))
    with pytest.warns(UserWarning, match="its head has 2 classes, this model 5; the head starts from scratch"):
        load_pretrained(build_model(_model_cfg(num_classes=5)), tmp_path / "mvit_v2_s.pth")  # fine-tuning to 5


def test_tables_trained_on_another_clip_size_are_resampled_as_torchvision_runs_them(tmp_path):
    # Trained at 32 px (8x8 grid) and loaded at 16 px: the height and width tables shrink by linear interpolation
    # (align_corners off), the time table too where the clip has fewer frames.
    torch.manual_seed(0)
    source = build_model(_model_cfg(image_size=32, num_frames=8))
    state = {k: v.clone() for k, v in source.state_dict().items()}
    ramp = torch.arange(15.0)[:, None].repeat(1, 16)  # row i holds i: a resampled row holds where it was read
    state["blocks.0.attn.rel_pos_h"] = ramp
    save_file(state, str(tmp_path / "w.safetensors"))
    model = build_model(_model_cfg())
    load_pretrained(model, tmp_path / "w.safetensors")
    table = model.blocks[0].attn.rel_pos_h  # 15 rows -> 7: row j reads position (j + 0.5) * 15 / 7 - 0.5
    want = torch.tensor([(j + 0.5) * 15 / 7 - 0.5 for j in range(7)])
    assert table.shape == (7, 16) and torch.allclose(table[:, 3], want, atol=1e-5)
    assert source.blocks[0].attn.rel_pos_t.shape[0] == 7 and model.blocks[0].attn.rel_pos_t.shape[0] == 3
    others = {k: v for k, v in model.state_dict().items() if ".rel_pos_" not in k}
    assert all(torch.equal(v, state[k]) for k, v in others.items())


def test_torchvision_computes_what_vitrain_computes_with_its_weights_on_other_clip_sizes(tmp_path, monkeypatch):
    if importlib.util.find_spec("torchvision") is None:
        pytest.skip("torchvision is not installed (pip install 'vitrain[peers]')")
    from vitrain.models import external

    external.allow_torchvision_import()
    import torchvision.models.video.mvit as tv

    torch.manual_seed(0)
    kinetics = tv.mvit_v2_s().state_dict()  # 16 frames of 224 px; its tables start at zero: filled here
    kinetics = {k: torch.randn_like(v) * (0.05 if v.ndim > 1 else 0.1) for k, v in kinetics.items()}
    torch.save(kinetics, tmp_path / "mvit_v2_s.pth")
    # torchvision builds for one clip size and resamples its tables to the grids it runs on (its _add_rel_pos):
    # built for 4 frames of 40 px (10x10 -> 5x5 -> 3x3 -> 2x2 grids), with the 224 px tables put back in.
    build = tv._mvit
    monkeypatch.setattr(tv, "_mvit", lambda **kw: build(**{**kw, "spatial_size": (40, 40), "temporal_size": 4}))
    theirs = tv.mvit_v2_s().eval()
    for name, module in theirs.named_modules():
        for table in ("rel_pos_h", "rel_pos_w", "rel_pos_t"):
            if hasattr(module, table):
                setattr(module, table, torch.nn.Parameter(kinetics[f"{name}.{table}"]))
    theirs.load_state_dict(kinetics)
    fields = ["model.num_classes=400", "model.num_frames=4", "model.image_size=40", "model.dropout=0"]
    ours = build_model(load_config(overrides=["model.preset=mvitv2_small", *fields]).model).eval()
    load_pretrained(ours, tmp_path / "mvit_v2_s.pth")
    clips = torch.randn(2, 3, 4, 40, 40)
    with torch.no_grad():
        assert torch.allclose(ours(clips), theirs(clips), atol=1e-5)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"pos_encoding.spatial_pos": torch.zeros(4, 16)}, "holds absolute position tables (MViTv1)"),
        ({"blocks.0.norm1.weight": torch.ones(8)}, "blocks.0.norm1.weight is (8,) there, (16,) here"),
        ({"blocks.9.mlp.0.weight": torch.ones(1)}, "it has an extra tensor blocks.9.mlp.fc1.weight"),
    ],
)
def test_weights_it_cannot_take_are_one_line_naming_the_tensor(tmp_path, change, message):
    state = _torchvision_file(build_model(_model_cfg()), tmp_path / "w.pth")
    torch.save({**state, **change}, tmp_path / "w.pth")
    with pytest.raises(CheckpointError, match=re.escape(message)) as refused:
        load_pretrained(build_model(_model_cfg()), tmp_path / "w.pth")
    assert "\n" not in str(refused.value) and "model.init_from=" in str(refused.value)
