"""Face data: identity folders and zips, the identity split, decoding, verification pairs, prepared faces."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import shared_data
from tests.distributed_helpers import losses
from tests.face.helpers import face_config, make_faces
from vitrain.cli import main
from vitrain.data.faces import (
    Pairs,
    cfp_pairs,
    decode_faces,
    generate_pairs,
    open_face_images,
    open_face_tree,
    read_lfw_pairs,
    restrict_pairs,
    split_identities,
)
from vitrain.data.prepare import FAILED, prepare
from vitrain.data.prepared import PreparedSet, open_prepared
from vitrain.engine import Trainer
from vitrain.errors import DataError
from vitrain.tasks.face import FaceTask


def write_image(path: Path, size: tuple[int, int] = (6, 8), mode: str = "L", value: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, value if mode == "L" else (value, 255 - value, 7)).save(path)


def people(root: Path, counts: dict[str, int], suffix: str = ".png") -> Path:
    """root/<identity>/<1..n><suffix>, grey 6x8."""
    for identity, n in counts.items():
        for k in range(1, n + 1):
            write_image(root / identity / f"{k}{suffix}", value=k)
    return root


def one_line_error(call, *args) -> str:
    with pytest.raises(DataError) as caught:
        call(*args)
    message = str(caught.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------------------------------------- tree


def test_identities_and_their_images_are_natural_sorted(tmp_path):
    people(tmp_path / "orl", {"s1": 2, "s2": 10, "s10": 1})
    (tmp_path / "orl" / "README").write_text("The ORL database of faces")
    tree = open_face_tree(tmp_path / "orl")
    assert tree.identities == ["s1", "s2", "s10"]
    assert tree.files["s2"][:3] == ["s2/1.png", "s2/2.png", "s2/3.png"]
    assert tree.files["s2"][-1] == "s2/10.png"
    assert not tree.is_zip


def test_a_zip_lists_the_same_identities_with_member_names(tmp_path):
    people(tmp_path / "orl_faces", {"s1": 2, "s2": 3})
    (tmp_path / "orl_faces" / "README").write_text("not an image")
    archive = tmp_path / "orl.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for path in sorted((tmp_path / "orl_faces").rglob("*")):
            z.write(path, path.relative_to(tmp_path).as_posix())
    tree = open_face_tree(archive)
    assert tree.is_zip
    assert tree.identities == ["s1", "s2"]
    assert tree.files["s1"] == ["orl_faces/s1/1.png", "orl_faces/s1/2.png"]
    assert tree.location("orl_faces/s1/1.png") == f"{archive}:orl_faces/s1/1.png"


def test_the_identity_is_the_first_folder_below_the_common_folder(tmp_path):
    images = tmp_path / "cfp" / "Data" / "Images"
    for identity in ("001", "002"):
        for view, n in (("profile", 2), ("frontal", 3)):
            for k in range(1, n + 1):
                write_image(images / identity / view / f"{k:02d}.jpg")
    (tmp_path / "cfp" / "Protocol").mkdir()
    (tmp_path / "cfp" / "Protocol" / "Pair_list_F.txt").write_text("1 ../Data/Images/001/frontal/01.jpg\n")
    tree = open_face_tree(tmp_path)
    assert tree.identities == ["001", "002"]
    assert tree.files["001"] == [
        "cfp/Data/Images/001/frontal/01.jpg",
        "cfp/Data/Images/001/frontal/02.jpg",
        "cfp/Data/Images/001/frontal/03.jpg",
        "cfp/Data/Images/001/profile/01.jpg",
        "cfp/Data/Images/001/profile/02.jpg",
    ]


def test_a_missing_root_is_named(tmp_path):
    assert f"face data {tmp_path / 'nope'} does not exist" in one_line_error(open_face_tree, tmp_path / "nope")


def test_a_file_that_is_not_a_zip_is_refused(tmp_path):
    (tmp_path / "faces.zip").write_bytes(b"not a zip")
    assert "is not a readable zip file" in one_line_error(open_face_tree, tmp_path / "faces.zip")


def test_a_folder_without_images_is_refused(tmp_path):
    (tmp_path / "README").write_text("no faces here")
    assert "holds no images" in one_line_error(open_face_tree, tmp_path)


def test_one_identity_is_not_a_face_set(tmp_path):
    people(tmp_path, {"s1": 3})
    write_image(tmp_path / "cover.png")
    assert "has 1 identity folder (s1); a face set needs at least 2" in one_line_error(open_face_tree, tmp_path)


def test_images_without_identity_folders_are_refused(tmp_path):
    people(tmp_path, {"s1": 3})
    message = one_line_error(open_face_tree, tmp_path)
    assert f"face data {tmp_path / 's1'} holds its images directly, not in identity folders" in message


# ---------------------------------------------------------------------------------------------- split

IDENTITIES = [f"id{k}" for k in range(1, 21)]


def test_a_seeded_split_is_disjoint_sorted_and_fixed_by_the_seed():
    train, verify = split_identities(IDENTITIES, 5, "seeded", seed=0)
    assert len(verify) == 5 and len(train) == 15
    assert set(train) | set(verify) == set(IDENTITIES) and not set(train) & set(verify)
    assert verify == sorted(verify, key=lambda i: int(i[2:]))
    assert split_identities(IDENTITIES, 5, "seeded", seed=0) == (train, verify)
    assert split_identities(IDENTITIES, 5, "seeded", seed=1)[1] != verify


def test_a_last_split_verifies_on_the_last_identities():
    cfp = [f"{k:03d}" for k in range(1, 501)]
    train, verify = split_identities(cfp, 50, "last", seed=0)
    assert (train[0], train[-1], verify[0], verify[-1]) == ("001", "450", "451", "500")


def test_the_verification_count_must_leave_both_sides_identities():
    assert "task.verify_identities=20 is impossible with 20 identities; use 2 to 19" in one_line_error(
        split_identities, IDENTITIES, 20, "last", 0
    )
    assert "task.verify_identities=1" in one_line_error(split_identities, IDENTITIES, 1, "seeded", 0)
    assert "with 2 identities; verification needs 2 held-out identities and 1 to train on: add identity" in (
        one_line_error(split_identities, ["a", "b"], 2, "last", 0)
    )  # not "use 2 to 1"


# ---------------------------------------------------------------------------------------------- decode


def test_grey_faces_stay_one_channel_and_any_size_is_resized(tmp_path):
    write_image(tmp_path / "a" / "1.png", size=(92, 112), value=200)  # ORL's 92x112
    write_image(tmp_path / "b" / "1.png", size=(30, 10), value=50)
    tree = open_face_tree(tmp_path)
    faces = decode_faces(tree, ["a/1.png", "b/1.png"], in_chans=1, size=16, workers=1)
    assert faces.shape == (2, 1, 16, 16) and faces.dtype.is_floating_point is False
    assert faces[0].unique().tolist() == [200] and faces[1].unique().tolist() == [50]


def test_colour_faces_decode_to_three_channels(tmp_path):
    write_image(tmp_path / "a" / "1.png", mode="RGB", value=10)
    write_image(tmp_path / "b" / "1.png", mode="RGB", value=20)
    faces = decode_faces(open_face_tree(tmp_path), ["a/1.png"], in_chans=3, size=8, workers=1)
    assert faces.shape == (1, 3, 8, 8)
    assert faces[0, :, 0, 0].tolist() == [10, 245, 7]


def test_a_broken_image_is_named(tmp_path):
    people(tmp_path, {"a": 1, "b": 1})
    (tmp_path / "b" / "1.png").write_bytes(b"broken")
    message = one_line_error(decode_faces, open_face_tree(tmp_path), ["a/1.png", "b/1.png"], 1, 8, 1)
    assert f"cannot decode image {tmp_path / 'b' / '1.png'}" in message


# ---------------------------------------------------------------------------------------------- LFW pairs


@pytest.fixture
def lfw(tmp_path):
    return open_face_tree(people(tmp_path / "lfw", {"Alice": 3, "Bob": 2, "Carol": 10}))


def write_pairs(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pairs.txt"
    path.write_text(text)
    return path


def test_an_lfw_pairs_file_gives_names_same_flags_and_header_folds(tmp_path, lfw):
    # Header "2 1": 2 folds, each 1 matched line then 1 mismatched line; tabs or spaces separate fields.
    path = write_pairs(tmp_path, "2\t1\nAlice\t1\t3\nAlice 2 Bob 1\nCarol 2 10\nBob\t2\tCarol\t1\n")
    pairs = read_lfw_pairs(path, lfw)
    assert pairs.name == "pairs" and len(pairs) == 4
    assert pairs.left == ["Alice/1.png", "Alice/2.png", "Carol/2.png", "Bob/2.png"]
    assert pairs.right == ["Alice/3.png", "Bob/1.png", "Carol/10.png", "Carol/1.png"]
    assert pairs.same.tolist() == [True, False, True, False]
    assert pairs.folds.tolist() == [0, 0, 1, 1]


def test_pairs_without_fold_header_are_dealt_into_ten_balanced_folds(tmp_path, lfw):
    matched = ["Carol 1 2"] * 11
    mismatched = ["Alice 1 Bob 1"] * 11
    pairs = read_lfw_pairs(write_pairs(tmp_path, "11\n" + "\n".join(matched + mismatched) + "\n"), lfw)
    assert pairs.folds[pairs.same].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0]
    assert pairs.folds[~pairs.same].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0]


def test_a_pairs_file_may_have_no_header(tmp_path, lfw):
    pairs = read_lfw_pairs(write_pairs(tmp_path, "Bob 1 Carol 1\nAlice 1 2\n"), lfw)
    assert pairs.same.tolist() == [False, True]
    assert pairs.folds.tolist() == [0, 0]


def test_an_unknown_identity_names_the_file_line_and_root(tmp_path, lfw):
    path = write_pairs(tmp_path, "Alice 1 2\nDave 1 Bob 1\n")
    message = one_line_error(read_lfw_pairs, path, lfw)
    assert message.startswith(f"pairs file {path} line 2: unknown identity 'Dave'")
    assert str(lfw.root) in message


def test_an_image_index_past_the_identity_is_refused(tmp_path, lfw):
    path = write_pairs(tmp_path, "Alice 1 2\nAlice 1 Bob 3\n")
    assert f"pairs file {path} line 2: identity Bob has 2 images, no image 3" in one_line_error(
        read_lfw_pairs, path, lfw
    )


def test_a_malformed_line_shows_the_expected_formats(tmp_path, lfw):
    path = write_pairs(tmp_path, "Alice 1 2\nAlice 1\n")
    message = one_line_error(read_lfw_pairs, path, lfw)
    assert message.startswith(f"pairs file {path} line 2: expected 'name i j' (matched) or 'name1 i name2 j'")


def test_a_non_integer_index_is_refused(tmp_path, lfw):
    path = write_pairs(tmp_path, "Alice one 2\nAlice 1 Bob 1\n")
    assert f"pairs file {path} line 1: image index 'one' is not an integer" in one_line_error(read_lfw_pairs, path, lfw)


def test_a_header_that_miscounts_the_lines_is_refused(tmp_path, lfw):
    path = write_pairs(tmp_path, "10 300\nAlice 1 2\nAlice 1 Bob 1\n")
    assert f"pairs file {path} line 1: header '10 300' promises 6000 pair lines" in one_line_error(
        read_lfw_pairs, path, lfw
    )


def test_a_line_of_the_wrong_kind_for_its_header_block_is_refused(tmp_path, lfw):
    path = write_pairs(tmp_path, "1\nAlice 1 Bob 1\nAlice 1 2\n")
    assert f"pairs file {path} line 2: the header '1' puts a matched" in one_line_error(read_lfw_pairs, path, lfw)


# ---------------------------------------------------------------------------------------------- CFP pairs


def tiny_cfp(root: Path, with_protocol: bool = True) -> Path:
    """Two people, 2 frontal + 1 profile each; FF/FP folds k hold one same and one diff pair."""
    images = root / "cfp" / "Data" / "Images"
    for identity in ("001", "002"):
        for view, n in (("frontal", 2), ("profile", 1)):
            for k in range(1, n + 1):
                write_image(images / identity / view / f"{k:02d}.jpg")
    if not with_protocol:
        return root
    protocol = root / "cfp" / "Protocol"
    protocol.mkdir()
    frontal = [f"../Data/Images/{i}/frontal/{k:02d}.jpg" for i in ("001", "002") for k in (1, 2)]
    profile = [f"../Data/Images/{i}/profile/01.jpg" for i in ("001", "002")]
    (protocol / "Pair_list_F.txt").write_text("".join(f"{n} {p}\n" for n, p in enumerate(frontal, 1)))
    (protocol / "Pair_list_P.txt").write_text("".join(f"{n} {p}\n" for n, p in enumerate(profile, 1)))
    for fold in range(1, 11):
        ff, fp = protocol / "Split" / "FF" / f"{fold:02d}", protocol / "Split" / "FP" / f"{fold:02d}"
        ff.mkdir(parents=True)
        fp.mkdir(parents=True)
        (ff / "same.txt").write_text("1,2\n" if fold < 10 else "3,4\n")
        (ff / "diff.txt").write_text("1,3\n")
        (fp / "same.txt").write_text("3,2\n")
        (fp / "diff.txt").write_text("1,2\n")
    return root


def cfp_image(identity: str, view: str, k: int) -> str:
    return f"cfp/Data/Images/{identity}/{view}/{k:02d}.jpg"


def test_cfp_frontal_frontal_pairs_follow_the_protocol(tmp_path):
    pairs = cfp_pairs(open_face_tree(tiny_cfp(tmp_path)), "ff")
    assert pairs.name == "cfp-ff" and len(pairs) == 20
    assert pairs.folds.tolist() == [k for k in range(10) for _ in range(2)]
    assert pairs.same.tolist() == [True, False] * 10
    assert (pairs.left[0], pairs.right[0]) == (cfp_image("001", "frontal", 1), cfp_image("001", "frontal", 2))
    assert (pairs.left[1], pairs.right[1]) == (cfp_image("001", "frontal", 1), cfp_image("002", "frontal", 1))
    assert (pairs.left[18], pairs.right[18]) == (cfp_image("002", "frontal", 1), cfp_image("002", "frontal", 2))


def test_cfp_frontal_profile_pairs_take_the_second_image_from_the_profile_list(tmp_path):
    pairs = cfp_pairs(open_face_tree(tiny_cfp(tmp_path)), "fp")
    assert (pairs.left[0], pairs.right[0]) == (cfp_image("002", "frontal", 1), cfp_image("002", "profile", 1))
    assert (pairs.left[1], pairs.right[1]) == (cfp_image("001", "frontal", 1), cfp_image("002", "profile", 1))


def test_cfp_pairs_need_the_protocol_folder(tmp_path):
    message = one_line_error(cfp_pairs, open_face_tree(tiny_cfp(tmp_path, with_protocol=False)), "fp")
    assert "cfp-fp needs CFP's Protocol folder beside Data" in message


def test_the_real_cfp_last_fold_is_identities_451_to_500():
    tree = open_face_tree(shared_data("cfp-faces.zip"))
    _, verify = split_identities(tree.identities, 50, "last", seed=0)
    pairs = restrict_pairs(cfp_pairs(tree, "fp"), tree, verify)
    assert (int(pairs.same.sum()), int((~pairs.same).sum())) == (350, 350)
    assert np.bincount(pairs.folds[pairs.same]).tolist() == [35] * 10
    assert np.bincount(pairs.folds[~pairs.same]).tolist() == [35] * 10


# ---------------------------------------------------------------------------------------------- generated


@pytest.fixture
def crowd(tmp_path):
    return open_face_tree(people(tmp_path, {f"p{k}": 4 for k in range(1, 9)}))


def identity(name: str) -> str:
    return name.split("/")[0]


def test_generated_pairs_are_balanced_distinct_and_among_the_given_identities(crowd):
    chosen = ["p2", "p3", "p5", "p8"]
    pairs = generate_pairs(crowd, chosen, count=15, seed=0)
    assert (int(pairs.same.sum()), int((~pairs.same).sum())) == (15, 15)
    assert {identity(n) for n in pairs.left + pairs.right} <= set(chosen)
    assert all((identity(a) == identity(b)) == s for a, b, s in zip(pairs.left, pairs.right, pairs.same, strict=True))
    assert len({frozenset(p) for p in zip(pairs.left, pairs.right, strict=True)}) == 30
    assert np.bincount(pairs.folds[pairs.same]).tolist() == [2, 2, 2, 2, 2, 1, 1, 1, 1, 1]


def test_generated_pairs_are_fixed_by_the_seed(crowd):
    a = generate_pairs(crowd, crowd.identities, count=20, seed=7)
    b = generate_pairs(crowd, crowd.identities, count=20, seed=7)
    c = generate_pairs(crowd, crowd.identities, count=20, seed=8)
    assert (a.left, a.right) == (b.left, b.right)
    assert (a.left, a.right) != (c.left, c.right)


def test_generated_pairs_take_every_matched_pair_when_fewer_exist(crowd):
    pairs = generate_pairs(crowd, ["p1", "p2"], count=1000, seed=0)
    # 2 people x C(4, 2) = 12 matched pairs; 4 x 4 = 16 mismatched exist, 12 of them are drawn.
    assert (int(pairs.same.sum()), int((~pairs.same).sum())) == (12, 12)
    assert pairs.left[:3] == ["p1/1.png", "p1/1.png", "p1/1.png"]
    assert pairs.right[:3] == ["p1/2.png", "p1/3.png", "p1/4.png"]


# ---------------------------------------------------------------------------------------------- restrict


def test_restricting_keeps_pairs_inside_the_identities_and_redeals_the_folds(crowd):
    rows = [("p1/1.png", "p1/2.png", True), ("p1/1.png", "p2/1.png", False), ("p3/1.png", "p3/2.png", True)]
    rows += [("p3/1.png", "p4/1.png", False), ("p3/3.png", "p3/4.png", True), ("p4/2.png", "p3/2.png", False)]
    pairs = Pairs(
        name="hand",
        left=[a for a, _, _ in rows],
        right=[b for _, b, _ in rows],
        same=np.array([s for _, _, s in rows]),
        folds=np.array([0, 0, 9, 9, 9, 9]),
    )
    kept = restrict_pairs(pairs, crowd, ["p3", "p4"])
    assert kept.left == ["p3/1.png", "p3/1.png", "p3/3.png", "p4/2.png"]
    assert kept.same.tolist() == [True, False, True, False]
    assert kept.folds.tolist() == [0, 0, 1, 1]
    assert "none of the 6 hand pairs" in one_line_error(restrict_pairs, pairs, crowd, ["p5", "p6"])


# ---------------------------------------------------------------------------------------------- prepared
# Face data prepared once (`vitrain data prepare SRC DST --identities`) and trained on from its memory map.

TRAIN = {"epochs": 2, "max_steps": 4, "checkpoint_every_steps": 4}  # 40 training images, 16 a step: 2 steps/epoch
HELD_OUT = {"identity_split": "last"}  # person05..person07 verify, so the pairs file below is about them
PAIRS = "person05 1 2\nperson06 3 4\nperson07 2 8\nperson05 1 person06 2\nperson06 5 person07 1\nperson05 3 person07 4"


def _build(cfg) -> None:
    FaceTask(cfg).build_data(torch.device("cpu"), 0, 1)


def test_identities_become_the_classes_of_one_split_with_each_rows_name(tmp_path):
    src = tmp_path / "set" / "faces"  # identities sit one folder down; sub-folders of an identity are kept
    for name, value in [("s10/1.png", 1), ("s2/10.png", 2), ("s2/2.png", 3), ("s2/profile/1.png", 4), ("s9/1.png", 5)]:
        write_image(src / name, size=(8, 8), value=value)
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


@pytest.mark.parametrize("where", ["file", "file/ev"])
def test_eval_out_that_is_a_file_or_under_one_is_one_line_and_exit_2(runs, tmp_path, capsys, where):
    (tmp_path / "file").write_text("kept")
    assert main(["eval", str(runs / "on_prepared"), "--out", str(tmp_path / where)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"vitrain: error: --out {tmp_path / where}: "), err
    assert "is a file" in err[0] and (tmp_path / "file").read_text() == "kept"


def test_a_prepared_size_other_than_the_models_is_refused_naming_both(runs):
    cfg = face_config(runs, runs / "faces_prepared", "small", model={"image_size": 8})
    message = one_line_error(_build, cfg)
    assert "16x16 images with 1 channel(s) but model.image_size=8 and model.in_chans=1" in message
    assert "--size 8" in message


def test_cfp_pairs_on_a_prepared_copy_are_refused_pointing_at_the_zip(runs):
    cfg = face_config(runs, runs / "faces_prepared", "cfp", task={"pairs": ["cfp-fp"]})
    assert "point data.root at the CFP zip" in one_line_error(_build, cfg)


def test_class_data_prepared_without_identities_is_refused_as_face_data(runs, tmp_path):
    prepare(runs / "faces", tmp_path / "classes", workers=1)  # identity folders read as classes of 'train'
    cfg = face_config(runs, tmp_path / "classes", "classes")
    assert "--identities" in one_line_error(_build, cfg)
