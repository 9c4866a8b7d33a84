"""Train the demo model on the CPU: `python -m mmserve.testing.demo.train --out assets/demo-model`.

Every step trains on fresh generated dialogues (stream "train", indices step·batch ..), so a
resumed run sees exactly the data it would have seen. Dialogues are drawn GROUP_STEPS batches at
a time, sorted by length and cut into batches, which removes most padding (random batches of
these dialogues are a third padding). Pictures are drawn and preprocessed in one worker process
while the model trains on one thread: two cores in all.

The loss is cross-entropy on the assistant answers (and their <|im_end|>), plus an auxiliary
loss on the image tokens (grounding.py). Progress is judged by teacher-forced exact match on a
fixed held-out batch: an answer whose every token is the argmax under teacher forcing is exactly
what greedy decoding produces.

The run keeps its state (weights, optimiser, step) in `--work-dir` every `--save-every` steps
and resumes from it when started again with the same work dir. `--init-from` starts a new
schedule from another run's weights; when that run's vision tower had fewer blocks, the new
blocks start as the identity (see `load_grown`), so the model begins where it was.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mmserve import envs
from mmserve.testing.demo import folder
from mmserve.testing.demo.dialogues import Dialogue, dialogues
from mmserve.testing.demo.grounding import GroundingHead, token_labels
from mmserve.testing.demo.pictures import render_with_boxes

IGNORE = -100
GROUNDING_WEIGHT = 0.5  # of the auxiliary per-image-token loss (grounding.py) beside the answer loss
GROUP_STEPS = 8  # batches drawn, sorted by length and cut together
ASSISTANT_HEADER = "<|im_start|>assistant\n"
END = "<|im_end|>"


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]  # IGNORE outside the answers
    pixel_values: np.ndarray | None  # [num_patches, C·T·P·P]
    grid_thw: tuple[int, int, int] | None
    token_labels: np.ndarray | None  # [num_image_tokens, 4], see grounding.token_labels


class Encoder:
    """Dialogue → token ids, answer labels and pixel values, as the model folder defines them
    (its chat template, tokenizer and preprocessor config)."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
        self.merge_size = self.image_processor.merge_size
        self.pad_id = self.tokenizer.convert_tokens_to_ids("<|endoftext|>")
        self.image_token_id = self.tokenizer.convert_tokens_to_ids("<|image_pad|>")

    def encode(self, dialogue: Dialogue) -> Example:
        messages = dialogue.messages({"type": "image"})
        text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        pixel_values = grid = grounding = None
        if dialogue.scene is not None:
            image, boxes, word_box = render_with_boxes(dialogue.scene)
            out = self.image_processor(images=[image], return_tensors="np")
            pixel_values = out["pixel_values"].astype(np.float32)
            grid = tuple(int(v) for v in out["image_grid_thw"][0])
            grounding = token_labels(dialogue.scene, boxes, word_box, grid, self.merge_size)
            num_tokens = grid[0] * grid[1] * grid[2] // self.merge_size**2
            text = text.replace("<|image_pad|>", "<|image_pad|>" * num_tokens, 1)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        labels = [IGNORE] * len(ids)
        for start, end in answer_spans(text):
            for i, (s, _) in enumerate(offsets):
                if start <= s < end:
                    labels[i] = ids[i]
        return Example(ids, labels, pixel_values, grid, grounding)


def answer_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of each assistant answer, its <|im_end|> included."""
    spans, pos = [], 0
    while (head := text.find(ASSISTANT_HEADER, pos)) >= 0:
        start = head + len(ASSISTANT_HEADER)
        end = text.index(END, start) + len(END)
        spans.append((start, end))
        pos = end
    return spans


def collate(examples: list[Example], encoder: Encoder) -> dict[str, torch.Tensor]:
    longest = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), longest), encoder.pad_id)
    labels = torch.full((len(examples), longest), IGNORE)
    mask = torch.zeros((len(examples), longest), dtype=torch.long)
    for row, e in enumerate(examples):  # right padding
        ids[row, : len(e.input_ids)] = torch.tensor(e.input_ids)
        labels[row, : len(e.labels)] = torch.tensor(e.labels)
        mask[row, : len(e.input_ids)] = 1
    batch = {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": labels,
        "mm_token_type_ids": (ids == encoder.image_token_id).int(),
    }
    with_image = [e for e in examples if e.pixel_values is not None]
    if with_image:
        batch["pixel_values"] = torch.from_numpy(np.concatenate([e.pixel_values for e in with_image]))
        batch["image_grid_thw"] = torch.tensor([e.grid_thw for e in with_image])
        batch["token_labels"] = torch.from_numpy(np.concatenate([e.token_labels for e in with_image]))
    return batch


class LengthGroupedBatches(torch.utils.data.Dataset):
    """Item g: the collated batches of steps g·GROUP_STEPS .. (g+1)·GROUP_STEPS - 1, made from
    that many batches' worth of dialogues sorted by token count, in a seeded order."""

    def __init__(self, model_dir: Path, seed: int, batch_size: int) -> None:
        self.model_dir, self.seed, self.batch_size = model_dir, seed, batch_size
        self.encoder: Encoder | None = None  # built in the worker process

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, group: int) -> list[dict[str, torch.Tensor]]:
        if self.encoder is None:
            self.encoder = Encoder(self.model_dir)
        size = GROUP_STEPS * self.batch_size
        drawn = dialogues("train", self.seed, size, start=group * size)
        batch = [self.encoder.encode(d) for d in drawn]
        batch.sort(key=lambda e: len(e.input_ids))
        order = torch.randperm(
            GROUP_STEPS, generator=torch.Generator().manual_seed(self.seed * 100003 + group)
        )
        cut = [batch[i * self.batch_size : (i + 1) * self.batch_size] for i in range(GROUP_STEPS)]
        return [collate(cut[int(i)], self.encoder) for i in order]


