"""ONNX export: one fp32 graph for any batch size whose outputs onnxruntime reproduces; refusals in one line."""

from __future__ import annotations

import builtins
import importlib.util
import math
import re

import numpy as np
import pytest
import torch
from torch import nn

from tests.conftest import model_overrides, tiny_overrides
from vitrain.cli import main
from vitrain.config import load_config
from vitrain.engine import Trainer
from vitrain.errors import CheckpointError, ConfigError
from vitrain.models import build_model, create_model
from vitrain.onnx_export import ONNX_FILE, export_checked
from vitrain.parallel import unwrap
from vitrain.tasks import build_task

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("onnxscript") is None,
    reason="export --format onnx needs the extra: pip install 'vitrain[onnx]' (onnxscript, onnxruntime)",
)


def _onnxruntime():
    return pytest.importorskip("onnxruntime", reason="the parity check needs the extra: pip install 'vitrain[onnx]'")


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """The suite's tiny ViT trained for four steps on the real digits, and its trainer."""
    cfg = load_config(None, tiny_overrides(tmp_path_factory.mktemp("onnx"), "name=digits", "train.max_steps=4"))
    trainer = Trainer(cfg)
    trainer.fit()
    return cfg, trainer


def test_a_digits_run_exports_a_graph_whose_logits_match_pytorchs_to_1e4(digits_run, tmp_path, capsys):
    onnxruntime = _onnxruntime()
    cfg, trainer = digits_run
    capsys.readouterr()
    assert main(["export", str(cfg.run_dir), str(tmp_path), "--format", "onnx"]) == 0
    printed = capsys.readouterr().out
    assert float(re.search(r"max \|logit difference\| (\S+) at batch sizes 1 and 3", printed).group(1)) <= 1e-4
    assert (tmp_path / "config.yaml").read_text().startswith("name: digits")
    session = onnxruntime.InferenceSession(str(tmp_path / ONNX_FILE), providers=["CPUExecutionProvider"])
    assert [(i.name, i.shape) for i in session.get_inputs()] == [("images", ["batch", 1, 16, 16])]
    assert [o.name for o in session.get_outputs()] == ["logits"]
    images, _ = next(iter(trainer.task.val_loader.epoch(0)))  # real digits, normalized as in training
    # Trained and loaded on a GPU where there is one; onnxruntime runs on the CPU.
    images, model = images.cpu(), unwrap(trainer.model).cpu().eval()
    for batch in (1, 5, len(images)):
        with torch.no_grad():
            expected = model(images[:batch]).numpy()
        got = session.run(None, {"images": images[:batch].numpy()})[0]
        assert got.shape == expected.shape and np.abs(got - expected).max() <= 1e-4


@pytest.mark.parametrize(
    "variant",
    [
        {"attention": "manual", "layout": "seq_first"},
        {"pool": "gap", "pos_embed": "sincos", "patch_embed": "conv"},
        {"pool": "flatten", "qkv_bias": False},
    ],
    ids=["manual-seq_first", "gap-sincos-conv", "flatten"],
)
def test_each_vit_variant_exports_within_the_tolerance(variant, tmp_path):
    _onnxruntime()
    cfg = load_config(overrides=[*model_overrides(), *(f"model.{k}={v}" for k, v in variant.items())])
    model = _with_running_statistics(create_model(cfg.model))
    path, parity = export_checked(model, cfg, tmp_path)
    assert path == tmp_path / ONNX_FILE and parity.output == "logits"
    assert parity.ok and parity.max_abs_diff <= 1e-4 and parity.batches == (1, 3)


def test_the_face_task_exports_its_embeddings_with_the_necks_running_statistics(tmp_path):
    onnxruntime = _onnxruntime()
    face = ["task.name=face", "task.embed_dim=16", "data.source=folder", f"data.root={tmp_path}", "model.pool=gap"]
    cfg = load_config(overrides=[*model_overrides(), *face])
    model = _with_running_statistics(build_task(cfg).build_model())
    path, parity = export_checked(model, cfg, tmp_path)
    assert parity.ok and parity.output == "embeddings" and "max |embedding difference|" in parity.line()
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [(o.name, o.shape) for o in session.get_outputs()] == [("embeddings", ["batch", 16])]
    assert model.training  # the caller's model is back in its mode


def test_a_video_model_exports_clips_with_their_frames_on_the_channel_axis(tmp_path):
    # The example was a batch of images, (batch, in_chans, H, W): the clip model's reshape to its frames failed
    # inside torch.export, said as "cannot be exported with a dynamic batch".
    onnxruntime = _onnxruntime()
    video = ["task.name=video", "model.name=video_vit", "model.num_frames=4", "model.tubelet_size=2", "model.pool=gap"]
    cfg = load_config(overrides=[*model_overrides(), *video, "data.source=video", f"data.root={tmp_path}"])
    model = build_model(cfg.model)
    path, parity = export_checked(model, cfg, tmp_path)
    assert parity.ok and parity.output == "logits"
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    m = cfg.model
    assert [i.shape for i in session.get_inputs()] == [["batch", 4 * m.in_chans, m.image_size, m.image_size]]


