"""Detection data: COCO-format JSON (native) or Pascal VOC XML read into letterboxed uint8 images and padded boxes.

Layouts under data.root (a folder or a .zip of one, possibly inside one top folder):

- COCO: `annotations/instances_<split>.json` or `<split>.json`; each image's `file_name` is looked up under
  `<split>/`, `images/`, then beside the annotations' folder.
- Pascal VOC: `Annotations/<name>.xml`, `JPEGImages/<filename>`, and the split's image names in
  `ImageSets/Main/<split>.txt` (without one, data.val_fraction of the images is held out as validation).
- YOLO (Ultralytics' layout): `images/<split>/*`, `labels/<split>/<stem>.txt` (`class x_centre y_centre width
  height` in fractions of the image), the class names in `data.yaml` (`names:`) or `classes.txt`.

The class list is read from the data (COCO's categories by id; VOC's object names, sorted). Every image is resized
with its aspect kept so that its longer side is model.image_size, then zero-padded at the bottom and right to a
square of that side (ViTDet pads the same way); its boxes are scaled by the same factor. Boxes travel as a
(N, M, 5) float tensor of (x1, y1, x2, y2, class) rows in input pixels, padded with rows of class -1, so that
batches stay tensors and the fast loader's order, prefetch and exact resume work unchanged.

Bad annotations (a box outside its image, a negative width or height, an unknown image or category) stop the
run with one line naming the file and the annotation id, or with data.skip_bad=K up to K of them are skipped and
named in log.txt. Zero-size boxes (a click without a drag in the labelling tool: two in BCCD) are always named and
skipped: they describe no object.
"""

from __future__ import annotations

import io
import json
import math
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from vitrain.config import Config
from vitrain.data.sources import (
    IMAGE_SUFFIXES,
    ImageTree,
    Skipped,
    decode_failure,
    decode_pool,
    file_reader,
    held_out_line,
    held_out_split,
    location,
)
from vitrain.errors import DataError

# A box may stick out of its image by this much (labelling tools' rounding, COCO's float corners): it is clipped.
OUTSIDE_SLACK_PX = 1.0


@dataclass
class Box:
    x1: float
    y1: float
    x2: float
    y2: float
    label: int
    annotation: str  # where it came from, for messages: `file annotation id N` / `file object N`
    # COCO's `area` (a mask's pixels): COCOeval sizes objects by it, not by the box; None: the box's width x height
    area: float | None = None
    # VOC's <difficult>1</difficult>: trained on (detectron2 does too), but neither found nor missed at evaluation
    difficult: bool = False


@dataclass
class ImageRecord:
    name: str  # the image file's name inside the tree
    width: int
    height: int
    image_id: int
    boxes: list[Box] = field(default_factory=list)
    # COCO's crowd regions: never training targets, but COCOeval needs them to ignore the detections that land there
    ignored: list[Box] = field(default_factory=list)


@dataclass
class Annotations:
    images: list[ImageRecord]
    classes: list[str]
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (annotation, why)
    held_out: str = ""  # VOC without its split's list: validation held out of every image, why in one line


class BadAnnotations:
    """Bad annotations as they are found: an error naming the first, or with data.skip_bad=K up to K kept as skips."""

    def __init__(self, skip_bad: int):
        self.skip_bad = skip_bad
        self.found: list[tuple[str, str]] = []

    def __call__(self, where: str, why: str) -> None:
        if len(self.found) >= self.skip_bad:
            allowed = f"data.skip_bad={self.skip_bad} bad annotations were already skipped; " if self.skip_bad else ""
            raise DataError(f"{where}: {why}; {allowed}fix the annotation or set data.skip_bad=N to skip up to N")
        self.found.append((where, why))


