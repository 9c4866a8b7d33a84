"""VisionArena-style serving benchmark against any OpenAI-compatible server (`mmserve bench serve`).

    .venv/bin/python benchmarks/visionarena.py --dataset-path /tmp/visionarena --num-prompts 100 \
        --max-concurrency 8 --output-len 32 --result-file benchmarks/results/run.json
"""

from __future__ import annotations

import sys

from mmserve.bench.serve import main

if __name__ == "__main__":
    sys.exit(main())
