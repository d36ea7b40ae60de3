"""Rollout: sampling and generation over the decoder's explicit KV cache."""