def check_box(box: Box, record: ImageRecord, bad: BadAnnotations, degenerate: list[tuple[str, str]]) -> bool:
    """Whether `box` is kept: inside its image (clipped to it where it sticks out by OUTSIDE_SLACK_PX at most) with a
    positive width and height."""
    corners = (box.x1, box.y1, box.x2, box.y2)
    if not all(math.isfinite(v) for v in corners):
        bad(box.annotation, f"box ({', '.join(f'{v:g}' for v in corners)}) has a corner that is not a finite number")
        return False
    w, h = box.x2 - box.x1, box.y2 - box.y1
    if w < 0 or h < 0:
        bad(box.annotation, f"box width {w:g} and height {h:g}: a negative size (x2 < x1 or y2 < y1)")
        return False
    if w == 0 or h == 0:
        degenerate.append((box.annotation, f"zero-size box (width {w:g}, height {h:g})"))
        return False
    slack = OUTSIDE_SLACK_PX
    if box.x1 < -slack or box.y1 < -slack or box.x2 > record.width + slack or box.y2 > record.height + slack:
        bad(
            box.annotation,
            f"box ({box.x1:g}, {box.y1:g}, {box.x2:g}, {box.y2:g}) lies outside its {record.width}x{record.height} "
            "image",
        )
        return False
    box.x1, box.y1 = max(box.x1, 0.0), max(box.y1, 0.0)
    box.x2, box.y2 = min(box.x2, float(record.width)), min(box.y2, float(record.height))
    return True


def find_layout(tree: ImageTree) -> str:
    names = tree.names
    if any(PurePosixPath(n).parent.name == "Annotations" and n.endswith(".xml") for n in names):
        return "voc"
    if any(n.endswith(".txt") and "labels/" in n for n in names) and any("images/" in n for n in names):
        return "yolo"
    if any(n.endswith(".json") for n in names):
        return "coco"
    raise DataError(
        f"data.root={tree.root} holds neither COCO-format annotations (a .json file) nor Pascal VOC ones "
        "(Annotations/*.xml) nor YOLO ones (images/<split>/, labels/<split>/*.txt); see docs/detection.md"
    )


