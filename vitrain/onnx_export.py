"""ONNX export of a trained model (fp32, eval mode, any batch size), checked by onnxruntime against PyTorch.

torch.onnx's exporter built on torch.export (dynamo=True, torch's default since 2.9) writes the graph: a model
whose forward branches on its input's values is refused instead of traced down one branch in silence, as the
TorchScript tracer (deprecated, to be removed) would. It needs onnxscript (pip install 'vitrain[onnx]'). A graph
whose batch axis came out fixed is refused here (torch.onnx lets that through).
Opset 18: LayerNormalization is one operator (17+), and every runtime released since 2023 reads it (onnxruntime
>= 1.14, TensorRT >= 8.6).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import math
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from vitrain.config import Config, to_yaml
from vitrain.errors import CheckpointError, ConfigError
from vitrain.files import atomic_write, check_output_folder

ONNX_FILE = "model.onnx"
# What an export writes: the graph, its weights beside it when they are large (EXTERNAL_DATA_BYTES), the config.
ONNX_FILES = (ONNX_FILE, f"{ONNX_FILE}.data", "config.yaml")
OPSET = 18
INPUT = "images"
# What the graph's outputs are called: a classifier's logits, the face task's embeddings (before their L2 norm), the
# detection head's three tensors, or a user's task's outputs.
OUTPUTS = {"classification": ["logits"], "face": ["embeddings"], "video": ["logits"]}
OUTPUTS["detection"] = ["class_logits", "box_distances", "centerness_logits"]  # FCOS's, over every pyramid point
EXAMPLE_BATCH = 2  # torch.export treats batch 1 as a constant; the check then runs at batch sizes other than this
CHECK_BATCHES = (1, 3)
# Weights at or above this size go to model.onnx.data beside the graph (protobuf's 2 GiB limit, with room to spare).
EXTERNAL_DATA_BYTES = 1536 << 20


@dataclass(frozen=True)
class Parity:
    """onnxruntime's outputs against PyTorch's on the same random images, at each batch size of the check."""

    output: str  # logits, embeddings, one of detection's three or outputs: the one nearest its limit
    max_abs_diff: float  # over every batch size and value
    max_abs_output: float  # the largest |PyTorch output|: what the tolerance is scaled by
    limit: float  # tolerance x max(1, max_abs_output)
    batches: tuple[int, ...]

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.limit

    def line(self) -> str:
        sizes, one = " and ".join(map(str, self.batches)), self.output.removesuffix("s")  # logits -> logit
        return (
            f"onnxruntime parity: max |{one} difference| {self.max_abs_diff:.3g} at batch sizes {sizes} "
            f"(limit {self.limit:.3g}; largest |{one}| {self.max_abs_output:.3g})"
        )


def output_names(cfg: Config) -> list[str]:
    return OUTPUTS.get(cfg.task.name, ["outputs"])


def export_checked(
    model: nn.Module, cfg: Config, out_dir: Path, overwrite: bool = False, tolerance: float = 1e-4
) -> tuple[Path, Parity | None]:
    """`vitrain export --format onnx`: OUT/model.onnx (`export_onnx`) and OUT/config.yaml beside it (the input size
    and data.mean/std a deployment preprocesses with); an unwritable or occupied OUT is refused first."""
    check_output_folder(out_dir, overwrite, ONNX_FILES, "export", CheckpointError)
    path, parity = export_onnx(model, cfg, out_dir, tolerance)
    atomic_write(out_dir / "config.yaml", to_yaml(cfg).encode())
    return path, parity


def export_onnx(model: nn.Module, cfg: Config, out_dir: Path, tolerance: float = 1e-4) -> tuple[Path, Parity | None]:
    """Write OUT/model.onnx from `model` (fp32, eval mode, dynamic batch axis) and, where onnxruntime is installed,
    check it: the largest |difference| between onnxruntime's and PyTorch's outputs on random images at two batch
    sizes must stay within `tolerance` x max(1, largest |output|), or nothing is written. Returns the file and the
    check (None without onnxruntime). The caller has refused an unwritable or occupied OUT already."""
    if not math.isfinite(tolerance) or tolerance < 0:
        raise ConfigError(f"export --tolerance {tolerance:g} must be >= 0 and finite, e.g. 1e-4")
    if importlib.util.find_spec("onnxscript") is None:
        raise ConfigError("export --format onnx needs onnxscript (torch.onnx's exporter): pip install 'vitrain[onnx]'")
    example = torch.randn(input_shape(cfg, EXAMPLE_BATCH), generator=torch.Generator())
    staging = out_dir / f".{ONNX_FILE}.partial"  # the graph names its weights file: both are written under their names
    with _exportable(model) as model:
        external = sum(t.numel() * 4 for t in model.state_dict().values()) >= EXTERNAL_DATA_BYTES
        program = _export(model, example, output_names(cfg), cfg.model.name)
        _check_batch_axis(program, cfg.model.name)
        try:
            staging.mkdir(parents=True, exist_ok=True)
            program.save(staging / ONNX_FILE, external_data=external)
            parity = check_parity(model, staging / ONNX_FILE, cfg, tolerance)
            if parity is not None and not parity.ok:
                raise CheckpointError(
                    f"export --format onnx: {parity.line()} exceeds --tolerance {tolerance:g}; {ONNX_FILE} was not "
                    "written (a layer the exporter translates differently; raise --tolerance only if the gap is "
                    "expected)"
                )
            for written in sorted(staging.iterdir(), reverse=True):  # model.onnx.data before the graph naming it
                written.replace(out_dir / written.name)
        except OSError as error:
            raise CheckpointError(
                f"export: cannot write to {out_dir} ({error.strerror}); choose a writable folder"
            ) from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return out_dir / ONNX_FILE, parity


def input_shape(cfg: Config, batch: int) -> tuple[int, ...]:
    """The graph's input, as the loader gives it: (batch, in_chans, size, size) images; a clip model's (num_frames
    above 1) frames stacked on the channel axis, frame-major: (batch, num_frames x in_chans, size, size)."""
    m = cfg.model
    return (batch, m.in_chans * max(m.num_frames, 1), m.image_size, m.image_size)


def check_parity(model: nn.Module, path: Path, cfg: Config, tolerance: float) -> Parity | None:
    """onnxruntime (CPU) against PyTorch (fp32 eval) on the same random images at CHECK_BATCHES; None without
    onnxruntime."""
    try:
        import onnxruntime
    except ImportError:
        return None
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    generator = torch.Generator().manual_seed(0)
    names = output_names(cfg)
    diff: dict[str, float] = {}
    largest: dict[str, float] = {}
    for batch in CHECK_BATCHES:
        images = torch.randn(input_shape(cfg, batch), generator=generator)
        with torch.no_grad():
            expected = model(images)
        expected = list(expected) if isinstance(expected, tuple | list) else [expected]
        try:
            got = [torch.from_numpy(array) for array in session.run(None, {INPUT: images.numpy()})]
        except Exception as error:  # onnxruntime's messages name the node; its first line is the one to show
            raise CheckpointError(
                f"export --format onnx: onnxruntime cannot run the graph at batch {batch} "
                f"({type(error).__name__}: {_first_line(error)}); {ONNX_FILE} was not written"
            ) from None
        shapes = [tuple(t.shape) for t in got], [tuple(t.shape) for t in expected]
        if shapes[0] != shapes[1]:
            raise CheckpointError(
                f"export --format onnx: onnxruntime gave shape(s) {', '.join(map(str, shapes[0]))} at batch {batch}, "
                f"PyTorch {', '.join(map(str, shapes[1]))}; {ONNX_FILE} was not written"
            )
        for i, (mine, theirs) in enumerate(zip(expected, got, strict=True)):
            name = names[i] if len(names) == len(expected) else f"output {i}"
            # A NaN anywhere is an infinite difference (max() would drop it: a NaN graph read as exact), and scales
            # no limit.
            gap, top = (theirs - mine).abs().max().item(), mine.abs().max().item()
            diff[name] = max(diff.get(name, 0.0), math.inf if math.isnan(gap) else gap)
            largest[name] = max(largest.get(name, 0.0), 0.0 if math.isnan(top) else top)
    # Each output against its own scale (a detection head's box distances in pixels beside its logits); the check
    # reports the output nearest its limit.
    limits = {name: tolerance * max(1.0, largest[name]) for name in diff}

    def nearness(name: str) -> float:  # the share of its limit an output's difference reaches
        return diff[name] / limits[name] if limits[name] else (math.inf if diff[name] else 0.0)

    worst = max(diff, key=nearness)
    return Parity(worst, diff[worst], largest[worst], limits[worst], CHECK_BATCHES)


def _check_batch_axis(program, model_name: str) -> None:
    """Refuse a graph whose input or output has a fixed batch size: torch.onnx lets a model that specializes on the
    example's batch (a reshape to a constant, say) through with that size baked in, and says nothing."""
    graph = program.model.graph
    for value in (graph.inputs[0], *graph.outputs):
        if isinstance(value.shape[0], int):
            raise CheckpointError(
                f"export --format onnx: model.name={model_name} fixes the batch size ({value.name} has batch "
                f"{value.shape[0]} in the graph, the example's); make its forward work for any batch (no reshape to "
                "a constant batch), or use --format vitrain"
            )


