"""Opening untrusted image bytes with bounded work: what is decoded, and how large it may become.

An image's cost is not its file size. A 661-byte PNG can declare 200,000 x 1 pixels: within any
pixel budget, but preprocessing scales the *shorter* side to the model's size, so it would become
12.8 M x 64 pixels (gigabytes, seconds of CPU). Every limit is therefore checked on the header,
before anything is decoded or resized:

* ``formats``: only these PIL decoders are tried (others, e.g. EPS, which runs Ghostscript, are
  never reached);
* ``max_pixels``: width x height as declared (decompression bombs);
* ``max_aspect_ratio``: longer side / shorter side, which bounds the size after the shorter side
  is scaled to the model's input size (at most ratio x size^2 pixels).

A decoded image is turned upright by its EXIF orientation tag, as viewers show it.

The service applies them to uploads (``ICR_MAX_IMAGE_PIXELS``, ``ICR_MAX_ASPECT_RATIO``) and
gallery builds to every image file they read (:func:`training.data.karpathy.load_image`).
"""

from __future__ import annotations

import io
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageOps, UnidentifiedImageError

# What uploads may be: the formats browsers and cameras produce, decoded by PIL's own code.
UPLOAD_FORMATS: tuple[str, ...] = ("JPEG", "PNG", "WEBP", "GIF", "BMP")
# Gallery folders (photo folders, datasets) may also hold TIFF scans and netpbm files (PPM, PGM,
# PBM): an allow-list of common photo formats, decoded by PIL's own code. Anything else PIL could
# open (EPS runs Ghostscript; PSD, ICO, FITS... are not photos) is refused, naming this list.
GALLERY_FORMATS: tuple[str, ...] = (*UPLOAD_FORMATS, "TIFF", "PPM")
MAX_PIXELS = 40_000_000
MAX_ASPECT_RATIO = 20.0


@dataclass(frozen=True)
class ImageLimits:
    max_pixels: int = MAX_PIXELS
    max_aspect_ratio: float = MAX_ASPECT_RATIO
    formats: tuple[str, ...] = UPLOAD_FORMATS


class ImageRefused(ValueError):
    """Why an image was not decoded: ``reason`` is format, pixels, aspect_ratio or corrupt."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def open_image(source: bytes | str | os.PathLike[str], limits: ImageLimits = ImageLimits()) -> Image.Image:
    """Decode ``source`` (file bytes or a path) as an RGB image within ``limits``; ImageRefused
    saying which limit (or that the file is corrupt) otherwise. Nothing is decoded before the
    header passed every check."""
    fp = io.BytesIO(source) if isinstance(source, bytes) else Path(source)
    try:
        image = Image.open(fp, formats=list(limits.formats))  # reads the header only
    except Image.DecompressionBombError:  # beyond PIL's own limit, found while opening
        raise _too_many_pixels(None, limits) from None
    except UnidentifiedImageError:
        raise ImageRefused(
            "format", f"not an image in an accepted format ({', '.join(limits.formats)})"
        ) from None
    except FileNotFoundError:
        raise
    except (OSError, SyntaxError, ValueError) as err:
        raise ImageRefused("corrupt", f"corrupt image header ({err})") from None
    with image:
        width, height = image.size
        if width < 1 or height < 1:
            raise ImageRefused("corrupt", f"the header declares {width} x {height} pixels")
        if width * height > limits.max_pixels:
            raise _too_many_pixels((width, height), limits)
        ratio = max(width, height) / min(width, height)
        if ratio > limits.max_aspect_ratio:
            raise ImageRefused(
                "aspect_ratio",
                f"{width} x {height} pixels: aspect ratio {_above(ratio, limits.max_aspect_ratio)}:1, "
                f"more than {limits.max_aspect_ratio:g}:1; crop or pad it closer to a square",
            )
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                image.load()
                # the way every viewer shows it: a phone stores its photos sideways, with an EXIF
                # orientation tag, and a model shown them sideways embeds something else
                upright = ImageOps.exif_transpose(image)
                return upright.convert("RGB")  # a copy, detached from the file
        except (Image.DecompressionBombWarning, Image.DecompressionBombError):
            raise _too_many_pixels((width, height), limits) from None
        except (OSError, ValueError, SyntaxError) as err:
            raise ImageRefused("corrupt", f"corrupt or truncated image ({err})") from None


def _above(value: float, limit: float) -> str:
    """``value`` (> ``limit``) with the fewest decimals that still show it above the limit: 21 x 1
    is "21", 28284 x 1414 "20.003" (rounded to "20" it would read as within a 20:1 limit)."""
    for decimals in range(7):
        text = f"{value:.{decimals}f}"
        if float(text) > limit:
            return text
    return repr(value)


def _too_many_pixels(size: tuple[int, int] | None, limits: ImageLimits) -> ImageRefused:
    declared = f"{size[0]} x {size[1]} pixels, " if size else ""
    return ImageRefused("pixels", f"{declared}more than {limits.max_pixels:,} pixels; downscale it")