def read_coco(tree: ImageTree, read: Any, split: str, skip_bad: int) -> Annotations:
    """A COCO-format split: its images, their boxes (category ids mapped to 0..C-1 in id order) and class names."""
    candidates = [n for n in tree.names if PurePosixPath(n).name in (f"instances_{split}.json", f"{split}.json")]
    if not candidates:
        raise DataError(
            f"data.root={tree.root} has no annotations/instances_{split}.json or {split}.json for split {split}; "
            "set data.train_split / data.val_split to the JSON files' split names"
        )
    path = sorted(candidates, key=len)[0]
    where = location(tree.root, tree.is_zip, path)
    try:
        data = json.loads(read(path))
    except (ValueError, UnicodeDecodeError) as error:
        raise DataError(f"{where} is not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise DataError(
            f"{where} holds a JSON {type(data).__name__}, not a COCO-format object with images, annotations and "
            "categories lists"
        )
    for key in ("images", "annotations", "categories"):
        if not isinstance(data.get(key), list):
            raise DataError(f"{where} has no '{key}' list; is it a COCO-format detection file?")
    check_coco_entries(where, data)
    categories = sorted(data["categories"], key=lambda c: (isinstance(c["id"], str), c["id"]))  # numbers, then names
    label_of = {c["id"]: i for i, c in enumerate(categories)}
    folder = PurePosixPath(path).parent
    base = folder.parent if folder.name == "annotations" else folder
    files = set(tree.names)
    records: dict[int, ImageRecord] = {}
    for image in data["images"]:
        name = next(
            (str(c) for c in (base / split / image["file_name"], base / "images" / image["file_name"],
                              base / image["file_name"], folder / image["file_name"]) if str(c) in files),
            None,
        )  # fmt: skip
        if name is None:
            raise DataError(
                f"{where}: image id {image['id']} names file {image['file_name']}, which is not under "
                f"{base / split}, {base / 'images'} or {base}; add the file or fix its file_name"
            )
        records[image["id"]] = ImageRecord(name, int(image["width"]), int(image["height"]), int(image["id"]))
    bad, degenerate = BadAnnotations(skip_bad), []
    for index, ann in enumerate(data["annotations"]):
        if not isinstance(ann, dict):
            bad(f"{where} annotations[{index}]", f"is {_shown(ann)}, not an object with image_id, category_id, bbox")
            continue
        what = f"{where} annotation id {ann['id']}" if "id" in ann else f"{where} annotations[{index}] (no id)"
        record = records.get(ann.get("image_id"))
        if record is None:
            bad(what, f"names image id {ann.get('image_id')}, which is not in the file's images")
            continue
        if ann.get("category_id") not in label_of:
            bad(what, f"names category id {ann.get('category_id')}, which is not in the file's categories")
            continue
        bbox = ann.get("bbox")
        if not isinstance(bbox, list) or len(bbox) != 4 or not all(_is_number(v) for v in bbox):
            bad(what, f"bbox {_shown(bbox)} is not 4 numbers [x, y, width, height]")
            continue
        x, y, w, h = (float(v) for v in bbox)
        try:
            area = None if ann.get("area") is None else float(ann["area"])
        except (TypeError, ValueError):
            bad(what, f"area {ann['area']!r} is not a number (the object's pixel count, or leave area out)")
            continue
        box = Box(x, y, x + w, y + h, label_of[ann["category_id"]], what, area)
        if check_box(box, record, bad, degenerate):
            (record.ignored if ann.get("iscrowd", 0) else record.boxes).append(box)
    if not records:
        raise DataError(f"{where} lists no images; a split needs at least one")
    return Annotations(list(records.values()), [str(c["name"]) for c in categories], bad.found + degenerate)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_coco_entries(where: str, data: dict[str, Any]) -> None:
    """Refuse images and categories that are not COCO's objects (the annotations are checked one by one)."""
    fix = "fix the entry or write the file again"
    seen: set[int] = set()
    for index, image in enumerate(data["images"]):
        entry = f"{where}: images[{index}]" + (
            f" (id {image['id']})" if isinstance(image, dict) and "id" in image else ""
        )
        if not isinstance(image, dict):
            raise DataError(f"{entry} is {_shown(image)}, not an object with id, file_name, width and height; {fix}")
        for key in ("id", "width", "height"):
            if key not in image:
                raise DataError(f"{entry}: {key} is missing; {fix}")
            try:
                int(image[key])
            except (TypeError, ValueError, OverflowError):
                raise DataError(f"{entry}: {key} is {_shown(image[key])}, not a whole number; {fix}") from None
        if not isinstance(image.get("file_name"), str) or not image["file_name"]:
            raise DataError(f"{entry}: file_name is {_shown(image.get('file_name'))}, not a file name; {fix}")
        if image["id"] in seen:
            raise DataError(f"{entry}: image id {image['id']} is listed twice; give each image its own id")
        seen.add(image["id"])
    seen_categories: set[int | str] = set()
    for index, category in enumerate(data["categories"]):
        entry = f"{where}: categories[{index}]"
        if not isinstance(category, dict):
            raise DataError(f"{entry} is {_shown(category)}, not an object with id and name; {fix}")
        # An id is whatever the annotations' category_id repeats: a whole number, as COCO writes it, or a name.
        if not isinstance(category.get("id"), (int, str)) or isinstance(category.get("id"), bool):
            shown = "is missing" if "id" not in category else f"is {_shown(category['id'])}, not a whole number"
            raise DataError(f"{entry}: id {shown}; {fix}")
        name = category.get("name")
        if not isinstance(name, (str, int, float)) or isinstance(name, bool) or not str(name).strip():
            shown = "is missing" if "name" not in category else f"is {_shown(category['name'])}, not a class name"
            raise DataError(f"{entry} (id {category['id']}): name {shown}; {fix}")
        if category["id"] in seen_categories:
            raise DataError(f"{entry}: category id {category['id']} is listed twice; give each category its own id")
        seen_categories.add(category["id"])


def yolo_classes(tree: ImageTree, read: Any) -> list[str]:
    """YOLO class names: `names` of data.yaml / dataset.yaml (a list, or a dict by index), else classes.txt lines."""
    import yaml

    for file in sorted((n for n in tree.names if PurePosixPath(n).name in ("data.yaml", "dataset.yaml")), key=len):
        names = (yaml.safe_load(read(file)) or {}).get("names")
        if isinstance(names, dict):
            return [str(names[i]) for i in sorted(names)]
        if isinstance(names, list):
            return [str(n) for n in names]
    for file in sorted((n for n in tree.names if PurePosixPath(n).name == "classes.txt"), key=len):
        return [line.strip() for line in read(file).decode().splitlines() if line.strip()]
    raise DataError(
        f"data.root={tree.root} holds YOLO labels but no class names: add data.yaml with names: [...] or classes.txt"
    )


