"""The vectorised sampler against a plain per-row reference written here, feature by feature."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from mmserve.layers.sampler import (
    Sampler,
    SamplingMetadata,
    apply_penalties_and_min_tokens,
    inverse_cdf_draw,
    row_argmax,
    sampling_probs,
)

VOCAB = 64


@dataclass
class Row:
    """One request's sampling settings and history, as the model runner would hold them."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    prompt: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    min_tokens: int = 0
    stop_ids: set[int] = field(default_factory=set)


def make_metadata(rows: list[Row], max_num_logprobs: int | None = None) -> SamplingMetadata:
    """Every optional tensor present (the vectorised paths run even for neutral values)."""
    greedy = [r.temperature < 1e-5 for r in rows]
    max_prompt = max(len(r.prompt) for r in rows)
    return SamplingMetadata(
        temperature=torch.tensor([0.0 if g else r.temperature for r, g in zip(rows, greedy)]),
        all_greedy=all(greedy),
        all_random=not any(greedy),
        top_k=torch.tensor([r.top_k for r in rows], dtype=torch.int64),
        top_p=torch.tensor([r.top_p for r in rows]),
        min_p=torch.tensor([r.min_p for r in rows]),
        generators={
            i: torch.Generator().manual_seed(r.seed) for i, r in enumerate(rows) if r.seed is not None
        },
        presence_penalties=torch.tensor([r.presence for r in rows]),
        frequency_penalties=torch.tensor([r.frequency for r in rows]),
        repetition_penalties=torch.tensor([r.repetition for r in rows]),
        prompt_token_ids=torch.tensor(
            [r.prompt + [VOCAB] * (max_prompt - len(r.prompt)) for r in rows], dtype=torch.int64
        ),
        output_token_ids=[list(r.output) for r in rows],
        min_tokens={i: (r.min_tokens, r.stop_ids) for i, r in enumerate(rows) if r.min_tokens},
        max_num_logprobs=max_num_logprobs,
    )


# ---------------------------------------------------------------- the reference, one row at a time


def ref_logits(logits: torch.Tensor, row: Row) -> torch.Tensor:
    """Penalties then min_tokens on one row [V], token by token, in float64."""
    out = logits.double().clone()
    for token in set(row.prompt) | set(row.output):
        out[token] = out[token] / row.repetition if out[token] > 0 else out[token] * row.repetition
    for token, count in Counter(row.output).items():
        out[token] -= row.frequency * count + row.presence
    if len(row.output) < row.min_tokens:
        for token in row.stop_ids:
            out[token] = -math.inf
    return out


def ref_probs(logits: torch.Tensor, row: Row) -> torch.Tensor:
    """Temperature, min_p, top-k, top-p and softmax on one row of penalised logits [V], float64."""
    logits = logits / row.temperature
    probs = logits.softmax(-1)
    logits[probs < row.min_p * probs.max()] = -math.inf
    if row.top_k > 0:
        kth = sorted(logits.tolist(), reverse=True)[min(row.top_k, len(logits)) - 1]
        logits[logits < kth] = -math.inf
    if row.top_p < 1:
        probs = logits.softmax(-1)
        mass = 0.0
        for token in sorted(range(len(probs)), key=lambda t: -probs[t].item()):
            if mass >= row.top_p:
                logits[token] = -math.inf
            mass += probs[token].item()
    return logits.softmax(-1)


def ref_sample(logits: torch.Tensor, row: Row, generator: torch.Generator | None) -> int:
    """Greedy argmax, or the first token whose running probability passes u · total, with u
    drawn from `generator` (one float64 uniform), walked token by token."""
    penalised = ref_logits(logits, row)
    if row.temperature < 1e-5:
        return int(penalised.argmax())
    probs = ref_probs(penalised, row).tolist()
    target = torch.rand(1, dtype=torch.float64, generator=generator).item() * math.fsum(probs)
    running = 0.0
    for token, p in enumerate(probs):
        running += p
        if p > 0 and running > target:
            return token
    return max(token for token, p in enumerate(probs) if p > 0)


