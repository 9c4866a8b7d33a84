"""Seeded pictures of 1–4 coloured shapes, sometimes with a word, for the demo model.

A `Scene` is what the pictures are about (which shapes, colours, places, word); `render` turns it
into pixels, with every incidental detail (exact size and offset of each shape, colour jitter,
background texture) drawn from the scene's own `render_seed`, so a scene always renders the same.

Layout: the picture is a 3×3 grid; shapes sit in the four corner cells and the centre cell, at
most one per cell, and each kind of shape appears at most once (so "the circle" is unambiguous).
A word, when there is one, is written across the middle row, and then the centre cell stays free.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw, ImageFont

RGB = tuple[int, int, int]

COLOURS: dict[str, RGB] = {
    "red": (220, 30, 30),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (245, 215, 40),
    "purple": (140, 60, 180),
    "black": (20, 20, 20),
}
SHAPES = ("circle", "square", "triangle", "star")
# Reading order: descriptions list shapes in this order.
POSITIONS = ("top left", "top right", "centre", "bottom left", "bottom right")
CELLS = {
    "top left": (0, 0),
    "top right": (2, 0),
    "centre": (1, 1),
    "bottom left": (0, 2),
    "bottom right": (2, 2),
}
WORDS = "CAT DOG SUN BOX CAR CUP HAT BUS YES NO STOP GO".split()
BACKGROUNDS: dict[str, RGB] = {
    "white": (255, 255, 255),
    "cream": (245, 238, 220),
    "light grey": (205, 205, 205),
    "light blue": (205, 225, 245),
    "pale green": (215, 238, 210),
}
TEXTURES = ("plain", "noise", "gradient")

MIN_CONTRAST = 110.0  # RGB distance between a shape and its background
MIN_WORD_CONTRAST = 150.0
MAX_ASPECT = 2.2
# Source picture areas are drawn around the model's budget of 64 image tokens (64·28·28 pixels).
TOKEN_BUDGET_PIXELS = 64 * 28 * 28


@dataclass(frozen=True)
class Item:
    shape: str
    colour: str
    position: str


@dataclass(frozen=True)
class Scene:
    width: int
    height: int
    background: str
    items: tuple[Item, ...]  # in reading order of position
    word: str | None
    render_seed: int
    texture: str | None = None  # None: drawn from render_seed

    def item(self, shape: str) -> Item | None:
        return next((it for it in self.items if it.shape == shape), None)


def contrast(a: RGB, b: RGB) -> float:
    return math.dist(a, b)


def sample_size(rng: random.Random) -> tuple[int, int]:
    """(width, height): mostly larger than the token budget (so the processor shrinks them to a
    few dozen tokens at many aspect ratios), some smaller, a few large uploads."""
    aspect = math.exp(rng.uniform(-math.log(MAX_ASPECT), math.log(MAX_ASPECT)))  # width / height
    u = rng.random()
    if u < 0.65:
        area = TOKEN_BUDGET_PIXELS * math.exp(rng.uniform(0.05, math.log(5)))
    elif u < 0.8:
        area = math.exp(rng.uniform(math.log(5 * TOKEN_BUDGET_PIXELS), math.log(1.2e6)))
    else:
        area = math.exp(rng.uniform(math.log(16000), math.log(TOKEN_BUDGET_PIXELS)))
    return max(32, round(math.sqrt(area * aspect))), max(32, round(math.sqrt(area / aspect)))


def sample_scene(rng: random.Random, word_probability: float = 0.3) -> Scene:
    """A random scene of 1–4 shapes (each count equally likely)."""
    width, height = sample_size(rng)
    background = rng.choice(list(BACKGROUNDS))
    bg = BACKGROUNDS[background]
    word = rng.choice(WORDS) if rng.random() < word_probability else None
    free = [p for p in POSITIONS if not (word and p == "centre")]
    count = rng.randint(1, 4)
    colours = [c for c, rgb in COLOURS.items() if contrast(rgb, bg) >= MIN_CONTRAST]
    positions = set(rng.sample(free, count))
    shapes = rng.sample(SHAPES, count)
    items = tuple(
        Item(shape, rng.choice(colours), pos)
        for shape, pos in zip(shapes, [p for p in POSITIONS if p in positions])
    )
    return Scene(width, height, background, items, word, rng.getrandbits(32))


# ----------------------------------------------------------------------------------------------
# Rendering.


def _background(scene: Scene, rng: np.random.Generator) -> np.ndarray:
    """[height, width, 3] float32 background with a light texture."""
    h, w = scene.height, scene.width
    base = np.broadcast_to(np.asarray(BACKGROUNDS[scene.background], np.float32), (h, w, 3)).copy()
    drawn = TEXTURES[int(rng.integers(len(TEXTURES)))]  # drawn even when fixed: same stream after
    texture = scene.texture or drawn
    if texture == "noise":
        base += rng.normal(0, rng.uniform(4, 10), size=(h, w, 1)).astype(np.float32)
    elif texture == "gradient":
        angle = rng.uniform(0, 2 * math.pi)
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        ramp = (xx / w - 0.5) * math.cos(angle) + (yy / h - 0.5) * math.sin(angle)
        base += (ramp * rng.uniform(20, 50))[..., None]
    return base


def _jitter(rgb: RGB, rng: np.random.Generator, amount: int = 12) -> RGB:
    return tuple(int(np.clip(v + rng.integers(-amount, amount + 1), 0, 255)) for v in rgb)


def _polygon(shape: str, cx: float, cy: float, size: float) -> list[tuple[float, float]]:
    r = size / 2
    if shape == "triangle":
        return [(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    if shape == "star":
        points = []
        for k in range(10):
            radius = r if k % 2 == 0 else 0.42 * r
            angle = -math.pi / 2 + k * math.pi / 5
            points.append((cx + radius * math.cos(angle), cy + radius * math.sin(angle) + 0.08 * r))
        return points
    raise ValueError(shape)


Box = tuple[float, float, float, float]  # x0, y0, x1, y1 in pixels


def _draw_shape(draw: ImageDraw.ImageDraw, item: Item, cell: Box, rng: np.random.Generator) -> Box:
    """Draw `item` inside `cell` at a random size and offset; returns the shape's bounding box."""
    x0, y0, x1, y1 = cell
    side = min(x1 - x0, y1 - y0)
    size = side * rng.uniform(0.55, 0.9)
    cx = rng.uniform(x0 + size / 2, x1 - size / 2)
    cy = rng.uniform(y0 + size / 2, y1 - size / 2)
    fill = _jitter(COLOURS[item.colour], rng)
    r = size / 2
    if item.shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif item.shape == "square":
        draw.rectangle((cx - r * 0.9, cy - r * 0.9, cx + r * 0.9, cy + r * 0.9), fill=fill)
    else:
        draw.polygon(_polygon(item.shape, cx, cy, size), fill=fill)
    return (cx - r, cy - r, cx + r, cy + r)