def read_yolo(tree: ImageTree, read: Any, split: str, skip_bad: int) -> Annotations:
    """A YOLO split (Ultralytics' layout): images/<split>/*, labels/<split>/<stem>.txt with one
    `class x_centre y_centre width height` line per box, in fractions of the image; an image without a label file
    has no objects."""
    from PIL import Image

    classes = yolo_classes(tree, read)
    images = sorted(n for n in tree.names if f"images/{split}/" in n and n.lower().endswith(IMAGE_SUFFIXES))
    labels = {n for n in tree.names if f"labels/{split}/" in n and n.endswith(".txt")}
    bad, degenerate, records = BadAnnotations(skip_bad), [], []
    label_of_image = {}
    for name in images:
        head, _, tail = name.rpartition("images/")
        label_of_image[name] = f"{head}labels/{str(PurePosixPath(tail).with_suffix('.txt'))}"
    for orphan in sorted(labels - set(label_of_image.values())):
        bad(location(tree.root, tree.is_zip, orphan), "names an image that is not in images/ (no file of its stem)")
    for name in images:
        with Image.open(io.BytesIO(read(name))) as img:
            width, height = img.size
        record = ImageRecord(name, width, height, len(records) + 1)
        label = label_of_image[name]
        if label in labels:
            where = location(tree.root, tree.is_zip, label)
            for number, line in enumerate(read(label).decode().splitlines()):
                if not line.strip():
                    continue
                what = f"{where} line {number + 1}"
                try:
                    index, cx, cy, w, h = (float(v) for v in line.split()[:5])
                except ValueError:
                    bad(what, f"is not `class x_centre y_centre width height`: {line.strip()!r}")
                    continue
                if not index.is_integer() or not 0 <= index < len(classes):
                    bad(what, f"names class {index:g}, but the data has classes 0 to {len(classes) - 1}")
                    continue
                x1, y1 = (cx - w / 2) * width, (cy - h / 2) * height
                box = Box(x1, y1, x1 + w * width, y1 + h * height, int(index), what)
                if check_box(box, record, bad, degenerate):
                    record.boxes.append(box)
        records.append(record)
    return Annotations(records, classes, bad.found + degenerate)


def read_voc(tree: ImageTree, read: Any, skip_bad: int) -> tuple[dict[str, ImageRecord], list[str], list]:
    """Every VOC annotation file of the tree: records by image stem, the sorted class names, the skips."""
    xml_names = sorted(n for n in tree.names if PurePosixPath(n).parent.name == "Annotations" and n.endswith(".xml"))
    files = set(tree.names)
    parsed = []
    for name in xml_names:
        where = location(tree.root, tree.is_zip, name)
        try:
            root = ET.fromstring(read(name))
        except ET.ParseError as error:
            raise DataError(f"{where} is not valid XML ({error})") from None
        parsed.append((name, where, root))
    names = {(obj.findtext("name") or "").strip() for _, _, root in parsed for obj in root.iter("object")}
    classes = sorted(names - {""})  # an object without a name is refused below, where its file is named
    label_of = {c: i for i, c in enumerate(classes)}
    bad, degenerate, records = BadAnnotations(skip_bad), [], {}
    for name, where, root in parsed:
        top = PurePosixPath(name).parent.parent
        filename = root.findtext("filename") or f"{PurePosixPath(name).stem}.jpg"
        image = str(top / "JPEGImages" / filename)
        if image not in files:
            raise DataError(f"{where} names image {filename}, which is not in {top / 'JPEGImages'}; add it or fix it")
        try:
            width, height = int(root.findtext("size/width") or 0), int(root.findtext("size/height") or 0)
        except ValueError:
            width = height = 0
        if width <= 0 or height <= 0:
            raise DataError(f"{where} has no positive <size><width>/<height>; add the image's size")
        record = ImageRecord(image, width, height, len(records) + 1)
        for number, obj in enumerate(root.iter("object")):
            what = f"{where} object {number}"
            try:
                x1, y1, x2, y2 = (float(obj.findtext(f"bndbox/{k}")) for k in ("xmin", "ymin", "xmax", "ymax"))
            except (TypeError, ValueError):
                bad(what, "has no numeric bndbox xmin, ymin, xmax, ymax")
                continue
            class_name = (obj.findtext("name") or "").strip()
            if not class_name:
                bad(what, "has no <name> (the object's class)")
                continue
            label = label_of[class_name]
            if x2 <= x1 or y2 <= y1:  # a point or a line as written (BCCD has two): reported as such
                check_box(Box(x1, y1, x2, y2, label, what), record, bad, degenerate)
                continue
            # VOC numbers pixels from 1: pixel columns xmin..xmax are the box, (xmin - 1, xmax) in edges
            difficult = (obj.findtext("difficult") or "0").strip() == "1"
            box = Box(x1 - 1, y1 - 1, x2, y2, label, what, difficult=difficult)
            if check_box(box, record, bad, degenerate):
                record.boxes.append(box)
        records[PurePosixPath(name).stem] = record
    return records, classes, bad.found + degenerate


