"""The bundled demo model answers questions about a bundled sample picture, exactly."""

from __future__ import annotations

import pytest

from mmserve.entrypoints.llm import LLM
from mmserve.sampling_params import SamplingParams
from mmserve.testing.demo.folder import DEMO_MODEL_DIR, REPO_DIR

SAMPLE = REPO_DIR / "assets" / "samples" / "shapes.png"  # red circle, green triangle, blue square
GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


def ask(llm: LLM, questions: list[str]) -> list[str]:
    conversations = [
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": SAMPLE.as_uri()}},
                    {"type": "text", "text": q},
                ],
            }
        ]
        for q in questions
    ]
    return [out.outputs[0].text for out in llm.chat(conversations, GREEDY)]


@pytest.fixture(scope="module")
def llm():
    with LLM(DEMO_MODEL_DIR, dtype="bfloat16", num_kv_blocks=64) as engine:
        yield engine


def test_demo_model_tells_colour_count_and_position_of_the_sample_shapes(llm):
    answers = ask(
        llm, ["What colour is the circle?", "How many shapes are there?", "Where is the blue square?"]
    )
    assert answers == ["The circle is red.", "There are 3 shapes.", "The blue square is at the bottom right."]


def test_demo_model_asks_for_a_picture_when_greeted(llm):
    [out] = llm.chat([{"role": "user", "content": "Hello!"}], GREEDY)
    assert out.outputs[0].text == "Hello! Send me a picture of shapes and ask me about it."
