"""Video classification: cross-entropy on clip logits; clip top-1/top-5 and multi-clip video accuracy.

Training sees one clip per video per epoch, from a random start (data.source=video). Evaluation cuts
`task.eval_clips` uniformly spaced clips from each validation video and reports both the accuracy of single clips
(val_top1, val_top5: every clip on its own) and of whole videos (val_video_top1/top5: the logits of a video's clips
averaged, Kinetics' multi-view protocol); the best checkpoint is the one with the highest video accuracy.

The frame-averaged image baseline is this task with a one-frame model: model.name=vit (num_frames=1) trains on single
random frames, and evaluation averages the logits of eval_clips frames per video (configs/video-weizmann-baseline.yaml).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vitrain.config import Config
from vitrain.data import build_loaders
from vitrain.data.loader import PAD_LABEL
from vitrain.errors import ConfigError, DataError
from vitrain.metrics import topk_correct
from vitrain.models import build_model
from vitrain.parallel import sum_over_ranks


class VideoTask:
    name = "video"
    best_metric = "val_video_top1"
    higher_is_better = True
    summary_defaults = {"val_top1": 0.0, "val_top5": 0.0, "val_video_top1": 0.0, "val_video_top5": 0.0}

    def __init__(self, cfg: Config, model: Any = None, data: Any = None):
        self.cfg = cfg
        self.model = model  # a module or factory from the library caller; None: the one model.name names
        self.data = data  # (train, val) clip sets or a function of the config making them; None: data.source's
        self.val_loader: Any = None
        self.baseline: dict[str, Any] | None = None  # task.baseline_run's accuracy
        self.classes: list[str] | None = None  # the training clips' class names (checkpoints and exports keep them)

    @staticmethod
    def check(cfg: Config) -> None:
        if cfg.train.distill.teacher:
            raise ConfigError("task.name=video has no distillation token; drop train.distill.teacher")
        if cfg.train.eval_flip:  # it was ignored: the clip evaluation averages clips, not mirror images
            raise ConfigError(
                "train.eval_flip averages an image classifier's logits with its mirror image's; task.name=video "
                "averages task.eval_clips clips of each video instead: set train.eval_flip=false"
            )
        if cfg.data.source not in ("video", "shards", "synthetic") and ":" not in cfg.data.source:
            raise ConfigError(
                f"task.name=video evaluates whole videos; data.source={cfg.data.source} gives images: set "
                "data.source=video"
            )

    def build_data(self, device: torch.device, rank: int, world_size: int) -> Any:
        self.baseline = self._baseline()
        train, self.val_loader = build_loaders(self.cfg, device, rank, world_size, self.data)
        if not hasattr(self.val_loader.data, "video_of"):
            raise DataError("task.name=video needs clip sets (video_of, videos) from data.source=video or shards")
        self.classes = getattr(train.data, "classes", None)
        return train

    def _baseline(self) -> dict[str, Any] | None:
        """task.baseline_run's accuracy, read before training so that a wrong path costs nothing."""
        run = self.cfg.task.baseline_run
        if not run:
            return None
        path = Path(run).expanduser() / "summary.json"
        try:
            summary = json.loads(path.read_text())
        except (OSError, ValueError):
            raise ConfigError(
                f"task.baseline_run={run} has no readable summary.json; train the baseline first (vitrain train "
                "video-weizmann-baseline) or leave task.baseline_run empty"
            ) from None
        keys = ("val_video_top1", "val_top1", "eval_clips")
        return {"run": str(run), **{k: summary[k] for k in keys if k in summary}}

    def build_model(self) -> nn.Module:
        return build_model(self.cfg.model, model=self.model)

    def build_head(self, device: torch.device) -> None:
        return None

    def loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.float(), labels, label_smoothing=self.cfg.train.label_smoothing)

    def evaluate(self, forward: nn.Module, final: bool, out_dir: Path) -> dict[str, Any]:
        """Each rank scores its share of the clips; clip counts and each video's summed logits are added over ranks."""
        loader, data = self.val_loader, self.val_loader.data
        rows = loader.order(0)  # this rank's rows in the order its batches come, padding included
        classes = self.cfg.model.num_classes
        sums = torch.zeros(4, dtype=torch.float64)  # clip loss, top-1, top-5, clips
        video_logits = torch.zeros(data.videos, classes, dtype=torch.float64)
        video_clips = torch.zeros(data.videos, dtype=torch.float64)
        # Each clip adds its video's label: the sum over ranks / clips is the label (a stream holds none up front).
        video_label_sums = torch.zeros(data.videos, dtype=torch.float64)
        was_training = forward.training
        forward.eval()
        with torch.inference_mode():
            for b, (clips, labels) in enumerate(loader.epoch(0)):
                logits = forward(clips).float()
                real = labels != PAD_LABEL
                loss = float(F.cross_entropy(logits, labels, reduction="sum", ignore_index=PAD_LABEL))
                top1, top5 = topk_correct(logits, labels, (1, 5))
                sums += torch.tensor([loss, top1, top5, int(real.sum())], dtype=torch.float64)
                batch_rows = rows[b * loader.batch_size : b * loader.batch_size + labels.shape[0]]
                videos = data.video_of(batch_rows)[real.cpu()]
                video_logits.index_add_(0, videos, logits[real].double().cpu())
                video_clips.index_add_(0, videos, torch.ones(len(videos), dtype=torch.float64))
                video_label_sums.index_add_(0, videos, labels[real].double().cpu())
        forward.train(was_training)
        device = loader.device
        sums = sum_over_ranks(sums.to(device)).cpu()
        video_logits = sum_over_ranks(video_logits.to(device)).cpu()
        video_clips = sum_over_ranks(video_clips.to(device)).cpu()
        video_label_sums = sum_over_ranks(video_label_sums.to(device)).cpu()
        seen = video_clips > 0
        mean_logits = video_logits[seen] / video_clips[seen, None]
        video_labels = (video_label_sums[seen] / video_clips[seen]).round().long()
        v1, v5 = topk_correct(mean_logits, video_labels, (1, 5))
        loss_sum, top1, top5, total = sums.tolist()
        videos = int(seen.sum())
        return {
            "val_loss": loss_sum / total if total else float("nan"),
            "val_top1": top1 / total if total else 0.0,
            "val_top5": top5 / total if total else 0.0,
            "val_video_top1": v1 / videos if videos else 0.0,
            "val_video_top5": v5 / videos if videos else 0.0,
            "val_samples": int(total),
            "val_videos": videos,
            "eval_clips": data.clips,
        } | ({"baseline": self.baseline} if self.baseline is not None else {})

    def eval_line(self, metrics: dict[str, Any]) -> str:
        line = (
            f"val_video_top1={metrics['val_video_top1']:.4f} ({metrics['eval_clips']} clips/video) "
            f"val_top1={metrics['val_top1']:.4f} val_top5={metrics['val_top5']:.4f} val_loss={metrics['val_loss']:.4f}"
        )
        baseline = metrics.get("baseline", {})
        if "val_video_top1" in baseline:
            line += f" | baseline val_video_top1={baseline['val_video_top1']:.4f} ({baseline['run']})"
        return line

    def describe_data(self) -> str:
        data = self.val_loader.data
        return f"{data.videos} val videos x {data.clips} clips"