def voc_split(tree: ImageTree, read: Any, records: dict[str, ImageRecord], split: str, train: bool, cfg: Config):
    """The records of a VOC split: ImageSets/Main/<split>.txt, or without one a held-out share of every image."""
    listed = [n for n in tree.names if n.endswith(f"ImageSets/Main/{split}.txt")]
    if listed:
        stems = [line.split()[0] for line in read(listed[0]).decode().splitlines() if line.strip()]
        where = location(tree.root, tree.is_zip, listed[0])
        missing = [s for s in stems if s not in records]
        if missing:
            raise DataError(f"{where} names image {missing[0]}, which has no Annotations/{missing[0]}.xml")
        return [records[s] for s in stems]
    ordered = [records[k] for k in sorted(records)]
    train_index, val_index = held_out_split(len(ordered), cfg.data.val_fraction)
    return [ordered[i] for i in (train_index if train else val_index).tolist()]


def read_annotations(cfg: Config, split: str, train: bool) -> tuple[ImageTree, Annotations]:
    root = Path(cfg.data.root).expanduser()
    if not root.exists():
        raise DataError(f"data.root={cfg.data.root} does not exist; give a COCO or VOC folder or a .zip of one")
    tree = ImageTree(root)
    held_out = ""
    with file_reader(tree.root, tree.is_zip) as read:
        layout = find_layout(tree)
        if layout == "coco":
            return tree, read_coco(tree, read, split, cfg.data.skip_bad)
        if layout == "yolo":
            annotations = read_yolo(tree, read, split, cfg.data.skip_bad)
            images, classes, skipped = annotations.images, annotations.classes, annotations.skipped
        else:
            records, classes, skipped = read_voc(tree, read, cfg.data.skip_bad)
            lists = sorted(  # the split lists, not VOC's per-class ones (aeroplane_train.txt)
                stem for n in tree.names
                if "ImageSets/Main/" in n and n.endswith(".txt") and "_" not in (stem := PurePosixPath(n).stem)
            )  # fmt: skip
            other = cfg.data.val_split if train else cfg.data.train_split
            if split not in lists and other in lists:  # a share of every image would hold the other list's images
                raise DataError(
                    f"data.root={cfg.data.root} has ImageSets/Main/{other}.txt but no {split}.txt (it has "
                    f"{', '.join(lists)}); add {split}.txt, set data.{'train' if train else 'val'}_split to one of "
                    "them, or remove the lists to hold out data.val_fraction of every image"
                )
            images = voc_split(tree, read, records, split, train, cfg)
            if train and split not in lists:
                held_out = held_out_line(cfg, lists)
    if not images:
        raise DataError(f"data.root={cfg.data.root}: split {split} lists no images; a split needs at least one")
    return tree, Annotations(images, classes, skipped, held_out)


def letterbox(raw: bytes, size: int) -> tuple[np.ndarray, float]:
    """Encoded bytes -> (3, size, size) uint8, the image resized (aspect kept) so its longer side is `size` and
    zero-padded at the bottom and right; and the scale factor applied."""
    from PIL import Image

    with Image.open(io.BytesIO(raw)) as img:
        img = img.convert("RGB")
        scale = size / max(img.size)
        resized = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))), Image.BILINEAR)
    canvas = np.zeros((size, size, 3), dtype=np.uint8)
    canvas[: resized.height, : resized.width] = np.asarray(resized)
    return canvas.transpose(2, 0, 1), scale


