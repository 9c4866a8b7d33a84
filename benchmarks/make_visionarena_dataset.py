"""Write the seeded VisionArena-Chat stand-in, or copy the real set, as DIR/data/train-*.parquet.

.venv/bin/python benchmarks/make_visionarena_dataset.py /tmp/visionarena --num-rows 500
.venv/bin/python benchmarks/make_visionarena_dataset.py /tmp/visionarena-real --from-hub
"""

from __future__ import annotations

import sys

from mmserve.bench.dataset import main

if __name__ == "__main__":
    sys.exit(main())
