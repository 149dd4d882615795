"""Embedded PyTorch engine behind the SGLang HTTP protocol (CPU/dev, also runs on CUDA).

Pieces: ``model_runner`` (transformers model + batched KV cache), ``sampling`` (temperature /
top-k / top-p with per-request seeds), ``scheduler`` (continuous batching loop on a thread),
``weights`` (updates by HF name from disk, shared memory and torch.distributed), ``checksum``
(per-tensor checksum shared with the weight-sync sender).
"""
