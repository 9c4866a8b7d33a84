"""Serving benchmarks: a VisionArena-Chat-schema dataset, a `vllm bench serve`-style client, peers.

`serve` is the `mmserve bench serve` command; `side_by_side` runs one workload against mmserve,
the transformers baseline (`hf_server`) and vLLM; `step_profile` times an engine step's stages.
"""