def new_model(model_dir: Path, seed: int) -> torch.nn.Module:
    """The architecture from the folder's config.json, every matrix N(0, INIT_STD), norms 1.

    Two changes make a CPU step about twice as fast without changing the function computed:
    eager attention (torch's CPU flash-attention backward with a padding mask is several times
    slower at these sizes) and the patch embedding as a matmul instead of a Conv3d whose kernel
    equals its stride (the same weights, flattened in the same order).
    """
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32, attn_implementation="eager")
    patch_embed = model.model.visual.patch_embed

    def patch_embed_as_matmul(pixels: torch.Tensor) -> torch.Tensor:
        weight = patch_embed.proj.weight  # [dim, C, T, P, P]
        return torch.nn.functional.linear(pixels.to(weight.dtype), weight.flatten(1))  # [patches, dim]

    patch_embed.forward = patch_embed_as_matmul
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith(".bias"):
                param.zero_()
            elif "norm" in name or "ln_q" in name:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * folder.INIT_STD)
    emb = model.get_input_embeddings().weight
    assert model.lm_head.weight.data_ptr() != emb.data_ptr(), "lm_head must not be tied"
    return model


def load_grown(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> bool:
    """Load `weights` into `model`, whose vision tower may have more blocks than theirs.

    Each added block starts as the identity: its two residual branches end in projections
    (`attn.proj`, `mlp.fc2`) that are set to zero, so the grown model computes what the loaded
    one did and training gives the new blocks their use. Returns whether blocks were added.
    """
    missing, unexpected = model.load_state_dict(weights, strict=False)
    added = sorted({int(name.split(".")[3]) for name in missing if name.startswith("model.visual.blocks.")})
    only_blocks = all(name.startswith(tuple(f"model.visual.blocks.{i}." for i in added)) for name in missing)
    if unexpected or not only_blocks:
        raise ValueError(f"weights do not fit the model: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for i in added:
            block = model.model.visual.blocks[i]
            for projection in (block.attn.proj, block.mlp.fc2):
                projection.weight.zero_()
                projection.bias.zero_()
    return bool(added)


def answer_logits(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits [N, vocab] float32, targets [N], batch row [N]) at the N positions that predict an
    answer token. The LM head runs on those positions only: they are about a tenth of the batch,
    and the full [batch, seq, vocab] logits would cost more than the rest of the model."""
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "token_labels")}
    hidden = model.model(**inputs, use_cache=False).last_hidden_state  # [B, T, hidden]
    targets = batch["labels"][:, 1:]
    scored = targets != IGNORE  # [B, T-1]
    rows = torch.arange(targets.shape[0]).unsqueeze(1).expand_as(targets)[scored]
    logits = model.lm_head(hidden[:, :-1][scored]).float()  # [N, vocab]
    return logits, targets[scored], rows


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.05) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def teacher_forced_exact_match(model, batches: list[dict[str, torch.Tensor]]) -> tuple[float, float]:
    """(loss, fraction of answers whose every token is the argmax) on held-out batches."""
    model.eval()
    losses, hits, total = [], 0, 0
    for batch in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, targets, rows = answer_logits(model, batch)
        losses.append(float(torch.nn.functional.cross_entropy(logits, targets)))
        num_rows = batch["input_ids"].shape[0]
        wrong = torch.zeros(num_rows, dtype=torch.long).index_add_(
            0, rows, (logits.argmax(-1) != targets).long()
        )
        hits += int((wrong == 0).sum())
        total += num_rows
    model.train()
    return float(np.mean(losses)), hits / total


def save_state(work_dir: Path, model, head, optimizer, step: int) -> None:
    tmp = work_dir / "state.pt.tmp"
    state = {"model": model.state_dict(), "head": head.state_dict(), "optimizer": optimizer.state_dict()}
    torch.save({**state, "step": step}, tmp)
    tmp.replace(work_dir / "state.pt")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=folder.DEMO_MODEL_DIR, help="model folder to write")
    parser.add_argument("--work-dir", type=Path, default=envs.cache_dir() / "demo-train")
    parser.add_argument("--steps", type=int, default=2000, help=f"a multiple of {GROUP_STEPS}")
    parser.add_argument("--batch-size", type=int, default=16, help="conversations (1-4 answers each)")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the data worker takes a core)")
    parser.add_argument("--save-every", type=int, default=200, help=f"a multiple of {GROUP_STEPS}")
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--eval-size", type=int, default=128)
    parser.add_argument("--init-from", type=Path, help="start from this state.pt's weights (a new schedule)")
    parser.add_argument(
        "--vision-depth", type=int, default=folder.PRESET.vision_depth, help="vision tower blocks"
    )
    parser.add_argument("--stop-after", type=int, help="stop (resumably) after this step, before --steps")
    args = parser.parse_args()
    if args.steps % GROUP_STEPS or args.save_every % GROUP_STEPS:
        parser.error(f"--steps and --save-every must be multiples of {GROUP_STEPS}")
    return args


def new_optimizer(params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only."""
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )


def restore(args: argparse.Namespace, model, head, optimizer) -> int:
    """Resume from the work dir's state.pt, or start from --init-from's weights; the first step."""
    if args.init_from and not (args.work_dir / "state.pt").exists():
        state = torch.load(args.init_from, weights_only=True)
        grown = load_grown(model, state["model"])
        head.load_state_dict(state["head"])
        if not grown:  # the optimiser's moments fit only the same parameters
            optimizer.load_state_dict(state["optimizer"])
        print(f"initialised from {args.init_from} (its step {state['step']})", flush=True)
        return 0
    if (args.work_dir / "state.pt").exists():
        state = torch.load(args.work_dir / "state.pt", weights_only=True)
        model.load_state_dict(state["model"])
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        print(f"resumed at step {state['step']}", flush=True)
        return state["step"]
    return 0


def train_step(model, head, optimizer, params, batch: dict, merged: dict, lr: float) -> dict:
    """One optimiser step on `batch`; its losses and gradient norm."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, targets, _ = answer_logits(model, batch)
        answer_loss = torch.nn.functional.cross_entropy(logits, targets)
        grounding_loss = torch.zeros(())
        if "token_labels" in batch:
            grounding_loss = head.loss(merged["out"], batch["token_labels"])
    (answer_loss + GROUNDING_WEIGHT * grounding_loss).backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {
        "loss": round(answer_loss.item(), 4),
        "grounding_loss": round(grounding_loss.item(), 4),
        "lr": lr,
        "grad_norm": round(float(grad_norm), 3),
    }


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    preset = dataclasses.replace(folder.PRESET, vision_depth=args.vision_depth)
    folder_dir = folder.write_files(args.work_dir / "model", preset)
    encoder = Encoder(folder_dir)
    model = new_model(folder_dir, args.seed)
    head = GroundingHead(folder.PRESET.hidden_size)
    merged = {}  # the merger's output of the current forward: [image tokens, hidden]
    model.model.visual.merger.register_forward_hook(lambda module, inputs, out: merged.update(out=out))
    params = [*model.parameters(), *head.parameters()]
    optimizer = new_optimizer(params, args.lr)
    start = restore(args, model, head, optimizer)
    # Held-out: a different stream than training ("heldout", not "train"; evaluate uses "eval").
    held = [encoder.encode(d) for d in dialogues("heldout", args.seed, args.eval_size)]
    held_batches = [collate(held[i : i + 32], encoder) for i in range(0, len(held), 32)]
    groups = torch.utils.data.DataLoader(
        LengthGroupedBatches(folder_dir, args.seed, args.batch_size),
        batch_size=None,
        sampler=range(start // GROUP_STEPS, args.steps // GROUP_STEPS),
        num_workers=1,
        prefetch_factor=2,
    )
    batches = (batch for group in groups for batch in group)
    log = (args.work_dir / "log.jsonl").open("a")
    model.train()
    began = time.monotonic()
    stop = min(args.steps, args.stop_after or args.steps)
    for step in range(start, stop):
        t0 = time.monotonic()
        batch = next(batches)
        t1 = time.monotonic()
        lr = lr_at(step, args.steps, args.lr, args.warmup)
        record = {"step": step + 1, **train_step(model, head, optimizer, params, batch, merged, lr)}
        record |= {
            "data_wait_s": round(t1 - t0, 3),
            "step_s": round(time.monotonic() - t1, 3),
            "elapsed_s": round(time.monotonic() - began, 1),
        }
        done = step + 1
        if done % args.eval_every == 0 or done == args.steps:
            record["heldout_loss"], record["heldout_exact"] = teacher_forced_exact_match(model, held_batches)
        if done % 10 == 0 or "heldout_exact" in record:
            print(json.dumps(record), flush=True)
        log.write(json.dumps(record) + "\n")
        log.flush()
        if done % args.save_every == 0 or done == args.steps:
            save_state(args.work_dir, model, head, optimizer, done)
            folder.write_weights(model, folder_dir, preset)
    if stop < args.steps:
        save_state(args.work_dir, model, head, optimizer, stop)
        print(f"stopped after step {stop} of {args.steps}; run again to resume", flush=True)
        return
    folder.write_files(args.out, preset)
    folder.write_weights(model, args.out, preset)
    print(f"wrote {args.out} after {args.steps} steps, {time.monotonic() - began:.0f} s", flush=True)


if __name__ == "__main__":
    main()
