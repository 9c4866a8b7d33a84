"""One workload against mmserve and its peers (transformers baseline, vLLM CPU), one table.

    .venv/bin/python benchmarks/side_by_side.py MODEL_DIR --dataset-path /tmp/visionarena \
        --num-prompts 100 --max-concurrency 8 --output-len 32 --ignore-eos \
        --peer mmserve=mmserve --peer hf=hf --peer vllm=vllm:--dtype bfloat16 \
        --markdown benchmarks/results/tiny.md --json benchmarks/results/tiny.json

See `mmserve.bench.side_by_side` for the peer syntax; vLLM needs `bash benchmarks/setup_vllm.sh`.
"""

from __future__ import annotations

import sys

from mmserve.bench.side_by_side import main

if __name__ == "__main__":
    sys.exit(main())
