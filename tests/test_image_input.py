"""Untrusted images are decoded only within their limits, checked on the header (core.image_input)."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from icr.core.image_input import GALLERY_FORMATS, ImageLimits, ImageRefused, open_image


def _encoded(size: tuple[int, int], fmt: str = "PNG", mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, color=None if mode == "1" else 0).save(out, format=fmt)
    return out.getvalue()


@pytest.mark.parametrize(
    ("fmt", "mode"),
    [
        ("PNG", "RGBA"),
        ("JPEG", "L"),
        ("WEBP", "RGB"),
        ("GIF", "P"),
        ("BMP", "RGB"),
        ("PNG", "I;16"),
        ("PNG", "1"),
    ],
)
def test_accepted_formats_and_modes_decode_to_rgb(fmt: str, mode: str) -> None:
    image = open_image(_encoded((40, 30), fmt, mode))
    assert image.mode == "RGB" and image.size == (40, 30)


def test_each_limit_is_named() -> None:
    with pytest.raises(ImageRefused, match="aspect ratio 21:1") as err:
        open_image(_encoded((21, 1)))
    assert err.value.reason == "aspect_ratio"
    assert open_image(_encoded((20, 1))).size == (20, 1)  # the limit itself is allowed
    # just above the limit: as many decimals as show it above (rounded to 20:1 it would not)
    with pytest.raises(ImageRefused, match=r"28284 x 1414 pixels: aspect ratio 20\.003:1, more than 20:1"):
        open_image(_encoded((28284, 1414), mode="1"))
    with pytest.raises(ImageRefused, match="1000 x 1000 pixels, more than 999,999") as err:
        open_image(_encoded((1000, 1000), mode="1"), ImageLimits(max_pixels=999_999))
    assert err.value.reason == "pixels"
    tiff = _encoded((8, 8), "TIFF")
    with pytest.raises(ImageRefused, match="accepted format") as err:
        open_image(tiff)  # uploads: no TIFF
    assert err.value.reason == "format"
    assert open_image(tiff, ImageLimits(formats=GALLERY_FORMATS)).size == (8, 8)
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"
    with pytest.raises(ImageRefused, match="accepted format"):
        open_image(eps)  # PIL's EPS decoder (Ghostscript) is never tried
    with pytest.raises(ImageRefused, match="corrupt or truncated") as err:
        noise = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))
        out = io.BytesIO()
        noise.save(out, format="PNG")
        open_image(out.getvalue()[:2000])  # header intact, pixel data cut short
    assert err.value.reason == "corrupt"


def test_thin_image_is_refused_on_its_header(tmp_path: Path) -> None:
    """A 200,000 x 1 PNG (under 2 KB; decoded and scaled to a 64-pixel shorter side it would be
    12.8 M x 64 pixels): refused on its header, the process's peak memory barely moves."""
    thin = tmp_path / "thin.png"
    Image.new("1", (200_000, 1)).save(thin)
    assert thin.stat().st_size < 2000
    script = textwrap.dedent(
        f"""
        import resource, sys
        from icr.core.image_input import ImageRefused, open_image
        from icr.training.models.preprocess import ImageTransform
        data = open({str(thin)!r}, "rb").read()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            image = open_image(data)
            ImageTransform(image_size=64, resize=None, mean=(0.5,) * 3, std=(0.5,) * 3)(image)
            print("decoded")
        except ImageRefused as err:
            print(err.reason)
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)  # KiB
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    ).stdout.split()
    assert out[0] == "aspect_ratio"
    assert int(out[1]) < 20_000  # KiB of growth: nothing was decoded or resized


def test_gallery_loader_names_the_file_and_the_limit(tmp_path: Path) -> None:
    from icr.training.data.errors import DatasetError
    from icr.training.data.karpathy import load_image

    Image.fromarray(np.zeros((2, 100, 3), np.uint8)).save(tmp_path / "strip.png")
    with pytest.raises(DatasetError, match="strip.png") as err:
        load_image(tmp_path / "strip.png")
    assert "aspect ratio 50:1" in str(err.value) and "Crop or downscale" in str(err.value)
    (tmp_path / "page.eps").write_bytes(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n")
    with pytest.raises(DatasetError, match="page.eps"):
        load_image(tmp_path / "page.eps")


@settings(max_examples=60, deadline=None)
@given(
    width=st.integers(1, 400),
    height=st.integers(1, 400),
    fmt_mode=st.sampled_from(
        [
            ("PNG", "RGB"),
            ("PNG", "RGBA"),
            ("PNG", "L"),
            ("PNG", "1"),
            ("PNG", "P"),
            ("JPEG", "RGB"),
            ("JPEG", "L"),
            ("WEBP", "RGBA"),
            ("GIF", "P"),
            ("BMP", "RGB"),
            ("TIFF", "RGB"),
        ]
    ),
    max_pixels=st.integers(1, 200_000),
    max_aspect=st.floats(1.0, 50.0),
    cut=st.none() | st.integers(0, 200),
)
def test_fuzzed_images_decode_exactly_when_within_every_limit(
    width: int, height: int, fmt_mode: tuple[str, str], max_pixels: int, max_aspect: float, cut: int | None
) -> None:
    fmt, mode = fmt_mode
    data = _encoded((width, height), fmt, mode)
    if cut is not None:
        data = data[:cut]  # a truncated file: refused, never a crash or an unbounded decode
    limits = ImageLimits(max_pixels=max_pixels, max_aspect_ratio=max_aspect)
    try:
        image = open_image(data, limits)
    except ImageRefused as err:
        if err.reason == "pixels":
            assert width * height > max_pixels
        elif err.reason == "aspect_ratio":
            assert max(width, height) / min(width, height) > max_aspect
        elif err.reason == "format":
            assert fmt == "TIFF" or cut is not None
        else:
            assert cut is not None
        return
    assert image.mode == "RGB" and image.size == (width, height)
    assert width * height <= max_pixels and max(width, height) / min(width, height) <= max_aspect
    assert fmt != "TIFF"


def _phone_photo(path: Path, orientation: int) -> np.ndarray:
    """A 64 x 48 JPEG stored sideways with an EXIF orientation tag, as phones write them; returns the
    pixels as stored (decoded without the tag)."""
    pixels = np.zeros((48, 64, 3), dtype=np.uint8)
    pixels[:, :32] = (220, 30, 30)  # left half red
    pixels[:, 32:] = (30, 30, 220)  # right half blue
    pixels[:8, :8] = (30, 220, 30)  # a green corner, so a flip is not mistaken for a rotation
    exif = Image.Exif()
    exif[0x0112] = orientation  # Orientation
    Image.fromarray(pixels).save(path, format="JPEG", quality=95, exif=exif)
    with Image.open(path) as stored:
        return np.asarray(stored.convert("RGB"))


# EXIF orientation -> what a viewer does to the stored pixels (rows, columns), written independently
# of PIL's transpose table: 6 = rotate 90 degrees clockwise, 8 = counter-clockwise, 3 = 180, 2 = mirror.
UPRIGHT = {
    1: lambda a: a,
    2: lambda a: a[:, ::-1],
    3: lambda a: a[::-1, ::-1],
    6: lambda a: np.rot90(a, k=-1),
    8: lambda a: np.rot90(a, k=1),
}


@pytest.mark.parametrize("orientation", sorted(UPRIGHT))
def test_photos_are_decoded_upright_by_their_exif_orientation(tmp_path: Path, orientation: int) -> None:
    path = tmp_path / f"phone-{orientation}.jpg"
    stored = _phone_photo(path, orientation)
    expected = UPRIGHT[orientation](stored)
    for source in (path, path.read_bytes()):  # gallery files and uploads
        image = open_image(source, ImageLimits(formats=GALLERY_FORMATS))
        assert image.size == (expected.shape[1], expected.shape[0])
        np.testing.assert_array_equal(np.asarray(image), expected)
    if orientation == 6:  # the sideways photo every viewer shows 48 wide and 64 high
        assert image.size == (48, 64)


def test_every_gallery_reader_sees_the_photo_upright(tmp_path: Path) -> None:
    from icr.index.photo_folder import decode_image
    from icr.training.data.karpathy import load_image

    path = tmp_path / "sideways.jpg"
    expected = UPRIGHT[6](_phone_photo(path, 6))
    for image in (load_image(path), decode_image(path)):
        np.testing.assert_array_equal(np.asarray(image), expected)
