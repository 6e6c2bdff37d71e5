"""`vitrain bench --peers`: timm and transformers train the same ViT beside vitrain; missing peers skip with why."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from vitrain.bench import peers
from vitrain.config import load_config
from vitrain.models import external


def test_a_missing_peer_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "timm" else real(name, *a))
    with pytest.raises(peers.PeerMissing, match=r"timm is not installed \(pip install 'vitrain\[peers\]'\)"):
        peers.import_timm()


def test_torchvision_imports_beside_the_cpu_wheel():
    if importlib.util.find_spec("torchvision") is None:
        pytest.skip("torchvision is not installed (pip install 'vitrain[peers]')")
    external.allow_torchvision_import()
    import torchvision.ops  # noqa: F401  (would raise `operator torchvision::nms does not exist` without it)

    assert "torchvision::nms" in torch._C._dispatch_get_all_op_names()


@pytest.mark.parametrize("emulated", ["", "a 512^3 bf16 matmul ran at 2.8 GFLOP/s ... (bf16 emulated)"])
def test_peers_train_the_same_model_and_are_compared_to_vitrain(tmp_path, monkeypatch, emulated):
    for name in ("timm", "transformers"):
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{name} is not installed (pip install 'vitrain[peers]')")
    timed = []
    real_best_of = peers._best_of
    monkeypatch.setattr(peers, "_best_of", lambda options, warmup: timed.extend(options) or real_best_of(options, 0))
    monkeypatch.setattr(peers, "bf16_emulated_here", lambda device_type: emulated or None)
    overrides = [*peers.DEFAULT_BASE, "model.preset=vit_tiny_patch16", "model.image_size=32", "model.depth=2"]
    overrides += ["train.batch_size=4", "data.synthetic_samples=8", f"log.out_dir={tmp_path}", "precision.mode=fp32"]
    result = peers.compare(load_config(None, overrides), steps=3, warmup=1)
    rows = {row["name"].split()[0]: row for row in result["rows"]}
    assert set(rows) == {"vitrain", "timm", "transformers"} and result["missing"] == {}
    # Where bf16 is emulated (a CPU without bf16 instructions) no peer times a bf16 option: minutes to lose.
    bf16_options = [label for label in timed if label.startswith("bf16")]
    assert len(timed) == (3 if emulated else 6) and len(bf16_options) == (0 if emulated else 3)
    assert (f"- bf16: no peer's bf16 option was timed: {emulated}." in peers.to_markdown(result)) == bool(emulated)
    assert rows["vitrain"]["vitrain_speedup"] == 1.0
    for row in rows.values():
        assert len(row["step_s"]) == 3 and row["images_per_s_spread"]["n"] == 3
        assert row["images_per_s"] > 0 and 0 < row["mfu"] < 2
        # MFU round by round: each round's step over the GEMM peak measured in that round
        peaks = result["peaks_gflops_per_s_rounds"][row["compute_dtype"]]
        per_round = sorted(
            result["train_gflops_per_image"] * 4 / t / p for t, p in zip(row["step_s"], peaks, strict=True)
        )
        assert row["mfu_spread"]["n"] == 3 and row["mfu"] == pytest.approx(per_round[1], rel=1e-3)
        # vitrain's speed-up is paired round by round: the median of the contender's step over vitrain's
        paired = sorted(t / v for t, v in zip(row["step_s"], rows["vitrain"]["step_s"], strict=True))
        assert row["vitrain_speedup"] == pytest.approx(paired[1], rel=1e-3)
    assert "| vitrain |" in peers.to_markdown(result)


def test_peer_models_have_vitrains_parameter_count():
    for name in ("timm", "transformers"):
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{name} is not installed (pip install 'vitrain[peers]')")
    from vitrain.models import complexity

    cfg = load_config(None, [*peers.DEFAULT_BASE, "model.preset=vit_tiny_patch16"])
    timm = peers.import_timm()
    transformers = peers.import_transformers()
    with torch.device("meta"):
        timm_model = timm.create_model("vit_tiny_patch16_224", num_classes=1000)
        hf_model = transformers.ViTForImageClassification(
            transformers.ViTConfig(
                hidden_size=192, num_hidden_layers=12, num_attention_heads=3, intermediate_size=768, num_labels=1000
            )
        )
    ours = complexity(cfg.model).params
    assert sum(p.numel() for p in timm_model.parameters()) == ours
    # transformers' ViT keeps a pooler-free classifier on the class token: the same parameters.
    assert sum(p.numel() for p in hf_model.parameters()) == ours
