"""gpt-oss in bf16 against the fp32 truth: mrl's Megatron model and transformers' own bf16 model, on CPU.

The probe behind docs/moe.md (gpt-oss, "bf16"). For each ``--pairs`` entry ``model_seed:batch_seed``: the tiny
gpt-oss of ``tests/helpers/tiny_models.py`` (``--swiglu-limit``, ``--full-attention``: every layer full attention,
``--zero NAME``: checkpoint tensors ending in NAME zeroed) and random ids ``[--batch, --seq]``; transformers' fp32
logits are the truth. For transformers' bf16 model and mrl's (one per ``--backends``: Megatron's local spec with
mrl's ``sdpa`` core attention, or Megatron's own ``local`` one, whose windows need CUDA) it prints max / mean
|Δlogit| to the truth with each model's own routing (``free``, and ``flips``: token-layer expert sets that differ
from the truth's), then with every router replaying the truth's expert ids (``replay``: own logits and softmax at
those experts). ``--blocks``: each attention and MoE block of both bf16 models fed the truth's input (cast to bf16)
and expert ids; the mean error of mrl's block over transformers' (1 = the same precision). ``--fuse-attention-bias``
(an experiment): Megatron's biased non-expert linears computed as one ``F.linear`` with the bias, as ``nn.Linear``
does, instead of the GEMM and then the bias add (or ``bias_dropout_add``).

    .venv/bin/python benchmarks/gpt_oss_bf16.py --pairs 0:1,2:1 --batch 8 --seq 32 --swiglu-limit 7.0 [--blocks]

One process, one torch thread, a few seconds per pair.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import types
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

Caps = dict[str, torch.Tensor]


def _fuse_attention_bias() -> None:
    """Megatron's plain Column/RowParallelLinear with a bias -> one F.linear (world size 1 only; the experts' own
    linears keep Megatron's path: their fc2 bias is scaled by the routing weight separately)."""
    from megatron.core.tensor_parallel import layers as tpl

    col, row = tpl.ColumnParallelLinear.forward, tpl.RowParallelLinear.forward

    def col_forward(self: Any, x: torch.Tensor, *a: Any, **k: Any):
        if type(self) is not tpl.ColumnParallelLinear or self.bias is None:
            return col(self, x, *a, **k)
        return F.linear(x, self.weight, self.bias), None

    def row_forward(self: Any, x: torch.Tensor, *a: Any, **k: Any):
        if type(self) is not tpl.RowParallelLinear or self.bias is None:
            return row(self, x, *a, **k)
        return F.linear(x, self.weight, self.bias), None

    tpl.ColumnParallelLinear.forward, tpl.RowParallelLinear.forward = col_forward, row_forward


def _swap_input(args: tuple, kwargs: dict, new: torch.Tensor) -> tuple[tuple, dict]:
    return ((new,) + tuple(args[1:]), kwargs) if args else (args, dict(kwargs, hidden_states=new))


def hf_run(path: Path, ids: torch.Tensor, dtype: torch.dtype, forced: Caps | None = None,
           feed: Caps | None = None) -> tuple[torch.Tensor, Caps]:
    """transformers' logits; captures ``{i}.chosen`` (expert sets), ``{i}.attn_in/attn/mlp_in/mlp``. ``forced``: top-k
    among those experts only; ``feed``: each block's input replaced by ``feed``'s (cast)."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    caps: Caps = {}
    for i, layer in enumerate(model.model.layers):
        def route(self: Any, h: torch.Tensor, i: int = i):  # GptOssTopKRouter.forward, optionally held
            logits = F.linear(h, self.weight, self.bias)
            if forced is not None:
                logits = logits.masked_fill(~forced[f"{i}.chosen"], float("-inf"))
            top, idx = torch.topk(logits, self.top_k, dim=-1)
            caps[f"{i}.chosen"] = torch.zeros(logits.shape, dtype=torch.bool).scatter_(1, idx, True)
            return logits, F.softmax(top, dim=1, dtype=top.dtype), idx

        layer.mlp.router.forward = types.MethodType(route, layer.mlp.router)
        for name, block in (("attn", layer.self_attn), ("mlp", layer.mlp)):
            def pre(mod: Any, args: tuple, kwargs: dict, name: str = name, i: int = i):
                x = args[0] if args else kwargs["hidden_states"]
                caps[f"{i}.{name}_in"] = x.float()
                if feed is not None:
                    return _swap_input(args, kwargs, feed[f"{i}.{name}_in"].to(x.dtype))
                return None

            def post(mod: Any, args: tuple, kwargs: dict, out: Any, name: str = name, i: int = i):
                caps[f"{i}.{name}"] = out[0].float()

            block.register_forward_pre_hook(pre, with_kwargs=True)
            block.register_forward_hook(post, with_kwargs=True)
    with torch.no_grad():
        return model(ids).logits.float(), caps


def mrl_run(path: Path, ids: torch.Tensor, dtype: torch.dtype, backend: str, forced: Caps | None = None,
            feed: Caps | None = None) -> tuple[torch.Tensor, Caps]:
    """mrl's model (``build_model_chunks`` + ``load_hf_weights``, Float16Module in bf16): logits and the same captures
    as :func:`hf_run`, in transformers' [b, s] token order."""
    from mrl.megatron.hf_io import HFCheckpointReader
    from mrl.megatron.mapping import load_hf_weights
    from mrl.megatron.provider import build_model_chunks, load_hf_config

    cfg = load_hf_config(path)
    chunks = build_model_chunks(cfg, dtype=dtype, attention_backend=backend)
    load_hf_weights(chunks, cfg, HFCheckpointReader(path).get)
    model = chunks[0].eval()
    b, s = ids.shape
    to_bs = lambda x: x.float().transpose(0, 1)  # Megatron's [s, b, ...] -> [b, s, ...]
    tokens_bs = lambda x: x.reshape(s, b, -1).transpose(0, 1).reshape(b * s, -1)
    caps: Caps = {}
    for i, layer in enumerate(getattr(model, "module", model).decoder.layers):
        router, gating = layer.mlp.router, layer.mlp.router.gating

        def held(x: torch.Tensor, gating: Any = gating, i: int = i) -> torch.Tensor:
            logits = gating(x)
            if forced is None:
                return logits
            allowed = forced[f"{i}.chosen"].view(b, s, -1).transpose(0, 1).reshape(logits.shape)
            return logits.masked_fill(~allowed, float("-inf"))

        router.gating = held
        router.register_forward_hook(lambda m, a, out, i=i: caps.__setitem__(f"{i}.chosen", tokens_bs(out[1])))
        for name, block in (("attn", layer.self_attention), ("mlp", layer.mlp)):
            def pre(mod: Any, args: tuple, kwargs: dict, name: str = name, i: int = i):
                if feed is None:
                    return None
                x = args[0] if args else kwargs["hidden_states"]
                return _swap_input(args, kwargs, feed[f"{i}.{name}_in"].to(x.dtype).transpose(0, 1).contiguous())

            def post(mod: Any, args: tuple, kwargs: dict, out: Any, name: str = name, i: int = i):
                caps[f"{i}.{name}"] = to_bs(out[0]) + (out[1].float() if out[1] is not None else 0.0)

            block.register_forward_pre_hook(pre, with_kwargs=True)
            block.register_forward_hook(post, with_kwargs=True)
    with torch.no_grad():
        logits = model(ids, torch.arange(s).expand(b, s), None)
    return logits.float()[..., : cfg.vocab_size], caps