def random_rows(gen: torch.Generator, num_rows: int, *, greedy_fraction: float = 0.25) -> list[Row]:
    """Rows with every feature on at random strengths, some greedy, all seeded."""

    def uniform(lo: float, hi: float) -> float:
        return lo + (hi - lo) * torch.rand((), generator=gen).item()

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi, (), generator=gen))

    def tokens(n: int) -> list[int]:
        return torch.randint(0, VOCAB, (n,), generator=gen).tolist()

    rows = []
    for i in range(num_rows):
        greedy = torch.rand((), generator=gen).item() < greedy_fraction
        rows.append(
            Row(
                temperature=0.0 if greedy else uniform(0.3, 2.0),
                top_k=randint(0, 40) if i % 2 else 0,
                top_p=uniform(0.2, 1.0) if i % 3 else 1.0,
                min_p=uniform(0.0, 0.3) if i % 4 else 0.0,
                seed=1000 + i,
                presence=uniform(-2, 2),
                frequency=uniform(-2, 2),
                repetition=uniform(0.5, 2.0),
                prompt=tokens(randint(0, 12)),
                output=tokens(randint(0, 20)),
                min_tokens=randint(0, 8),
                stop_ids=set(tokens(3)),
            )
        )
    return rows


# ---------------------------------------------------------------- against the reference


def test_penalties_and_min_tokens_match_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    rows = random_rows(gen, 32)
    logits = torch.randn(len(rows), VOCAB, generator=gen) * 3
    got = apply_penalties_and_min_tokens(logits, make_metadata(rows))
    for i, row in enumerate(rows):
        torch.testing.assert_close(got[i].double(), ref_logits(logits[i], row), rtol=1e-6, atol=1e-5)
    assert any(len(r.output) < r.min_tokens and r.stop_ids for r in rows)  # min_tokens exercised


def test_sampling_probs_match_reference() -> None:
    gen = torch.Generator().manual_seed(1)
    rows = random_rows(gen, 48, greedy_fraction=0.0)
    logits = torch.randn(len(rows), VOCAB, generator=gen) * 3
    metadata = make_metadata(rows)
    probs = sampling_probs(apply_penalties_and_min_tokens(logits, metadata), metadata)
    for i, row in enumerate(rows):
        expected = ref_probs(ref_logits(logits[i], row), row)
        assert torch.equal(probs[i] > 0, expected > 0), f"row {i} keeps a different set of tokens"
        torch.testing.assert_close(probs[i].double(), expected, rtol=1e-5, atol=1e-6)
    num_kept = (probs > 0).sum(-1)
    assert num_kept.min() < VOCAB // 4 < num_kept.max()  # the filters did cut, and not always


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampled_tokens_match_reference_with_the_same_q(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    rows = random_rows(gen, 40)
    logits = (torch.randn(len(rows), VOCAB, generator=gen) * 3).to(dtype)
    out = Sampler()(logits, make_metadata(rows))
    expected = [
        ref_sample(logits[i].float(), row, torch.Generator().manual_seed(row.seed))
        for i, row in enumerate(rows)
    ]
    assert out.sampled_token_ids.tolist() == expected
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs_tensors is None


def test_greedy_rows_take_the_argmax_of_the_penalised_logits() -> None:
    gen = torch.Generator().manual_seed(3)
    rows = random_rows(gen, 16, greedy_fraction=1.0)
    logits = torch.randn(len(rows), VOCAB, generator=gen)
    metadata = make_metadata(rows)
    assert metadata.all_greedy
    expected = [int(ref_logits(logits[i], row).argmax()) for i, row in enumerate(rows)]
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == expected
    assert expected != logits.argmax(-1).tolist()  # the penalties changed something


def test_all_greedy_without_options_is_the_plain_argmax() -> None:
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(4))
    metadata = SamplingMetadata(temperature=torch.zeros(5), all_greedy=True, all_random=False)
    out = Sampler()(logits, metadata)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_row_argmax_is_torch_argmax_with_ties_infinities_and_strides() -> None:
    gen = torch.Generator().manual_seed(6)
    logits = torch.randint(0, 4, (9, VOCAB), generator=gen).float()  # many ties per row
    logits[1] = -math.inf
    logits[2, 7:] = math.inf
    logits[3, 5] = math.nan
    for x in (logits, logits[:, ::2], logits.t().contiguous().t(), torch.randn(1, VOCAB).expand(4, -1)):
        assert row_argmax(x).dtype == torch.int64
        assert torch.equal(row_argmax(x), x.argmax(dim=-1))
    assert torch.equal(row_argmax(logits.bfloat16()), logits.bfloat16().argmax(dim=-1))


