"""Exact-match accuracy of the demo model on held-out generated questions, through mmserve.

    python -m mmserve.testing.demo.evaluate --offline                      # LLM(...).chat
    python -m mmserve.testing.demo.evaluate --url http://127.0.0.1:8000/v1  # a running server
    python -m mmserve.testing.demo.evaluate --offline --compare-transformers 100

Questions come from the "eval" stream (training used "train"), with greedy decoding. Pictures
travel as PNG data URLs in both modes, exactly as an OpenAI client sends them.
`--compare-transformers N` also answers the first N questions with transformers' greedy
`generate` on the same folder (in `--transformers-dtype`, by default the engine's dtype) and
reports how many answers agree with mmserve's.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from mmserve.testing.demo import folder
from mmserve.testing.demo.dialogues import KINDS, Dialogue, dialogues, openai_messages
from mmserve.testing.demo.pictures import render

MAX_TOKENS = 64


@dataclass
class Scored:
    dialogue: Dialogue
    answer: str

    @property
    def correct(self) -> bool:
        return self.answer.strip() == self.dialogue.expected


def answer_offline(items: Sequence[Dialogue], model: str, dtype: str) -> list[str]:
    from mmserve.entrypoints.llm import LLM
    from mmserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    with LLM(model, dtype=dtype, num_kv_blocks=4096) as llm:
        outputs = llm.chat([openai_messages(d) for d in items], params)
    return [out.outputs[0].text for out in outputs]


def answer_over_http(
    items: Sequence[Dialogue], url: str, served_model: str | None, workers: int
) -> list[str]:
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="EMPTY")
    name = served_model or client.models.list().data[0].id

    def ask(dialogue: Dialogue) -> str:
        response = client.chat.completions.create(
            model=name, messages=openai_messages(dialogue), temperature=0.0, max_tokens=MAX_TOKENS
        )
        return response.choices[0].message.content or ""

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(ask, items))


def answer_with_transformers(items: Sequence[Dialogue], model: str, dtype: torch.dtype) -> list[str]:
    from mmserve.testing.reference import Reference

    reference = Reference(model, dtype=dtype)
    answers = []
    for d in items:
        images = [render(d.scene)] if d.scene is not None else []
        prompt = reference.build_prompt(d.prompt_messages({"type": "image"}), images)
        tokens = reference.generate(prompt, MAX_TOKENS).token_ids
        answers.append(reference.tokenizer.decode(tokens, skip_special_tokens=True))
    return answers


def report(scored: list[Scored], show_errors: int) -> float:
    totals, hits = Counter(), Counter()
    for s in scored:
        totals[s.dialogue.kind] += 1
        hits[s.dialogue.kind] += s.correct
    print(f"{'question type':<14}{'n':>5}{'exact match':>13}")
    for kind in KINDS:
        if totals[kind]:
            print(f"{kind:<14}{totals[kind]:>5}{100 * hits[kind] / totals[kind]:>12.1f}%")
    overall = sum(hits.values()) / len(scored)
    print(f"{'overall':<14}{len(scored):>5}{100 * overall:>12.1f}%")
    by_count, count_hits = Counter(), Counter()
    for s in scored:
        if s.dialogue.scene is not None:
            by_count[len(s.dialogue.scene.items)] += 1
            count_hits[len(s.dialogue.scene.items)] += s.correct
    print("questions about a picture, by its number of shapes:")
    for n in sorted(by_count):
        label = f"{n} shape" + "s" * (n > 1)
        print(f"{label:<14}{by_count[n]:>5}{100 * count_hits[n] / by_count[n]:>12.1f}%")
    errors = [s for s in scored if not s.correct]
    for s in errors[:show_errors]:
        print(f"  [{s.dialogue.kind}] {s.dialogue.turns[-1].question!r}")
        print(f"      expected {s.dialogue.expected!r}\n      got      {s.answer!r}")
    return overall


def main() -> None:
    parser = argparse.ArgumentParser(description="Exact-match accuracy of the demo model through mmserve.")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--offline", action="store_true", help="answer with mmserve's offline LLM")
    mode.add_argument("--url", help="OpenAI API base URL of a running server, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument(
        "--model", default=str(folder.DEMO_MODEL_DIR), help="model folder (offline, transformers)"
    )
    parser.add_argument("--served-model-name", help="model name for --url (default: the server's first)")
    parser.add_argument("--num", type=int, default=500, help="held-out questions")
    parser.add_argument("--seed", type=int, default=0, help="seed of the eval stream")
    parser.add_argument("--dtype", default="bfloat16", help="mmserve's dtype (offline)")
    parser.add_argument("--workers", type=int, default=8, help="concurrent requests (--url)")
    parser.add_argument("--compare-transformers", type=int, default=0, metavar="N")
    parser.add_argument("--transformers-dtype", default=None, help="default: --dtype")
    parser.add_argument("--show-errors", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    items = dialogues("eval", args.seed, args.num)
    began = time.monotonic()
    if args.offline:
        answers = answer_offline(items, args.model, args.dtype)
        how = f"mmserve offline LLM, {args.dtype}"
    else:
        answers = answer_over_http(items, args.url, args.served_model_name, args.workers)
        how = f"mmserve server at {args.url}"
    print(
        f"{len(items)} held-out questions (eval stream, seed {args.seed}), greedy, {how}: "
        f"{time.monotonic() - began:.1f} s"
    )
    scored = [Scored(d, a) for d, a in zip(items, answers)]
    report(scored, args.show_errors)

    if args.compare_transformers:
        from mmserve.config import parse_dtype

        dtype = getattr(torch, parse_dtype(args.transformers_dtype or args.dtype, "float32"))
        sample = scored[: args.compare_transformers]
        reference = answer_with_transformers([s.dialogue for s in sample], args.model, dtype)
        agree = [s.answer == r for s, r in zip(sample, reference)]
        ref_correct = sum(r.strip() == s.dialogue.expected for s, r in zip(sample, reference))
        print(
            f"transformers greedy generate ({dtype}) on the first {len(sample)} questions: "
            f"{sum(agree)}/{len(sample)} answers identical to mmserve's; "
            f"transformers exact match {ref_correct}/{len(sample)}"
        )
        for s, r, same in zip(sample, reference, agree):
            if not same:
                print(
                    f"  [{s.dialogue.kind}] {s.dialogue.turns[-1].question!r}\n"
                    f"      mmserve      {s.answer!r}\n      transformers {r!r}"
                )


if __name__ == "__main__":
    main()
