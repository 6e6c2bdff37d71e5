"""FCOS in pure PyTorch: the shared head, target assignment, focal / GIoU / centerness losses, NMS and decoding.

Tian et al. 2019 ("FCOS: Fully Convolutional One-Stage Object Detection"), with its later refinements: centerness on
the regression tower, regression targets normalised by the level's stride, center sampling (radius 1.5 strides),
GIoU loss weighted by the centerness target. Written here rather than taken from torchvision because torchvision's
C++ operators do not load beside the CPU torch 2.13 wheel vitrain pins (docs/detection.md).

Boxes are (x1, y1, x2, y2) in pixels of the model's input throughout; targets travel as (B, M, 5) tensors of
(x1, y1, x2, y2, class), rows with a negative class being padding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

INF = float("inf")


def level_ranges(strides: tuple[int, ...]) -> list[tuple[float, float]]:
    """The sizes (a point's largest distance to its box's sides) each level regresses: (4s, 8s] for stride s, the
    first level from 0 and the last to infinity (FCOS's P3 range ends at 64 = 8 x 8)."""
    ranges = [(4.0 * s, 8.0 * s) for s in strides]
    ranges[0] = (0.0, ranges[0][1])
    ranges[-1] = (ranges[-1][0], INF)
    return ranges


def group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(math.gcd(32, channels), channels)


class FCOSHead(nn.Module):
    """Two towers of `convs` 3x3 convs (GroupNorm, ReLU) shared over the levels; class logits from the first,
    box distances (ReLU of a per-level scale, times the stride) and centerness from the second."""

    def __init__(self, channels: int, num_classes: int, convs: int, strides: tuple[int, ...], prior: float = 0.01):
        super().__init__()
        self.strides = strides
        self.num_classes = num_classes

        def tower() -> nn.Sequential:
            layers: list[nn.Module] = []
            for _ in range(convs):
                layers += [nn.Conv2d(channels, channels, 3, padding=1), group_norm(channels), nn.ReLU()]
            return nn.Sequential(*layers)

        self.cls_tower, self.box_tower = tower(), tower()
        self.cls_logits = nn.Conv2d(channels, num_classes, 3, padding=1)
        self.box_pred = nn.Conv2d(channels, 4, 3, padding=1)
        self.centerness = nn.Conv2d(channels, 1, 3, padding=1)
        self.scales = nn.Parameter(torch.ones(len(strides)))
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.normal_(module.weight, std=0.01)
                nn.init.zeros_(module.bias)
        # Every point starts out predicting `prior` for each class, so the background's loss does not swamp the
        # first steps (RetinaNet's prior).
        nn.init.constant_(self.cls_logits.bias, -math.log((1 - prior) / prior))

    def forward(self, maps: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits, boxes, centers = [], [], []
        for level, (x, stride) in enumerate(zip(maps, self.strides, strict=True)):
            c, b = self.cls_tower(x), self.box_tower(x)
            logits.append(self.cls_logits(c).flatten(2).transpose(1, 2))
            distances = F.relu(self.scales[level] * self.box_pred(b)) * stride
            boxes.append(distances.flatten(2).transpose(1, 2))
            centers.append(self.centerness(b).flatten(1))
        return torch.cat(logits, 1), torch.cat(boxes, 1), torch.cat(centers, 1)

    def points(self, image_size: int) -> Points:
        return make_points(image_size, self.strides)


@dataclass(frozen=True)
class Points:
    """The head's points, level by level in row-major order (the order of its outputs): centres (P, 2) in pixels,
    strides (P,), and the size range (low, high] (P,) each regresses (`level_ranges`)."""

    centres: torch.Tensor
    strides: torch.Tensor
    low: torch.Tensor
    high: torch.Tensor

    def to(self, device: torch.device) -> Points:
        return Points(*(t.to(device) for t in (self.centres, self.strides, self.low, self.high)))


def make_points(image_size: int, strides: tuple[int, ...]) -> Points:
    """The points of a square input of `image_size` pixels over levels of `strides`."""
    centres, point_strides, low, high = [], [], [], []
    for s, (lo, hi) in zip(strides, level_ranges(strides), strict=True):
        side = image_size // s
        coords = (torch.arange(side, dtype=torch.float32) + 0.5) * s
        ys, xs = torch.meshgrid(coords, coords, indexing="ij")
        centres.append(torch.stack([xs.flatten(), ys.flatten()], 1))
        for values, value in ((point_strides, float(s)), (low, lo), (high, hi)):
            values.append(torch.full((side * side,), value))
    return Points(torch.cat(centres), torch.cat(point_strides), torch.cat(low), torch.cat(high))


def assign_targets(points: Points, boxes: torch.Tensor, radius: float = 1.5) -> tuple[torch.Tensor, torch.Tensor]:
    """One image's FCOS targets: (P,) class per point (-1: background) and (P, 4) distances l, t, r, b.

    A point is a candidate for a box when it lies inside the box and within `radius` strides of its centre (center
    sampling), and the box's size at that point (the largest distance) falls in the point's level range; among
    several candidate boxes the smallest by area wins. `boxes`: (M, 5) rows (x1, y1, x2, y2, class), negative class
    rows ignored.
    """
    boxes = boxes[boxes[:, 4] >= 0]
    centres = points.centres
    p = centres.shape[0]
    if boxes.shape[0] == 0:
        return torch.full((p,), -1, dtype=torch.long, device=centres.device), centres.new_zeros(p, 4)
    x, y = centres[:, 0:1], centres[:, 1:2]  # (P, 1)
    x1, y1, x2, y2 = boxes[:, 0], boxes[:, 1], boxes[:, 2], boxes[:, 3]  # (M,)
    distances = torch.stack([x - x1, y - y1, x2 - x, y2 - y], dim=2)  # (P, M, 4)
    inside = distances.min(dim=2).values > 0
    cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
    reach = points.strides[:, None] * radius
    near_centre = (
        (x > torch.maximum(cx - reach, x1)) & (x < torch.minimum(cx + reach, x2))
        & (y > torch.maximum(cy - reach, y1)) & (y < torch.minimum(cy + reach, y2))
    )  # fmt: skip
    size = distances.max(dim=2).values
    fits = (size > points.low[:, None]) & (size <= points.high[:, None])
    area = ((x2 - x1) * (y2 - y1)).expand(p, -1)
    area = torch.where(inside & near_centre & fits, area, torch.full_like(area, INF))
    smallest, which = area.min(dim=1)
    labels = boxes[which, 4].long()
    labels[smallest == INF] = -1
    return labels, distances[torch.arange(p, device=centres.device), which]


def centerness_target(distances: torch.Tensor) -> torch.Tensor:
    """sqrt(min(l, r) / max(l, r) x min(t, b) / max(t, b)): 1 at a box's centre, towards 0 at its edges."""
    lr, tb = distances[:, 0::2], distances[:, 1::2]
    ratio = (lr.min(1).values / lr.max(1).values) * (tb.min(1).values / tb.max(1).values)
    return ratio.clamp(min=0).sqrt()


def sigmoid_focal_loss(logits: torch.Tensor, targets: torch.Tensor, alpha: float = 0.25, gamma: float = 2.0):
    """RetinaNet's focal loss per element (summed by the caller): -alpha_t (1 - p_t)^gamma log(p_t)."""
    p = logits.sigmoid()
    ce = F.binary_cross_entropy_with_logits(logits, targets, reduction="none")
    p_t = p * targets + (1 - p) * (1 - targets)
    alpha_t = alpha * targets + (1 - alpha) * (1 - targets)
    return alpha_t * (1 - p_t) ** gamma * ce


def giou_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """1 - generalized IoU per row of two (N, 4) sets of l, t, r, b distances from the same points."""
    pl, pt, pr, pb = pred.unbind(1)
    tl, tt, tr, tb = target.unbind(1)
    pred_area = (pl + pr) * (pt + pb)
    target_area = (tl + tr) * (tt + tb)
    inter = (torch.minimum(pl, tl) + torch.minimum(pr, tr)).clamp(min=0) * (
        torch.minimum(pt, tt) + torch.minimum(pb, tb)
    ).clamp(min=0)
    union = pred_area + target_area - inter
    enclose = (torch.maximum(pl, tl) + torch.maximum(pr, tr)) * (torch.maximum(pt, tt) + torch.maximum(pb, tb))
    iou = inter / union.clamp(min=1e-6)
    return 1 - (iou - (enclose - union) / enclose.clamp(min=1e-6))


def fcos_losses(
    output: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    targets: torch.Tensor,
    points: Points,
) -> dict[str, torch.Tensor]:
    """The three FCOS losses of a batch in fp32: focal over every point and class divided by the positives, GIoU
    over the positives weighted by their centerness target, centerness BCE over the positives."""
    logits, distances, centers = (o.float() for o in output)
    labels, goals = zip(*(assign_targets(points, t) for t in targets.float()), strict=True)
    labels, goals = torch.stack(labels), torch.stack(goals)  # (B, P), (B, P, 4)
    positive = labels >= 0
    positives = max(int(positive.sum()), 1)
    one_hot = torch.zeros_like(logits)
    one_hot[positive] = F.one_hot(labels[positive], logits.shape[-1]).to(logits.dtype)
    cls = sigmoid_focal_loss(logits, one_hot).sum() / positives
    if not positive.any():  # no object in the batch: the box branches get zero loss (and gradients)
        zero = (distances.sum() + centers.sum()) * 0.0
        return {"cls": cls, "box": zero, "centerness": zero}
    goal = goals[positive]
    center_goal = centerness_target(goal)
    weight = center_goal.sum().clamp(min=1e-6)
    box = (giou_loss(distances[positive], goal) * center_goal).sum() / weight
    centerness = F.binary_cross_entropy_with_logits(centers[positive], center_goal, reduction="sum") / positives
    return {"cls": cls, "box": box, "centerness": centerness}


def box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(N, M) IoU of two sets of (x1, y1, x2, y2) boxes."""
    area_a = (a[:, 2] - a[:, 0]).clamp(min=0) * (a[:, 3] - a[:, 1]).clamp(min=0)
    area_b = (b[:, 2] - b[:, 0]).clamp(min=0) * (b[:, 3] - b[:, 1]).clamp(min=0)
    top_left = torch.maximum(a[:, None, :2], b[None, :, :2])
    bottom_right = torch.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = (bottom_right - top_left).clamp(min=0).prod(dim=2)
    return inter / (area_a[:, None] + area_b[None, :] - inter).clamp(min=1e-9)


def nms(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """Greedy non-maximum suppression: indices of the kept boxes, highest score first. A box is dropped when its
    IoU with a kept, higher-scoring box exceeds `iou_threshold`."""
    order = scores.argsort(descending=True)
    overlaps = (box_iou(boxes[order], boxes[order]) > iou_threshold).cpu()
    suppressed = torch.zeros(len(order), dtype=torch.bool)
    keep = []
    for i in range(len(order)):
        if suppressed[i]:
            continue
        keep.append(i)
        suppressed |= overlaps[i]
    return order[torch.tensor(keep, dtype=torch.long, device=order.device)]


def batched_nms(boxes: torch.Tensor, scores: torch.Tensor, classes: torch.Tensor, iou_threshold: float):
    """NMS within each class only: each class's boxes are shifted apart so that boxes of two classes never overlap."""
    if boxes.numel() == 0:
        return torch.zeros(0, dtype=torch.long, device=boxes.device)
    shift = classes.to(boxes.dtype)[:, None] * (boxes.max() + 1)
    return nms(boxes + shift, scores, iou_threshold)


def decode(
    output: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    points: Points,
    image_size: int,
    score_threshold: float = 0.05,
    iou_threshold: float = 0.6,
    max_detections: int = 100,
    candidates: int = 1000,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each image's detections: (boxes (K, 4) in input pixels, scores (K,), classes (K,)). Scores are
    sqrt(class probability x centerness); points whose class probability is under `score_threshold` are dropped,
    the best `candidates` kept, then class-wise NMS and the best `max_detections`."""
    logits, distances, centers = (o.float() for o in output)
    probs = logits.sigmoid()
    found = []
    for prob, dist, center in zip(probs, distances, centers, strict=True):
        point, cls = (prob > score_threshold).nonzero(as_tuple=True)
        score = (prob[point, cls] * center[point].sigmoid()).sqrt()
        if score.numel() > candidates:
            score, top = score.topk(candidates)
            point, cls = point[top], cls[top]
        xy, d = points.centres[point], dist[point]
        boxes = torch.cat([xy - d[:, :2], xy + d[:, 2:]], 1).clamp(0, image_size)
        keep = batched_nms(boxes, score, cls, iou_threshold)[:max_detections]
        found.append((boxes[keep], score[keep], cls[keep]))
    return found
