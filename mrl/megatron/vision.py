"""The vision tower and multimodal RoPE of a vision-language ``GPTModel`` (families with a
:class:`~mrl.families.base.VisionTower`: Qwen2.5-VL, Qwen3-VL, Qwen3.5).

* **Tower**: transformers' own vision module of the family, built from config.json's ``vision_config`` on the first
  pipeline stage only and replicated over TP (every TP rank runs it on the same pixels, as Megatron-Bridge, slime and
  ROLL do), registered as ``GPTModel.vision_model`` so that DDP, the optimizer and the weight mapping see it.
* **Merge**: a forward hook on the word embedding (its output ``[b, s, h]``, already reduced over TP) writes the
  tower's merged patch features into the rows of the ``image_token_id`` tokens, in row-major token order, exactly
  transformers' ``inputs_embeds.masked_scatter(image_mask, image_embeds)``. Gradients reach the tower through it.
* **3-D positions** (:func:`rope_index`): per sequence, text tokens at ``(p, p, p)`` with ``p`` counting on; an
  image of ``t × h × w`` patches (``m`` the spatial merge) is ``t · h/m · w/m`` tokens at ``(s + i, s + r, s + c)``
  for its ``(i, r, c)`` grid cell, ``s`` the next position, after which ``p = s + max(h, w)/m`` (transformers'
  ``get_rope_index`` for images). Each sequence of a packed row starts again at 0 (:func:`mrope_positions`).
* **Deepstack** (Qwen3-VL): the tower's deepstack features ``f_k`` are added at the image tokens to the output of
  decoder layer ``k`` (hooks on the first layers; they must be on the first pipeline stage, else refused).
* **Table** (:func:`mrope_table`): ``θ_{a, j} = pos_a · inv_freq_j`` for the 3 axes; frequency ``j`` takes the angle
  of its axis (:class:`~mrl.families.base.VisionTower` ``mrope``), doubled to the head width as Megatron's
  non-interleaved RoPE expects: ``[L, b, 1, d]``, ``d`` the rotated width (Qwen3.5: ``rotary_percent`` 0.25 of the
  head; Megatron passes the rest through). Installed on ``rotary_pos_emb`` so every stage rotates q and k by it; a
  forward given no 3-D positions (text only) keeps Megatron's own table, which equals it at ``t = h = w``.

Not supported (refused in one line): sequence parallelism and context parallelism with a vision tower, the
shared-prefix layout with pictures, videos.
"""
from __future__ import annotations

import importlib
import itertools
from typing import Any

import torch
from torch import Tensor

from mrl.families import family_of
from mrl.families.rules import Rule
from mrl.families.views import VISION

_INPUTS = "_mrl_vision_inputs"  # (pixel_values, image_grid_thw) of the next forward, on the first stage
_MROPE = "_mrl_mrope_positions"  # [3, b, L] positions of the next forward, every stage
_DEEPSTACK = "_mrl_deepstack"  # (image-token mask [b, s], deepstack features) of the running forward, first stage


def vision_tower_of(hf_config: Any):
    """The family's :class:`~mrl.families.base.VisionTower`, or None for a text-only family or a text-only config of
    a vision-language family (``Qwen3_5ForCausalLM``: no ``vision_config``, so no tower and plain RoPE)."""
    tower = family_of(hf_config).vision
    if tower is None:
        return None
    get = hf_config.get if isinstance(hf_config, dict) else lambda k: getattr(hf_config, k, None)
    # the decoder view keeps the outer config's vision_config under VISION; an outer config has it as it is
    return tower if get(VISION) is not None or get("vision_config") is not None else None


def mrope_section(hf_config: Any, default: tuple[int, int, int] | None = None) -> list[int]:
    """``rope_parameters.mrope_section`` (t, h, w frequencies), else the family's ``default``."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    sec = params.get("mrope_section") or default
    if not sec or len(sec) != 3:
        raise ValueError(f"config.json text_config.rope_parameters.mrope_section={sec}: expected 3 sizes (t, h, w)")
    return [int(x) for x in sec]


def check_vision(hf_config: Any, *, sequence_parallel: bool, context_parallel: int) -> None:
    """The refusals of a vision-language model (its family has a tower) before anything is built."""
    if vision_tower_of(hf_config) is None:
        return
    if sequence_parallel:
        raise ValueError("megatron.sequence_parallel with a vision tower is not supported yet (the image features "
                         "are merged into the full embedding); fix: megatron.sequence_parallel=false")
    if context_parallel > 1:
        raise ValueError("megatron.context_parallel_size > 1 with a vision-language model is not supported; fix: "
                         "megatron.context_parallel_size=1")


def build_tower(hf_config: Any, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' vision module of the family from the view's ``vision_config`` (random init: the weights are
    loaded by the mapping like every other tensor)."""
    spec = vision_tower_of(hf_config)
    vcfg = getattr(hf_config, VISION, None)
    if vcfg is None:
        raise ValueError("this model's config has no vision_config (a vision-language checkpoint's config.json holds "
                         "text_config and vision_config)")
    cfg_mod = importlib.import_module(f"transformers.models.{spec.module}.configuration_{spec.module}")
    mdl_mod = importlib.import_module(f"transformers.models.{spec.module}.modeling_{spec.module}")
    cfg = getattr(cfg_mod, spec.config_class)(**{k: v for k, v in vcfg.items() if k not in ("model_type",)})
    cfg._attn_implementation = "sdpa"
    return getattr(mdl_mod, spec.model_class)._from_config(cfg, dtype=dtype)


