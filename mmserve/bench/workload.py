"""Turn dataset rows into benchmark work, the way vLLM's VisionArena sampler does.

Single-turn: the first user message and the first image (re-encoded as a JPEG data URL, as vLLM's
`process_image` does), text part first. Multi-turn: every user message of a conversation, image k
attached to turn k (the real set does not say where later images belong). Rows of the video mix
(a `videos` column, see `dataset`) carry an mp4 instead, sent as a `video_url` part with turn 1.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass, field

import numpy as np
from PIL import Image


@dataclass(frozen=True)
class SingleTurn:
    prompt: str
    image_url: str  # data:image/jpeg;base64,... ("" for a video row)
    video_url: str = ""  # data:video/mp4;base64,...

    def message(self) -> dict:
        return user_message(self.prompt, [self.image_url] if self.image_url else [], self.video_urls)

    @property
    def video_urls(self) -> list[str]:
        return [self.video_url] if self.video_url else []


@dataclass(frozen=True)
class Conversation:
    user_texts: list[str]  # one per turn, in order
    image_urls: list[str]  # image k belongs to turn k
    video_urls: list[str] = field(default_factory=list)  # videos of the first turn

    def message(self, turn: int, file_ids: list[str] | None = None) -> dict:
        """Turn `turn`'s user message; with `file_ids` (one per image, uploaded beforehand) its
        image is referred to by file id instead of sent as a data URL."""
        videos = self.video_urls if turn == 0 else []
        if file_ids is not None:
            return user_message(self.user_texts[turn], [], videos, file_ids[turn : turn + 1])
        return user_message(self.user_texts[turn], self.image_urls[turn : turn + 1], videos)

    def first_turn(self) -> SingleTurn:
        return SingleTurn(
            self.user_texts[0], self.image_urls[0] if self.image_urls else "", (self.video_urls or [""])[0]
        )


def mp4_data_url(data: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


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
        if row["images"] or row.get("videos"):
            picked.append(row)
    if not picked:
        raise ValueError("no row of the dataset has an image or a video")
    return [picked[k % len(picked)] for k in range(num)]


def sample_single_turn(dataset, num: int, seed: int) -> list[SingleTurn]:
    return [c.first_turn() for c in sample_conversations(dataset, num, seed)]


def sample_conversations(dataset, num: int, seed: int) -> list[Conversation]:
    out = []
    for row in _rows(dataset, num, seed):
        texts = [turn[0]["content"] for turn in row["conversation"] if turn and turn[0]["role"] == "user"]
        images = [jpeg_data_url(im) for im in row["images"][: len(texts)]]
        out.append(Conversation(texts, images, [mp4_data_url(v) for v in row.get("videos") or []]))
    return out


def user_message(
    text: str, image_urls: list[str], video_urls: list[str] = (), image_file_ids: list[str] = ()
) -> dict:
    """An OpenAI user message: the text part first, then the images and videos (vLLM's order)."""
    parts: list[dict] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in image_urls]
    parts += [{"type": "image_file", "image_file": {"file_id": i}} for i in image_file_ids]
    parts += [{"type": "video_url", "video_url": {"url": url}} for url in video_urls]
    return {"role": "user", "content": parts}
