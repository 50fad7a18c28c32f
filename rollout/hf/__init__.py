"""The CPU inference server (the hf engine's process): an OpenAI-compatible HTTP API on transformers, with vLLM's control endpoints."""
