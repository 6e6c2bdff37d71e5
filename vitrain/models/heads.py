"""Margin-softmax heads for face recognition: ArcFace, CosFace, combined (m1, m2, m3) and plain normalized softmax."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vitrain.config import TaskConfig

# Cosines are kept inside (-1, 1): arccos and the sine in ArcFace have infinite slopes at the ends.
COS_LIMIT = 1.0 - 1e-7


@dataclass(frozen=True)
class Margin:
    """The target-logit transform of insightface's combined margin: s x (cos(m1 theta + m2) - m3).

    arcface = (1, m, 0), cosface = (1, 0, m), softmax = (1, 0, 0) (normalized softmax, "NormFace").
    """

    kind: str
    scale: float
    m1: float = 1.0
    m2: float = 0.0
    m3: float = 0.0

    @classmethod
    def from_config(cls, task: TaskConfig) -> Margin:
        if task.margin == "arcface":
            return cls("arcface", task.scale, m2=task.arcface_m)
        if task.margin == "cosface":
            return cls("cosface", task.scale, m3=task.cosface_m)
        if task.margin == "combined":
            m1, m2, m3 = task.combined_m
            return cls("combined", task.scale, m1, m2, m3)
        return cls("softmax", task.scale)

    def target(self, cos: torch.Tensor) -> torch.Tensor:
        """The margined cosine of each sample's own identity (before the scale)."""
        if self.kind == "cosface":
            return cos - self.m3
        if self.kind == "arcface":
            # cos(theta + m) while theta + m < pi; beyond, a straight continuation keeps the logit decreasing in
            # theta (cos(theta + m) would turn back up and reward a worse angle).
            sin = (1.0 - cos * cos).clamp_min(0.0).sqrt()
            shifted = cos * math.cos(self.m2) - sin * math.sin(self.m2)
            return torch.where(cos > math.cos(math.pi - self.m2), shifted, cos - math.sin(math.pi - self.m2) * self.m2)
        if self.kind == "combined":
            theta = torch.acos(cos)
            margined = torch.cos(self.m1 * theta + self.m2) - self.m3
            edge = (math.pi - self.m2) / self.m1  # the angle where m1 theta + m2 reaches pi
            if edge >= math.pi:
                return margined
            # Past the edge cos(m1 theta + m2) turns back up (a worse angle would earn a larger logit): continue from
            # its value there, -1 - m3, straight in the cosine, as ArcFace's continuation does.
            return torch.where(theta < edge, margined, cos - math.cos(edge) - 1.0 - self.m3)
        return cos

    def logits(self, cos: torch.Tensor, target_col: torch.Tensor) -> torch.Tensor:
        """s x cosines with the margin applied where `target_col` (per row; -1: none here) names the true column."""
        cos = cos.clamp(-COS_LIMIT, COS_LIMIT)
        rows = (target_col >= 0).nonzero().squeeze(1)
        if rows.numel():
            cols = target_col[rows]
            cos = cos.index_put((rows, cols), self.target(cos[rows, cols]))
        return cos * self.scale