def attach(model: torch.nn.Module, hf_config: Any) -> None:
    """Give one ``GPTModel`` chunk its vision parts: the tower and the embedding hook on the first stage, the mRoPE
    table on every stage."""
    spec = vision_tower_of(hf_config)
    if spec is None:
        return
    rope = model.rotary_pos_emb
    sections, interleaved = mrope_section(hf_config, spec.mrope_default), spec.mrope == "interleaved"
    half = int(rope.inv_freq.numel())  # of the rotated part only: Qwen3.5 rotates rotary_percent=0.25 of each head
    # sections split the half-width exactly; the interleaved rule (axis j mod 3 while j < 3·section) is transformers'
    # for any sizes (it slices past the end harmlessly), so a tiny model's narrower rotary part keeps it
    if not interleaved and sum(sections) != half:
        raise ValueError(f"config.json mrope_section={sections} sums to {sum(sections)}, the rotary half-width is {half}")
    setattr(rope, _MROPE, None)
    plain = rope.forward

    def rope_forward(max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None) -> Tensor:
        pos = getattr(rope, _MROPE)
        if pos is None:  # text only, no 3-D positions given: t = h = w, so mRoPE is Megatron's own RoPE
            return plain(max_seq_len, offset, packed_seq, cp_group)
        return mrope_table(rope.inv_freq, pos, sections, interleaved)

    rope.forward = rope_forward
    if spec.deepstack:
        _check_deepstack_stage(model, hf_config)
    if not model.pre_process:
        return
    dtype = model.config.params_dtype
    model.vision_model = build_tower(hf_config, dtype).to(next(model.embedding.parameters()).device)
    image_token = int(hf_config.image_token_id)
    setattr(model, _INPUTS, None)

    def merge(_module, args, out: Tensor) -> Tensor:
        given = getattr(model, _INPUTS)
        setattr(model, _DEEPSTACK, None)
        if given is None:  # no pictures: every image token is text (a sampled one in a response)
            return out
        pixels, grid, mask = given
        mask = args[0] == image_token if mask is None else mask.to(args[0].device)
        n_tok = int(mask.sum())
        feats, deep = tower_features(model.vision_model, pixels, grid)
        if deep:
            setattr(model, _DEEPSTACK, (mask, deep))
        if feats.shape[0] != n_tok:
            raise ValueError(f"the pictures give {feats.shape[0]} image features but the batch holds {n_tok} image "
                             "tokens: TrainBatch.multi_modal does not match input_ids")
        return out.masked_scatter(mask.unsqueeze(-1), feats.to(out.dtype))

    model.embedding.word_embeddings.register_forward_hook(merge)
    if spec.deepstack:
        _attach_deepstack(model, hf_config)


def _deepstack_layers(hf_config: Any) -> int:
    """How many decoder layers (the first ones) get deepstack features: one per ``deepstack_visual_indexes``."""
    return len((getattr(hf_config, VISION, None) or {}).get("deepstack_visual_indexes") or [])


def _check_deepstack_stage(model: torch.nn.Module, hf_config: Any) -> None:
    """Deepstack layers read the tower's features, which exist on the first pipeline stage only."""
    n = _deepstack_layers(hf_config)
    if not model.pre_process and any(layer.layer_number - 1 < n for layer in model.decoder.layers):
        raise ValueError(f"Qwen3-VL adds deepstack image features after decoder layers 0..{n - 1}, which must all be "
                         "on the first pipeline stage (the vision tower's); fix: more layers on stage 0 "
                         "(megatron.num_layers_in_first_pipeline_stage) or a smaller pipeline_model_parallel_size")


