"""The sampler's distribution step (`sampling_probs`, temperature only) against the form it had
before stop 38, on the CPU.

    .venv/bin/python -m benchmarks.sampling_probs_cpu --vocab 151936 --batch 1 8 --rounds 10

The baseline shifts by the row max and divides into a new tensor, then zeroes NaNs with
`masked_fill_(isnan)`; `sampling_probs` divides in place and zeroes them with `nan_to_num_`.
Both give the same float32 probabilities (checked here). Alternating calls in one process with
one torch thread; milliseconds per call, median and best of `--rounds`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import types
from collections.abc import Callable

import torch

from mmserve.layers.sampler import sampling_probs


def before(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """The baseline: what sampling_probs computed for rows without min_p, top-k or top-p."""
    logits = logits.float()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature[:, None]
    logits.masked_fill_(logits.isnan(), 0.0)
    return logits.softmax(dim=-1)


def time_ms(call: Callable[[], torch.Tensor], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return 1e3 * (time.perf_counter() - start) / calls


def compare(vocab: int, batch: int, rounds: int, calls: int) -> dict[str, list[float]]:
    """Milliseconds per call of each candidate, `rounds` alternating measurements each."""
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)) * 3
    temperature = torch.ones(batch)
    metadata = types.SimpleNamespace(temperature=temperature, min_p=None, top_k=None, top_p=None)
    candidates = {
        "before": lambda: before(logits, temperature),
        "now": lambda: sampling_probs(logits, metadata),
    }
    assert torch.equal(candidates["now"](), candidates["before"]())
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, call in candidates.items():
            times[name].append(time_ms(call, calls))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[151936])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=20, help="calls per round and candidate")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"threads=1 load={os.getloadavg()[0]:.2f}")
    print(f"{'vocab':>7} {'batch':>5} {'before ms':>18} {'now ms':>18} {'before / now':>13}")
    for vocab in args.vocab:
        for batch in args.batch:
            times = compare(vocab, batch, args.rounds, args.calls)
            median = {name: statistics.median(values) for name, values in times.items()}
            cells = [f"{median[n]:8.3f} ({min(times[n]):.3f})" for n in ("before", "now")]
            ratio = median["before"] / median["now"]
            print(f"{vocab:>7} {batch:>5} {cells[0]:>18} {cells[1]:>18} {ratio:>13.2f}")


if __name__ == "__main__":
    main()
