"""Face test helpers: a folder of generated grey faces and the face task's config on the suite's tiny ViT."""

from __future__ import annotations

import dataclasses

import numpy as np
from PIL import Image

from tests.conftest import TINY_MODEL, model_section
from vitrain.config import load_config

STEPS = {"epochs": 6, "max_steps": 6, "checkpoint_every_steps": 3}  # 40 training images, 16 a step: 2 steps/epoch
# The tiny ViT pooling the mean of the patch tokens; the face task sizes its identity head itself (no num_classes).
MODEL = dataclasses.replace(TINY_MODEL, pool="gap")
MODEL_FIELDS = ("image_size", "patch_size", "in_chans", "width", "depth", "heads", "pool")


def make_faces(root, identities=8, per_identity=8, size=16, seed=0):
    """Grey 'faces': each identity a fixed random pattern, each image that pattern plus noise and a small shift."""
    rng = np.random.default_rng(seed)
    for i in range(identities):
        pattern = rng.uniform(0, 255, (size, size))
        folder = root / f"person{i:02d}"
        folder.mkdir(parents=True)
        for j in range(per_identity):
            image = np.roll(pattern, rng.integers(-1, 2), axis=1) + rng.normal(0, 40, (size, size))
            Image.fromarray(image.clip(0, 255).astype(np.uint8), "L").save(folder / f"{j + 1}.png")
    return root


def face_config(out_dir, root, name, batch_size=16, **sections):
    raw = {
        "name": name,
        "task": {"name": "face", "embed_dim": 16, "scale": 8.0, "verify_identities": 3, "generated_pairs": 20},
        "model": model_section(MODEL, MODEL_FIELDS),
        "data": {"source": "folder", "root": str(root), "decode_workers": 1},
        "train": {"batch_size": batch_size, "threads": 1, "keep_checkpoints": 10, **STEPS},
        "precision": {"mode": "fp32"},
        "log": {"out_dir": str(out_dir), "every_steps": 1, "progress": False},
    }
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return load_config(base=raw)
