"""Image preparation for generation requests (``services.inference.prepare_image``), real Pillow."""

from __future__ import annotations

import io

import pytest
from PIL import Image, JpegImagePlugin

from modeld.errors import BadRequest
from modeld.services.inference import IMAGE_LONG_SIDE, JPEG_QUALITY, prepare_image

MAX_PIXELS = 40_000_000  # the default MODELD_MAX_IMAGE_PIXELS
EXIF_ORIENTATION = 0x0112


def _encode(img: Image.Image, fmt: str = "PNG", **kw: object) -> bytes:
    out = io.BytesIO()
    img.save(out, format=fmt, **kw)
    return out.getvalue()


def _open(data: bytes) -> Image.Image:
    img = Image.open(io.BytesIO(data))
    img.load()
    return img


def _quantization(quality: int) -> dict[int, list[int]]:
    """The JPEG quantization tables Pillow writes at ``quality`` (they depend on it alone)."""
    return _tables(_open(_encode(Image.new("RGB", (16, 16)), "JPEG", quality=quality)))


def _tables(img: Image.Image) -> dict[int, list[int]]:
    """The quantization tables of a decoded JPEG (a JPEG-only attribute)."""
    assert isinstance(img, JpegImagePlugin.JpegImageFile), img.format
    return dict(img.quantization)


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        ((1200, 800), (640, 427)),
        ((800, 1600), (320, 640)),
        ((640, 640), (640, 640)),
        ((100, 50), (100, 50)),  # never upscaled
    ],
)
def test_long_side_is_bounded_and_aspect_kept(
    size: tuple[int, int], expected: tuple[int, int]
) -> None:
    """The long side is at most 640 px, the aspect ratio is kept, small images stay as they are."""
    out = _open(prepare_image(_encode(Image.new("RGB", size, "red")), MAX_PIXELS))
    assert out.size == expected
    assert max(out.size) <= IMAGE_LONG_SIDE


def test_output_is_an_rgb_jpeg_at_quality_88() -> None:
    """Any input (here RGBA PNG) comes out as an RGB JPEG with quality 88's tables."""
    rgba = Image.new("RGBA", (900, 300), (10, 200, 30, 128))
    out = _open(prepare_image(_encode(rgba), MAX_PIXELS))
    assert (out.format, out.mode) == ("JPEG", "RGB")
    assert JPEG_QUALITY == 88
    assert _tables(out) == _quantization(88)
    assert _tables(out) != _quantization(75)  # Pillow's default: the check can tell


def test_exif_orientation_is_applied_before_the_resize() -> None:
    """A sideways photo (EXIF orientation 6) comes out upright, bounded on its upright side.

    Stored 1280x640 with its left half red and its right half blue; orientation 6 means
    "turn 90 degrees clockwise to view", so upright it is 640x1280 with red on top.
    """
    stored = Image.new("RGB", (1280, 640), "blue")
    stored.paste((255, 0, 0), (0, 0, 640, 640))
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = 6
    out = _open(prepare_image(_encode(stored, "JPEG", quality=95, exif=exif.tobytes()), MAX_PIXELS))
    assert out.size == (320, 640)
    top, bottom = out.getpixel((160, 40)), out.getpixel((160, 600))
    assert isinstance(top, tuple) and isinstance(bottom, tuple)
    assert top[0] > 200 and top[2] < 60, top
    assert bottom[2] > 200 and bottom[0] < 60, bottom
    # The orientation is spent: nothing downstream turns the image a second time.
    assert out.getexif().get(EXIF_ORIENTATION) in (None, 1)


def test_an_undecodable_image_is_a_bad_request() -> None:
    """Bytes that are no image are a 400 that says what to send."""
    with pytest.raises(BadRequest) as info:
        prepare_image(b"not an image at all", MAX_PIXELS)
    assert "PNG or JPEG" in info.value.message


def test_an_undecodable_image_is_said_plainly() -> None:
    """The 400 for bytes that are no image, or a truncated one, says so without a Python repr
    (Pillow names its buffer object: ``<_io.BytesIO object at 0x...>``)."""
    png = _encode(Image.new("RGB", (64, 64), (1, 2, 3)))
    with pytest.raises(BadRequest) as unknown:
        prepare_image(b"not an image at all", MAX_PIXELS)
    assert unknown.value.message == (
        "an image could not be decoded (its bytes are in no image format modeld reads); "
        "send PNG or JPEG bytes"
    )
    with pytest.raises(BadRequest) as truncated:
        prepare_image(png[:60], MAX_PIXELS)
    assert truncated.value.message == (
        "an image could not be decoded (image file is truncated); send PNG or JPEG bytes"
    )
