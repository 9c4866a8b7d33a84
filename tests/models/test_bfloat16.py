"""bfloat16: our engine against transformers in bfloat16, within bfloat16's resolution.

Random-weight tiny models have nearly flat output distributions, so in bfloat16 two top tokens
are often within one rounding step of each other; token-exact greedy agreement is therefore
asserted in float32 (test_qwen_vl_vs_transformers.py), and here the first step's log-probs
must agree to bfloat16 precision and our greedy pick must be one of transformers' near-best.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from mmserve.config import CacheConfig, SchedulerConfig
from mmserve.models.registry import load_model_config
from mmserve.ops import cpu
from mmserve.testing.driver import ChunkedDriver
from mmserve.testing.reference import Reference, synthetic_image
from mmserve.worker.model_runner import ModelRunner

BF16_STEP = 0.0625  # two bfloat16 rounding steps of a logit of magnitude 4–8


def test_bfloat16_first_step_agrees_with_transformers(model_dir):
    reference = Reference(model_dir, dtype=torch.bfloat16)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
    prompt = reference.build_prompt(messages, [synthetic_image(200, 150, seed=1)])
    expected = reference.generate(prompt, 1)
    runner = ModelRunner(
        load_model_config(model_dir, dtype="bfloat16"),
        CacheConfig(),
        SchedulerConfig(max_num_seqs=2),
        torch.device("cpu"),
    )
    runner.initialize_kv_cache(64)
    assert runner.kv_caches[0].dtype == torch.bfloat16
    [ours] = ChunkedDriver(runner).generate([prompt], 1, chunk_size=4096)
    want = torch.log_softmax(expected.logits[0], dim=-1)
    ids = torch.tensor(ours.logprobs[0].token_ids[0])
    got = torch.tensor(ours.logprobs[0].logprobs[0])
    # A log-prob is a logit minus the log-normaliser: the normaliser's rounding shifts every
    # entry alike (~3e-4 with oneDNN's bfloat16 matmuls), so it is taken out before the logits'
    # own differences are held to two rounding steps.
    difference = got - want[ids]
    worst = (difference - difference.median()).abs().max().item()
    assert worst <= BF16_STEP, f"a logit {worst:.4f} from transformers' (the normaliser's shift taken out)"
    assert want[ours.output[0]] > want.max() - BF16_STEP


# Zen 4 to mmserve's path choices (envs.cpu_flags_off, envs.cpu_vendor) and to oneDNN.
ZEN4_VIEW = {
    "MMSERVE_CPU_FLAGS_OFF": "amx_bf16 amx_tile amx_int8 avx512_fp16",
    "MMSERVE_CPU_VENDOR": "AuthenticAMD",
}


@pytest.mark.slow
def test_bfloat16_on_zen4_kernels_agrees_with_transformers():
    """The test above on Zen 4's path from any AVX512-BF16 build (an AMX Xeon's too): this
    machine's library with its AMX tiles off runs Zen 4's vdpbf16ps kernels bit for bit, and
    the path choices see an AMD CPU without AMX (bf16 panels for the language model, csrc's
    vision attention, a bf16 tower). In a child process: oneDNN takes its ISA cap
    (ONEDNN_MAX_CPU_ISA, what Zen 4 has) only before its first use, and the flags are hidden
    only once the library is loaded, so no second build is made."""
    if not cpu.is_available() or not cpu.bf16_dot_products():
        pytest.skip("no AVX512-BF16 kernels in this build")
    script = textwrap.dedent(f"""
        import os, sys
        import torch
        from mmserve.ops import cpu
        from mmserve.worker import kernel_plan
        from mmserve.testing.checkpoints import checkpoint
        cpu.ops()  # this machine's build, before the flags are hidden
        os.environ.update({ZEN4_VIEW!r})
        cpu.set_amx_tiles(False)
        assert kernel_plan.bf16_dot_products_lead() and not kernel_plan.float32_outruns_bfloat16()
        torch.set_num_threads(2)
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_bfloat16 import test_bfloat16_first_step_agrees_with_transformers as check
        for family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
            try:
                check(checkpoint(family))
            except AssertionError as error:
                raise AssertionError(f"{{family}}: {{error}}") from error
        print("ok")
    """)
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
