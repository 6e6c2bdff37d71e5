"""Face data prepared once (`vitrain data prepare SRC DST --identities`) and trained on from its memory map."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from tests.distributed_helpers import losses
from tests.test_face import face_config, make_faces
from vitrain.cli import main
from vitrain.data.faces import open_face_images
from vitrain.data.prepare import FAILED, prepare
from vitrain.data.prepared import PreparedSet, open_prepared
from vitrain.engine import Trainer
from vitrain.errors import DataError
from vitrain.tasks.face import FaceTask

TRAIN = {"epochs": 2, "max_steps": 4, "checkpoint_every_steps": 4}  # 40 training images, 16 a step: 2 steps/epoch
HELD_OUT = {"identity_split": "last"}  # person05..person07 verify, so the pairs file below is about them
PAIRS = "person05 1 2\nperson06 3 4\nperson07 2 8\nperson05 1 person06 2\nperson06 5 person07 1\nperson05 3 person07 4"


def _write(path, value: int, size: int = 8) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((size, size), value, dtype=np.uint8), "L").save(path)


def _one_line(call, *args) -> str:
    with pytest.raises(DataError) as caught:
        call(*args)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def _build(cfg) -> None:
    FaceTask(cfg).build_data(torch.device("cpu"), 0, 1)


def test_identities_become_the_classes_of_one_split_with_each_rows_name(tmp_path):
    src = tmp_path / "set" / "faces"  # identities sit one folder down; sub-folders of an identity are kept
    for name, value in [("s10/1.png", 1), ("s2/10.png", 2), ("s2/2.png", 3), ("s2/profile/1.png", 4), ("s9/1.png", 5)]:
        _write(src / name, value)
    (src / "README.txt").write_text("not an image")
    args = ["data", "prepare", str(tmp_path / "set"), str(tmp_path / "out"), "--identities", "--workers", "1"]
    assert main(args) == 0

    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["layout"] == "identities" and list(manifest["splits"]) == ["all"]
    assert manifest["classes"] == ["s2", "s9", "s10"]
    names = ["faces/s2/2.png", "faces/s2/10.png", "faces/s2/profile/1.png", "faces/s9/1.png", "faces/s10/1.png"]
    assert manifest["splits"]["all"]["names"] == names
    images, labels = open_prepared(tmp_path / "out")["all"].read(torch.arange(5))
    assert labels.tolist() == [0, 0, 0, 1, 2]
    assert images[:, 0, 0, 0].tolist() == [3, 2, 4, 5, 1] and images.shape == (5, 1, 8, 8)


def test_an_image_that_does_not_decode_is_listed_in_failed_and_has_no_row(tmp_path):
    make_faces(tmp_path / "faces", identities=2, per_identity=3, size=8)
    bad = tmp_path / "faces" / "person01" / "2.png"
    bad.write_bytes(b"\x89PNG broken")
    result = prepare(tmp_path / "faces", tmp_path / "out", workers=1, identities=True)
    assert [where for where, _ in result.failed] == [str(bad)]
    assert (tmp_path / "out" / FAILED).read_text().startswith(f"{bad}\t")
    faces = open_face_images(tmp_path / "out", in_chans=1, size=8)
    assert faces.tree.files["person01"] == ["person01/1.png", "person01/3.png"]
    assert len(faces.read(["person00/2.png", "person01/3.png"])) == 2


def test_an_interrupted_identity_preparation_resumes_to_the_same_rows(tmp_path):
    make_faces(tmp_path / "faces", identities=3, per_identity=3, size=8)

    def stop(_: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare(tmp_path / "faces", tmp_path / "out", workers=1, shard_size=2, identities=True, progress=stop)
    assert len(list((tmp_path / "out").glob("*.done.json"))) == 1
    result = prepare(tmp_path / "faces", tmp_path / "out", workers=1, shard_size=2, identities=True)
    assert (result.shards_done_before, result.shards_converted) == (1, 4)
    prepare(tmp_path / "faces", tmp_path / "straight", workers=1, identities=True)
    resumed, straight = (open_face_images(tmp_path / d, 1, 8) for d in ("out", "straight"))
    assert resumed.tree.files == straight.tree.files
    names = [n for files in straight.tree.files.values() for n in files]
    assert torch.equal(resumed.read(names), straight.read(names))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("face_prepared")
    root = make_faces(out_dir / "faces")
    (out_dir / "pairs.txt").write_text(PAIRS)
    prepare(root, out_dir / "faces_prepared", size=16, workers=1, identities=True)
    task = {**HELD_OUT, "pairs": ["generated", str(out_dir / "pairs.txt")]}
    for name, data_root in (("on_folder", root), ("on_prepared", out_dir / "faces_prepared")):
        Trainer(face_config(out_dir, data_root, name, train=TRAIN, task=task)).fit()
    return out_dir


def test_training_on_the_prepared_copy_gives_the_losses_of_the_folder(runs):
    folder, prepared = losses(runs / "on_folder"), losses(runs / "on_prepared")
    assert sorted(folder) == sorted(prepared) == [1, 2, 3, 4]
    for step, loss in folder.items():
        assert prepared[step] == pytest.approx(loss, abs=1e-6), step


def test_verification_on_the_prepared_copy_matches_the_folder_for_generated_and_lfw_pairs(runs):
    folder, prepared = (json.loads((runs / name / "summary.json").read_text()) for name in ("on_folder", "on_prepared"))
    for key in ("val_generated_acc", "val_pairs_acc", "val_pairs_raw_pixels_acc"):
        assert prepared[key] == pytest.approx(folder[key], abs=1e-9), key
    report = json.loads((runs / "on_prepared" / "verification.json").read_text())
    assert report["reports"]["pairs"]["matched"] == report["reports"]["pairs"]["mismatched"] == 3


def test_the_prepared_training_set_is_read_from_the_memory_map(runs):
    cfg = face_config(runs, runs / "faces_prepared", "loader", train=TRAIN, task=HELD_OUT)
    train = FaceTask(cfg).build_data(torch.device("cpu"), 0, 1).data
    assert isinstance(train, PreparedSet) and len(train) == 40 and train.classes[0] == "person00"
    assert train.labels.tolist() == [i for i in range(5) for _ in range(8)]


def test_eval_of_a_run_on_prepared_data_verifies_its_held_out_identities(runs, tmp_path):
    assert main(["eval", str(runs / "on_prepared"), "--out", str(tmp_path / "ev")]) == 0
    report = json.loads((tmp_path / "ev" / "verification.json").read_text())
    assert report["reports"]["pairs"]["pairs"] == 6


def test_a_prepared_size_other_than_the_models_is_refused_naming_both(runs):
    cfg = face_config(runs, runs / "faces_prepared", "small", model={"image_size": 8})
    message = _one_line(_build, cfg)
    assert "16x16 images with 1 channel(s) but model.image_size=8 and model.in_chans=1" in message
    assert "--size 8" in message


def test_cfp_pairs_on_a_prepared_copy_are_refused_pointing_at_the_zip(runs):
    cfg = face_config(runs, runs / "faces_prepared", "cfp", task={"pairs": ["cfp-fp"]})
    assert "point data.root at the CFP zip" in _one_line(_build, cfg)


def test_class_data_prepared_without_identities_is_refused_as_face_data(runs, tmp_path):
    prepare(runs / "faces", tmp_path / "classes", workers=1)  # identity folders read as classes of 'train'
    cfg = face_config(runs, tmp_path / "classes", "classes")
    assert "--identities" in _one_line(_build, cfg)
