"""Questions about a `Scene` with their one correct answer, in a fixed answer style.

A `Dialogue` is one conversation: a picture (or none, for small talk) and question/answer turns.
Evaluation dialogues (`sample_dialogue`) have one turn, or two ("followup"); their `kind` names
the question type that accuracy is reported under, and only the last answer is scored.
Training dialogues (`training_dialogue`) ask 1–4 questions about one picture: every answer is
trained, so the picture and the system prompt are paid for once per several answers, and the
first turn of each is exactly a one-question dialogue.
"""

from __future__ import annotations

import base64
import io
import random
from collections.abc import Callable
from dataclasses import dataclass

from PIL import Image

from mmserve.testing.demo.pictures import SHAPES, Scene, render, sample_scene

KINDS = ("colour", "count", "position", "describe", "word", "followup", "chat")
# How often each kind is drawn, in training and in evaluation alike.
KIND_WEIGHTS = {
    "colour": 0.19,
    "count": 0.12,
    "position": 0.19,
    "describe": 0.16,
    "word": 0.1,
    "followup": 0.16,
    "chat": 0.08,
}

COLOUR_QUESTIONS = (
    "What colour is the {shape}?",
    "What color is the {shape}?",
    "Which colour is the {shape}?",
    "What is the colour of the {shape}?",
)
COUNT_QUESTIONS = (
    "How many shapes are there?",
    "How many shapes can you see?",
    "Count the shapes.",
    "How many shapes are in the picture?",
)
POSITION_QUESTIONS = (
    "Where is the {thing}?",
    "Where is the {thing} in the picture?",
    "Where can I find the {thing}?",
)
DESCRIBE_QUESTIONS = (
    "Describe the image.",
    "Describe the picture.",
    "What do you see?",
    "What is in this picture?",
)
WORD_QUESTIONS = (
    "What word is written?",
    "What does the text say?",
    "Read the word in the picture.",
    "Which word is written in the picture?",
)
NO_PICTURE_ANSWER = "Please send me a picture first."
SMALL_TALK: dict[tuple[str, ...], str] = {
    ("Hello!", "Hi!", "Hello", "Hi there!", "Hey!", "Good morning!"): (
        "Hello! Send me a picture of shapes and ask me about it."
    ),
    ("Who are you?", "What are you?"): (
        "I am a tiny demo model. I answer questions about pictures of simple shapes."
    ),
    ("What can you do?", "How can you help me?"): (
        "I can tell the colour, the number and the position of the shapes in a picture, "
        "describe it and read a short word."
    ),
    ("Thank you!", "Thanks!", "Thanks a lot!"): "You are welcome!",
    ("Goodbye!", "Bye!"): "Goodbye!",
}


@dataclass(frozen=True)
class Turn:
    question: str
    answer: str


@dataclass(frozen=True)
class Dialogue:
    kind: str
    scene: Scene | None
    turns: tuple[Turn, ...]
    image_first: bool = True  # the picture comes before the first question's text

    def messages(self, image_part: dict | None) -> list[dict]:
        """Chat messages for every turn, answers included; `image_part` is the content part
        that stands for the picture (e.g. {"type": "image"} for the template)."""
        out: list[dict] = []
        for i, turn in enumerate(self.turns):
            text = {"type": "text", "text": turn.question}
            if i == 0 and self.scene is not None:
                parts = [image_part, text] if self.image_first else [text, image_part]
                out.append({"role": "user", "content": parts})
            else:
                out.append({"role": "user", "content": turn.question})
            out.append({"role": "assistant", "content": turn.answer})
        return out

    def prompt_messages(self, image_part: dict | None) -> list[dict]:
        """The conversation up to the last question: what the model is asked to continue."""
        return self.messages(image_part)[:-1]

    @property
    def expected(self) -> str:
        return self.turns[-1].answer


# ----------------------------------------------------------------------------------------------
# Answers in the fixed style.


def place(position: str) -> str:
    return "in the centre" if position == "centre" else f"at the {position}"


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def count_answer(scene: Scene) -> str:
    n = len(scene.items)
    return "There is 1 shape." if n == 1 else f"There are {n} shapes."


def describe_answer(scene: Scene) -> str:
    phrases = [f"{_article(it.colour)} {it.colour} {it.shape} {place(it.position)}" for it in scene.items]
    listed = phrases[0] if len(phrases) == 1 else ", ".join(phrases[:-1]) + " and " + phrases[-1]
    n = len(scene.items)
    text = f"There {'is' if n == 1 else 'are'} {n} shape{'' if n == 1 else 's'}: {listed}."
    if scene.word:
        text += f" The word {scene.word} is written across the middle."
    return text


def word_answer(scene: Scene) -> str:
    return f"The word is {scene.word}." if scene.word else "No word is written."


# ----------------------------------------------------------------------------------------------
# Question makers: (scene, rng) -> Turn.


def colour_turn(scene: Scene, rng: random.Random) -> Turn:
    if rng.random() < 0.15 and len(scene.items) < len(SHAPES):
        absent = rng.choice([s for s in SHAPES if scene.item(s) is None])
        return Turn(rng.choice(COLOUR_QUESTIONS).format(shape=absent), f"There is no {absent}.")
    item = rng.choice(scene.items)
    question = rng.choice(COLOUR_QUESTIONS).format(shape=item.shape)
    return Turn(question, f"The {item.shape} is {item.colour}.")


def count_turn(scene: Scene, rng: random.Random) -> Turn:
    return Turn(rng.choice(COUNT_QUESTIONS), count_answer(scene))