def test_all_greedy_rows_never_sort_or_softmax_the_vocabulary(monkeypatch) -> None:
    """Greedy rows with top-k / top-p / min-p set (a model's generation defaults do that) still
    cost one argmax: no sort, no softmax, no probabilities."""

    def forbidden(*args, **kwargs):
        raise AssertionError("an all-greedy batch without logprobs took the random path")

    for name in ("sort", "softmax", "log_softmax", "cumsum"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    monkeypatch.setattr("mmserve.layers.sampler.sampling_probs", forbidden)
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(5))
    metadata = SamplingMetadata(
        temperature=torch.zeros(6),
        all_greedy=True,
        all_random=False,
        top_k=torch.full((6,), 3),
        top_p=torch.full((6,), 0.5),
        min_p=torch.full((6,), 0.1),
    )
    out = Sampler()(logits, metadata)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1)) and out.logprobs_tensors is None


def test_min_tokens_forbids_stop_ids_until_reached() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 7] = 10.0  # the stop token is the runaway favourite
    rows = [
        Row(temperature=0.0, output=[1, 2], min_tokens=3, stop_ids={7}),
        Row(temperature=0.0, output=[1, 2, 3], min_tokens=3, stop_ids={7}),
    ]
    first, second = Sampler()(logits, make_metadata(rows)).sampled_token_ids.tolist()
    assert first != 7 and second == 7


def test_neutral_values_equal_absent_options() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, VOCAB, generator=gen)
    rows = [Row(temperature=0.7, prompt=[1, 2], output=[3]) for _ in range(6)]
    full = make_metadata(rows)
    bare = SamplingMetadata(temperature=full.temperature, all_greedy=False, all_random=True)
    full_probs = sampling_probs(apply_penalties_and_min_tokens(logits, full), full)
    torch.testing.assert_close(full_probs, sampling_probs(logits, bare))


def test_logprobs_are_raw_with_sampled_token_first_and_its_rank() -> None:
    gen = torch.Generator().manual_seed(6)
    rows = random_rows(gen, 12)
    logits = torch.randn(len(rows), VOCAB, generator=gen) * 2
    out = Sampler()(logits, make_metadata(rows, max_num_logprobs=5))
    lp = out.logprobs_tensors
    assert lp is not None
    assert lp.logprob_token_ids.shape == lp.logprobs.shape == (len(rows), 6)
    for i in range(len(rows)):
        raw = logits[i].double().log_softmax(-1)  # before penalties and temperature
        sampled = int(out.sampled_token_ids[i])
        top = sorted(range(VOCAB), key=lambda t: -raw[t].item())[:5]
        assert lp.logprob_token_ids[i].tolist() == [sampled, *top]
        torch.testing.assert_close(lp.logprobs[i].double(), raw[[sampled, *top]], rtol=0, atol=1e-5)
        num_better = sum(int(raw[t] > raw[sampled]) for t in range(VOCAB))
        assert int(lp.sampled_token_ranks[i]) == 1 + num_better
    assert lp.sampled_token_ranks.max() > 1  # some rows did not sample their best token


def test_zero_logprobs_gives_only_the_sampled_token() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(7)).bfloat16()
    metadata = SamplingMetadata(temperature=torch.zeros(3), all_greedy=True, all_random=False)
    metadata.max_num_logprobs = 0
    lp = Sampler()(logits, metadata).logprobs_tensors
    assert lp is not None
    assert lp.logprob_token_ids[:, 0].tolist() == logits.argmax(-1).tolist()
    assert lp.logprobs.shape == (3, 1) and lp.logprobs.dtype == torch.float32
    assert lp.sampled_token_ranks.tolist() == [1, 1, 1]


# ---------------------------------------------------------------- distributions and seeds