def _flips(truth: Caps, caps: Caps) -> int:
    return sum(int((caps[k] != v).any(-1).sum()) for k, v in truth.items() if k.endswith(".chosen"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", default="0:1", help="model_seed:batch_seed, comma-separated")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--swiglu-limit", type=float, default=None, help="default: the tiny model's (0.4)")
    p.add_argument("--full-attention", action="store_true", help="every layer full attention (no windows)")
    p.add_argument("--zero", default="", help="zero the checkpoint tensors whose names end in this")
    p.add_argument("--backends", default="sdpa", help="mrl attention backends, comma-separated: sdpa, local")
    p.add_argument("--blocks", action="store_true", help="per-block errors with the truth's inputs")
    p.add_argument("--fuse-attention-bias", action="store_true", help="experiment: bias inside one F.linear")
    a = p.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29655")
    import transformers as tf

    from mrl.megatron.parallel import init_parallel
    from tests.helpers.tiny_models import make_tiny_hf

    init_parallel(device="cpu")
    if a.fuse_attention_bias:
        _fuse_attention_bias()
    overrides: dict[str, Any] = {}
    if a.swiglu_limit is not None:
        overrides["swiglu_limit"] = a.swiglu_limit
    if a.full_attention:
        overrides["layer_types"] = ["full_attention"] * 4
    root = Path(tempfile.mkdtemp(prefix="gpt_oss_bf16_"))
    bf16 = torch.bfloat16
    for pair in a.pairs.split(","):
        mseed, bseed = map(int, pair.split(":"))
        path = make_tiny_hf(root / f"m{mseed}", "gpt_oss", seed=mseed, **overrides)
        if a.zero:
            m = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            with torch.no_grad():
                for name, t in m.named_parameters():
                    if name.endswith(a.zero):
                        t.zero_()
            m.save_pretrained(path)
        vocab = tf.AutoConfig.from_pretrained(path).vocab_size
        ids = torch.randint(3, vocab, (a.batch, a.seq), generator=torch.Generator().manual_seed(bseed))
        truth, tcaps = hf_run(path, ids, torch.float32)
        runs = {"transformers": functools.partial(hf_run, path, ids, bf16)}
        for be in a.backends.split(","):
            runs[f"mrl-{be}"] = functools.partial(mrl_run, path, ids, bf16, be)
        parts, blocks = [], {}
        for name, run in runs.items():
            free, caps = run()
            replay, _ = run(tcaps)
            d, dr = (free - truth).abs(), (replay - truth).abs()
            parts.append(f"{name}: free {d.max():.3f}/{d.mean():.4f} flips {_flips(tcaps, caps)}"
                         f" | replay {dr.max():.3f}/{dr.mean():.4f}")
            if a.blocks:
                blocks[name] = run(tcaps, tcaps)[1]
        print(f"pair {pair}  " + "  ".join(parts), flush=True)
        if a.blocks:
            ref = blocks.pop("transformers")
            for name, caps in blocks.items():
                ratios = [f"{k} {float((caps[k] - tcaps[k]).abs().mean() / (ref[k] - tcaps[k]).abs().mean()):.2f}"
                          for k in sorted(tcaps) if k.endswith(("attn", "mlp"))]
                print(f"  blocks {name} / transformers (mean error): " + ", ".join(ratios), flush=True)


if __name__ == "__main__":
    main()
