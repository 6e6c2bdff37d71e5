"""Face recognition: an embedding backbone, a margin-softmax identity head (sharded, sampled), verification at FAR.

Training identities and verification identities are disjoint (task.verify_identities held out). Evaluation embeds
every image of the verification pair sets (task.pairs) and reports, per set, the 10-fold accuracy and TPR at
FAR 0.1 / 0.01 / 0.001; the best checkpoint is the one with the highest accuracy on the first set. At the end of
training the same figures for a raw-pixel cosine baseline are reported beside them (task.baseline), with
verification.json and an ROC plot in the run folder. data.root may also be a folder made from identity folders by
`vitrain data prepare SRC DST --identities`: images are then read from its memory map instead of decoded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from vitrain.config import Config
from vitrain.data.augment import BatchAugment
from vitrain.data.faces import (
    FaceImages,
    Pairs,
    cfp_pairs,
    generate_pairs,
    open_face_images,
    read_lfw_pairs,
    restrict_pairs,
    split_identities,
)
from vitrain.data.loader import BatchLoader
from vitrain.data.sources import SPLIT_SEED
from vitrain.errors import ConfigError, DataError
from vitrain.models import build_model
from vitrain.models.heads import Margin
from vitrain.parallel import distributed
from vitrain.parallel.identity_head import IdentityHead
from vitrain.tasks.verify import embed_images, pixel_embeddings, score_pair_sets, summary_line, write_report


def read_pair_sets(
    specs: tuple[str, ...] | list[str], faces: FaceImages, identities: list[str] | None, count: int
) -> list[Pairs]:
    """The pair sets named in task.pairs; with `identities`, only pairs among them (the held-out identities)."""
    tree, sets = faces.tree, []
    for spec in specs:
        if spec == "generated":
            pairs = generate_pairs(tree, identities or tree.identities, count, SPLIT_SEED)
        elif spec in ("cfp-ff", "cfp-fp"):
            pairs = cfp_pairs(tree, spec.removeprefix("cfp-"))
        else:
            if faces.failed:  # LFW image numbers count an identity's images: one missing shifts the rest
                raise DataError(
                    f"pairs file {spec} numbers each identity's images, but {faces.failed} image(s) of the prepared "
                    f"data {tree.root} failed to decode (failed.txt); fix them and prepare again, or use data.root="
                    "the original identity folders"
                )
            pairs = read_lfw_pairs(spec, tree)
        if identities is not None and spec != "generated":
            pairs = restrict_pairs(pairs, tree, identities)
        matched, folds = int(pairs.same.sum()), len(set(pairs.folds.tolist()))
        if matched == 0 or matched == len(pairs) or folds < 2:
            raise DataError(
                f"pair set {pairs.name} ({spec}) holds {matched} matched and {len(pairs) - matched} mismatched pairs "
                f"in {folds} folds among the verification identities; verification needs both kinds in 2 or more "
                "folds: raise task.generated_pairs or task.verify_identities, or use another pair source"
            )
        if pairs.name in {p.name for p in sets}:
            raise DataError(f"task.pairs names two pair sets {pairs.name}; give each pairs file its own file name")
        sets.append(pairs)
    return sets


class VerificationImages:
    """The images of some pair sets, each image once, with its row by name."""

    def __init__(self, faces: FaceImages, pair_sets: list[Pairs]):
        names = sorted({name for pairs in pair_sets for name in (*pairs.left, *pairs.right)})
        self.row_of = {name: i for i, name in enumerate(names)}
        self.images = faces.read(names)
        self.pair_sets = pair_sets


class FaceTask:
    name = "face"
    best_metric = "val_acc"
    higher_is_better = True
    summary_defaults: dict[str, Any] = {}

    def __init__(self, cfg: Config, model: Any = None, data: Any = None):
        self.cfg = cfg
        self.model = model  # a module or factory from the library caller; None: the one model.name names
        if data is not None:
            raise ConfigError("task.name=face reads identity folders from data.root; it takes no data= object")
        self.head: IdentityHead | None = None
        self.num_identities = 0
        self.verification: VerificationImages | None = None

    @staticmethod
    def check(cfg: Config) -> None:
        """The face fields of the task section, and what face recognition asks of the data and parallelism."""
        k = cfg.task
        if cfg.train.eval_flip:  # it was ignored here: verification has its own flips
            raise ConfigError(
                "train.eval_flip averages a classifier's logits; face verification adds each mirror image's embedding "
                "by task.flip_fusion: set train.eval_flip=false"
            )
        if k.embed_dim <= 0:
            raise ConfigError(f"task.embed_dim={k.embed_dim} must be positive")
        if not 0.0 < k.sample_rate <= 1.0:
            raise ConfigError(f"task.sample_rate={k.sample_rate} must be in (0, 1]; 1 uses every identity centre")
        if k.scale <= 0:
            raise ConfigError(f"task.scale={k.scale} must be positive")
        if not 0.0 <= k.arcface_m < 3.14159:
            raise ConfigError(f"task.arcface_m={k.arcface_m} must be in [0, pi): an angle in radians, e.g. 0.5")
        if not 0.0 <= k.cosface_m < 1.0:  # a margin on a cosine: at 1 or more no angle leaves the target ahead
            raise ConfigError(f"task.cosface_m={k.cosface_m} must be in [0, 1), e.g. 0.35")
        m1, m2, m3 = k.combined_m
        if m1 <= 0 or m2 < 0 or m3 < 0:
            raise ConfigError(
                f"task.combined_m={list(k.combined_m)} needs m1 > 0, m2 >= 0, m3 >= 0, e.g. [1.0, 0.3, 0.2]"
            )
        if k.verify_identities < 2:
            raise ConfigError(
                f"task.verify_identities={k.verify_identities} must be >= 2 (a mismatched pair needs two identities)"
            )
        if k.generated_pairs < 10:
            raise ConfigError(f"task.generated_pairs={k.generated_pairs} must be >= 10 (10 folds of matched pairs)")
        if not k.pairs:
            raise ConfigError("task.pairs is empty; use [generated], cfp-ff, cfp-fp or an LFW-format pairs file")
        if cfg.data.source not in ("folder", "recordio"):
            raise ConfigError(
                "task.name=face reads identity folders or an insightface RecordIO set: set data.source=folder or "
                f"recordio and data.root=PATH, not {cfg.data.source}"
            )
        if cfg.data.mixup_alpha or cfg.data.cutmix_alpha:
            raise ConfigError(
                "task.name=face trains on one identity per image: set data.mixup_alpha=0 data.cutmix_alpha=0"
            )
        if cfg.data.loader != "fast":
            raise ConfigError("task.name=face reads identity folders with the fast loader: set data.loader=fast")
        if cfg.parallel.pipeline_stages > 1:
            raise ConfigError(
                f"task.name=face with parallel.pipeline_stages={cfg.parallel.pipeline_stages} is not supported (its "
                "identity head and loss live outside the model); set parallel.pipeline_stages=1"
            )
        if cfg.model.name != "vit":
            raise ConfigError(
                f"task.name=face builds vitrain's ViT with an embedding neck; model.name={cfg.model.name} is for "
                "classification (set model.name=vit)"
            )

    def build_data(self, device: torch.device, rank: int, world_size: int) -> BatchLoader:
        cfg, k, m, d = self.cfg, self.cfg.task, self.cfg.model, self.cfg.data
        faces = open_face_images(d.root, m.in_chans, m.image_size, d.decode_workers, d.verify)
        tree = faces.tree
        train_ids, verify_ids = split_identities(tree.identities, k.verify_identities, k.identity_split, SPLIT_SEED)
        names = [name for identity in train_ids for name in tree.files[identity]]
        labels = [i for i, identity in enumerate(train_ids) for _ in tree.files[identity]]
        train = faces.dataset(names, torch.tensor(labels, dtype=torch.long), train_ids)
        self.num_identities = len(train_ids)
        self.verify_ids = verify_ids
        self.verification = VerificationImages(faces, read_pair_sets(k.pairs, faces, verify_ids, k.generated_pairs))
        self.device = device
        return BatchLoader(
            train,
            cfg.train.batch_size,
            BatchAugment(d, m.in_chans, True, m.image_size, self.num_identities),
            device,
            shuffle=True,
            seed=cfg.train.seed,
            rank=rank,
            world_size=world_size,
            prefetch=d.prefetch,
            repeats=d.repeated_aug,
        )

    def build_model(self) -> nn.Module:
        return build_model(self.cfg.model, embed_dim=self.cfg.task.embed_dim, model=self.model)

    def build_head(self, device: torch.device) -> IdentityHead:
        k = self.cfg.task
        head = IdentityHead(
            self.num_identities, k.embed_dim, Margin.from_config(k), k.sample_rate, k.shard_head, self.cfg.train.seed
        )
        self.head = head.to(device)
        return self.head

    def loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        assert self.head is not None, "build_head first"
        return self.head(output, labels)

    def evaluate(self, forward: nn.Module, final: bool, out_dir: Path) -> dict[str, Any]:
        k = self.cfg.task
        reports, lines = score(forward, self.cfg, self.verification, self.device, baseline=final and k.baseline)
        if final and distributed.rank() == 0:
            write_report(out_dir, *reports, {"verify_identities": self.verify_ids, "lines": lines})
        self._lines = lines
        metrics: dict[str, Any] = {"val_acc": reports[0][self.verification.pair_sets[0].name]["accuracy"]}
        for key, report in reports[0].items():
            prefix = "val_" + key.replace(" ", "_")
            metrics[f"{prefix}_acc"] = report["accuracy"]
            for point in report["tpr_at_far"]:
                metrics[f"{prefix}_tpr@far={point['far']:g}"] = point["tpr"]
            metrics[f"{prefix}_tpr@far"] = " ".join(report["tpr@far"])
        return metrics

    def eval_line(self, metrics: dict[str, Any]) -> str:
        return "verification on held-out identities: " + " | ".join(self._lines)

    def describe_data(self) -> str:
        v = self.verification
        pairs = ", ".join(f"{p.name} {len(p)} pairs" for p in v.pair_sets)
        return f"{self.num_identities} training identities, {len(self.verify_ids)} held out ({pairs})"


def score(
    forward: nn.Module, cfg: Config, verification: VerificationImages, device: torch.device, baseline: bool
) -> tuple[tuple[dict[str, Any], dict[str, Any]], list[str]]:
    """((reports, ROC curves), summary lines) of the model's embeddings, and of raw pixels with `baseline`."""
    m, k, v = cfg.model, cfg.task, verification
    normalize = BatchAugment(cfg.data, m.in_chans, False, m.image_size, 1)
    embeddings = embed_images(forward, v.images, normalize, cfg.train.batch_size, device, k.flip_fusion)
    models = {"model": embeddings}
    if baseline:
        models["raw pixels"] = pixel_embeddings(v.images, normalize)
    reports, curves = score_pair_sets(v.pair_sets, v.row_of, models)
    return (reports, curves), [summary_line(key, report) for key, report in reports.items()]


def verify(
    model: nn.Module, cfg: Config, device: torch.device, root: Path | None, pairs: list[str] | None, out_dir: Path
) -> dict[str, Any]:
    """`vitrain eval` of a face model: verification pairs on `root` (any identity folders, every identity), or
    without a root on the run's own data.root and held-out identities; the raw-pixel baseline beside it."""
    k, m, d = cfg.task, cfg.model, cfg.data
    faces = open_face_images(d.root if root is None else root, m.in_chans, m.image_size, d.decode_workers, d.verify)
    tree = faces.tree
    identities: list[str] | None = None  # another face set: every identity
    if root is None:
        _, identities = split_identities(tree.identities, k.verify_identities, k.identity_split, SPLIT_SEED)
    specs = pairs or (list(k.pairs) if root is None else ["generated"])
    verification = VerificationImages(faces, read_pair_sets(specs, faces, identities, k.generated_pairs))
    reports, lines = score(model, cfg, verification, device, baseline=k.baseline)
    path = write_report(out_dir, *reports, {"root": str(tree.root), "pairs": specs, "lines": lines})
    for line in lines:
        print(line)
    return {"lines": lines, "report": str(path), "reports": reports[0]}
