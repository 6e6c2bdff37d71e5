"""FCOS pieces by value: target assignment, focal and GIoU losses, NMS against brute force, decoding, COCO AP."""

from __future__ import annotations

import math

import pytest
import torch

from vitrain.models.fcos import (
    Points,
    assign_targets,
    batched_nms,
    box_iou,
    centerness_target,
    decode,
    fcos_losses,
    giou_loss,
    level_ranges,
    make_points,
    nms,
    sigmoid_focal_loss,
)


def one_level(centres: list[tuple[float, float]], stride: float = 8.0, low: float = 0.0, high: float = 1e9) -> Points:
    n = len(centres)
    return Points(torch.tensor(centres), torch.full((n,), stride), torch.full((n,), low), torch.full((n,), high))


def test_level_ranges_are_fcos_sizes_by_stride():
    assert level_ranges((4, 8, 16, 32)) == [(0.0, 32.0), (32.0, 64.0), (64.0, 128.0), (128.0, math.inf)]


def test_points_are_cell_centres_level_by_level():
    points = make_points(32, (8, 16))
    assert points.centres[:2].tolist() == [[4.0, 4.0], [12.0, 4.0]]
    assert points.centres[16:].tolist() == [[8.0, 8.0], [24.0, 8.0], [8.0, 24.0], [24.0, 24.0]]
    assert points.strides.tolist() == [8.0] * 16 + [16.0] * 4


def test_assignment_by_hand_inside_centre_region_and_smallest_box():
    # A big box 0..40 and a small box 10..20 inside it; stride 8, centre radius 1.5 x 8 = 12.
    boxes = torch.tensor([[0.0, 0.0, 40.0, 40.0, 0.0], [10.0, 10.0, 20.0, 20.0, 1.0], [-1, -1, -1, -1, -1.0]])
    points = one_level([(15.0, 15.0), (30.0, 30.0), (5.0, 5.0), (50.0, 50.0)])
    labels, distances = assign_targets(points, boxes)
    # (15, 15): in both, the small one wins; (30, 30): big only, within 12 of its centre 20; (5, 5): inside the big
    # box but 15 from its centre (outside the sampling radius); (50, 50): outside both.
    assert labels.tolist() == [1, 0, -1, -1]
    assert distances[0].tolist() == [5.0, 5.0, 5.0, 5.0]
    assert distances[1].tolist() == [30.0, 30.0, 10.0, 10.0]


def test_assignment_respects_the_level_size_range():
    boxes = torch.tensor([[0.0, 0.0, 40.0, 40.0, 0.0]])
    small_level = one_level([(20.0, 20.0)], high=16.0)  # the box's size at its centre is 20: not this level's
    assert assign_targets(small_level, boxes)[0].tolist() == [-1]
    assert assign_targets(one_level([(20.0, 20.0)], low=16.0, high=32.0), boxes)[0].tolist() == [0]


def test_centerness_target_by_value():
    target = centerness_target(torch.tensor([[5.0, 5.0, 5.0, 5.0], [2.0, 4.0, 8.0, 4.0]]))
    assert target.tolist() == pytest.approx([1.0, math.sqrt(2 / 8)])


def test_focal_loss_by_value():
    logits, targets = torch.tensor([0.0, 2.0]), torch.tensor([1.0, 0.0])
    p = torch.sigmoid(torch.tensor(2.0)).item()
    expected = [0.25 * 0.5**2 * math.log(2), 0.75 * p**2 * -math.log(1 - p)]
    assert sigmoid_focal_loss(logits, targets).tolist() == pytest.approx(expected, rel=1e-5)


def test_giou_loss_by_value():
    same = torch.tensor([[2.0, 2.0, 2.0, 2.0]])
    assert giou_loss(same, same).item() == pytest.approx(0.0, abs=1e-6)
    # From one point: a 4x4 box (2 each side) and a 2x2 one (1 each side): IoU 4/16, enclosure = union.
    assert giou_loss(same, torch.tensor([[1.0, 1.0, 1.0, 1.0]])).item() == pytest.approx(0.75)
    # Boxes touching only at the point: 0..2 left of it and 0..2 right of it, both 2 high: IoU 0, enclosure 4 x 2,
    # union 8 -> GIoU 0 - 0 = 0: loss 1
    left, right = torch.tensor([[2.0, 1.0, 0.0, 1.0]]), torch.tensor([[0.0, 1.0, 2.0, 1.0]])
    assert giou_loss(left, right).item() == pytest.approx(1.0)


