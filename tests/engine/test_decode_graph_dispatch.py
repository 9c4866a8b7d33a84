"""The runner's decode-graph path end to end on the CPU: decode-only steps go through the static
buffers, padded up to the ladder, and the tokens stay those of the eager engine.

No CUDA graph exists here: `replay` below runs the padded forward eagerly over the static
buffers, which is what a captured graph would compute, with the C++ kernels, which honour the
padding contract of the graph backends (Triton's padding is tested in
tests/unit/worker/test_cuda_graphs.py; its interpreter would take minutes for an engine run).
The capture itself is checked on a GPU (benchmarks/gpu_check.py, "graphs")."""

from __future__ import annotations

import torch
from engine_cases import conversation

from mmserve.entrypoints.llm import LLM
from mmserve.sampling_params import SamplingParams
from mmserve.testing.checkpoints import checkpoint
from mmserve.worker.cuda_graphs import DecodeGraphs, StaticDecodeInputs

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
SIZES = [1, 2, 4, 8]


class EagerPaddedReplay(DecodeGraphs):
    def replay(self, size: int) -> torch.Tensor:
        static = self.static
        embeds, positions = static.embeds[:size], static.positions[:, :size]
        return self.forward(embeds, positions, self.kv_caches, static.metadata(size))


def run(llm: LLM, num_prompts: int) -> list[list[int]]:
    prompts = [{"prompt_token_ids": list(range(200 + 7 * i, 211 + 9 * i))} for i in range(num_prompts)]
    texts = [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY)]
    [image_chat] = llm.chat(conversation(num_prompts, num_images=1, sizes=((112, 84),))[0], GREEDY)
    return [*texts, image_chat.outputs[0].token_ids]


def test_decode_steps_through_padded_static_inputs_keep_the_eager_tokens():
    with LLM(
        checkpoint("qwen2_vl"), dtype="float32", attention_backend="cpu", max_num_seqs=8, num_kv_blocks=256
    ) as llm:
        runner = llm.engine_core.executor.runner
        assert runner.decode_graphs is None  # none on CPU: nothing captures here
        batches = (3, 6, 11)  # pad to 4 and 8; 11 is past the largest size for part of its run
        expected = {n: run(llm, n) for n in batches}
        config = llm.config.model
        static = StaticDecodeInputs(
            SIZES[-1],
            config.hidden_size,
            runner.max_blocks_per_req,
            config.max_model_len,
            getattr(torch, config.dtype),
            runner.device,
            config.position_rows,
        )
        runner.decode_graphs = EagerPaddedReplay(runner.model, runner.kv_caches, static, SIZES)
        got = {n: run(llm, n) for n in batches}
        assert runner.decode_graphs.num_replays > 0
    assert got == expected
