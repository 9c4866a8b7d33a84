"""Conversations for the engine tests: OpenAI messages for our engine, and the same conversation
and images for the transformers reference."""

from __future__ import annotations

import base64

from mmserve.testing.reference import Reference, png_bytes, synthetic_image

MAX_TOKENS = 16
QUESTIONS = [
    "What colour is the circle?",
    "How many shapes are there?",
    "Describe the image.",
    "Where is the red square?",
    "Is there any text in the picture?",
    "Tell me a joke about triangles.",
    "What is the biggest shape?",
    "Hello, how are you today?",
]


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def conversation(i: int, num_images: int, sizes=((200, 150), (120, 260))):
    """OpenAI messages for our engine, plus the same conversation and images for the reference."""
    images = [synthetic_image(w, h, seed=100 * i + k) for k, (w, h) in enumerate(sizes[:num_images])]
    parts = [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in images]
    parts.append({"type": "text", "text": QUESTIONS[i % len(QUESTIONS)]})
    ref_parts = [{"type": "image"} for _ in images] + [
        {"type": "text", "text": QUESTIONS[i % len(QUESTIONS)]}
    ]
    return [{"role": "user", "content": parts}], [{"role": "user", "content": ref_parts}], images


def expected_tokens(reference: Reference, ref_messages, images, max_tokens: int = MAX_TOKENS):
    prompt = reference.build_prompt(ref_messages, images)
    return prompt.token_ids, reference.generate(prompt, max_tokens).token_ids