@dataclass
class DetectionSet:
    """A whole split in memory: letterboxed images (N, 3, S, S) uint8, boxes (N, M, 5) float32 in input pixels
    (class -1: padding), each image's scale factor and original record, the class names."""

    images: torch.Tensor
    targets: torch.Tensor
    scales: torch.Tensor
    records: list[ImageRecord]
    classes: list[str]
    skipped: Skipped = field(default_factory=Skipped)

    def __len__(self) -> int:
        return self.images.shape[0]

    def read(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.targets[index]

    def coco_ground_truth(self) -> dict[str, Any]:
        """The split's boxes as a COCO-format dict in original image pixels (category ids are class + 1); crowd
        regions and VOC's difficult objects as `iscrowd: 1`, so that COCOeval counts a detection on one neither as
        right nor as wrong."""
        images, annotations = [], []
        for record in self.records:
            images.append({"id": record.image_id, "width": record.width, "height": record.height,
                           "file_name": record.name})  # fmt: skip
            # COCOeval's only ignore mark is iscrowd; for a difficult object it also means that a detection lying
            # inside it is ignored by intersection over the detection's area, a looser test than VOC's IoU >= 0.5
            for box, crowd in [(b, int(b.difficult)) for b in record.boxes] + [(b, 1) for b in record.ignored]:
                w, h = box.x2 - box.x1, box.y2 - box.y1
                annotations.append(
                    {"id": len(annotations) + 1, "image_id": record.image_id, "iscrowd": crowd,
                     "category_id": box.label + 1, "bbox": [box.x1, box.y1, w, h],
                     "area": w * h if box.area is None else box.area}
                )  # fmt: skip
        categories = [{"id": i + 1, "name": name} for i, name in enumerate(self.classes)]
        return {"images": images, "annotations": annotations, "categories": categories}


def load_split(cfg: Config, split: str, train: bool) -> DetectionSet:
    tree, annotations = read_annotations(cfg, split, train)
    size = cfg.model.image_size
    records = annotations.images
    declared = [(r.width, r.height) for r in records]  # the boxes are checked against these (check_box)
    images, scales = letterbox_files(tree, [r.name for r in records], size, cfg.data.decode_workers, declared)
    most = max(1, max(len(r.boxes) for r in records))
    targets = torch.full((len(records), most, 5), -1.0)
    for i, (record, scale) in enumerate(zip(records, scales.tolist(), strict=True)):
        for j, box in enumerate(record.boxes):
            targets[i, j] = torch.tensor([box.x1 * scale, box.y1 * scale, box.x2 * scale, box.y2 * scale, box.label])
    skipped = Skipped(undecodable=list(annotations.skipped), held_out=annotations.held_out)
    return DetectionSet(images, targets, scales, records, annotations.classes, skipped)


def letterbox_files(
    tree: ImageTree, names: list[str], size: int, workers: int, declared: list[tuple[int, int]] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, 3, size, size) uint8 letterboxed images of a tree's files and their scale factors, decoded in chunks by
    `workers` processes (data.decode_workers); a file that does not decode is an error naming it, and so is one whose
    (width, height) differs from its annotation's `declared` one (its boxes were checked against that size)."""
    chunks = [names[i : i + 256] for i in range(0, len(names), 256)]
    jobs = [(str(tree.root), tree.is_zip, chunk, size) for chunk in chunks]
    if workers <= 1 or len(chunks) == 1:
        results = [_letterbox_chunk(job) for job in jobs]
    else:
        with decode_pool(workers) as pool:
            results = list(pool.map(_letterbox_chunk, jobs))
    for start, (_, _, failed, sizes) in zip(range(0, len(names), 256), results, strict=True):
        if failed:
            row, reason = failed[0]
            where = location(tree.root, tree.is_zip, names[start + row])
            raise DataError(f"cannot decode image {where} ({reason}); fix or remove the file and its annotations")
        for row, (width, height) in enumerate(sizes):
            said = declared[start + row] if declared is not None else (width, height)
            if tuple(said) != (width, height):
                where = location(tree.root, tree.is_zip, names[start + row])
                raise DataError(
                    f"image {where} is {width}x{height} but its annotation gives {said[0]}x{said[1]} (its <size>, or "
                    "width/height); fix the annotation: its boxes are read in the image's pixels"
                )
    images = torch.from_numpy(np.concatenate([r[0] for r in results]))
    return images, torch.from_numpy(np.concatenate([r[1] for r in results]))


def _letterbox_chunk(job: tuple[str, bool, list[str], int]) -> tuple[np.ndarray, np.ndarray, list, list]:
    """A chunk's letterboxed images, scales, (row, reason) of files that do not decode, and each file's size."""
    from PIL import Image

    root, is_zip, names, size = job
    images = np.zeros((len(names), 3, size, size), dtype=np.uint8)
    scales = np.zeros(len(names), dtype=np.float32)
    failed, sizes = [], []
    with file_reader(root, is_zip) as read:
        for i, name in enumerate(names):
            try:
                raw = read(name)
                with Image.open(io.BytesIO(raw)) as img:  # the header only
                    sizes.append(img.size)
                images[i], scales[i] = letterbox(raw, size)
            except Exception as error:  # Pillow raises many kinds for a file that is not an image
                failed.append((i, decode_failure(error)))
                sizes.append((0, 0))
    return images, scales, failed, sizes


def read_classes(cfg: Config) -> list[str]:
    """The class names of data.root's training split, read from its annotations alone (no image decoded)."""
    return read_annotations(cfg, cfg.data.train_split, True)[1].classes


def detection_source(cfg: Config) -> tuple[DetectionSet, DetectionSet]:
    """(train, val) of data.root's detection annotations, split by data.train_split / data.val_split."""
    if not cfg.data.root:
        raise DataError("data.source=detection needs data.root=PATH (a COCO or Pascal VOC folder, or a .zip of one)")
    train = load_split(cfg, cfg.data.train_split, True)
    val = load_split(cfg, cfg.data.val_split, False)
    if val.classes != train.classes:
        raise DataError(
            f"data.root={cfg.data.root}: split {cfg.data.val_split}'s classes {val.classes} differ from split "
            f"{cfg.data.train_split}'s {train.classes}; give both splits the same categories"
        )
    return train, val


class DetectionAugment:
    """On the training device: large-scale jitter and a horizontal flip that move the boxes with the pixels, then
    normalisation to float. `jitter_scale` (low, high): each image rescaled by a factor drawn from it, then cropped
    at a random place (larger) or zero-padded at the bottom and right (smaller) back to `size` (ViTDet's LSJ)."""

    def __init__(self, cfg: Config, train: bool):
        d = cfg.data
        self.size = cfg.model.image_size
        self.train = train
        self.hflip = d.hflip if train else 0.0
        self.jitter = tuple(d.jitter_scale) if train else (1.0, 1.0)
        self.mean = torch.tensor(d.mean).view(-1, 1, 1)
        self.std = torch.tensor(d.std).view(-1, 1, 1)

    def __call__(
        self, images: torch.Tensor, targets: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        images, targets = images.float() / 255.0, targets.clone()
        if self.jitter != (1.0, 1.0):
            low, high = self.jitter
            factors = low + (high - low) * torch.rand(images.shape[0], generator=generator)
            corners = torch.rand(images.shape[0], 2, generator=generator)
            rows = [
                jitter_one(img, box, float(f), c)
                for img, box, f, c in zip(images, targets, factors, corners, strict=True)
            ]
            images, targets = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
        if self.hflip:
            flip = (torch.rand(images.shape[0], generator=generator) < self.hflip).to(images.device)
            images = torch.where(flip[:, None, None, None], images.flip(-1), images)
            targets = torch.where(flip[:, None, None], flip_boxes(targets, self.size), targets)
        images = (images - self.mean.to(images.device)) / self.std.to(images.device)
        return images, targets


def flip_boxes(targets: torch.Tensor, size: int) -> torch.Tensor:
    """Boxes (.., 5) mirrored left-right in an image `size` pixels wide; padding rows (class < 0) left as they are."""
    flipped = targets.clone()
    flipped[..., 0], flipped[..., 2] = size - targets[..., 2], size - targets[..., 0]
    return torch.where(targets[..., 4:5] >= 0, flipped, targets)


def jitter_one(
    image: torch.Tensor, boxes: torch.Tensor, factor: float, corner: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One image (C, S, S) rescaled by `factor`, cropped (at `corner`, fractions of the slack) or padded back to
    S; its boxes moved, clipped to the image, and those left under one pixel wide or high made padding."""
    size = image.shape[-1]
    side = max(1, round(size * factor))
    scaled = F.interpolate(image[None], size=(side, side), mode="bilinear", align_corners=False)[0]
    boxes = boxes.clone()
    real = boxes[:, 4] >= 0
    boxes[:, :4] *= side / size
    if side > size:
        x0, y0 = (int(c * (side - size + 1)) for c in corner.tolist())
        x0, y0 = min(x0, side - size), min(y0, side - size)
        out = scaled[:, y0 : y0 + size, x0 : x0 + size]
        boxes[:, [0, 2]] -= x0
        boxes[:, [1, 3]] -= y0
    else:
        out = F.pad(scaled, (0, size - side, 0, size - side))
    boxes[:, :4] = boxes[:, :4].clamp(0, size)
    kept = real & (boxes[:, 2] - boxes[:, 0] >= 1) & (boxes[:, 3] - boxes[:, 1] >= 1)
    boxes[~kept] = -1.0
    return out, boxes