def _draw_word(draw: ImageDraw.ImageDraw, scene: Scene, rng: np.random.Generator) -> Box:
    w, h = scene.width, scene.height
    bg = BACKGROUNDS[scene.background]
    choices = [rgb for rgb in COLOURS.values() if contrast(rgb, bg) >= MIN_WORD_CONTRAST]
    fill = _jitter(choices[int(rng.integers(len(choices)))], rng, amount=8)
    # Letters as tall as most of the middle row, as long as the word fits 90% of the width.
    size = h / 3 * rng.uniform(0.6, 0.85)
    probe = ImageFont.load_default(size=100)
    x0, y0, x1, y1 = probe.getbbox(scene.word)
    size = min(size * 100 / (y1 - y0), 0.9 * w * 100 / (x1 - x0))
    font = ImageFont.load_default(size=max(8, int(size)))
    cx = w / 2 + rng.uniform(-0.03, 0.03) * w
    draw.text((cx, h / 2), scene.word, fill=fill, font=font, anchor="mm")
    return draw.textbbox((cx, h / 2), scene.word, font=font, anchor="mm")


def render(scene: Scene) -> Image.Image:
    return render_with_boxes(scene)[0]


def render_with_boxes(scene: Scene) -> tuple[Image.Image, list[Box], Box | None]:
    """The picture, the bounding box of each item (in `scene.items` order) and of the word."""
    rng = np.random.default_rng(scene.render_seed)
    pixels = _background(scene, rng)
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    cell_w, cell_h = scene.width / 3, scene.height / 3
    margin = 0.04 * min(cell_w, cell_h)
    boxes = []
    for item in scene.items:
        col, row = CELLS[item.position]
        cell = (
            col * cell_w + margin,
            row * cell_h + margin,
            (col + 1) * cell_w - margin,
            (row + 1) * cell_h - margin,
        )
        boxes.append(_draw_shape(draw, item, cell, rng))
    word_box = _draw_word(draw, scene, rng) if scene.word else None
    return image, boxes, word_box
