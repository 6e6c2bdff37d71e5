"""Detection AP against pycocotools' COCOeval on the original annotations: what vitrain reads and hands to COCOeval
must score hand-made cases as COCOeval scores the files themselves (crowd regions, COCO's area, VOC's difficult)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from tests.detection_helpers import drawn_image, voc_xml
from tests.test_detection_data import coco_image, detection_cfg
from vitrain.data.detection import detection_source
from vitrain.tasks.detection import METRICS, coco_metrics

pytest.importorskip("pycocotools", reason="COCO AP needs pycocotools: pip install 'vitrain[detection]'")


def cocoeval_stats(truth: dict, detections: list[dict]) -> list[float]:
    """AP, AP50, AP75, AP small/medium/large of pycocotools' COCOeval on `truth` as given."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO()
        gt.dataset = truth
        gt.createIndex()
        scored = COCOeval(gt, gt.loadRes(detections), "bbox")
        scored.evaluate()
        scored.accumulate()
        scored.summarize()
    return [float(v) for v in scored.stats[:6]]


def vitrain_stats(val, detections: list[dict]) -> list[float]:
    """The same figures by vitrain: `detections` (COCO results, category ids class + 1) as coco_metrics takes them."""
    found = []
    for record in val.records:
        mine = [d for d in detections if d["image_id"] == record.image_id]
        boxes = torch.tensor([[x, y, x + w, y + h] for x, y, w, h in (d["bbox"] for d in mine)]).reshape(-1, 4)
        scores = torch.tensor([d["score"] for d in mine])
        found.append((boxes, scores, torch.tensor([d["category_id"] - 1 for d in mine], dtype=torch.long)))
    metrics = coco_metrics(val, found)
    return [metrics[name] for name in METRICS]


def truth_of(image_id: int, annotations: list[tuple[list[float], float, int]]) -> dict:
    """A one-image, one-class COCO file: (bbox, area, iscrowd) per annotation."""
    return {
        "images": [coco_image(image_id, 200, 200)],
        "categories": [{"id": 1, "name": "cell"}],
        "annotations": [
            {"id": i + 1, "image_id": image_id, "category_id": 1, "bbox": bbox, "area": area, "iscrowd": crowd}
            for i, (bbox, area, crowd) in enumerate(annotations)
        ],
    }


def write_coco_splits(root: Path, truth: dict) -> None:
    for split in ("train", "val"):
        for image in truth["images"]:
            drawn_image(root / split / image["file_name"], image["width"], image["height"], [])
        (root / "annotations").mkdir(parents=True, exist_ok=True)
        (root / "annotations" / f"instances_{split}.json").write_text(json.dumps(truth))


def test_a_detection_on_a_crowd_region_is_ignored_as_cocoeval_ignores_it(tmp_path: Path):
    truth = truth_of(1, [([10, 10, 40, 40], 1600, 0), ([100, 100, 80, 80], 6400, 1)])
    detections = [{"image_id": 1, "category_id": 1, "bbox": [10, 10, 40, 40], "score": 0.8},
                  {"image_id": 1, "category_id": 1, "bbox": [110, 110, 50, 50], "score": 0.9}]  # fmt: skip
    write_coco_splits(tmp_path, truth)
    train, val = detection_source(detection_cfg(tmp_path))
    assert vitrain_stats(val, detections) == pytest.approx(cocoeval_stats(truth, detections))
    # the crowd region is scored as an ignore region but is no object to learn
    assert (train.targets[0, :, 4] >= 0).sum().item() == 1


def test_cocos_area_field_not_the_box_picks_the_size_bucket(tmp_path: Path):
    # a 40x40 box whose mask covers 900 px is a small object to COCOeval (area < 32^2), not a medium one
    truth = truth_of(1, [([10, 10, 40, 40], 900.0, 0), ([100, 100, 30, 30], 800.0, 0)])
    detections = [{"image_id": 1, "category_id": 1, "bbox": [10, 10, 40, 40], "score": 0.9}]
    write_coco_splits(tmp_path, truth)
    _, val = detection_source(detection_cfg(tmp_path))
    assert vitrain_stats(val, detections) == pytest.approx(cocoeval_stats(truth, detections))


def test_a_missed_voc_difficult_object_is_ignored_yet_still_trained_on(tmp_path: Path):
    top = tmp_path / "voc"
    drawn_image(top / "JPEGImages" / "a.png", 200, 200, [])
    xml = voc_xml("a.png", 200, 200, [("cell", 11, 11, 50, 50), ("cell", 101, 101, 150, 150)])
    xml = xml.replace("<bndbox><xmin>101", "<difficult>1</difficult><bndbox><xmin>101")
    (top / "Annotations").mkdir(parents=True)
    (top / "Annotations" / "a.xml").write_text(xml)
    (top / "ImageSets" / "Main").mkdir(parents=True)
    for split in ("train", "val"):
        (top / "ImageSets" / "Main" / f"{split}.txt").write_text("a\n")
    train, val = detection_source(detection_cfg(top))
    image_id = val.records[0].image_id
    # VOC's convention (and detectron2's evaluator): a difficult object neither counts as missed nor as matched
    truth = truth_of(image_id, [([10, 10, 40, 40], 1600, 0), ([100, 100, 50, 50], 2500, 1)])
    detections = [{"image_id": image_id, "category_id": 1, "bbox": [10, 10, 40, 40], "score": 0.9}]
    assert vitrain_stats(val, detections) == pytest.approx(cocoeval_stats(truth, detections))
    assert (train.targets[0, :, 4] >= 0).sum().item() == 2  # trained on, as detectron2 does


def test_no_detections_score_0_where_objects_are_and_minus_1_for_a_size_without_any(tmp_path: Path):
    # Two small objects: AP 0 overall and small, -1 (COCO's "no such object") for medium and large; it read 0.0.
    truth = truth_of(1, [([10, 10, 40, 40], 900.0, 0), ([100, 100, 30, 30], 800.0, 0)])
    write_coco_splits(tmp_path, truth)
    _, val = detection_source(detection_cfg(tmp_path))
    missed = [{"image_id": 1, "category_id": 1, "bbox": [150, 10, 20, 20], "score": 0.9}]  # COCOeval needs a result
    assert vitrain_stats(val, []) == [0.0, 0.0, 0.0, 0.0, -1.0, -1.0] == pytest.approx(cocoeval_stats(truth, missed))
