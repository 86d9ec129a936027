"""One image file's pixels as the file holds them, in 8 bits: the reading that training, evaluation and
``predict`` share, so a model sees the same pixels from a file wherever it meets it.

- EXIF orientation is applied (a phone photo stored sideways is seen upright, as every viewer shows it).
- 16-bit images (microscopy, medical, depth: Pillow's ``I;16`` and ``I`` modes) are scaled from 0-65535
  to 0-255. Pillow's own ``convert("L")`` clips them instead, which turns nearly every pixel white.
- Floating-point images (32-bit TIFF, Pillow's ``F``) are scaled from 0-1 to 0-255 when they lie in 0-1, kept when
  they lie in 0-255, and refused otherwise (no range to read them by). ``convert("L")`` reads 0-1 as black.
- Transparency (RGBA, LA, a palette with a transparent colour) is flattened over black, so what a transparent
  pixel hides never reaches the model; palette images become RGB.
- The result is ``L`` (grey) or ``RGB``: a grey file stays grey, so the caller can decide the channel count
  over a whole split instead of letting the first image decide it (``common.data.decoded.decode_split``).
"""

from __future__ import annotations

import contextlib
import math

import torch

from common.errors import DataError

MAX_SHOWN = 5  # unreadable files named in one message
GREY_MODES = ("1", "L", "LA", "La", "I", "I;16", "I;16L", "I;16B", "I;16N", "F")
SIXTEEN_BIT_MODES = ("I", "I;16", "I;16L", "I;16B", "I;16N")


def natural(img):
    """``img`` (a loaded PIL image) as 'L' or 'RGB', its pixels read as described in the module docstring."""
    import numpy as np
    from PIL import Image, ImageOps

    if img.getexif().get(0x0112, 1) != 1:  # Orientation: only then is a copy worth making
        img = ImageOps.exif_transpose(img)
    mode = img.mode
    if mode in SIXTEEN_BIT_MODES:
        wide = np.asarray(img).astype(np.int64).clip(0, 65535)
        return Image.fromarray(((wide * 255 + 32767) // 65535).astype(np.uint8), "L")
    if mode == "F":
        values = np.asarray(img, dtype=np.float64)
        lo, hi = (float(values.min()), float(values.max())) if values.size else (0.0, 0.0)
        if not (np.isfinite(lo) and np.isfinite(hi)) or lo < 0 or hi > 255:
            raise DataError(
                f"a floating-point image with values from {lo:g} to {hi:g}: neither 0-1 nor 0-255, so "
                "there is no one way to read it as pixels; save it scaled to 8 or 16 bits"
            )
        scale = 255.0 if hi <= 1.0 else 1.0
        return Image.fromarray(np.rint(values * scale).astype(np.uint8), "L")
    if mode == "P":
        img = img.convert("RGBA" if "transparency" in img.info else "RGB")
    elif mode == "L" and "transparency" in img.info:
        img = img.convert("LA")
    elif mode in ("RGB",) and "transparency" in img.info:
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "RGBa", "LA", "La", "PA"):
        flat = Image.alpha_composite(Image.new("RGBA", img.size, (0, 0, 0, 255)), img.convert("RGBA"))
        return flat.convert("L" if img.mode in ("LA", "La") else "RGB")
    if img.mode in GREY_MODES:
        return img if img.mode == "L" else img.convert("L")
    return img if img.mode == "RGB" else img.convert("RGB")  # CMYK, YCbCr, LAB, HSV, ...


def as_mode(img, mode: str):
    """``img`` read by ``natural`` and then given ``mode`` ('L' or 'RGB')."""
    img = natural(img)
    return img if img.mode == mode else img.convert(mode)


def at_size(img, mode: str | None, size: tuple[int, int] | None):
    """(``img`` read by ``natural``, given ``mode`` ('L' or 'RGB'; None keeps the mode read) and resized bilinearly to
    ``size`` (width, height) where it differs, whether it was resized): how the decoded-cache recipes decode a file
    (``--channels``, ``--image-size``) and ``predict`` reads one for their models."""
    from PIL import Image

    img = as_mode(img, mode) if mode else natural(img)
    resized = size is not None and img.size != tuple(size)
    return (img.resize(tuple(size), Image.BILINEAR) if resized else img), resized


def unreadable_reason(err: Exception) -> str:
    """Why Pillow could not open or decode a file, with the fix where there is one."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(err, Image.DecompressionBombError):
        return (
            f"{err}; shrink it below {2 * Image.MAX_IMAGE_PIXELS / 1e6:.0f} megapixels, e.g. "
            "`mogrify -resize 4096x4096\\> FILE`, or remove it"
        )
    if isinstance(err, UnidentifiedImageError):
        return "not an image file Pillow can read"
    return str(err) if isinstance(err, (OSError, DataError)) else f"{type(err).__name__}: {err}"


def unreadable_error(bad: list[tuple[str, str]], total: int, what: str) -> DataError:
    """One paragraph naming every unreadable file of a split ((file, reason) pairs), not only the first."""
    shown = "; ".join(f"{src} ({reason})" for src, reason in bad[:MAX_SHOWN])
    more = f"; and {len(bad) - MAX_SHOWN} more" if len(bad) > MAX_SHOWN else ""
    return DataError(
        f"{len(bad)} of the {total} images in {what} could not be read: {shown}{more}. Remove or "
        "replace those files and run again."
    )


@contextlib.contextmanager
def open_rgb(source, min_side: int):
    """The photo at ``source`` (a path, or a file object holding its bytes) decoded whole as RGB; a JPEG at the
    smallest scale whose shorter side is still at least ``min_side``."""
    from PIL import Image

    with Image.open(source) as img:
        if img.format == "JPEG":
            w, h = img.size
            scale = min_side / min(w, h)
            img.draft("RGB", (math.ceil(w * scale), math.ceil(h * scale)))  # at least this big; 1/2, 1/4, 1/8
        img.load()
        yield as_mode(img, "RGB")


def read_rgb(source, min_side: int) -> torch.Tensor:
    """uint8 (3, H, W) of the photo at ``source`` (``open_rgb``)."""
    from torchvision.transforms.v2.functional import pil_to_tensor

    with open_rgb(source, min_side) as img:
        return pil_to_tensor(img)
