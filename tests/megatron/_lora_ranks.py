"""Rank body of the LoRA parity test (module-level so spawn can pickle it)."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.megatron._ranks import MICRO_BATCH, NUM_MICRO, SEQ


def _logits_and_grads(chunks: list, hf_config, ids: torch.Tensor, weight: torch.Tensor):
    """Logits [B, T, V] (last stage) of a forward-backward of ``L = Σ logits · weight``."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    micro, wts = list(ids.split(MICRO_BATCH)), list(weight.split(MICRO_BATCH))
    pos = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
    iters = [iter(range(NUM_MICRO)) for _ in chunks]  # one per virtual stage (interleaved schedule)

    def step(data_iter, model):
        i = next(data_iter)
        out = model(micro[i], pos, None)

        def loss_func(output: torch.Tensor):
            full = gather_from_tensor_model_parallel_region(output)[..., : hf_config.vocab_size]
            # Megatron divides each micro-batch loss by NUM_MICRO: undo it, so grads are of Σ.
            return (full * wts[i]).sum() * NUM_MICRO, {"logits": full.detach()}

        return out, loss_func

    for c in chunks:
        c.eval()
    store = get_forward_backward_func()(
        forward_step_func=step, data_iterator=iters if len(chunks) > 1 else iters[0],
        model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=NUM_MICRO,
        seq_length=SEQ, micro_batch_size=MICRO_BATCH, forward_only=False,
    )
    return torch.cat([d["logits"] for d in store]) if ps.is_pipeline_last_stage() else None


def lora_parity_rank(rank: int, world: int, root: str, cases: dict[str, list[tuple[int, int, int | None]]]) -> dict:
    """Per case/layout: max |Δlogits| vs peft, max |Δgrad| of A/B vs peft, and at the case's ``merged_at`` layout
    (TP2×PP2 unless ref.pt names another) the peft export round trip (names, max |Δ|; written as peft files on a
    single-stage layout) and max |Δ| of the merged HF export vs peft's merge_and_unload."""
    from megatron.core import parallel_state as ps

    from mrl.megatron.hf_io import HFCheckpointReader
    from mrl.megatron.lora import apply_lora, export_peft_tensors, load_peft_tensors
    from mrl.megatron.mapping import export_hf_weights, load_hf_weights
    from mrl.megatron.parallel import init_parallel
    from mrl.megatron.provider import build_model_chunks, load_hf_config

    out: dict = {}
    layouts = list(dict.fromkeys(lay for lays in cases.values() for lay in lays))
    for tp, pp, vpp in layouts:
        init_parallel(device="cpu", tp=tp, pp=pp, vpp=vpp)
        for case in (c for c, lays in cases.items() if (tp, pp, vpp) in lays):
            path = Path(root) / case
            ref = torch.load(path / "ref.pt", weights_only=True)
            cfg = load_hf_config(path / "base")
            chunks = build_model_chunks(cfg)
            load_hf_weights(chunks, cfg, HFCheckpointReader(path / "base"))
            apply_lora(chunks, cfg, targets=tuple(ref["targets"]), rank=ref["r"], alpha=ref["alpha"],
                       dropout=0.0, seed=0)
            # Initial adapters (peft's init: A Kaiming-uniform, B = 0) do not depend on the layout.
            out[(case, tp, pp, vpp, "init")] = {n: t.double().sum().item() for n, t in export_peft_tensors(chunks)}
            save_at, load_at = ref.get("ckpt", (None, None))
            if (tp, pp, vpp) == load_at:  # the adapters saved at another TP come back whole (layout-free checkpoint)
                from mrl.megatron.checkpoint import load_checkpoint

                load_checkpoint(path / "ckpt", chunks, load_optimizer=False)
                out[(case, tp, pp, vpp, "ckpt")] = max(
                    (t - ref["adapters"][n]).abs().max().item() for n, t in export_peft_tensors(chunks))
            load_peft_tensors(chunks, ref["adapters"].__getitem__)
            if (tp, pp, vpp) == save_at:
                from mrl.megatron.checkpoint import save_checkpoint

                save_checkpoint(path / "ckpt", chunks, hf_config=cfg)
            logits = _logits_and_grads(chunks, cfg, ref["ids"], ref["weight"])
            key = (case, tp, pp, vpp)
            if logits is not None:
                out[key + ("logits",)] = (logits - ref["logits"]).abs().max().item()
            frozen = [n for c in chunks for n, p in c.named_parameters() if p.grad is not None and "_lora." not in n]
            assert not frozen, f"base parameters got gradients: {frozen[:3]}"
            grads = {}
            for c in chunks:
                for m in c.modules():
                    if hasattr(m, "A") and hasattr(m, "kind"):
                        for d in (m.A, m.B):
                            for p in d.values():
                                p.data, p.grad = p.grad, None  # export the gradients through the same gather
            for name, g in export_peft_tensors(chunks):
                # Relative to the tensor's largest entry: these grads are O(100) (Σ over B·T·V terms).
                grads[name] = ((g - ref["grads"][name]).abs().max() / ref["grads"][name].abs().max()).item()
            out[key + ("grads",)] = grads
            if (tp, pp, vpp) == tuple(ref.get("merged_at", (2, 2, None))):
                load_peft_tensors(chunks, ref["adapters"].__getitem__)
                # the peft export round trip: the tensors loaded come back under the same names, unchanged
                exported = dict(export_peft_tensors(chunks))
                out[key + ("peft_roundtrip", ps.get_pipeline_model_parallel_rank())] = (
                    sorted(exported), max((t - ref["adapters"][n]).abs().max().item() for n, t in exported.items()))
                if pp == 1 and ps.get_tensor_model_parallel_rank() == 0:
                    from mrl.megatron.lora_io import write_peft

                    meta = {"rank": ref["r"], "alpha": ref["alpha"], "dropout": 0.0, "targets": ref["targets"]}
                    write_peft(path / "peft", exported, meta, base_model=str(path / "base"))
                if ref.get("merged", True) is None:  # no merge oracle (transformers' fused experts)
                    continue
                merged = dict(export_hf_weights(chunks, cfg))
                n_lora = len(list(export_hf_weights(chunks, cfg, only_lora=True)))
                out[key + ("merged",)] = max((t - ref["merged"][n]).abs().max().item() for n, t in merged.items())
                out[key + ("only_lora", ps.get_pipeline_model_parallel_rank())] = (n_lora, len(merged))
    return out


