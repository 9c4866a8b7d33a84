"""Qwen3-VL (dense): a ViT with learned, interpolated position embeddings and DeepStack features
in front of the Qwen3 language model; interleaved M-RoPE; videos laid out frame pair by frame
pair with timestamps."""