def _export(model: nn.Module, example: torch.Tensor, outputs: list[str], model_name: str):  # -> torch.onnx.ONNXProgram
    batch = torch.export.Dim("batch", min=1)
    with warnings.catch_warnings():
        # torch.export's own pytree code warns about its internals on every export: nothing the user can act on.
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
        try:
            return torch.onnx.export(
                model,
                (example,),
                dynamo=True,
                opset_version=OPSET,
                input_names=[INPUT],
                output_names=outputs,
                dynamic_shapes=({0: batch},),
                verbose=False,
            )
        except Exception as error:  # torch.export's reasons run to pages; the first line names the construct
            raise CheckpointError(
                f"export --format onnx: model.name={model_name} cannot be exported with a dynamic batch "
                f"({type(error).__name__}: {_first_line(error)}); export --format vitrain keeps its weights"
            ) from None


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


@contextlib.contextmanager
def _exportable(model: nn.Module) -> Iterator[nn.Module]:
    """The model as the export sees it: fp32 on the CPU in eval mode (dropout off, BatchNorm's running statistics).
    One held elsewhere or in another dtype is copied; the caller's own is back in its mode afterwards."""
    tensors = [*model.parameters(), *model.buffers()]
    if any(t.device.type != "cpu" or (t.is_floating_point() and t.dtype != torch.float32) for t in tensors):
        model = copy.deepcopy(model).to("cpu", torch.float32)
    training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(training)
