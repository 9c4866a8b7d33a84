"""Latency and throughput against request rate, from a sweep's per-rate metric dicts (PNG)."""

from __future__ import annotations

from pathlib import Path


def plot_sweep(points: list[dict], path: str | Path, title: str) -> Path:
    """`points` are metrics_json() dicts with a "request_rate" key; the rates are plotted as
    categories (so inf fits on the axis), median and P99 of TTFT/TPOT/E2EL, and throughputs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{p['request_rate']:g}" for p in points]
    x = list(range(len(points)))
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for ax, stat in zip(axes, ("ttft", "tpot", "e2el")):
        ax.plot(x, [p[f"median_{stat}_ms"] for p in points], marker="o", label="median")
        p99 = f"p99_{stat}_ms"
        if all(p99 in p for p in points):
            ax.plot(x, [p[p99] for p in points], marker="s", label="P99")
        ax.set_title(f"{stat.upper()} (ms)")
        ax.legend()
    ax = axes[3]
    ax.plot(x, [p["request_throughput"] for p in points], marker="o", color="C2", label="req/s")
    ax.set_ylabel("req/s")
    twin = ax.twinx()
    twin.plot(x, [p["output_throughput"] for p in points], marker="^", color="C3", label="output tok/s")
    twin.set_ylabel("output tok/s")
    ax.set_title("throughput")
    ax.legend(loc="upper left")
    twin.legend(loc="lower right")
    for ax in axes:
        ax.set_xticks(x, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    return _save(fig, path, title)


def plot_peers(results: list[dict], path: str | Path, title: str) -> Path:
    """Bars per peer: request throughput, and median/P99 TTFT and TPOT (side_by_side results)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["peer"] for r in results]
    runs = [r["runs"][0] for r in results]
    x = range(len(names))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    axes[0].bar(x, [m["request_throughput"] for m in runs], color="C2")
    axes[0].set_title("request throughput (req/s)")
    for ax, stat in zip(axes[1:], ("ttft", "tpot")):
        ax.bar([i - 0.2 for i in x], [m[f"median_{stat}_ms"] for m in runs], width=0.4, label="median")
        ax.bar([i + 0.2 for i in x], [m.get(f"p99_{stat}_ms", 0.0) for m in runs], width=0.4, label="P99")
        ax.set_title(f"{stat.upper()} (ms)")
        ax.legend()
    for ax in axes:
        ax.set_xticks(list(x), names, rotation=20)
        ax.grid(alpha=0.3, axis="y")
    return _save(fig, path, title)


def _save(fig, path: str | Path, title: str) -> Path:
    """Title, lay out, write the PNG (creating its folder) and free the figure."""
    import matplotlib.pyplot as plt

    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
