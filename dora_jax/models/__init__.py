"""The decoder family (Llama / Qwen / SmolLM2) and its weight I/O."""
