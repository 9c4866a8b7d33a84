"""Qwen2.5-VL: Qwen2-VL with an RMSNorm/SwiGLU vision tower, window attention and videos whose
temporal positions follow their frame rate."""