def test_unseeded_draws_follow_the_processed_distribution() -> None:
    num_draws = 20000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0]).expand(num_draws, -1)
    metadata = SamplingMetadata(
        temperature=torch.full((num_draws,), 0.8),
        all_greedy=False,
        all_random=True,
        top_p=torch.full((num_draws,), 0.9),
    )
    probs = sampling_probs(logits, metadata)[0]
    assert probs[-1] == 0  # cut by top_p
    torch.manual_seed(0)
    counts = torch.bincount(Sampler()(logits, metadata).sampled_token_ids, minlength=6).double()
    sigma = (num_draws * probs * (1 - probs)).sqrt()
    assert ((counts - num_draws * probs).abs() <= 5 * sigma + 1e-9).all(), (counts, num_draws * probs)
    assert counts[-1] == 0


def _run_steps(request_row: int, batch_size: int, step_logits: list[torch.Tensor], seed: int) -> list[int]:
    """Sample one seeded request for several steps at `request_row` of a batch of noisy neighbours."""
    neighbours = torch.Generator().manual_seed(1000 * batch_size + request_row)
    generators = {request_row: torch.Generator().manual_seed(seed)}
    tokens = []
    for logits in step_logits:
        batch = torch.randn(batch_size, VOCAB, generator=neighbours) * 5
        batch[request_row] = logits
        temperature = torch.rand(batch_size, generator=neighbours) + 0.5
        temperature[: request_row % 2] = 0.0  # a greedy neighbour in some batches
        temperature[request_row] = 1.0
        for row in range(batch_size):  # seeded neighbours too, with their own seeds
            if row != request_row and row % 2:
                generators.setdefault(row, torch.Generator().manual_seed(row))
        metadata = SamplingMetadata(
            temperature=temperature,
            all_greedy=False,
            all_random=bool((temperature > 0).all()),
            top_k=torch.full((batch_size,), 40, dtype=torch.int64),
            top_p=torch.full((batch_size,), 0.95),
            generators=generators,
        )
        torch.manual_seed(request_row)  # the global RNG must not matter
        tokens.append(int(Sampler()(batch, metadata).sampled_token_ids[request_row]))
    return tokens


def test_seeded_request_samples_the_same_tokens_at_any_row_of_any_batch() -> None:
    step_logits = [torch.randn(VOCAB, generator=torch.Generator().manual_seed(s)) for s in range(8)]
    alone = _run_steps(0, 1, step_logits, seed=42)
    for batch_size, row in [(1, 0), (3, 0), (3, 2), (8, 1), (8, 5), (8, 7)]:
        assert _run_steps(row, batch_size, step_logits, seed=42) == alone, (batch_size, row)
    assert _run_steps(0, 1, step_logits, seed=43) != alone  # the seed does matter
    assert len(set(alone)) > 1  # and the request really is sampled, not stuck on one token


# ---------------------------------------------------------------- edges


def test_top_k_top_p_min_p_keep_at_least_the_best_token() -> None:
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(5, VOCAB, generator=gen)
    metadata = SamplingMetadata(
        temperature=torch.ones(5),
        all_greedy=False,
        all_random=True,
        top_k=torch.tensor([1, 0, 1, VOCAB + 10, 0]),
        top_p=torch.tensor([1.0, 1e-9, 1e-9, 1e-9, 1e-300]),  # 1e-300 is 0 in float32
        min_p=torch.tensor([0.0, 1.0, 1.0, 0.0, 0.0]),
    )
    probs = sampling_probs(logits, metadata)
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), VOCAB).float())


def test_top_k_keeps_ties_with_the_kth_token() -> None:
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0]])
    metadata = SamplingMetadata(
        temperature=torch.ones(1), all_greedy=False, all_random=True, top_k=torch.tensor([2])
    )
    assert (sampling_probs(logits, metadata)[0] > 0).tolist() == [True, True, True, False]


def test_tiny_temperature_behaves_like_greedy() -> None:
    gen = torch.Generator().manual_seed(9)
    # Distinct logits at least 0.01 apart: at temperature 2e-5 the runner-up has weight e^-500.
    logits = torch.stack([torch.randperm(VOCAB, generator=gen).float() * 0.01 for _ in range(16)])
    metadata = SamplingMetadata(temperature=torch.full((16,), 2e-5), all_greedy=False, all_random=True)
    for _ in range(5):
        assert torch.equal(Sampler()(logits, metadata).sampled_token_ids, logits.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1e-5, 0.01, 1.0, 10.0])