def position_turn(scene: Scene, rng: random.Random) -> Turn:
    item = rng.choice(scene.items)
    thing = f"{item.colour} {item.shape}" if rng.random() < 0.6 else item.shape
    question = rng.choice(POSITION_QUESTIONS).format(thing=thing)
    return Turn(question, f"The {thing} is {place(item.position)}.")


def describe_turn(scene: Scene, rng: random.Random) -> Turn:
    return Turn(rng.choice(DESCRIBE_QUESTIONS), describe_answer(scene))


def word_turn(scene: Scene, rng: random.Random) -> Turn:
    return Turn(rng.choice(WORD_QUESTIONS), word_answer(scene))


PICTURE_TURNS: dict[str, Callable[[Scene, random.Random], Turn]] = {
    "colour": colour_turn,
    "count": count_turn,
    "position": position_turn,
    "describe": describe_turn,
    "word": word_turn,
}


def _casual(question: str, rng: random.Random) -> str:
    """Some users type in lower case or leave out the final punctuation."""
    if rng.random() < 0.15:
        question = question[0].lower() + question[1:]
    if rng.random() < 0.1:
        question = question.rstrip("?!.")
    return question


def _casual_turn(turn: Turn, rng: random.Random) -> Turn:
    return Turn(_casual(turn.question, rng), turn.answer)


def chat_dialogue(rng: random.Random) -> Dialogue:
    """Small talk without a picture; a picture question without a picture asks for one."""
    if rng.random() < 0.25:
        kind = rng.choice(["colour", "count", "position", "describe", "word"])
        turn = PICTURE_TURNS[kind](sample_scene(rng), rng)
        return Dialogue("chat", None, (_casual_turn(Turn(turn.question, NO_PICTURE_ANSWER), rng),))
    prompts, answer = rng.choice(list(SMALL_TALK.items()))
    return Dialogue("chat", None, (_casual_turn(Turn(rng.choice(prompts), answer), rng),))


def sample_dialogue(rng: random.Random) -> Dialogue:
    kind = rng.choices(list(KIND_WEIGHTS), weights=list(KIND_WEIGHTS.values()))[0]
    if kind == "chat":
        return chat_dialogue(rng)
    scene = sample_scene(rng, word_probability=0.6 if kind == "word" else 0.3)
    image_first = rng.random() < 0.85
    if kind == "followup":
        first, second = rng.sample(["colour", "count", "position", "word", "describe"], 2)
        turns = (PICTURE_TURNS[first](scene, rng), PICTURE_TURNS[second](scene, rng))
    else:
        turns = (PICTURE_TURNS[kind](scene, rng),)
    return Dialogue(kind, scene, tuple(_casual_turn(t, rng) for t in turns), image_first)


@dataclass(frozen=True)
class Mixture:
    """What training conversations are made of."""

    turn_weights: dict[str, float]  # question types
    turns_per_picture: dict[int, float]
    chat_probability: float


MIXTURE = Mixture(
    turn_weights={"colour": 0.25, "count": 0.15, "position": 0.25, "describe": 0.15, "word": 0.2},
    turns_per_picture={1: 0.1, 2: 0.2, 3: 0.3, 4: 0.4},
    chat_probability=0.08,
)


def training_dialogue(rng: random.Random, mixture: Mixture = MIXTURE) -> Dialogue:
    """1–4 questions about one picture, or 1–2 turns of small talk without a picture.

    No fact is asked twice and a description, which states every fact, comes last: otherwise a
    later answer could be copied from the conversation instead of read from the picture.
    """
    if rng.random() < mixture.chat_probability:
        turns = tuple(chat_dialogue(rng).turns[0] for _ in range(rng.choice([1, 1, 2])))
        return Dialogue("chat", None, turns)
    scene = sample_scene(rng, word_probability=0.35)
    per_picture = mixture.turns_per_picture
    wanted = rng.choices(list(per_picture), weights=list(per_picture.values()))[0]
    kinds = list(mixture.turn_weights)
    turns: list[Turn] = []
    facts: set[tuple[str, str]] = set()
    describe: Turn | None = None
    for _ in range(20):  # redraw when a fact repeats
        if len(turns) + (describe is not None) == wanted:
            break
        kind = rng.choices(kinds, weights=[mixture.turn_weights[k] for k in kinds])[0]
        turn = _casual_turn(PICTURE_TURNS[kind](scene, rng), rng)
        if kind == "describe":
            describe = turn
            kinds.remove("describe")
            continue
        fact = (kind, next((shape for shape in SHAPES if shape in turn.question), ""))
        if fact not in facts:
            facts.add(fact)
            turns.append(turn)
    if describe is not None:
        turns.append(describe)
    return Dialogue("train", scene, tuple(turns), image_first=rng.random() < 0.85)


def dialogues(stream: str, seed: int, count: int, start: int = 0) -> list[Dialogue]:
    """Dialogues `start .. start+count` of a named stream: each index has its own generator, so
    any slice is reproducible on its own. Stream "train" draws training dialogues; any other
    name ("eval", "heldout") draws evaluation dialogues."""
    if stream == "train":
        return [training_dialogue(random.Random(f"train:{seed}:{i}")) for i in range(start, start + count)]
    return [sample_dialogue(random.Random(f"{stream}:{seed}:{i}")) for i in range(start, start + count)]


# ----------------------------------------------------------------------------------------------
# Pictures as the OpenAI API carries them.


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def image_url_part(image: Image.Image) -> dict:
    url = "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def openai_messages(dialogue: Dialogue) -> list[dict]:
    """The prompt in OpenAI chat format, the picture as a PNG data URL."""
    part = image_url_part(render(dialogue.scene)) if dialogue.scene is not None else None
    return dialogue.prompt_messages(part)