def test_a_bf16_model_is_exported_from_an_fp32_copy_and_left_as_it_was(tiny_model, tmp_path):
    _onnxruntime()
    cfg = load_config(overrides=model_overrides())
    model = tiny_model.to(torch.bfloat16)
    _, parity = export_checked(model, cfg, tmp_path)
    assert parity.ok and parity.max_abs_diff <= 1e-4
    assert model.training and {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_a_parity_gap_above_the_tolerance_exits_2_in_one_line_and_writes_nothing(digits_run, tmp_path, capsys):
    _onnxruntime()
    cfg, _ = digits_run
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["export", str(cfg.run_dir), str(out), "--format", "onnx", "--tolerance", "1e-12"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "max |logit difference|" in err[0] and "exceeds --tolerance 1e-12" in err[0]
    assert list(out.iterdir()) == []


class _Outputs(nn.Module):
    """The tiny ViT's logits and a second output: scaled by 1e6 (its own scale) or NaN."""

    def __init__(self, vit: nn.Module, second: float):
        super().__init__()
        self.vit, self.second = vit, second

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.vit(images)
        return logits, logits * self.second


def test_each_output_is_held_to_its_own_scale_and_a_nan_is_never_within_it(tiny_model, tmp_path):
    _onnxruntime()
    cfg = load_config(overrides=model_overrides())
    _, parity = export_checked(_Outputs(tiny_model, 1e6), cfg, tmp_path / "scaled")
    # Both outputs pass; the line names the one nearest its limit by share, whatever their sizes.
    assert parity.ok and parity.output == "output 1" and parity.max_abs_output > 1e3
    with pytest.raises(CheckpointError, match=r"max \|output 1 difference\| inf .*exceeds --tolerance"):
        export_checked(_Outputs(tiny_model, math.nan), cfg, tmp_path / "nan")  # max() dropped the NaN: "0"
    assert not (tmp_path / "nan" / ONNX_FILE).exists()


def test_without_onnxruntime_the_graph_is_written_and_said_unchecked(digits_run, tmp_path, capsys, monkeypatch):
    real_import = builtins.__import__

    def no_onnxruntime(name, *args, **kwargs):
        if name == "onnxruntime":
            raise ImportError("No module named 'onnxruntime'")
        return real_import(name, *args, **kwargs)

    cfg, _ = digits_run
    monkeypatch.setattr(builtins, "__import__", no_onnxruntime)
    capsys.readouterr()
    assert main(["export", str(cfg.run_dir), str(tmp_path), "--format", "onnx"]) == 0
    assert "onnxruntime is not installed: the graph was not checked" in capsys.readouterr().out
    assert (tmp_path / ONNX_FILE).stat().st_size > 10_000


class _BranchesOnItsInput(nn.Module):
    """A model whose forward takes a Python branch on the values of its input: torch.export cannot capture it."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16 * 16, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        logits = self.head(images.flatten(1))
        return logits if images.mean() > 0 else -logits


def test_a_model_torch_export_cannot_capture_is_refused_naming_it(tmp_path):
    cfg = load_config(overrides=[*model_overrides(), "model.name=mypkg.models:branchy"], check=False)
    with pytest.raises(CheckpointError, match=r"model.name=mypkg.models:branchy cannot be exported .*--format vitrain"):
        export_checked(_BranchesOnItsInput(), cfg, tmp_path)
    assert not (tmp_path / ONNX_FILE).exists()


class _FixedBatch(nn.Module):
    """A model that reshapes to the example's batch size: torch.onnx bakes that size into the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16 * 16, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(images.reshape(2, -1))


def test_a_model_that_fixes_the_batch_size_is_refused_naming_it(tmp_path):
    cfg = load_config(overrides=[*model_overrides(), "model.name=mypkg.models:fixed"], check=False)
    with pytest.raises(
        CheckpointError, match=r"model.name=mypkg.models:fixed fixes the batch size \(images has batch 2"
    ):
        export_checked(_FixedBatch(), cfg, tmp_path)
    assert not (tmp_path / ONNX_FILE).exists()


def test_onnx_export_refuses_a_negative_tolerance_an_occupied_folder_and_a_missing_exporter(
    tiny_model, tmp_path, monkeypatch
):
    cfg = load_config(overrides=model_overrides())
    with pytest.raises(ConfigError, match=r"export --tolerance -1 must be >= 0"):
        export_checked(tiny_model, cfg, tmp_path, tolerance=-1.0)
    (tmp_path / ONNX_FILE).write_bytes(b"an earlier export")
    with pytest.raises(CheckpointError, match=r"already holds model.onnx; pass --overwrite"):
        export_checked(tiny_model, cfg, tmp_path)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "onnxscript" else real_find_spec(name, *a)
    )
    with pytest.raises(ConfigError, match=r"needs onnxscript .*pip install 'vitrain\[onnx\]'"):
        export_checked(tiny_model, cfg, tmp_path, overwrite=True)


def _with_running_statistics(model: nn.Module) -> nn.Module:
    """BatchNorm statistics other than the initial 0 / 1, so a graph normalizing by the batch's own would differ."""
    generator = torch.Generator().manual_seed(1)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.running_mean.copy_(torch.randn(module.running_mean.shape, generator=generator))
            module.running_var.copy_(torch.rand(module.running_var.shape, generator=generator) + 0.5)
    return model
