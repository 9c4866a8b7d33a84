"""Qwen2-VL: a ViT with 2-D RoPE and a 2×2 patch merger in front of the Qwen2 language model,
M-RoPE positions, smart-resized images (`family.py` is the entry)."""