def brute_force_nms(boxes: torch.Tensor, scores: torch.Tensor, threshold: float) -> list[int]:
    kept: list[int] = []
    for i in sorted(range(len(scores)), key=lambda j: -scores[j].item()):
        if all(box_iou(boxes[i : i + 1], boxes[k : k + 1]).item() <= threshold for k in kept):
            kept.append(i)
    return kept


# slow: 7 s on a Zen 4; NMS's own cases run in the default suite
@pytest.mark.slow
def test_nms_matches_a_brute_force_reference():
    generator = torch.Generator().manual_seed(0)
    corners = torch.rand(200, 2, generator=generator) * 100
    boxes = torch.cat([corners, corners + 5 + torch.rand(200, 2, generator=generator) * 30], 1)
    scores = torch.rand(200, generator=generator)
    for threshold in (0.3, 0.5, 0.7):
        assert nms(boxes, scores, threshold).tolist() == brute_force_nms(boxes, scores, threshold)


def test_batched_nms_never_suppresses_across_classes():
    boxes = torch.tensor([[0.0, 0.0, 10.0, 10.0], [0.0, 0.0, 10.0, 10.0], [0.0, 0.0, 10.0, 10.0]])
    kept = batched_nms(boxes, torch.tensor([0.9, 0.8, 0.7]), torch.tensor([0, 1, 0]), 0.5)
    assert kept.tolist() == [0, 1]


def test_decode_turns_a_confident_point_into_its_box():
    points = one_level([(20.0, 20.0), (40.0, 40.0)])
    logits = torch.tensor([[[-9.0, 9.0], [-9.0, -9.0]]])
    distances = torch.tensor([[[5.0, 6.0, 7.0, 8.0], [1.0, 1.0, 1.0, 1.0]]])
    centers = torch.tensor([[9.0, 0.0]])
    [(boxes, scores, classes)] = decode((logits, distances, centers), points, 64)
    assert boxes.tolist() == [[15.0, 14.0, 27.0, 28.0]] and classes.tolist() == [1]
    assert scores.item() == pytest.approx(torch.sigmoid(torch.tensor(9.0)).item())


def test_losses_are_finite_and_an_empty_batch_still_gives_a_cls_loss():
    points = make_points(32, (4, 8, 16, 32))
    n = points.centres.shape[0]
    output = (torch.zeros(2, n, 3, requires_grad=True), torch.ones(2, n, 4), torch.zeros(2, n))
    targets = torch.full((2, 2, 5), -1.0)
    targets[0, 0] = torch.tensor([4.0, 4.0, 20.0, 28.0, 2.0])
    losses = fcos_losses(output, targets, points)
    assert all(math.isfinite(v.item()) and v.item() > 0 for v in losses.values())
    empty = fcos_losses(output, torch.full((2, 2, 5), -100.0), points)  # the loader's PAD_LABEL rows
    assert empty["box"].item() == 0.0 and empty["cls"].item() > 0


def test_coco_ap_of_a_perfect_prediction_is_one(tmp_path):
    pytest.importorskip("pycocotools", reason="COCO AP needs pycocotools: pip install 'vitrain[detection]'")
    from tests.detection_helpers import write_voc
    from tests.test_detection_data import detection_cfg
    from vitrain.data.detection import detection_source
    from vitrain.tasks.detection import coco_metrics

    _, val = detection_source(detection_cfg(write_voc(tmp_path, {"train": 1, "val": 3})))
    found = []
    for record in val.records:
        boxes = torch.tensor([[b.x1, b.y1, b.x2, b.y2] for b in record.boxes])
        found.append((boxes, torch.ones(len(boxes)), torch.tensor([b.label for b in record.boxes])))
    metrics = coco_metrics(val, found)
    assert metrics["val_ap"] == pytest.approx(1.0) and metrics["val_ap50"] == pytest.approx(1.0)
    assert metrics["val_ap75"] == pytest.approx(1.0)
    shifted = [(b + 6.0, s, c) for b, s, c in found]  # off by 6 px on 8-24 px boxes: far below AP 1
    assert coco_metrics(val, shifted)["val_ap"] < 0.5
