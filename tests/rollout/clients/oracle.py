"""The transformers oracle the client tests compare the engine's log-probs with."""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

TOL = 1e-5  # fp32; the engine's decode path agrees with transformers to ~1e-6


class Oracle:
    def __init__(self, model_dir: str) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    @torch.inference_mode()
    def logprobs(self, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
        """[len(ids) - 1, V]: row k is log_softmax(z_k / T), the distribution of ids[k + 1]."""
        logits = self.model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
        return torch.log_softmax(logits / temperature, dim=-1)

    def token_logprobs(self, prompt: list[int], output: list[int], temperature: float = 1.0) -> list[float]:
        """Log-probs of ``output`` given ``prompt`` (each output token conditioned on all before it)."""
        ids = prompt + output
        lp = self.logprobs(ids, temperature)
        return [float(lp[len(prompt) - 1 + k, t]) for k, t in enumerate(output)]

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        """n tokens of greedy decoding (argmax of each full forward)."""
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(self.logprobs(ids + [0])[-1].argmax()))
        return ids[len(prompt):]
