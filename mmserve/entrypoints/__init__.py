"""User-facing entry points: the offline LLM, the OpenAI-compatible server, the CLI."""
