"""Object detection: a ViTDet backbone with an FCOS head, COCO mAP on the validation split; best = highest val_ap.

The data (data.source=detection: COCO JSON or Pascal VOC XML, vitrain/data/detection.py) brings the class list; the
head is sized by it, so another data set trains with only data.root changed. The loss is FCOS's three terms
(focal, GIoU, centerness) summed to one fp32 scalar. Evaluation decodes each validation image's detections
(class-wise NMS), maps them back to original image pixels and scores them with pycocotools' COCOeval (AP, AP50,
AP75, AP small/medium/large); every rank scores the whole split, so the figures agree without a collective. The
final evaluation also draws the first validation images' detections to `detections/*.png` in the run folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vitrain import registry
from vitrain.config import Config
from vitrain.data.detection import DetectionAugment, DetectionSet, ImageRecord, load_split, read_classes
from vitrain.data.loader import BatchLoader
from vitrain.errors import ConfigError
from vitrain.models.fcos import Points, decode, fcos_losses, make_points
from vitrain.models.vitdet import ViTDet, check_vitdet, pyramid_strides
from vitrain.parallel import distributed

METRICS = ("val_ap", "val_ap50", "val_ap75", "val_ap_small", "val_ap_medium", "val_ap_large")  # COCOeval.stats[:6]
COCO_AREA_RANGES = ((0, 1e10), (0, 1e10), (0, 1e10), (0, 32**2), (32**2, 96**2), (96**2, 1e10))  # METRICS' objects
LOSS_TERMS = ("cls", "box", "centerness")  # fcos_losses' terms, summed to the training loss
SHOWN_AT_END = 4  # validation images drawn with their detections after the final evaluation


def coco_eval_module() -> Any:
    """pycocotools' COCO and COCOeval, or a ConfigError saying how to install them."""
    try:
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval
    except ImportError:
        raise ConfigError(
            "task.name=detection scores with pycocotools, which is not installed: pip install 'vitrain[detection]'"
        ) from None
    return COCO, COCOeval


