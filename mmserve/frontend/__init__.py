"""The frontend: prompts and images in, text out. Never touches the model."""