def lora_dropout_rank(rank: int, world: int, root: str) -> dict:
    """TP2, dropout 0.3, train mode: the replicated adapter tensors (column A, row B) must get the same
    gradient on both TP ranks (the column layers drew one mask for their shared input); returns the
    max |Δgrad| across ranks and how far the train-mode logits are from eval-mode ones."""
    import torch.distributed as dist

    from mrl.megatron.hf_io import HFCheckpointReader
    from mrl.megatron.lora import adapters_of, apply_lora, load_peft_tensors
    from mrl.megatron.mapping import load_hf_weights
    from mrl.megatron.parallel import init_parallel
    from mrl.megatron.provider import build_model_chunks, load_hf_config

    init_parallel(device="cpu", tp=2, pp=1)
    path = Path(root) / "llama_all"
    ref = torch.load(path / "ref.pt", weights_only=True)
    cfg = load_hf_config(path / "base")
    chunks = build_model_chunks(cfg)
    load_hf_weights(chunks, cfg, HFCheckpointReader(path / "base"))
    apply_lora(chunks, cfg, targets=tuple(ref["targets"]), rank=ref["r"], alpha=ref["alpha"], dropout=0.3, seed=0)
    load_peft_tensors(chunks, ref["adapters"].__getitem__)
    model = chunks[0]
    ids, pos = ref["ids"][:MICRO_BATCH], torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
    model.eval()
    with torch.no_grad():
        eval_logits = model(ids, pos, None)
    model.train()
    train_logits = model(ids, pos, None)
    (train_logits * ref["weight"][:MICRO_BATCH, :, : train_logits.shape[-1]]).sum().backward()
    worst = 0.0
    for ad in adapters_of(chunks):
        for proj in ad.A:
            g = (ad.A[proj] if ad.kind == "column" else ad.B[proj]).grad
            other = g.clone()
            dist.broadcast(other, src=0)
            worst = max(worst, (g - other).abs().max().item())
    return {"replicated_grad_diff": worst, "train_vs_eval": (train_logits - eval_logits).abs().max().item()}