class DetectionTask:
    name = "detection"
    best_metric = "val_ap"
    higher_is_better = True
    summary_defaults = {"val_ap": 0.0, "val_ap50": 0.0}

    def __init__(self, cfg: Config, model: Any = None, data: Any = None):
        if model is not None:
            raise ConfigError("task.name=detection builds its own ViTDet; it takes no model= object")
        self.cfg = cfg
        self.data = data  # (train, val) DetectionSets or a function of the config making them; None: data.source's
        self.classes: list[str] | None = None
        self.val: DetectionSet | None = None
        self.points: Points = make_points(cfg.model.image_size, pyramid_strides(cfg.model.patch_size))

    @staticmethod
    def check(cfg: Config) -> None:
        """The detection fields, and what detection asks of the model, data and parallelism."""
        k, d, p = cfg.task, cfg.data, cfg.parallel
        check_vitdet(cfg.model)
        if cfg.model.name != "vit":
            raise ConfigError(
                f"task.name=detection builds a ViTDet from vitrain's ViT; set model.name=vit, not {cfg.model.name}"
            )
        if d.source != "detection" and ":" not in d.source:
            raise ConfigError(
                f"task.name=detection reads boxes: set data.source=detection (not {d.source}) and data.root"
            )
        if d.loader != "fast":
            raise ConfigError("task.name=detection reads its data with the fast loader: set data.loader=fast")
        if cfg.train.token_drop:
            raise ConfigError(
                f"train.token_drop={cfg.train.token_drop} drops patches the feature pyramid needs; set "
                "train.token_drop=0 for task.name=detection"
            )
        pixel_only = ("randaugment", "trivialaugment", "three_augment", "random_resized_crop", "crop_padding",
                      "mixup_alpha", "cutmix_alpha", "random_erasing", "min_size")  # fmt: skip
        on = [f"data.{name}={getattr(d, name)}" for name in pixel_only if getattr(d, name)]
        if on:
            raise ConfigError(
                f"{on[0]} changes the pixels but not the boxes; task.name=detection augments with data.jitter_scale "
                "and data.hflip only: turn it off"
            )
        low, high = d.jitter_scale
        if not 0.0 < low <= high:
            raise ConfigError(
                f"data.jitter_scale={list(d.jitter_scale)} must be scale factors 0 < low <= high (ViTDet: [0.1, 2.0])"
            )
        if p.pipeline_stages > 1 or p.sharded_init:
            raise ConfigError(
                "task.name=detection supports neither parallel.pipeline_stages > 1 nor parallel.sharded_init (both cut "
                "or draw the classifier ViT by its anatomy); set parallel.pipeline_stages=1 parallel.sharded_init=false"
            )
        if cfg.train.eval_flip:
            raise ConfigError("train.eval_flip averages a classifier's logits; set train.eval_flip=false for detection")
        if cfg.train.distill.teacher:
            raise ConfigError("train.distill.teacher distils classifiers; drop it for task.name=detection")
        if k.pyramid_channels <= 0 or k.head_convs < 0:
            raise ConfigError(
                f"task.pyramid_channels={k.pyramid_channels} must be positive and task.head_convs={k.head_convs} >= 0"
            )
        if not 0.0 <= k.score_threshold < 1.0 or not 0.0 < k.nms_iou <= 1.0 or k.max_detections <= 0:
            raise ConfigError(
                f"task.score_threshold={k.score_threshold} must be in [0, 1), task.nms_iou={k.nms_iou} in (0, 1] and "
                f"task.max_detections={k.max_detections} positive"
            )

    def datasets(self) -> tuple[DetectionSet, DetectionSet]:
        if self.data is None:
            return registry.lookup("data", self.cfg.data.source)(self.cfg)
        return self.data(self.cfg) if callable(self.data) else self.data

    def build_data(self, device: torch.device, rank: int, world_size: int) -> BatchLoader:
        coco_eval_module()  # before any training: a run that cannot be scored stops now
        cfg = self.cfg
        train, self.val = self.datasets()
        self.classes, self.device = train.classes, device
        return BatchLoader(
            train,
            cfg.train.batch_size,
            DetectionAugment(cfg, train=True),
            device,
            shuffle=True,
            seed=cfg.train.seed,
            rank=rank,
            world_size=world_size,
            prefetch=cfg.data.prefetch,
        )

    def build_model(self) -> nn.Module:
        if self.classes is None:  # `vitrain eval` / export: the class list from the annotations, no images decoded
            self.classes = read_classes(self.cfg)
        model_cfg = self.cfg.model
        if model_cfg.num_classes != len(self.classes):  # the data's class list sizes the head
            model_cfg = dataclasses.replace(model_cfg, num_classes=len(self.classes))
        model = ViTDet(model_cfg, self.cfg.task.pyramid_channels, self.cfg.task.head_convs)
        if self.cfg.task.freeze_backbone:
            for param in [model.patch_embed.proj.weight, model.patch_embed.proj.bias, model.pos_embed]:
                param.requires_grad_(False)
            model.blocks.requires_grad_(False)
        return model

    def build_head(self, device: torch.device) -> None:
        return None

    def loss(self, output: tuple[torch.Tensor, ...], targets: torch.Tensor) -> torch.Tensor:
        if self.points.centres.device != targets.device:
            self.points = self.points.to(targets.device)
        parts = fcos_losses(output, targets, self.points)
        return sum(parts[term] for term in LOSS_TERMS)

    def predict(self, forward: nn.Module, data: DetectionSet, device: torch.device) -> tuple[list[tuple], dict]:
        """Each image's detections (boxes in original image pixels, scores, classes), in the split's order; and the
        split's FCOS losses, the mean of each image's own (val_loss and its three terms)."""
        k, size = self.cfg.task, self.cfg.model.image_size
        normalize = DetectionAugment(self.cfg, train=False)
        points, found = self.points.to(device), []
        sums: dict[str, Any] = dict.fromkeys(LOSS_TERMS, 0.0)  # tensors once added to: read once, at the end
        was_training = forward.training
        forward.eval()
        with torch.inference_mode():
            for start in range(0, len(data), self.cfg.train.batch_size):
                rows = torch.arange(start, min(start + self.cfg.train.batch_size, len(data)))
                images, targets = data.read(rows)
                images, targets = normalize(images.to(device), targets.to(device), torch.Generator())
                output = forward(images)
                # Image by image: a batch's loss is normalized by its own positives, so batched the split's val_loss
                # would depend on the eval batch size (1.4195 at 8, 1.4534 at 1 in one run).
                for i in range(len(rows)):
                    one = tuple(o[i : i + 1] for o in output)
                    for term, value in fcos_losses(one, targets[i : i + 1], points).items():
                        sums[term] = sums[term] + value
                for (boxes, scores, classes), scale, row in zip(
                    decode(output, points, size, k.score_threshold, k.nms_iou, k.max_detections),
                    data.scales[rows].tolist(),
                    rows.tolist(),
                    strict=True,
                ):
                    found.append((inside(boxes.cpu() / scale, data.records[row]), scores.cpu(), classes.cpu()))
        forward.train(was_training)
        losses = {f"val_loss_{term}": float(total) / len(data) for term, total in sums.items()}
        return found, {"val_loss": sum(losses.values())} | losses

    def evaluate(self, forward: nn.Module, final: bool, out_dir: Path) -> dict[str, Any]:
        assert self.val is not None, "build_data first"
        found, losses = self.predict(forward, self.val, self.device)
        metrics = coco_metrics(self.val, found) | losses
        if final and distributed.rank() == 0:
            draw_detections(self.val, found, out_dir / "detections", SHOWN_AT_END)
        return metrics

    def eval_line(self, metrics: dict[str, Any]) -> str:
        scores = " ".join(f"{name}={metrics[name]:.4f}" for name in METRICS)
        return f"{scores} detections={metrics['val_detections']} val_loss={metrics['val_loss']:.4f}"

    def describe_data(self) -> str:
        assert self.val is not None and self.classes is not None
        return f"{len(self.val)} val images, {len(self.classes)} classes ({', '.join(self.classes)})"


