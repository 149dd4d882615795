"""Rank bodies shared by the multi-rank model-layer tests (module-level so spawn can pickle them)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

SEQ = 16
MICRO_BATCH = 2
NUM_MICRO = 2


def write_reference_logits(path: Path, gen: torch.Generator) -> None:
    """``path/ref.pt``: random ids [NUM_MICRO * MICRO_BATCH, SEQ] and transformers' fp32 logits of them."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (NUM_MICRO * MICRO_BATCH, SEQ), generator=gen)
    with torch.no_grad():
        logits = model(ids).logits
    torch.save({"ids": ids, "logits": logits}, path / "ref.pt")


def assert_stages_export_the_checkpoint(src_dir: Path, stage_dirs: list[Path]) -> list:
    """Every tensor of the HF checkpoint at ``src_dir`` exported by exactly one stage, bit for bit; the stages' readers."""
    from mrl.megatron.hf_io import HFCheckpointReader

    src = HFCheckpointReader(src_dir)
    stages = [HFCheckpointReader(d) for d in stage_dirs]
    exported = {n: st for st in stages for n in st.names()}
    assert sum(len(st.names()) for st in stages) == len(exported), "a tensor was exported twice"
    assert set(exported) == set(src.names())
    for name in src.names():
        a, b = src.get(name), exported[name].get(name)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
    return stages


def pipeline_logits(chunks: list, hf_config: Any, ids: torch.Tensor) -> torch.Tensor | None:
    """Full-vocab logits [B, T, V] through ``get_forward_backward_func()`` (forward only).

    ``ids`` is [NUM_MICRO * MICRO_BATCH, SEQ]; returns the concatenated micro-batch logits on the
    last pipeline stage, ``None`` elsewhere.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    device = next(chunks[0].parameters()).device
    micro = list(ids.to(device).split(MICRO_BATCH))
    pos = torch.arange(SEQ, device=device).expand(MICRO_BATCH, SEQ)

    def step(data_iter, model):
        out = model(next(data_iter), pos, None)

        def loss_func(output: torch.Tensor):
            full = gather_from_tensor_model_parallel_region(output)[..., : hf_config.vocab_size]
            return output.sum() * 0.0, {"logits": full.detach()}

        return out, loss_func

    for c in chunks:
        c.eval()
        # Megatron's bf16 p2p buffers follow config.pipeline_dtype; nothing else to set here.
    n_chunks = len(chunks)
    iters = [iter(micro) for _ in range(n_chunks)] if n_chunks > 1 else iter(micro)
    with torch.no_grad():
        store = get_forward_backward_func()(
            forward_step_func=step, data_iterator=iters, model=chunks if n_chunks > 1 else chunks[0],
            num_microbatches=NUM_MICRO, seq_length=SEQ, micro_batch_size=MICRO_BATCH, forward_only=True,
        )
    if not ps.is_pipeline_last_stage():
        return None
    return torch.cat([d["logits"] for d in store])


def parity_and_roundtrip_rank(rank: int, world: int, root: str,
                              cases: dict[str, list[tuple[int, int, int | None]]]) -> dict:
    """For each layout and each case (checkpoint dir name -> layouts to run): build, load HF
    weights, compare logits to ref.pt -> {(case, tp, pp, vpp): max |Δ|}. At TP2×PP2 also export
    the stage's HF tensors into ``root/rt_<case>/stage<pp>`` (TP rank 0 writes)."""
    from megatron.core import parallel_state as ps

    from mrl.megatron.hf_io import HFCheckpointReader, write_hf_checkpoint
    from mrl.megatron.mapping import export_hf_weights, load_hf_weights
    from mrl.megatron.parallel import init_parallel
    from mrl.megatron.provider import build_model_chunks, load_hf_config

    # MRL_TEST_DEVICE=cuda runs the same body with NCCL on a GPU host (one GPU per rank).
    device = os.environ.get("MRL_TEST_DEVICE", "cpu")
    out: dict = {}
    layouts = list(dict.fromkeys(lay for lays in cases.values() for lay in lays))
    for tp, pp, vpp in layouts:
        init_parallel(device=device, tp=tp, pp=pp, vpp=vpp)
        for fam in (name for name, lays in cases.items() if (tp, pp, vpp) in lays):
            # "<dir>@bfloat16" runs the checkpoint in <dir> as a bf16 model (Float16Module).
            dir_name, _, dtype_name = fam.partition("@")
            path = Path(root) / dir_name
            ref = torch.load(path / "ref.pt", weights_only=True)
            cfg = load_hf_config(path)
            chunks = build_model_chunks(cfg, dtype=getattr(torch, dtype_name or "float32"))
            load_hf_weights(chunks, cfg, HFCheckpointReader(path))
            logits = pipeline_logits(chunks, cfg, ref["ids"])
            if logits is not None:
                out[(fam, tp, pp, vpp)] = (logits.cpu() - ref["logits"]).abs().max().item()
            if (tp, pp, vpp) == (2, 2, None) and not dtype_name:
                stage_dir = Path(root) / f"rt_{fam}" / f"stage{ps.get_pipeline_model_parallel_rank()}"
                tensors = export_hf_weights(chunks, cfg)
                if ps.get_tensor_model_parallel_rank() == 0:
                    # Tiny shard limit: exercises multi-shard files and the index.
                    write_hf_checkpoint(stage_dir, tensors, max_shard_bytes=64 * 1024)
                else:
                    for _ in tensors:  # the TP gathers are collectives: iterate in lockstep
                        pass
    return out
