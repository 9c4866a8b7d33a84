"""Turn dataset rows into benchmark work, the way vLLM's VisionArena sampler does.

Single-turn: the first user message and the first image (re-encoded as a JPEG data URL, as vLLM's
`process_image` does), text part first. Multi-turn: every user message of a conversation, image k
attached to turn k (the real set does not say where later images belong).
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass

import numpy as np
from PIL import Image


@dataclass(frozen=True)
class SingleTurn:
    prompt: str
    image_url: str  # data:image/jpeg;base64,...


@dataclass(frozen=True)
class Conversation:
    user_texts: list[str]  # one per turn, in order
    image_urls: list[str]  # image k belongs to turn k


def jpeg_data_url(image: Image.Image | dict) -> str:
    """An image (PIL, or a {bytes, path} dict from an undecoded Image column) as a JPEG data URL."""
    if isinstance(image, dict):
        image = Image.open(io.BytesIO(image["bytes"]))
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="JPEG")
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def _rows(dataset, num: int, seed: int) -> list[dict]:
    """`num` rows with at least one image, images left as {bytes, path}: a seeded shuffle, repeated
    (oversampled, as vLLM does) when the dataset has fewer than `num` such rows."""
    from datasets import Image as ImageFeature
    from datasets import List

    dataset = dataset.cast_column("images", List(ImageFeature(decode=False)))
    picked: list[dict] = []
    for i in np.random.default_rng(seed).permutation(len(dataset)):
        if len(picked) == num:
            break
        row = dataset[int(i)]
        if row["images"]:
            picked.append(row)
    if not picked:
        raise ValueError("no row of the dataset has an image")
    return [picked[k % len(picked)] for k in range(num)]


def sample_single_turn(dataset, num: int, seed: int) -> list[SingleTurn]:
    rows = _rows(dataset, num, seed)
    return [SingleTurn(r["conversation"][0][0]["content"], jpeg_data_url(r["images"][0])) for r in rows]


def sample_conversations(dataset, num: int, seed: int) -> list[Conversation]:
    out = []
    for row in _rows(dataset, num, seed):
        texts = [turn[0]["content"] for turn in row["conversation"] if turn and turn[0]["role"] == "user"]
        out.append(Conversation(texts, [jpeg_data_url(im) for im in row["images"][: len(texts)]]))
    return out


def user_message(text: str, image_urls: list[str]) -> dict:
    """An OpenAI user message: the text part first, then the images (vLLM's order)."""
    parts: list[dict] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in image_urls]
    return {"role": "user", "content": parts}
