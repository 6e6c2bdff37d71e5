"""Detection data: VOC and COCO reading, letterboxing, box-moving augmentation, and each bad input's one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.conftest import shared_data
from tests.detection_helpers import TINY_VITDET, write_coco, write_voc
from vitrain.config import load_config
from vitrain.data.detection import DetectionAugment, detection_source, flip_boxes, jitter_one, letterbox
from vitrain.errors import DataError


def detection_cfg(root: Path, *extra: str):
    return load_config(
        None,
        [
            "task.name=detection",
            "data.source=detection",
            f"data.root={root}",
            "data.val_split=val",
            *TINY_VITDET,
            *extra,
        ],
    )


def coco_image(image_id: int, width: int = 80, height: int = 40) -> dict:
    return {"id": image_id, "file_name": f"{image_id}.png", "width": width, "height": height}


def coco_box(ann_id: int, image_id: int, bbox: list[float], category: int = 1) -> dict:
    return {"id": ann_id, "image_id": image_id, "category_id": category, "bbox": bbox, "iscrowd": 0}


def test_voc_split_is_read_with_sorted_classes_and_boxes_scaled_to_the_letterbox(tmp_path: Path):
    root = write_voc(tmp_path, {"train": 3, "val": 2}, size=(80, 60))
    train, val = detection_source(detection_cfg(root))
    assert (len(train), len(val)) == (3, 2)
    assert train.classes == ["cell", "dot"]
    assert train.images.shape == (3, 3, 64, 64)
    assert train.scales.tolist() == pytest.approx([0.8] * 3)  # longer side 80 -> 64
    first = train.records[0].boxes[0]
    row = train.targets[0, 0]
    # VOC's 1-based xmin becomes the pixel edge xmin - 1; every coordinate then scaled by 0.8
    assert row[:4].tolist() == pytest.approx([first.x1 * 0.8, first.y1 * 0.8, first.x2 * 0.8, first.y2 * 0.8])
    assert int(row[4]) == first.label


def test_letterbox_keeps_the_aspect_and_pads_bottom_right(tmp_path: Path):
    write_coco(tmp_path, "x", [coco_image(1, 80, 40)], [])
    pixels, scale = letterbox((tmp_path / "x" / "1.png").read_bytes(), 64)
    assert scale == pytest.approx(0.8)
    assert pixels.shape == (3, 64, 64)
    assert (pixels[:, :32] == 128).all() and (pixels[:, 32:] == 0).all()  # 40 x 0.8 = 32 rows of image


def test_coco_categories_map_to_classes_in_id_order(tmp_path: Path):
    for split in ("train", "val"):
        write_coco(tmp_path, split, [coco_image(5)], [coco_box(9, 5, [10, 4, 20, 8], category=7)])
    train, _ = detection_source(detection_cfg(tmp_path))
    assert train.classes == ["cell", "dot"]
    assert train.targets[0, 0].tolist() == pytest.approx([8.0, 3.2, 24.0, 9.6, 1.0])
    truth = train.coco_ground_truth()
    assert truth["annotations"][0]["bbox"] == [10.0, 4.0, 20.0, 8.0]  # original pixels for COCOeval
    # Category ids that are names, repeated by the annotations' category_id, read as they did before the checks.
    named = [{"id": "c", "name": "cell"}, {"id": "d", "name": "dot"}]
    for split in ("train", "val"):
        write_coco(tmp_path, split, [coco_image(5)], [coco_box(9, 5, [10, 4, 20, 8], category="d")], named)
    train, _ = detection_source(detection_cfg(tmp_path))
    assert train.classes == ["cell", "dot"] and train.targets[0, 0, 4].item() == 1.0


@pytest.mark.parametrize(
    ("annotation", "message"),
    [
        (coco_box(3, 1, [70, 4, 20, 8]), "annotation id 3: box (70, 4, 90, 12) lies outside its 80x40 image"),
        (coco_box(4, 1, [10, 4, -5, 8]), "annotation id 4: box width -5 and height 8: a negative size"),
        (coco_box(5, 2, [10, 4, 5, 8]), "annotation id 5: names image id 2, which is not in the file's images"),
        (coco_box(6, 1, [10, 4, 5, 8], category=3), "annotation id 6: names category id 3, which is not in"),
        (coco_box(7, 1, ["a", 4, 5, 8]), "annotation id 7: bbox ['a', 4, 5, 8] is not 4 numbers [x, y, width, height]"),
        (coco_box(8, 1, [10, 4, 5]), "annotation id 8: bbox [10, 4, 5] is not 4 numbers"),
        (coco_box(9, 1, None), "annotation id 9: bbox None is not 4 numbers"),
        (coco_box(10, 1, [float("nan"), 4, 5, 8]), "annotation id 10: box (nan, 4, nan, 12) has a corner that is not"),
        ("oops", "annotations[0]: is 'oops', not an object with image_id, category_id, bbox"),
    ],
)
def test_each_bad_coco_annotation_stops_with_one_line_naming_file_and_id(tmp_path: Path, annotation, message):
    path = write_coco(tmp_path, "train", [coco_image(1)], [annotation])
    write_coco(tmp_path, "val", [coco_image(1)], [])
    with pytest.raises(DataError) as error:
        detection_source(detection_cfg(tmp_path))
    assert str(error.value).startswith(f"{path} {message}")
    assert "data.skip_bad" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda data: [1, 2], " holds a JSON list, not a COCO-format object with images, annotations and"),
        (lambda data: data["images"][0].pop("id") and data, ": images[0]: id is missing"),
        (
            lambda data: data["images"].append(data["images"][0]) or data,
            ": images[1] (id 1): image id 1 is listed twice",
        ),
        (lambda data: data["categories"][0].pop("name") and data, ": categories[0] (id 1): name is missing"),
    ],
    ids=["list", "image-without-id", "image-twice", "category-without-name"],
)
def test_a_coco_file_of_the_wrong_structure_is_one_line_naming_file_and_entry(tmp_path: Path, damage, message):
    path = write_coco(tmp_path, "train", [coco_image(1)], [coco_box(3, 1, [1, 1, 5, 5])])
    write_coco(tmp_path, "val", [coco_image(1)], [])
    path.write_text(json.dumps(damage(json.loads(path.read_text()))))
    with pytest.raises(DataError) as error:
        detection_source(detection_cfg(tmp_path))
    assert str(error.value).startswith(f"{path}{message}") and "\n" not in str(error.value)


def test_skip_bad_counts_the_bad_annotations_and_trains_on_the_rest(tmp_path: Path):
    bad = [coco_box(3, 1, [70, 4, 20, 8]), coco_box(4, 1, [10, 4, -5, 8])]
    write_coco(tmp_path, "train", [coco_image(1)], [*bad, coco_box(5, 1, [1, 1, 5, 5])])
    write_coco(tmp_path, "val", [coco_image(1)], [])
    train, _ = detection_source(detection_cfg(tmp_path, "data.skip_bad=2"))
    assert len(train.records[0].boxes) == 1
    assert [line.split(": ")[1].split()[-1] for line in train.skipped.lines()] == ["3", "4"]
    with pytest.raises(DataError, match="annotation id 4: .* data.skip_bad=1 bad annotations were already skipped"):
        detection_source(detection_cfg(tmp_path, "data.skip_bad=1"))


def test_zero_size_boxes_are_reported_and_skipped_without_skip_bad(tmp_path: Path):
    write_coco(tmp_path, "train", [coco_image(1)], [coco_box(8, 1, [10, 4, 0, 8]), coco_box(9, 1, [1, 1, 5, 5])])
    write_coco(tmp_path, "val", [coco_image(1)], [])
    train, _ = detection_source(detection_cfg(tmp_path))
    assert len(train.records[0].boxes) == 1
    assert train.skipped.lines() == [f"data: skipped {tmp_path}/annotations/instances_train.json annotation id 8: "
                                     "zero-size box (width 0, height 8)"]  # fmt: skip


def test_an_empty_image_list_is_an_error_naming_the_file(tmp_path: Path):
    path = write_coco(tmp_path, "train", [], [])
    with pytest.raises(DataError, match=f"^{path} lists no images"):
        detection_source(detection_cfg(tmp_path))


def test_a_missing_image_file_is_an_error_naming_the_image_id(tmp_path: Path):
    path = write_coco(tmp_path, "train", [coco_image(1)], [])
    (tmp_path / "train" / "1.png").unlink()
    with pytest.raises(DataError, match=f"^{path}: image id 1 names file 1.png, which is not under"):
        detection_source(detection_cfg(tmp_path))


def test_a_voc_box_outside_its_image_names_the_xml_and_object(tmp_path: Path):
    root = write_voc(tmp_path, {"train": 1, "val": 1}, size=(80, 60))
    xml = root / "Annotations" / "img_000.xml"
    xml.write_text(xml.read_text().replace("<xmax>", "<xmax>9", 1))
    with pytest.raises(DataError, match=f"^{xml} object 0: box .* lies outside its 80x60 image"):
        detection_source(detection_cfg(root))


def test_a_voc_size_other_than_the_images_is_named(tmp_path: Path):
    # Boxes are checked against <size> but scaled by the decoded image: a larger <size> let boxes lie outside it.
    root = write_voc(tmp_path, {"train": 1, "val": 1}, size=(80, 60))
    xml = root / "Annotations" / "img_000.xml"
    xml.write_text(xml.read_text().replace("<width>80</width>", "<width>160</width>"))
    with pytest.raises(DataError, match=r"^image .*img_000.png is 80x60 but its annotation gives 160x60 \(its <size>"):
        detection_source(detection_cfg(root))


@pytest.mark.parametrize(
    ("pattern", "new", "message"),
    [
        (r"<xmax>[^<]*</xmax>", "<xmax>nan</xmax>", r"object 0: box \(.*, nan, .*\) has a corner that is not a finite"),
        (r"<xmax>[^<]*</xmax>", "<xmax>inf</xmax>", r"object 0: box \(.*, inf, .*\) has a corner that is not a finite"),
        (r"<name>[^<]*</name>", "", r"object 0: has no <name> \(the object's class\)"),
    ],
    ids=["nan", "inf", "no-name"],
)
def test_a_voc_object_without_finite_corners_or_a_name_names_the_xml(tmp_path: Path, pattern, new, message):
    root = write_voc(tmp_path, {"train": 1, "val": 1}, size=(80, 60))
    xml = root / "Annotations" / "img_000.xml"
    xml.write_text(re.sub(pattern, new, xml.read_text(), count=1))
    with pytest.raises(DataError, match=f"^{xml} {message}.*; fix the annotation") as error:
        detection_source(detection_cfg(root))
    assert "\n" not in str(error.value)


def test_hflip_mirrors_boxes_and_leaves_padding_rows_alone():
    targets = torch.tensor([[[4.0, 2.0, 10.0, 6.0, 1.0], [-1.0, -1.0, -1.0, -1.0, -1.0]]])
    flipped = flip_boxes(targets, 64)
    assert flipped[0, 0].tolist() == [54.0, 2.0, 60.0, 6.0, 1.0]
    assert flipped[0, 1].tolist() == [-1.0] * 5


def test_flip_in_the_augment_moves_the_pixels_with_the_box(tmp_path: Path):
    cfg = detection_cfg(tmp_path, "data.hflip=1.0", "data.mean=[0]", "data.std=[1]")
    images = torch.zeros(1, 3, 64, 64, dtype=torch.uint8)
    images[0, :, 2:6, 4:10] = 255
    out, boxes = DetectionAugment(cfg, train=True)(
        images, torch.tensor([[[4.0, 2.0, 10.0, 6.0, 0.0]]]), torch.Generator()
    )
    x1, y1, x2, y2 = (int(v) for v in boxes[0, 0, :4])
    assert (x1, y1, x2, y2) == (54, 2, 60, 6)
    assert out[0, 0, y1:y2, x1:x2].min() == 1.0 and out[0, 0].sum() == (x2 - x1) * (y2 - y1)


def test_jitter_down_scales_boxes_and_pads():
    image = torch.zeros(3, 64, 64)
    image[:, 8:24, 16:32] = 1.0
    out, boxes = jitter_one(image, torch.tensor([[16.0, 8.0, 32.0, 24.0, 1.0]]), 0.5, torch.zeros(2))
    assert out.shape == (3, 64, 64)
    assert boxes[0].tolist() == [8.0, 4.0, 16.0, 12.0, 1.0]
    assert out[0, 5:11, 9:15].min() > 0.99 and out[0, 32:].abs().sum() == 0


def test_jitter_up_crops_moves_and_clips_boxes_and_drops_those_cut_away():
    image = torch.zeros(3, 64, 64)
    boxes = torch.tensor([[16.0, 8.0, 32.0, 24.0, 1.0], [0.0, 0.0, 4.0, 4.0, 0.0]])
    out, moved = jitter_one(image, boxes, 2.0, torch.tensor([0.25, 0.125]))  # crop from x0 = 16, y0 = 8
    assert out.shape == (3, 64, 64)
    assert moved[0].tolist() == [16.0, 8.0, 48.0, 40.0, 1.0]
    assert moved[1].tolist() == [-1.0] * 5  # (0, 0, 8, 8) after scaling, then left of the crop: gone


def test_bccd_reads_its_split_and_reports_its_degenerate_boxes():
    zip_path = shared_data("bccd-detection.zip")
    cfg = detection_cfg(zip_path, "data.train_split=test", "data.val_split=val")
    test, val = detection_source(cfg)
    assert (len(test), len(val)) == (72, 87)
    assert test.classes == ["Platelets", "RBC", "WBC"]
    lines = test.skipped.lines()
    assert len(lines) == 2 and all("zero-size box" in line for line in lines)
    assert "BloodImage_00338.xml object" in " ".join(lines)


def test_an_image_that_does_not_decode_is_named(tmp_path: Path):
    root = write_voc(tmp_path, {"train": 2, "val": 1})
    (root / "JPEGImages" / "img_001.png").write_bytes(b"not a picture")
    with pytest.raises(DataError, match=r"^cannot decode image .*img_001.png \(not an image PIL can read\)"):
        detection_source(detection_cfg(root))


def test_decoding_in_worker_processes_gives_the_same_pixels(tmp_path: Path):
    from vitrain.data.detection import letterbox_files
    from vitrain.data.sources import ImageTree

    root = write_voc(tmp_path, {"train": 300})  # two chunks of 256
    tree = ImageTree(root)
    names = sorted(n for n in tree.names if n.endswith(".png"))
    one, scales = letterbox_files(tree, names, 32, workers=1)
    two, _ = letterbox_files(tree, names, 32, workers=2)
    assert torch.equal(one, two) and scales.shape == (300,)


def write_yolo(root: Path, lines: dict[str, str]) -> Path:
    """images/<split>/<stem>.png (80 x 40) and labels/<split>/<stem>.txt for each 'split/stem' key; data.yaml."""
    from tests.detection_helpers import drawn_image

    for key, text in lines.items():
        split, stem = key.split("/")
        drawn_image(root / "images" / split / f"{stem}.png", 80, 40, [])
        (root / "labels" / split).mkdir(parents=True, exist_ok=True)
        (root / "labels" / split / f"{stem}.txt").write_text(text)
    (root / "data.yaml").write_text("names: [cell, dot]\n")
    return root


def test_yolo_labels_are_read_in_fractions_of_the_image(tmp_path: Path):
    root = write_yolo(tmp_path, {"train/a": "1 0.5 0.5 0.25 0.5\n", "val/b": "0 0.1 0.1 0.1 0.1\n"})
    train, val = detection_source(detection_cfg(root))
    assert train.classes == ["cell", "dot"] and (len(train), len(val)) == (1, 1)
    assert train.targets[0, 0].tolist() == pytest.approx([24.0, 8.0, 40.0, 24.0, 1.0])  # (30, 10, 50, 30) x 0.8


def test_a_yolo_class_out_of_range_names_the_label_file_and_line(tmp_path: Path):
    root = write_yolo(tmp_path, {"train/a": "0 0.5 0.5 0.2 0.2\n5 0.5 0.5 0.2 0.2\n", "val/b": ""})
    with pytest.raises(DataError, match=r"labels/train/a.txt line 2: names class 5, but the data has classes 0 to 1"):
        detection_source(detection_cfg(root))


def test_a_yolo_label_without_its_image_is_named(tmp_path: Path):
    root = write_yolo(tmp_path, {"train/a": "0 0.5 0.5 0.2 0.2\n", "val/b": ""})
    (root / "labels" / "train" / "ghost.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    with pytest.raises(DataError, match=r"labels/train/ghost.txt: names an image that is not in images/"):
        detection_source(detection_cfg(root))


def test_detection_data_for_another_task_is_refused_in_one_line(tmp_path: Path):
    from vitrain.errors import ConfigError

    with pytest.raises(
        ConfigError, match="^data.source=detection reads boxes for task.name=detection, not task.name=cl"
    ):
        load_config(None, ["data.source=detection", f"data.root={tmp_path}"])


def test_pixel_only_augmentation_is_refused_for_detection(tmp_path: Path):
    from vitrain.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^data.crop_padding=4 changes the pixels but not the boxes; .* turn it off"):
        detection_cfg(tmp_path, "data.crop_padding=4")


def test_a_voc_tree_without_split_lists_holds_out_val_fraction(tmp_path: Path):
    import shutil

    root = write_voc(tmp_path, {"all": 10})
    shutil.rmtree(root / "ImageSets")
    train, val = detection_source(detection_cfg(root, "data.val_fraction=0.3"))
    assert (len(train), len(val)) == (7, 3)
    assert not {r.name for r in train.records} & {r.name for r in val.records}
    assert train.skipped.held_out.startswith("data: no 'val' split beside 'train' in data.root (it has no other")


def test_a_voc_tree_listing_one_split_but_not_the_other_is_refused(tmp_path: Path):
    # A share of every image held out as validation would include images of train.txt (or the other way round).
    root = write_voc(tmp_path, {"train": 6, "val": 2})
    (root / "ImageSets" / "Main" / "val.txt").unlink()
    (root / "ImageSets" / "Main" / "cat_train.txt").write_text("img_000 1\n")  # VOC's per-class lists: not splits
    with pytest.raises(DataError, match=r"has ImageSets/Main/train.txt but no val.txt \(it has train\); add val.txt"):
        detection_source(detection_cfg(root))


def test_a_box_sticking_out_by_under_a_pixel_is_clipped_not_refused(tmp_path: Path):
    write_coco(tmp_path, "train", [coco_image(1)], [coco_box(1, 1, [-0.5, 30, 10, 10.75])])  # 80 x 40 image
    write_coco(tmp_path, "val", [coco_image(1)], [])
    train, _ = detection_source(detection_cfg(tmp_path))
    box = train.records[0].boxes[0]
    assert (box.x1, box.y1, box.x2, box.y2) == (0.0, 30.0, 9.5, 40.0)
