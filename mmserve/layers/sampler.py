"""The sampler: one next token per batch row from the last-position logits, vectorised.

Order (vLLM V1): penalties and min_tokens change the logits, then the token constraints
(logit_bias, allowed_token_ids, bad words, the structured-output grammar's bitmask); greedy
rows take their argmax; random rows divide by temperature, then apply min_p, top-k, top-p and
draw by inverting their cumulative distribution at one uniform number each, which needs no host
synchronisation. Logprobs, when asked for, come from the raw logits. The input logits are never
modified. Shapes: B = batch rows, V = vocabulary size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from mmserve.sampling_params import SAMPLING_EPS


@dataclass
class SamplingMetadata:
    """Per-step sampling inputs, built by the model runner from its persistent batch.

    Optional fields are None (or empty) when no row uses the feature, so an all-greedy batch
    without penalties or min_tokens costs one argmax. `output_token_ids` must have one list per
    row whenever penalties or `min_tokens` are given. Generators must live on the logits' device.
    """

    temperature: torch.Tensor  # [B] float32; 0 for greedy rows
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None = None  # [B] int64; 0 = off
    top_p: torch.Tensor | None = None  # [B] float32; 1 = off
    min_p: torch.Tensor | None = None  # [B] float32; 0 = off
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> seeded generator
    presence_penalties: torch.Tensor | None = None  # [B] float32; 0 = off
    frequency_penalties: torch.Tensor | None = None  # [B] float32; 0 = off
    repetition_penalties: torch.Tensor | None = None  # [B] float32; 1 = off
    prompt_token_ids: torch.Tensor | None = None  # [B, P] int64, padded with V (ignored)
    output_token_ids: list[list[int]] = field(default_factory=list)  # per row, generated so far
    # row -> (min_tokens, ids forbidden while the row has generated fewer than min_tokens)
    min_tokens: dict[int, tuple[int, set[int]]] = field(default_factory=dict)
    max_num_logprobs: int | None = None  # None: no logprobs; 0: the sampled token's only
    # Token constraints; None when no row has one (see `apply_token_constraints`).
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, ids, bias) [N]
    allowed_token_mask: torch.Tensor | None = None  # [B, V] bool; all True for unrestricted rows
    banned_tokens: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, ids) [N]: bad words
    grammar_bitmask: torch.Tensor | None = None  # [B, ceil(V / 32)] int32, xgrammar's bit layout
    grammar_rows: torch.Tensor | None = None  # [G] int64: the rows with a grammar (the others: all -1)

    @property
    def has_token_constraints(self) -> bool:
        constraints = (self.logit_bias, self.allowed_token_mask, self.banned_tokens, self.grammar_bitmask)
        return any(c is not None for c in constraints)

    @property
    def has_penalties(self) -> bool:
        penalties = (self.presence_penalties, self.frequency_penalties, self.repetition_penalties)
        return any(p is not None for p in penalties)


@dataclass
class LogprobsTensors:
    """Log-softmax of the raw logits for the sampled token and the top-k tokens of each row."""

    logprob_token_ids: torch.Tensor  # [B, k + 1] int64; column 0 = sampled token, then top-k
    logprobs: torch.Tensor  # [B, k + 1] float32
    sampled_token_ranks: torch.Tensor  # [B] int64; 1 + number of tokens with a higher logprob


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs_tensors: LogprobsTensors | None


class Sampler:
    """`Sampler()(logits [B, V] float32 or bf16, metadata) -> SamplerOutput`."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        processed = apply_penalties_and_min_tokens(logits, metadata)
        if metadata.has_token_constraints:
            copy = processed is logits
            processed = apply_token_constraints(processed.to(torch.float32, copy=copy), metadata)
        sampled = sample(processed, metadata)
        logprobs = None
        if metadata.max_num_logprobs is not None:
            logprobs = gather_logprobs(logits, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs)


def apply_penalties_and_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """A float32 copy of `logits` with penalties and min_tokens applied; `logits` itself if none."""
    if not metadata.has_penalties and not metadata.min_tokens:
        return logits
    logits = logits.to(torch.float32, copy=True)
    if metadata.has_penalties:
        logits = _apply_penalties(logits, metadata)
    if metadata.min_tokens:
        _forbid_stop_tokens(logits, metadata)
    return logits


