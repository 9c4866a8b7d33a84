"""Seeded synthetic images of the two kinds chat users send: photos and text/diagram screenshots.

Both are pure functions of (kind, size, seed), so a generated dataset is reproducible byte for byte.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageDraw, ImageFont

# (width, height) from a 256² thumbnail to a 2048×1536 camera photo, landscape and portrait.
SIZES: tuple[tuple[int, int], ...] = (
    (256, 256),
    (512, 384),
    (640, 480),
    (480, 640),
    (800, 600),
    (1024, 768),
    (1280, 720),
    (1024, 1024),
    (768, 1024),
    (1600, 1200),
    (1920, 1080),
    (2048, 1536),
)

_WORDS = (
    "total revenue quarter input output layer node server request latency cache block token image "
    "invoice date amount step result error warning config model batch queue memory score table"
).split()


def photo(width: int, height: int, seed: int) -> Image.Image:
    """Smooth colour fields with sensor noise and a few soft blobs: compresses like a photo."""
    rng = np.random.default_rng(seed)
    # Work at a quarter of the size and upscale: smooth content at a fraction of the cost.
    h, w = max(height // 4, 8), max(width // 4, 8)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    channels = []
    for _ in range(3):
        fx, fy, phase = rng.uniform(0.005, 0.05), rng.uniform(0.005, 0.05), rng.uniform(0, 6.3)
        channels.append(127 + 100 * np.sin(xx * fx + phase) * np.cos(yy * fy - phase))
    base = np.stack(channels, axis=-1)  # base: [h, w, 3]
    for _ in range(rng.integers(2, 6)):
        cy, cx, r = rng.uniform(0, h), rng.uniform(0, w), rng.uniform(0.05, 0.3) * min(h, w)
        blob = np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * r * r))[..., None]
        base = base * (1 - blob) + blob * rng.integers(0, 256, size=3)
    small = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
    image = np.asarray(small.resize((width, height), Image.Resampling.BILINEAR), dtype=np.int16)
    noise = rng.integers(-12, 13, size=(height, width, 1), dtype=np.int16)
    return Image.fromarray(np.clip(image + noise, 0, 255).astype(np.uint8))


def diagram(width: int, height: int, seed: int) -> Image.Image:
    """White page with a title, lines of text, boxes joined by arrows and a bar chart."""
    rng = np.random.default_rng(seed)
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    font_px = max(10, height // 40)
    font = ImageFont.load_default(size=font_px)
    title = " ".join(rng.choice(_WORDS, size=3)).title()
    draw.text(
        (width * 0.05, height * 0.03), title, fill="black", font=ImageFont.load_default(size=font_px * 2)
    )
    y = height * 0.12
    while y < height * 0.45:
        line = " ".join(rng.choice(_WORDS, size=int(rng.integers(4, 10))))
        draw.text((width * 0.05, y), f"{line} {rng.integers(0, 10_000)}", fill=(30, 30, 30), font=font)
        y += font_px * 1.5
    boxes = int(rng.integers(2, 5))
    box_w, box_h = width / (2 * boxes + 1), height * 0.12
    for i in range(boxes):
        x0 = box_w * (2 * i + 1)
        y0 = height * 0.5
        colour = tuple(int(c) for c in rng.integers(120, 230, size=3))
        draw.rectangle((x0, y0, x0 + box_w, y0 + box_h), outline="black", fill=colour, width=2)
        draw.text((x0 + 4, y0 + 4), str(rng.choice(_WORDS)), fill="black", font=font)
        if i + 1 < boxes:
            ya = y0 + box_h / 2
            draw.line((x0 + box_w, ya, x0 + 2 * box_w, ya), fill="black", width=2)
    bars = rng.uniform(0.1, 1.0, size=int(rng.integers(3, 9)))
    bar_w = width * 0.8 / len(bars)
    for i, value in enumerate(bars):
        x0 = width * 0.1 + i * bar_w
        draw.rectangle(
            (x0, height * (0.95 - 0.25 * value), x0 + bar_w * 0.7, height * 0.95), fill=(60, 90, 200)
        )
    return image


def encode(image: Image.Image, fmt: str) -> bytes:
    """The image as a JPEG (quality 90) or PNG file."""
    buf = io.BytesIO()
    if fmt == "JPEG":
        image.save(buf, format="JPEG", quality=90)
    else:
        image.save(buf, format="PNG")
    return buf.getvalue()
