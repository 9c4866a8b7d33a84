"""The generated stand-in for VisionArena-Chat: its parquet schema, as `datasets` loads it back."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from mmserve.bench import dataset, images, workload

datasets = pytest.importorskip("datasets")
NUM_ROWS = 6


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("visionarena")
    paths = dataset.write_dataset(out, NUM_ROWS, seed=3, rows_per_shard=4)
    assert [p.name for p in paths] == ["train-00000-of-00002.parquet", "train-00001-of-00002.parquet"]
    return out


@pytest.fixture(scope="module")
def loaded(folder):
    return datasets.load_dataset(str(folder), split="train")


def test_loads_as_the_train_split_with_visionarena_features(loaded):
    assert len(loaded) == NUM_ROWS
    assert loaded.features == dataset.features()
    assert isinstance(loaded.features["images"].feature, datasets.Image)
    assert set(loaded.column_names) == {
        "conversation_id",
        "model",
        "conversation",
        "images",
        "num_turns",
        "language",
    }


def test_conversation_is_turns_of_role_content_messages(loaded):
    for row in loaded:
        assert 1 <= row["num_turns"] <= 4
        assert len(row["conversation"]) == row["num_turns"]
        for turn in row["conversation"]:
            assert [m["role"] for m in turn] == ["user", "assistant"]
            assert all(isinstance(m["content"], str) and m["content"] for m in turn)
        assert isinstance(row["conversation_id"], str) and isinstance(row["language"], str)


def test_images_decode_as_jpeg_or_png_of_the_listed_sizes(loaded):
    for row in loaded:
        assert len(row["images"]) == 1
        image = row["images"][0]
        assert isinstance(image, Image.Image)
        assert image.format in {"JPEG", "PNG"}
        assert image.size in images.SIZES


def test_vllm_reader_fields_are_there(loaded):
    row = loaded[0]
    assert isinstance(row["conversation"][0][0]["content"], str)  # vLLM's prompt
    assert isinstance(row["images"][0], Image.Image)  # vLLM's image


def test_same_seed_same_rows():
    assert dataset.make_row(4, seed=9) == dataset.make_row(4, seed=9)
    assert dataset.make_row(4, seed=9)["images"] != dataset.make_row(4, seed=10)["images"]


def test_single_turn_sample_is_text_then_jpeg_data_url(loaded):
    requests = workload.sample_single_turn(loaded, NUM_ROWS + 2, seed=0)  # oversampled
    assert len(requests) == NUM_ROWS + 2
    first = requests[0]
    message = workload.user_message(first.prompt, [first.image_url])
    assert [p["type"] for p in message["content"]] == ["text", "image_url"]
    header, data = first.image_url.split(",", 1)
    assert header == "data:image/jpeg;base64"
    assert Image.open(io.BytesIO(base64.b64decode(data))).format == "JPEG"


def test_conversations_keep_every_user_turn(loaded):
    conversations = workload.sample_conversations(loaded, NUM_ROWS, seed=0)
    assert sorted(len(c.user_texts) for c in conversations) == sorted(loaded["num_turns"])
    assert all(len(c.image_urls) == 1 for c in conversations)


def test_the_video_mix_sends_clips_as_video_url_parts(tmp_path):
    dataset.write_dataset(tmp_path, 8, seed=1, video_fraction=0.5)
    loaded = datasets.load_dataset(str(tmp_path), split="train")
    assert loaded.features == dataset.features(with_videos=True)
    num_videos = sum(bool(row["videos"]) for row in loaded)
    assert 0 < num_videos < len(loaded)
    assert all(bool(row["videos"]) != bool(row["images"]) for row in loaded)  # a clip or a picture
    requests = workload.sample_single_turn(loaded, 8, seed=0)
    kinds = [[part["type"] for part in r.message()["content"]] for r in requests]
    assert ["text", "video_url"] in kinds and ["text", "image_url"] in kinds
    video = next(r for r in requests if r.video_url)
    assert video.video_url.startswith("data:video/mp4;base64,")