def _apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    # Repetition (prompt + output tokens) scales a logit towards "less likely" whatever its sign;
    # frequency and presence (output tokens only) subtract, as in the OpenAI API.
    num_rows, vocab_size = logits.shape
    counts = _output_token_counts(metadata.output_token_ids, num_rows, vocab_size, logits.device)
    occurred = counts > 0  # [B, V]
    if metadata.repetition_penalties is not None:
        seen = occurred
        if metadata.prompt_token_ids is not None:
            seen = seen | _token_mask(metadata.prompt_token_ids, vocab_size)
        penalty = torch.where(seen, metadata.repetition_penalties[:, None], 1.0)  # [B, V]
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    if metadata.frequency_penalties is not None:
        logits -= metadata.frequency_penalties[:, None] * counts
    if metadata.presence_penalties is not None:
        logits -= metadata.presence_penalties[:, None] * occurred
    return logits


def _output_token_counts(
    output_token_ids: list[list[int]], num_rows: int, vocab_size: int, device: torch.device
) -> torch.Tensor:
    """counts[b, v] = how often row b generated token v: [B, V] float32."""
    max_len = max((len(ids) for ids in output_token_ids), default=0)
    # Pad with vocab_size, an extra column that is counted and then dropped.
    padded = [ids + [vocab_size] * (max_len - len(ids)) for ids in output_token_ids]
    index = torch.tensor(padded, dtype=torch.int64, device=device).reshape(num_rows, max_len)
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, index, torch.ones(index.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab_size]


def _token_mask(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """mask[b, v] = token v occurs in row b of `token_ids` [B, P] (padded with vocab_size)."""
    mask = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.bool, device=token_ids.device)
    return mask.scatter_(1, token_ids, True)[:, :vocab_size]


def _forbid_stop_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Set the stop ids of rows still short of their min_tokens to -inf, in place."""
    rows: list[int] = []
    cols: list[int] = []
    for row, (min_tokens, stop_ids) in metadata.min_tokens.items():
        if len(metadata.output_token_ids[row]) < min_tokens:
            rows += [row] * len(stop_ids)
            cols += stop_ids
    if rows:
        index = torch.tensor([rows, cols], dtype=torch.int64, device=logits.device)
        logits[index[0], index[1]] = -math.inf


def apply_token_constraints(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Add logit_bias, then set to -inf what a row may not sample: tokens outside its
    allowed_token_ids, the last token of a bad word whose beginning it just wrote, and tokens
    its grammar forbids now. In place on `logits` ([B, V] float32), which is returned."""
    if metadata.logit_bias is not None:
        rows, ids, bias = metadata.logit_bias
        logits.index_put_((rows, ids), bias, accumulate=True)
    if metadata.allowed_token_mask is not None:
        logits.masked_fill_(~metadata.allowed_token_mask, -math.inf)
    if metadata.banned_tokens is not None:
        logits[metadata.banned_tokens] = -math.inf
    if metadata.grammar_bitmask is not None:
        import xgrammar  # the library whose bitmask layout this is; its kernels (CPU, Triton) apply it

        rows = metadata.grammar_rows.tolist()
        xgrammar.apply_token_bitmask_inplace(
            logits, metadata.grammar_bitmask, vocab_size=logits.shape[-1], indices=rows
        )
    return logits


