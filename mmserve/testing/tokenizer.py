"""The project's byte-level BPE tokenizer, shaped like Qwen2's.

It is trained once by `python -m mmserve.testing.tokenizer` and committed under
assets/tokenizer/: retraining at test time could differ between Python and library versions.
The special tokens follow the Qwen2 / Qwen2-VL family in the family's order, appended after the
learned vocabulary, so token ids look like a (much smaller) Qwen2 vocabulary.
"""

from __future__ import annotations

import ast
import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path

ASSET_DIR = Path(__file__).resolve().parents[2] / "assets" / "tokenizer"
TOKENIZER_JSON = ASSET_DIR / "tokenizer.json"

NUM_LEARNED_TOKENS = 12000

# Qwen2 / Qwen2-VL / Qwen2.5-VL special tokens, in the family's id order.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
]

# Qwen2's pre-tokenizer split: contractions, letter runs, single digits, punctuation, whitespace.
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# The Qwen2-VL chat format: a default system turn, <|im_start|>role ... <|im_end|>, and each
# image as <|vision_start|><|image_pad|><|vision_end|> (the frontend expands <|image_pad|>).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}"
    "{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Qwen3-VL's chat format: no default system turn, and videos numbered like pictures.
QWEN3_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}"
    "{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}"
    "{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def special_token_ids() -> dict[str, int]:
    """Ids of the special tokens: they follow the learned vocabulary, as in Qwen2."""
    return {tok: NUM_LEARNED_TOKENS + i for i, tok in enumerate(SPECIAL_TOKENS)}


def tokenizer_config(model_max_length: int, family: str = "qwen2_vl") -> dict:
    """tokenizer_config.json contents for a model folder using the committed tokenizer, with
    the family's chat template."""
    ids = special_token_ids()
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": model_max_length,
        "added_tokens_decoder": {
            str(i): {
                "content": tok,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for tok, i in ids.items()
        },
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"],
        "chat_template": QWEN3_VL_CHAT_TEMPLATE if family == "qwen3_vl" else CHAT_TEMPLATE,
    }


# ----------------------------------------------------------------------------------------------
# Training (run once; the result is committed).

_COLOURS = "red green blue yellow orange purple pink brown black white grey cyan magenta".split()
_SHAPES = "circle square triangle star rectangle diamond hexagon heart cross ellipse".split()
_PLACES = "top left|top right|bottom left|bottom right|centre|top|bottom|left|right|middle".split("|")


def _stdlib_docstrings() -> Iterator[str]:
    """Docstrings and comments-free source text of the Python standard library: plain English."""
    root = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    for path in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    yield doc


def _picture_sentences(rng: random.Random, count: int) -> Iterator[str]:
    """Questions and answers about simple pictures, the demo model's domain."""
    for _ in range(count):
        colour, shape, place = rng.choice(_COLOURS), rng.choice(_SHAPES), rng.choice(_PLACES)
        n = rng.randint(1, 9)
        yield rng.choice(
            [
                f"What colour is the {shape}? The {shape} is {colour}.",
                f"How many shapes are there? There are {n} shapes.",
                f"Where is the {colour} {shape}? It is at the {place}.",
                f"Describe the image. A {colour} {shape} at the {place} on a plain background.",
                f'What word is written? The word "{rng.choice(_SHAPES).upper()}" is written.',
                f"Hello! How are you today? I am fine, thank you. I can describe {colour} pictures.",
            ]
        )


def corpus(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts = list(_stdlib_docstrings())
    texts.extend(_picture_sentences(rng, 200_000))
    rng.shuffle(texts)
    return texts


def train(out_path: Path = TOKENIZER_JSON) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=NUM_LEARNED_TOKENS,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    if tok.get_vocab_size() != NUM_LEARNED_TOKENS:
        raise RuntimeError(f"trained {tok.get_vocab_size()} tokens, wanted {NUM_LEARNED_TOKENS}")
    tok.add_special_tokens(SPECIAL_TOKENS)
    from tokenizers import processors

    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_path))
    # Check the ids landed where special_token_ids() says.
    saved = json.loads(out_path.read_text())
    for added in saved["added_tokens"]:
        assert special_token_ids()[added["content"]] == added["id"], added


if __name__ == "__main__":
    train()
    print(f"wrote {TOKENIZER_JSON}")