def test_extreme_logits_give_no_nan(dtype: torch.dtype, temperature: float) -> None:
    gen = torch.Generator().manual_seed(10)
    rows = random_rows(gen, 8, greedy_fraction=0.0)
    for row in rows:
        row.temperature = temperature
    logits = torch.randn(len(rows), VOCAB, generator=gen) * 1e30
    logits[:, ::3] = -math.inf  # masked entries, as a grammar or a bad-words list would leave
    logits = logits.to(dtype)
    metadata = make_metadata(rows, max_num_logprobs=3)
    probs = sampling_probs(apply_penalties_and_min_tokens(logits, metadata), metadata)
    assert not probs.isnan().any()
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(rows)))
    out = Sampler()(logits, metadata)
    processed = apply_penalties_and_min_tokens(logits, metadata)
    assert torch.isfinite(processed.gather(1, out.sampled_token_ids[:, None])).all()
    assert out.logprobs_tensors is not None and not out.logprobs_tensors.logprobs.isnan().any()


def test_infinite_logits_share_the_probability_and_win_every_draw() -> None:
    """A +inf logit (repetition_penalty 1e-300 divides a positive logit into one) takes all the
    probability, split evenly among a row's +inf tokens; no NaN reaches the draw."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(12))
    logits[0, 5] = math.inf
    logits[1, [3, 40]] = math.inf
    logits[2, 7] = -math.inf  # finite maximum: the usual distribution
    logits[3, :] = -math.inf
    logits[3, 9] = math.inf
    metadata = SamplingMetadata(temperature=torch.ones(4), all_greedy=False, all_random=True)
    probs = sampling_probs(logits, metadata)
    assert not probs.isnan().any()
    assert probs[0, 5] == 1 and probs[1, [3, 40]].tolist() == [0.5, 0.5] and probs[3, 9] == 1
    assert probs[2, 7] == 0 and (probs[2] > 0).sum() == VOCAB - 1
    torch.manual_seed(0)
    for _ in range(50):
        drawn = Sampler()(logits, metadata).sampled_token_ids.tolist()
        assert drawn[0] == 5 and drawn[1] in (3, 40) and drawn[3] == 9 and drawn[2] != 7


@pytest.mark.parametrize(("u", "expected"), [(0.0, [1, 0]), (0.5, [2, 1]), (1.0, [2, 1])])
def test_draw_never_lands_on_a_token_of_probability_zero(monkeypatch, u: float, expected: list[int]) -> None:
    """u = 0 and u · total = total (what rounding can give for u just under 1) are the edges."""
    probs = torch.tensor([[0.0, 0.3, 0.7, 0.0], [0.4, 0.6, 0.0, 0.0]])
    monkeypatch.setattr(torch, "rand", lambda *shape, **kwargs: torch.full(shape, u, dtype=torch.float64))
    assert inverse_cdf_draw(probs, {}).tolist() == expected


@pytest.mark.parametrize("only", ["frequency", "min_tokens", "everything"])
def test_input_logits_are_not_modified(only: str) -> None:
    gen = torch.Generator().manual_seed(11)
    rows = random_rows(gen, 8)
    logits = torch.randn(len(rows), VOCAB, generator=gen)
    full = make_metadata(rows, max_num_logprobs=2)
    metadata = {
        "frequency": SamplingMetadata(
            temperature=full.temperature,
            all_greedy=False,
            all_random=False,
            frequency_penalties=full.frequency_penalties,
            output_token_ids=full.output_token_ids,
        ),
        "min_tokens": SamplingMetadata(
            temperature=full.temperature,
            all_greedy=False,
            all_random=False,
            output_token_ids=[[]] * len(rows),
            min_tokens={row: (1, {0, 1, 2}) for row in range(len(rows))},
        ),
        "everything": full,
    }[only]
    before = logits.clone()
    Sampler()(logits, metadata)
    assert torch.equal(logits, before)