def inside(boxes: torch.Tensor, record: ImageRecord) -> torch.Tensor:
    """Boxes (x1, y1, x2, y2) in original pixels clipped to the image: the model sees a letterboxed square, and a box
    reaching into its padding would otherwise lie partly outside the image (and lose IoU with the one it found)."""
    limit = torch.tensor([record.width, record.height, record.width, record.height], dtype=boxes.dtype)
    return torch.minimum(boxes.clamp_min(0.0), limit)


def coco_metrics(data: DetectionSet, found: list[tuple]) -> dict[str, Any]:
    """COCO AP figures of `found` (per image of `data`: boxes in original pixels, scores, classes) by pycocotools;
    -1 where the split has no object of a size (COCO's convention)."""
    coco_class, coco_eval_class = coco_eval_module()
    results = [
        {"image_id": record.image_id, "category_id": int(c) + 1, "score": float(s),
         "bbox": [float(b[0]), float(b[1]), float(b[2] - b[0]), float(b[3] - b[1])]}
        for record, (boxes, scores, classes) in zip(data.records, found, strict=True)
        for b, s, c in zip(boxes.tolist(), scores.tolist(), classes.tolist(), strict=True)
    ]  # fmt: skip
    metrics: dict[str, Any] = dict.fromkeys(METRICS, 0.0) | {"val_detections": len(results)}
    if not results:  # COCOeval takes no empty result list: every AP is 0, and -1 where no object is there to find
        areas = [a["area"] for a in data.coco_ground_truth()["annotations"] if not a["iscrowd"]]
        for name, (low, high) in zip(METRICS, COCO_AREA_RANGES, strict=True):
            if not any(low <= area <= high for area in areas):
                metrics[name] = -1.0
        return metrics
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints its progress and table
        truth = coco_class()
        truth.dataset = data.coco_ground_truth()
        truth.createIndex()
        scored = coco_eval_class(truth, truth.loadRes(results), "bbox")
        scored.evaluate()
        scored.accumulate()
        scored.summarize()
    return metrics | {name: float(value) for name, value in zip(METRICS, scored.stats[:6], strict=True)}


DRAWN_SIZE = 512  # pictures smaller than this are enlarged by a whole factor, so that labels stay legible


def draw_detections(
    data: DetectionSet, found: list[tuple], out_dir: Path, count: int, min_score: float = 0.5
) -> list[Path]:
    """PNGs of the first `count` images of `data` (their letterboxed pixels, enlarged a whole number of times up to
    DRAWN_SIZE): true boxes in green, detections scoring at least `min_score` in red with their class and score."""
    from PIL import Image, ImageDraw

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(min(count, len(data))):
        picture = Image.fromarray(data.images[i].permute(1, 2, 0).numpy())
        zoom = max(1, DRAWN_SIZE // max(picture.size))
        picture = picture.resize((picture.width * zoom, picture.height * zoom), Image.Resampling.BILINEAR)
        scale = float(data.scales[i]) * zoom
        draw = ImageDraw.Draw(picture)
        for box in data.records[i].boxes:
            draw.rectangle([box.x1 * scale, box.y1 * scale, box.x2 * scale, box.y2 * scale], outline=(0, 200, 0))
        boxes, scores, classes = found[i]
        for b, s, c in zip(boxes.tolist(), scores.tolist(), classes.tolist(), strict=True):
            if s < min_score:
                continue
            corners = [v * scale for v in b]
            draw.rectangle(corners, outline=(230, 0, 0), width=2)
            draw.text((corners[0] + 2, corners[1] + 1), f"{data.classes[c]} {s:.2f}", fill=(230, 0, 0))
        path = out_dir / f"{Path(data.records[i].name).stem}.png"
        picture.save(path)
        paths.append(path)
    return paths


def evaluate_checkpoint(
    model: nn.Module, cfg: Config, device: torch.device, out_dir: Path, show: int, min_score: float
) -> dict[str, Any]:
    """`vitrain eval` of a detector: COCO AP on the run's validation split (data.root and data.val_split may be
    overridden), and with `show` > 0 that many images drawn with their detections scoring >= `min_score` under
    `out_dir`."""
    task = DetectionTask(cfg)
    val = load_split(cfg, cfg.data.val_split, train=False)
    found, losses = task.predict(model, val, device)
    result: dict[str, Any] = coco_metrics(val, found) | losses
    if show:
        result["pictures"] = [str(p) for p in draw_detections(val, found, out_dir, show, min_score)]
    return result
