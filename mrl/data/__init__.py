"""Datasets, tokenization, sampler state and DP balancing (no Ray/Megatron imports)."""