def _attach_deepstack(model: torch.nn.Module, hf_config: Any) -> None:
    """Hooks adding deepstack feature ``k`` at the image tokens to decoder layer ``k``'s output (transformers'
    ``_deepstack_process``: ``h[image] += f_k``; features in row-major [b, s] token order, the layer's output [s, b, h])."""
    n = _deepstack_layers(hf_config)

    def add(layer, _args, output):
        state = getattr(model, _DEEPSTACK, None)
        k = layer.layer_number - 1
        if state is None or k >= len(state[1]):
            return output
        mask, feats = state
        hidden, *rest = output if isinstance(output, tuple) else (output,)
        s, b, h = hidden.shape
        delta = hidden.new_zeros(b, s, h).masked_scatter(mask.unsqueeze(-1), feats[k].to(hidden.dtype))
        hidden = hidden + delta.transpose(0, 1)
        return (hidden, *rest) if isinstance(output, tuple) else hidden

    for layer in model.decoder.layers:
        if layer.layer_number - 1 < n:
            layer.register_forward_hook(add)


def tower_features(tower: torch.nn.Module, pixels: Tensor, grid: Tensor) -> tuple[Tensor, list[Tensor]]:
    """([Σ tokens, h] the tower's merged patch features of the pictures in order, the deepstack features alike (none
    without deepstack)); no graph when the tower is frozen."""
    trains = any(p.requires_grad for p in tower.parameters())
    with torch.set_grad_enabled(trains and torch.is_grad_enabled()):
        out = tower(pixels.to(next(tower.parameters()).dtype), grid_thw=grid)
    return out.pooler_output, list(getattr(out, "deepstack_features", None) or [])


def set_vision_inputs(model: torch.nn.Module, positions: Tensor | None, pixels: Tensor | None = None,
                      grid: Tensor | None = None, mask: Tensor | None = None) -> None:
    """The next forward's 3-D positions ``[3, b, L]`` (every stage) and pictures (first stage; None: none) with the
    [b, L] tokens their features replace (:func:`picture_tokens`; default: every ``image_token_id`` token)."""
    rope = getattr(model, "rotary_pos_emb", None)
    if rope is not None and hasattr(rope, _MROPE):
        setattr(rope, _MROPE, positions)
    if hasattr(model, _INPUTS):
        setattr(model, _INPUTS, None if pixels is None else (pixels, grid, mask))


def mrope_table(inv_freq: Tensor, pos: Tensor, sections: list[int], interleaved: bool) -> Tensor:
    """[L, b, 1, d] rotary angles of 3-D positions ``pos`` [3, b, L] (module docstring)."""
    freqs = pos.to(inv_freq.device).float()[..., None] * inv_freq.float()  # [3, b, L, d/2]
    half = inv_freq.numel()
    j = torch.arange(half, device=freqs.device)
    if interleaved:  # Qwen3-VL: axis j mod 3 for the first 3·section[a] frequencies of axis a, else t
        axis = j % 3
        axis = torch.where((axis == 1) & (j < 3 * sections[1]) | (axis == 2) & (j < 3 * sections[2]), axis, 0)
    else:  # Qwen2.5-VL: consecutive groups of section[0], section[1], section[2] frequencies
        axis = torch.repeat_interleave(torch.arange(3, device=freqs.device),
                                       torch.tensor(sections, device=freqs.device))
    picked = freqs.gather(0, axis.view(1, 1, 1, half).expand(1, *freqs.shape[1:]))[0]  # [b, L, d/2]
    return torch.cat([picked, picked], -1).transpose(0, 1).unsqueeze(2).contiguous()


def rope_index(ids: Tensor, grids: Tensor, *, image_token: int, merge: int) -> Tensor:
    """[3, n] positions of one sequence ``ids`` [n] whose pictures have patch grids ``grids`` [k, 3] (t, h, w), in
    order (module docstring). Every picture's tokens must be ``image_token`` and contiguous; image tokens after the
    last picture's are text (see :func:`picture_tokens`)."""
    n = int(ids.numel())
    out = torch.empty(3, n, dtype=torch.long)
    is_img = (ids == image_token).cpu()
    col, p, k = 0, 0, 0
    starts = torch.nonzero(is_img[1:] & ~is_img[:-1]).flatten() + 1
    starts = ([0] if n and bool(is_img[0]) else []) + starts.tolist()
    for s in starts:
        text = s - col
        out[:, col:s] = torch.arange(p, p + text)
        p += text
        col = s
        # a run of image tokens may hold several adjacent pictures: take grids until the run ends. Image tokens past
        # the pictures are text: a response may sample the image token's id, which the engine embeds and positions
        # as any text token (no picture is merged at decode), so the trainer must too
        while col < n and bool(is_img[col]) and k < len(grids):
            t, h, w = (int(x) for x in grids[k])
            hh, ww = h // merge, w // merge
            cnt = t * hh * ww
            if col + cnt > n or not bool(is_img[col:col + cnt].all()):
                raise ValueError(f"picture {k} has {cnt} tokens ({t}x{h}x{w} patches / {merge}^2) but the sequence "
                                 "holds fewer image tokens there")
            ti, ri, ci = torch.meshgrid(torch.arange(t), torch.arange(hh), torch.arange(ww), indexing="ij")
            out[:, col:col + cnt] = torch.stack([ti, ri, ci]).reshape(3, -1) + p
            p += max(hh, ww)
            col += cnt
            k += 1
    out[:, col:] = torch.arange(p, p + n - col)
    if k != len(grids):
        raise ValueError(f"a sequence has {len(grids)} pictures but image tokens for {k}")
    return out


