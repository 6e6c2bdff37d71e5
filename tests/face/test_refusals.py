"""Face refusals in one line (thin pair sets, timm export, sharded LAMB) and fine-tuning from a classifier."""

from __future__ import annotations

import pytest
import torch

from tests.face.helpers import face_config, make_faces
from vitrain.cli import main
from vitrain.config import OptimConfig
from vitrain.data.faces import open_face_tree, split_identities
from vitrain.data.sources import SPLIT_SEED
from vitrain.engine import Trainer
from vitrain.errors import ConfigError, DataError
from vitrain.models import create_model
from vitrain.models.heads import Margin
from vitrain.optim import build_head_optimizer
from vitrain.parallel.identity_head import IdentityHead


def test_a_pairs_file_with_no_mismatched_pair_among_the_held_out_identities_is_refused(tmp_path):
    root = make_faces(tmp_path / "faces")
    train_ids, held_out = split_identities(open_face_tree(root).identities, 3, "seeded", SPLIT_SEED)
    pairs = tmp_path / "only_matched.txt"  # mismatched pairs exist, but each involves a training identity
    lines = [f"{name} 1 2\n" for name in held_out] + [f"{name} 1 {train_ids[0]} 2\n" for name in held_out]
    pairs.write_text("".join(lines))
    cfg = face_config(tmp_path, root, "thin", task={"pairs": [str(pairs)]})
    with pytest.raises(DataError, match=r"pair set only_matched .* 3 matched and 0 mismatched .* needs both kinds"):
        Trainer(cfg)


def test_timm_export_of_a_face_model_is_refused_in_one_line(tmp_path, capsys):
    root = make_faces(tmp_path / "faces")
    Trainer(face_config(tmp_path, root, "run", train={"max_steps": 1})).fit()
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out"), "--format", "timm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no timm VisionTransformer equivalent" in err[0] and "--format vitrain" in err[0]


def test_a_face_model_starts_from_a_classifier_and_keeps_its_neck_fresh(tmp_path):
    from safetensors.torch import save_file

    cfg = face_config(tmp_path, make_faces(tmp_path / "faces"), "init")
    classifier = create_model(cfg.model)
    save_file(classifier.state_dict(), str(tmp_path / "classifier.safetensors"))
    cfg.model.init_from = str(tmp_path / "classifier.safetensors")
    trainer = Trainer(cfg)
    assert torch.equal(trainer.model.blocks[0].attn.qkv.weight.cpu(), classifier.blocks[0].attn.qkv.weight)


def test_lamb_on_a_sharded_head_is_refused():
    head = IdentityHead(10, 4, Margin("cosface", 8.0, m3=0.2))
    head.sharded = True  # as on 2 or more ranks
    with pytest.raises(ConfigError, match=r"optim.name=lamb .* task.shard_head=false"):
        build_head_optimizer(head, OptimConfig(name="lamb"), torch.device("cpu"))


@pytest.mark.parametrize("margin", ["-0.1", "1.0", "1e12"])
def test_a_cosface_margin_outside_0_to_1_is_refused(margin):
    from vitrain.config import CONFIG_DIR, load_config

    with pytest.raises(ConfigError, match=rf"task.cosface_m={float(margin)} must be in \[0, 1\), e\.g\. 0\.35"):
        load_config(CONFIG_DIR / "face-orl.yaml", ["task.margin=cosface", f"task.cosface_m={margin}"])


def test_eval_flip_is_refused_for_face_verification_which_flips_by_flip_fusion():
    from vitrain.config import CONFIG_DIR, load_config

    with pytest.raises(ConfigError, match=r"adds each mirror image's embedding by task.flip_fusion: set train.eval_f"):
        load_config(CONFIG_DIR / "face-orl.yaml", ["train.eval_flip=true"])  # it was ignored
