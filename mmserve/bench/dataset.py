"""A seeded stand-in for lmarena-ai/VisionArena-Chat in its schema, and loading either one.

Schema (as `datasets` features; what vLLM's VisionArena reader uses is marked *):
  conversation_id: string
  model:           string
  conversation*:   list of turns, each a list of {role, content} messages (user, then assistant)
  images*:         list of Image (HF Image feature: bytes + path, original JPEG/PNG bytes)
  num_turns:       int64
  language:        string
vLLM reads `conversation[0][0]["content"]` (the first user message) and `images[0]`.

The video mix (`--video-fraction F`) adds a `videos` column (list of mp4 bytes): a fraction F of
the rows carry a short synthetic clip instead of an image, with questions about it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from mmserve.bench import images as synth

HF_NAME = "lmarena-ai/VisionArena-Chat"

_MODELS = ("gpt-4o-2024-05-13", "claude-3-5-sonnet-20240620", "gemini-1.5-pro-exp-0801", "llava-v1.6-34b")
_OBJECTS = ("dog", "car", "building", "plate of food", "street sign", "mountain", "person", "plant")
_PHOTO_QUESTIONS = (
    "What is this?",
    "Describe this image.",
    "What breed is the {obj} in this picture?",
    "Where do you think this photo was taken? Explain the clues you see.",
    "Write a short poem inspired by this picture of a {obj}.",
    "I took this photo on my holiday last summer. Can you describe in detail what is happening in "
    "the scene, what the {obj} is doing, what the weather looks like, and suggest a caption that "
    "I could use when I share it with my friends?",
)
_DIAGRAM_QUESTIONS = (
    "Read the text.",
    "Transcribe all the text in this image.",
    "What does this chart show?",
    "Explain this diagram step by step.",
    "Solve the problem shown in the image and show your work.",
    "This is a screenshot from a report at work. Summarise the key numbers, explain what the boxes "
    "and arrows in the middle mean, and tell me which bar in the chart at the bottom is largest "
    "and by roughly how much it exceeds the smallest one.",
)
_FOLLOW_UPS = (
    "Can you be more specific?",
    "What colour is the largest object?",
    "Is there any text in the top left corner?",
    "Translate that into French.",
    "Why do you think so?",
    "Now count the items you mentioned and give me a total.",
    "Make the answer shorter, one sentence.",
    "Look again at the right half of the image. What did you miss the first time?",
)
_LANGUAGES = (
    ("English", None),
    ("Chinese", "这张图片里有什么？"),
    ("Spanish", "¿Qué hay en esta imagen?"),
    ("German", "Was ist auf diesem Bild zu sehen?"),
    ("Russian", "Что изображено на этой картинке?"),
)
_VIDEO_QUESTIONS = (
    "What happens in this video?",
    "Describe the video.",
    "How does the scene change over time?",
    "What moves in this clip, and in which direction?",
    "Summarise the video in one sentence.",
)
_VIDEO_SIZES = ((320, 240), (240, 320), (426, 240), (256, 256))
_ANSWER_WORDS = (
    "the image shows a scene with several objects in the foreground and a blurred background "
    "there is text near the top and a chart below it which suggests a report of some kind"
).split()


def features(with_videos: bool = False):
    """The `datasets.Features` of the written parquet (also what the tests check against)."""
    from datasets import Features, Image, List, Value

    message = {"role": Value("string"), "content": Value("string")}
    columns = {
        "conversation_id": Value("string"),
        "model": Value("string"),
        "conversation": List(List(message)),
        "images": List(Image()),
        "num_turns": Value("int64"),
        "language": Value("string"),
    }
    if with_videos:
        columns["videos"] = List(Value("binary"))
    return Features(columns)


def make_row(index: int, seed: int, video_fraction: float = 0.0) -> dict[str, Any]:
    """One conversation: an image (photo → mostly JPEG, diagram → mostly PNG), 1–4 turns about it;
    with `video_fraction`, that share of the rows has a clip instead (and a `videos` column)."""
    rng = np.random.default_rng([seed, index])
    if video_fraction:
        is_video = bool(rng.random() < video_fraction)
        row = make_video_row(index, seed, rng) if is_video else make_row(index, seed)
        return row | {"videos": row.get("videos", [])}
    width, height = synth.SIZES[int(rng.integers(len(synth.SIZES)))]
    is_photo = bool(rng.random() < 0.55)
    image = (
        synth.photo(width, height, int(rng.integers(2**31)))
        if is_photo
        else synth.diagram(width, height, int(rng.integers(2**31)))
    )
    fmt = (
        ("JPEG" if rng.random() < 0.85 else "PNG") if is_photo else ("PNG" if rng.random() < 0.8 else "JPEG")
    )
    num_turns = int(rng.choice([1, 2, 3, 4], p=[0.55, 0.25, 0.12, 0.08]))
    language, foreign_question = _LANGUAGES[int(rng.choice(len(_LANGUAGES), p=[0.7, 0.12, 0.08, 0.05, 0.05]))]
    questions = _PHOTO_QUESTIONS if is_photo else _DIAGRAM_QUESTIONS
    first = foreign_question or str(rng.choice(questions)).format(obj=rng.choice(_OBJECTS))
    user_texts = [first] + [str(rng.choice(_FOLLOW_UPS)) for _ in range(num_turns - 1)]
    conversation = [
        [
            {"role": "user", "content": text},
            {"role": "assistant", "content": " ".join(rng.choice(_ANSWER_WORDS, int(rng.integers(8, 120))))},
        ]
        for text in user_texts
    ]
    return {
        "conversation_id": f"{seed:04x}{index:08x}",
        "model": str(rng.choice(_MODELS)),
        "conversation": conversation,
        "images": [{"bytes": synth.encode(image, fmt), "path": None}],
        "num_turns": num_turns,
        "language": language,
    }


def make_video_row(index: int, seed: int, rng: np.random.Generator) -> dict[str, Any]:
    """A conversation about a short clip (1–4 s at 8 fps, landscape or portrait), 1–2 turns."""
    from mmserve.testing.videos import Clip, encode_clip

    width, height = _VIDEO_SIZES[int(rng.integers(len(_VIDEO_SIZES)))]
    clip = Clip(width, height, int(rng.integers(8, 33)), fps=8, seed=int(rng.integers(2**31)))
    num_turns = int(rng.choice([1, 2], p=[0.7, 0.3]))
    texts = [str(rng.choice(_VIDEO_QUESTIONS))] + [str(rng.choice(_FOLLOW_UPS)) for _ in range(num_turns - 1)]
    answer = lambda: " ".join(rng.choice(_ANSWER_WORDS, int(rng.integers(8, 80))))
    return {
        "conversation_id": f"{seed:04x}{index:08x}",
        "model": str(rng.choice(_MODELS)),
        "conversation": [
            [{"role": "user", "content": t}, {"role": "assistant", "content": answer()}] for t in texts
        ],
        "images": [],
        "videos": [encode_clip(clip)],
        "num_turns": num_turns,
        "language": "English",
    }


def write_dataset(
    out_dir: str | Path, num_rows: int, seed: int = 0, rows_per_shard: int = 250, video_fraction: float = 0.0
) -> list[Path]:
    """Write `num_rows` conversations as OUT_DIR/data/train-0000i-of-0000n.parquet; return the files.

    `datasets.load_dataset(OUT_DIR)` then loads them as split "train" with the Image feature.
    """
    from datasets import Dataset

    data_dir = Path(out_dir) / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    num_shards = max(1, -(-num_rows // rows_per_shard))
    paths = []
    for shard in range(num_shards):
        rows = [
            make_row(i, seed, video_fraction)
            for i in range(shard * rows_per_shard, min(num_rows, (shard + 1) * rows_per_shard))
        ]
        schema = features(with_videos=video_fraction > 0)
        columns = {name: [row[name] for row in rows] for name in schema}
        path = data_dir / f"train-{shard:05d}-of-{num_shards:05d}.parquet"
        Dataset.from_dict(columns, features=schema).to_parquet(str(path))
        paths.append(path)
    return paths


def load_conversations(source: str, split: str = "train"):
    """A local folder written by `write_dataset` (or any parquet copy of the real set), else the
    Hub dataset by name (needs network access and, for VisionArena-Chat, an HF token)."""
    from datasets import load_dataset

    return load_dataset(source, split=split)


def copy_from_hub(out_dir: str | Path, num_rows: int | None, name: str = HF_NAME) -> list[Path]:
    """Save (the first `num_rows` of) the real dataset's train split in the same layout."""
    dataset = load_conversations(name)
    if num_rows is not None:
        dataset = dataset.select(range(min(num_rows, len(dataset))))
    path = Path(out_dir) / "data" / "train-00000-of-00001.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    dataset.to_parquet(str(path))
    return [path]


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Write a VisionArena-Chat-schema dataset as parquet.")
    parser.add_argument("out_dir")
    parser.add_argument("--num-rows", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--video-fraction",
        type=float,
        default=0.0,
        help="Share of rows with a short mp4 clip instead of an image.",
    )
    parser.add_argument("--from-hub", action="store_true", help=f"Copy {HF_NAME} instead (needs network).")
    args = parser.parse_args(argv)
    if args.from_hub:
        paths = copy_from_hub(args.out_dir, args.num_rows)
    else:
        paths = write_dataset(args.out_dir, args.num_rows, args.seed, video_fraction=args.video_fraction)
    print("\n".join(str(p) for p in paths))
    return 0
