"""Model-based reward (verl's ``compute_rm_score``): a frozen Megatron reward model on this rank.

The checkpoint is a Hugging Face ``*ForSequenceClassification`` model with one label (Llama,
Qwen2, Qwen3, Mistral families): its ``model.*`` body maps to ``GPTModel`` exactly like a causal
LM, and ``score.weight`` [1, H] becomes a scalar head in place of the LM head — the critic's
head (:class:`mrl.workers.megatron_model._ValueHead`), loaded instead of initialised. TP/PP: the actor's on its
ranks (colocated, ``init_parallel=False``), or the RM's own group and layout (separate, mrl/workers/side_rank.py);
the frozen side model's common part (offload, DP padding) is :class:`mrl.workers.side_model.SideModelWorker`.

    rm_score_i = score.weight · h_i[last]     h = final-norm hidden states, [B]

where ``last`` is the sample's last attended token (prompt + response, whatever the padding:
the micro-batch inputs are compacted, so it is column ``num_tokens - 1``; with context parallelism the rows are
packed and cut over the CP ranks, :func:`last_token_values`) — the token ``transformers``' sequence classifier
reads (the last non-pad token).
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from mrl.config.parallel import ParallelConfig
from mrl.dtypes import torch_dtype
from mrl.workers.batch import TrainBatch
from mrl.workers.megatron_model import MegatronModel, as_causal_lm_config  # noqa: F401 (re-exported, see below)
from mrl.workers.minibatch import at_least, restore_order, split_by_length
from mrl.workers.side_model import SideModelWorker

if TYPE_CHECKING:
    from mrl.config import MRLConfig
    from mrl.config.run_plan import RunPlan

# The RM's config check (as_causal_lm_config) and weight loader (load_reward_model) are MegatronModel's score-head
# path (score_head=True), so they live in megatron_model.py: no import cycle between the two files.


class RewardModelWorker(SideModelWorker):
    """Frozen reward model on this rank; ``compute`` gives [B] scores on every rank.

    Args:
        model_path: HF ``*ForSequenceClassification`` checkpoint directory.
        parallel: its TP/PP layout (DP = world / (TP·PP)).
        micro_batch_size: samples per forward on one DP rank.
    """

    what = "reward model"

    def __init__(self, model_path: str | os.PathLike, parallel: ParallelConfig, *, micro_batch_size: int,
                 device: str = "cpu", dtype: torch.dtype | None = None, seed: int,
                 init_parallel: bool = True) -> None:
        super().__init__(micro_batch_size)
        # context parallelism cuts packed rows (mrl/megatron/context_parallel.py): the RM packs only then
        self.model = MegatronModel(model_path, parallel, device=device,
                                   dtype=dtype or (torch.float32 if device == "cpu" else torch.bfloat16),
                                   seed=seed, train=False, score_head=True, init_parallel=init_parallel,
                                   remove_padding=parallel.context_parallel_size > 1)

    @classmethod
    def from_config(cls, cfg: MRLConfig, plan: RunPlan, parallel: ParallelConfig, *, device: str,
                    init_parallel: bool) -> RewardModelWorker:
        rm = cfg.reward_model
        return cls(rm.model.path, parallel, micro_batch_size=rm.micro_batch_size_per_gpu, device=device,
                   seed=cfg.trainer.seed, dtype=torch_dtype(plan.dtype), init_parallel=init_parallel)

    def compute(self, batch: TrainBatch) -> torch.Tensor:
        """[B] float32 score of each full sequence (prompt + response), identical on every rank.

        A batch that does not divide by the DP size (validation chunks) is padded with copies of its
        last sample, whose scores are dropped."""
        e = self.model
        B = batch.batch_size
        batch, _ = self.dp_padded(batch)
        local = e.dp_shard(batch)
        # similar lengths together
        parts = at_least(split_by_length(local.seq_lengths().tolist(), self.micro_batch_size), e.min_micro_batches)
        mbs = e.make_micro_batches(local, parts, packed=e.cp_size > 1)  # compact rows unless CP packs them

        def fn(mb, out):  # out [b, L, 1] on the last stage
            return torch.zeros((), device=out.device), {"s": last_token_values(mb.inputs, out.squeeze(-1).float())}

        e.set_train(False)
        with torch.no_grad():
            out = e.run(mbs, fn, forward_only=True)
        if e.is_last_stage:
            s = restore_order([o["s"] for o in out], parts).to(e.device)
        else:
            s = torch.zeros(local.batch_size, device=e.device)
        return e.all_gather_dp(e.broadcast_from_last_stage(s)).cpu()[:B]


def last_token_values(inp, per_pos: torch.Tensor) -> torch.Tensor:
    """[b] the value at each sample's last token from ``per_pos`` [rows, L] per-position outputs: compact rows at
    column ``num_tokens − 1``; a packed row (context parallelism) at sequence i's start ``cu_seqlens[i]`` +
    ``num_tokens[i] − 1``, after this CP rank's zigzag share is all-gathered back into the whole row (forward
    only: the RM is frozen)."""
    last = (inp.num_tokens - 1).long()
    if inp.cu_seqlens is None:
        return per_pos.gather(1, last[:, None].to(per_pos.device))[:, 0]
    if inp.cp_cols is not None:
        from mrl.megatron.context_parallel import gather_same_loss

        every = gather_same_loss(per_pos, inp.cp_group)  # [cp, 1, L / cp]
        per_pos = every[:, 0].reshape(-1)[inp.cp_order.to(per_pos.device)][None]
    return per_pos[0, (inp.cu_seqlens[: len(last)] + last).to(per_pos.device)]
