"""CPU time of a server's processes by name, read from /proc: where each engine spends the cores
per request (the API server, the EngineCore, the preprocessing workers, ...).

A peer's server runs as its own process group (`peers.RunningServer`), so every process of it —
threads included, in its own counters — is found by its group id. Time of processes that exited
during a run is not counted (servers keep theirs for their life).
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def group_cpu_seconds(pgid: int) -> dict[str, float]:
    """{process name: user + system CPU seconds} summed over the live processes of group `pgid`;
    {} where /proc is missing."""
    totals: dict[str, float] = defaultdict(float)
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone since the listing
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces or parentheses, so split after it
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) != pgid:  # fields[0] is the state: pgrp is field 5 of the whole line
            continue
        totals[name] += (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime
    return dict(totals)


def cpu_between(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds each process name spent between two `group_cpu_seconds` readings."""
    return {name: after[name] - before.get(name, 0.0) for name in after}
