"""Image bytes to uint8 pixels: libjpeg-turbo through simplejpeg for JPEG (reduced-size DCT when it can), Pillow else.

Both decoders give the same pixels for a full-size JPEG decode (libjpeg-turbo's default integer DCT and fancy
upsampling in each); `reduce=True` lets a JPEG at least twice the wanted size decode at 1/2, 1/4 or 1/8 scale in the
DCT itself (libjpeg-turbo's scaled decode) before the bicubic resize: much less work, slightly different pixels.
benchmarks/decode_speed.py measures both on the same real files.
"""

from __future__ import annotations

import io

import numpy as np

try:  # a binary wheel with libjpeg-turbo inside: a required dependency, but a broken install still decodes
    import simplejpeg
except ImportError:  # pragma: no cover - exercised only where the wheel is missing
    simplejpeg = None

JPEG_MAGIC = b"\xff\xd8"


def decoder_name() -> str:
    """The JPEG decoder in use, for logs and benchmark rows."""
    return f"simplejpeg {simplejpeg.__version__} (libjpeg-turbo)" if simplejpeg is not None else "Pillow"


def decode_image(raw: bytes, mode: str, size: int, reduce: bool = False, use_pillow: bool = False) -> np.ndarray:
    """Encoded bytes -> (C, size, size) uint8 in PIL `mode` (L or RGB), resized with bicubic when needed.

    A colour JPEG decodes with libjpeg-turbo through simplejpeg (the same pixels as Pillow's decode, faster); grey
    output, other formats, and `use_pillow=True` go through Pillow.
    """
    from PIL import Image

    if simplejpeg is not None and mode == "RGB" and not use_pillow and raw[:2] == JPEG_MAGIC:
        wanted = {"min_height": size, "min_width": size} if reduce else {}
        try:
            array = simplejpeg.decode_jpeg(raw, colorspace="RGB", **wanted)
        except ValueError:  # CMYK, arithmetic coding, a corrupt stream: Pillow decodes it or names the fault
            array = None
        if array is not None:
            if array.shape[:2] != (size, size):
                array = np.asarray(Image.fromarray(array).resize((size, size), Image.BICUBIC))
            return array.transpose(2, 0, 1)
    with Image.open(io.BytesIO(raw)) as img:
        if reduce and img.format == "JPEG":
            img.draft(mode, (size, size))  # Pillow's own scaled DCT decode
        img = img.convert(mode)
        if img.size != (size, size):
            img = img.resize((size, size), Image.BICUBIC)
        array = np.asarray(img, dtype=np.uint8)
    return array[None] if array.ndim == 2 else array.transpose(2, 0, 1)
