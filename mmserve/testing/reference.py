"""transformers as the correctness oracle, on the same model folder and the same inputs.

transformers 5's AutoProcessor needs torchvision, which has no CPU build that imports beside
the CPU torch here, so prompts are built from the tokenizer's chat template plus the image
processor's PIL backend, and `mm_token_type_ids` is passed with `image_grid_thw` (transformers 5
requires it for M-RoPE).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image


@dataclass
class PromptInputs:
    """A prompt with its image placeholders expanded, as both engines see it."""

    token_ids: list[int]
    pixel_values: list[np.ndarray]  # one [num_patches, C·T·P·P] array per image
    grid_thw: list[tuple[int, int, int]]
    image_spans: list[tuple[int, int]]  # (offset, length) of each image's placeholder run


@dataclass
class ReferenceOutput:
    token_ids: list[int]
    logits: torch.Tensor  # [num_generated, vocab] float32, the logits each token was chosen from


def synthetic_image(width: int, height: int, seed: int) -> Image.Image:
    """Seeded smooth colour field plus noise and a few rectangles: varied, lossless-friendly."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack(
        [
            127 + 127 * np.sin(xx / (5 + 20 * rng.random()) + rng.random() * 6),
            127 + 127 * np.cos(yy / (5 + 20 * rng.random()) + rng.random() * 6),
            127 + 127 * np.sin((xx + yy) / (5 + 20 * rng.random())),
        ],
        axis=-1,
    )
    base += rng.normal(0, 20, size=base.shape)
    for _ in range(3):
        x0, y0 = rng.integers(0, width), rng.integers(0, height)
        base[y0 : y0 + height // 4, x0 : x0 + width // 4] = rng.integers(0, 256, size=3)
    return Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


class Reference:
    def __init__(self, model_dir: str | Path, dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoModelForImageTextToText, AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype).eval()
        self.image_token_id = self.model.config.image_token_id
        self.merge_size = self.image_processor.merge_size

    def build_prompt(self, messages: list[dict], images: list[Image.Image]) -> PromptInputs:
        """Chat template → expand each <|image_pad|> to the image's token count → token ids."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        pixel_values, grids = [], []
        for image in images:
            out = self.image_processor(images=[image], return_tensors="np")
            pixel_values.append(out["pixel_values"].astype(np.float32))
            grids.append(tuple(int(v) for v in out["image_grid_thw"][0]))
        pieces = text.split("<|image_pad|>")
        if len(pieces) != len(images) + 1:
            raise ValueError(f"{len(pieces) - 1} image placeholders for {len(images)} images")
        expanded = pieces[0]
        for grid, piece in zip(grids, pieces[1:]):
            expanded += "<|image_pad|>" * (int(np.prod(grid)) // self.merge_size**2) + piece
        token_ids = self.tokenizer(expanded, add_special_tokens=False)["input_ids"]
        return PromptInputs(token_ids, pixel_values, grids, image_spans(token_ids, self.image_token_id))

    @torch.inference_mode()
    def generate(self, prompt: PromptInputs, max_new_tokens: int) -> ReferenceOutput:
        """Greedy decoding with transformers' `generate`."""
        ids = torch.tensor([prompt.token_ids])
        kwargs = {}
        if prompt.pixel_values:
            kwargs["pixel_values"] = torch.from_numpy(np.concatenate(prompt.pixel_values))
            kwargs["image_grid_thw"] = torch.tensor(prompt.grid_thw)
        out = self.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            mm_token_type_ids=(ids == self.image_token_id).int(),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            **kwargs,
        )
        generated = out.sequences[0, ids.shape[1] :].tolist()
        return ReferenceOutput(generated, torch.cat(out.logits).float())


@dataclass
class VisionInputs:
    """Pixels and grids of a prompt's images and videos, as transformers' model takes them."""

    image_pixels: list[np.ndarray]
    image_grids: list[tuple[int, int, int]]
    video_pixels: list[np.ndarray]
    video_grids: list[tuple[int, int, int]]
    second_per_grid_ts: list[float] | None = None  # Qwen2.5-VL

    def model_kwargs(self) -> dict:
        kwargs: dict = {}
        if self.image_pixels:
            kwargs["pixel_values"] = torch.from_numpy(np.concatenate(self.image_pixels))
            kwargs["image_grid_thw"] = torch.tensor(self.image_grids)
        if self.video_pixels:
            kwargs["pixel_values_videos"] = torch.from_numpy(np.concatenate(self.video_pixels))
            kwargs["video_grid_thw"] = torch.tensor(self.video_grids)
        if self.second_per_grid_ts is not None:
            kwargs["second_per_grid_ts"] = torch.tensor(self.second_per_grid_ts)
        return kwargs


@torch.inference_mode()
def generate_with_vision(
    reference: Reference, token_ids: list[int], vision: VisionInputs, max_new_tokens: int
) -> ReferenceOutput:
    """Greedy `generate` on prompt ids whose placeholders are already expanded (image pads are
    token type 1, video pads 2, as transformers' processors mark them)."""
    ids = torch.tensor([token_ids])
    config = reference.model.config
    token_types = (ids == config.image_token_id).int() + 2 * (ids == config.video_token_id).int()
    out = reference.model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=token_types,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        **vision.model_kwargs(),
    )
    return ReferenceOutput(out.sequences[0, ids.shape[1] :].tolist(), torch.cat(out.logits).float())


def image_spans(token_ids: list[int], image_token_id: int) -> list[tuple[int, int]]:
    """(offset, length) of each maximal run of image placeholder tokens."""
    is_image = np.asarray(token_ids) == image_token_id
    edges = np.diff(np.concatenate([[0], is_image.astype(np.int8), [0]]))
    starts, ends = np.nonzero(edges == 1)[0], np.nonzero(edges == -1)[0]
    return [(int(s), int(e - s)) for s, e in zip(starts, ends)]
