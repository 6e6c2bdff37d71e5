"""JPEG decode speed: Pillow vs libjpeg-turbo through simplejpeg, full-size and reduced-DCT, on the same real files.

    python benchmarks/decode_speed.py --out results/loader-sources/decode.json

Each round decodes the same files with every method in turn (interleaved); medians and spreads of images/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import zipfile
from pathlib import Path

from vitrain.data.decode import decode_image, decoder_name
from vitrain.device import cpu_description

SETS = {  # name: (zip, member prefix, decoded size)
    "cifar10 32px -> 32": ("cifar10-jpg.zip", "cifar10/train/", 32),
    "cfp ~105x137 -> 64": ("cfp-faces.zip", "cfp/Data/Images/", 64),
    "bccd 640x480 -> 224": ("bccd-detection.zip", "bccd/JPEGImages/", 224),
}
METHODS = {
    "pillow": {"use_pillow": True},
    "pillow reduced (draft)": {"use_pillow": True, "reduce": True},
    "simplejpeg": {},
    "simplejpeg reduced (DCT scaling)": {"reduce": True},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared" / "data"))
    parser.add_argument("--images", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = {"cpu": cpu_description(), "decoder": decoder_name(), "images": args.images, "sets": {}}
    for name, (archive, prefix, size) in SETS.items():
        with zipfile.ZipFile(Path(args.data) / archive) as z:
            names = [n for n in z.namelist() if n.startswith(prefix) and n.endswith(".jpg")][: args.images]
            raws = [z.read(n) for n in names]
        rounds = {m: [] for m in METHODS}
        for _ in range(args.rounds):
            for method, options in METHODS.items():
                start = time.perf_counter()
                for raw in raws:
                    decode_image(raw, "RGB", size, **options)
                rounds[method].append(len(raws) / (time.perf_counter() - start))
        rows = {m: {"images_per_s": statistics.median(r), "spread": [min(r), max(r)]} for m, r in rounds.items()}
        base = rows["pillow"]["images_per_s"]
        for row in rows.values():
            row["vs_pillow"] = row["images_per_s"] / base
        result["sets"][name] = rows
        print(name)
        for method, row in rows.items():
            print(f"  {method:<34} {row['images_per_s']:>9,.0f} images/s  {row['vs_pillow']:.2f}x Pillow")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