def mrope_positions(tokens: Tensor, num_tokens: Tensor, cu_seqlens: Tensor | None, grids: list[Tensor], *,
                    image_token: int, merge: int) -> Tensor:
    """[3, rows, L] positions of a micro-batch's model inputs. Compact rows: row i is sample i, its valid tokens from
    column 0 (``num_tokens``); a packed row: the sequences of ``cu_seqlens``, each from position 0 (samples first,
    in order, then alignment padding). ``grids``: each sample's [k_i, 3] picture grids. Padding columns continue the
    text positions (nothing kept reads them)."""
    rows, L = tokens.shape
    out = torch.empty(3, rows, L, dtype=torch.long)
    if cu_seqlens is None:
        spans = [(r, 0, L, int(num_tokens[r])) for r in range(rows)]
    else:
        cu = cu_seqlens.tolist()
        spans = [(0, a, b, min(b - a, int(num_tokens[i])) if i < len(num_tokens) else 0)
                 for i, (a, b) in enumerate(itertools.pairwise(cu))]
    empty = torch.zeros(0, 3, dtype=torch.long)
    for i, (r, a, b, n) in enumerate(spans):
        g = grids[i] if i < len(grids) else empty
        pos = rope_index(tokens[r, a:a + n], g, image_token=image_token, merge=merge)
        nxt = int(pos.max()) + 1 if n else 0
        out[:, r, a:a + n] = pos
        out[:, r, a + n:b] = torch.arange(nxt, nxt + b - a - n)
    return out


def picture_tokens(tokens: Tensor, num_tokens: Tensor, cu_seqlens: Tensor | None, grids: list[Tensor], *,
                   image_token: int, merge: int) -> Tensor:
    """[rows, L] bool: the tokens the pictures' features replace — in each sequence its first ``Σ t·h·w / merge²``
    image tokens (spans as :func:`mrope_positions`). An image token past them is text: a sampled one in a response,
    which the engine embeds as an ordinary token."""
    rows, L = tokens.shape
    out = torch.zeros(rows, L, dtype=torch.bool)
    if cu_seqlens is None:
        spans = [(r, 0, int(num_tokens[r])) for r in range(rows)]
    else:
        spans = [(0, a, min(b - a, int(num_tokens[i])) if i < len(num_tokens) else 0)
                 for i, (a, b) in enumerate(itertools.pairwise(cu_seqlens.tolist()))]
    for i, (r, a, n) in enumerate(spans):
        g = grids[i] if i < len(grids) else None
        want = int((g[:, 0] * g[:, 1] * g[:, 2]).sum()) // merge ** 2 if g is not None and len(g) else 0
        where = torch.nonzero(tokens[r, a:a + n].cpu() == image_token).flatten()[:want]
        out[r, a + where] = True
    return out


def vision_rules(chunk: torch.nn.Module, hf_config: Any) -> list[Rule]:
    """One replicated rule per tower tensor of a first-stage chunk: ``vision_model.<n>`` ↔ ``<prefix><n>``."""
    tower = getattr(chunk, "vision_model", None)
    spec = vision_tower_of(hf_config)
    if tower is None or spec is None:
        return []
    return [Rule(f"vision_model.{n}", (spec.prefix + n,), "replicated", "model") for n, _ in tower.named_parameters()]


def batch_pictures(samples: list[dict[str, Tensor]] | None, device: torch.device
                   ) -> tuple[Tensor | None, Tensor | None, list[Tensor]]:
    """(pixel_values of every sample in order, their grids, each sample's grids) of a micro-batch's samples."""
    empty = torch.zeros(0, 3, dtype=torch.long)
    if not samples:
        return None, None, []
    grids = [d.get("image_grid_thw", empty).long().cpu() if d else empty for d in samples]
    pix = [d["pixel_values"] for d in samples if d and d.get("pixel_values") is not None]
    if not pix:
        return None, None, grids
    return torch.cat(pix).to(device), torch.cat(grids).to(device), grids
