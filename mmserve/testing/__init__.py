"""Test fixtures the project makes for itself: a tokenizer and tiny real-architecture checkpoints."""