def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Next token per row, [B] int64: argmax for greedy rows, a random draw for the others."""
    if metadata.all_greedy:
        return row_argmax(logits)
    random = inverse_cdf_draw(sampling_probs(logits, metadata), metadata.generators)
    if metadata.all_random:
        return random
    return torch.where(metadata.temperature < SAMPLING_EPS, row_argmax(logits), random)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of a [B, V] tensor ([B] int64, the first index of a tie, as torch).
    float32 on the CPU goes through numpy's vectorised argmax, which measured 20-50x faster
    than torch 2.13's CPU argmax over a vocabulary (BENCHMARKS.md, "A lean step")."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return x.argmax(dim=-1)
    return torch.from_numpy(np.argmax(x.numpy(), axis=-1).astype(np.int64, copy=False))


def sampling_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The distribution random rows draw from: [B, V] float32 (greedy rows' rows are unused).

    Temperature, then min_p, then top-k, then top-p; each filter keeps at least the top token.
    """
    temperature = torch.where(metadata.temperature < SAMPLING_EPS, 1.0, metadata.temperature)
    logits = logits.float()
    # Shifting each row's max to 0 first means no finite logit overflows to inf at any
    # temperature, and makes exp(logit) the probability relative to the top token. A row whose
    # max is +inf (repetition_penalty 1e-300 divides a positive logit into one) gets inf - inf
    # = NaN at its +inf tokens: those become 0, the rest are -inf, so they share the row.
    logits = logits - logits.amax(dim=-1, keepdim=True)  # a new tensor: the caller's stays as it is
    logits.div_(temperature[:, None])
    # nan_to_num_ is one vectorised pass (masked_fill_ of isnan took 1.6 ms for 8 rows of 152k)
    logits.nan_to_num_(nan=0.0, posinf=math.inf, neginf=-math.inf)
    if metadata.min_p is not None:
        # p / p_max < min_p  <=>  logit < log(min_p), since the max logit is 0.
        logits.masked_fill_(logits < metadata.min_p.log()[:, None], -math.inf)
    if metadata.top_k is not None or metadata.top_p is not None:
        logits = _apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
    return logits.softmax(dim=-1)


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask to -inf all but the k best tokens (ties with the k-th kept), then all but the
    smallest set of best tokens whose probability mass reaches top_p. One sort, no host sync."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    if top_k is not None:
        kth_index = top_k.clamp(1, logits.shape[-1]) - 1  # [B]
        kth_logit = sorted_logits.gather(1, kth_index[:, None])  # [B, 1]
        kth_logit.masked_fill_(top_k[:, None] <= 0, -math.inf)  # top_k 0: keep everything
        sorted_logits.masked_fill_(sorted_logits < kth_logit, -math.inf)
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # exactly 0 for the top token
        # top_p 1 is off: rounding could otherwise let mass_before reach 1 and drop the tail.
        outside = (mass_before >= top_p[:, None]) & (top_p < 1)[:, None]
        outside[:, 0] = False  # the top token stays, even where top_p is 0 (1e-300 in float32)
        sorted_logits.masked_fill_(outside, -math.inf)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def inverse_cdf_draw(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Draw one token per row of `probs` [B, V]: the first token whose cumulative probability
    exceeds u · total, u ~ Uniform[0, 1) (float64, so the running sum of a 152k-token vocabulary
    keeps every token's share to ~1e-16). Rows in `generators` draw their u from their own
    generator, so a seeded request samples the same tokens at any row of any batch.

    One random number and one cumulative sum a row: the exponential race (argmax(probs / q), q ~
    Exponential(1) per token, what vLLM runs on GPUs) drew V numbers a row, and torch's CPU
    exponential_ took 2.2 ms a step for 8 rows of a 12k vocabulary and 25 ms for a 152k one,
    against 0.13 and 0.8 ms here (BENCHMARKS.md, "Zen 4, stop 37"). Nothing waits for the host.
    A token of probability 0 never wins: its interval [cdf[i-1], cdf[i]) is empty.
    """
    cdf = probs.to(torch.float64).cumsum_(dim=-1)  # [B, V], non-decreasing
    total = cdf[:, -1:].contiguous()  # [B, 1]: 1 up to rounding
    u = torch.rand(probs.shape[0], 1, dtype=torch.float64, device=probs.device)  # [B, 1]
    for row, generator in generators.items():
        u[row] = torch.rand(1, dtype=torch.float64, device=probs.device, generator=generator)
    drawn = torch.searchsorted(cdf, u * total, right=True)  # [B, 1]
    # u · total can round up to total itself; the first index where cdf reaches total is the
    # last token with probability, never past it
    last = torch.searchsorted(cdf, total)
    return torch.minimum(drawn, last).squeeze(1)


def gather_logprobs(raw_logits: torch.Tensor, sampled: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """Logprobs (log-softmax of the raw logits, before penalties and temperature) of the
    sampled token and the `num_logprobs` best tokens of each row, and the sampled token's rank."""
    logprobs = raw_logits.float().log_softmax(dim=-1)  # [B, V]
    sampled_logprobs = logprobs.gather(1, sampled[:, None])  # [B, 1]
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)  # [B, k]
    ranks = (logprobs > sampled_logprobs).sum(dim=-1) + 1  # [B]
    return LogprobsTensors(
        logprob_token_ids=torch.cat([sampled[:, None], top_ids], dim=1),
        logprobs=torch.cat([sampled_logprobs, top_logprobs], dim=1),
        sampled_token_ranks=ranks,
    )
