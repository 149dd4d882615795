"""mrl's multimodal RoPE pieces against transformers' own (:mod:`mrl.megatron.vision`), on CPU without Megatron:

* the 3-D positions of each sample == ``get_rope_index`` of transformers' Qwen2.5-VL model (one picture with
  h' != w', two pictures, none), and in a packed row every sequence starts again at 0 with its own pictures' grids
  (RoPE is relative, so a packed row's logits cannot see a sequence offset by a constant: checked here instead);
* the rotary table's cos/sin == transformers' ``Qwen2_5_VLRotaryEmbedding`` (sections) and
  ``Qwen3VLTextRotaryEmbedding`` (interleaved) at the same positions, exactly (the same float32 products);
* ``TrainBatch.multi_modal`` travels with its rows through select, index, slice, concat and the mini-batch iterator."""
from __future__ import annotations

import pytest
import torch

from mrl.megatron.vision import mrope_positions, mrope_table, picture_tokens, rope_index
from mrl.workers.batch import TrainBatch
from mrl.workers.minibatch import (
    build_model_inputs,
    build_packed_inputs,
    make_minibatch_iterator,
)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from transformers import Qwen2_5_VLForConditionalGeneration

    from tests.helpers.tiny_vlm import save_tiny_vlm, vlm_batch

    path = save_tiny_vlm(tmp_path_factory.mktemp("vision") / "ckpt", "qwen2_5_vl")
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return model, vlm_batch(path)


def _hf_positions(model, batch) -> list[torch.Tensor]:
    out = []
    for i in range(batch.batch_size):
        ids = batch.input_ids[i][batch.attention_mask[i].bool()][None]
        grid = batch.multi_modal[i].get("image_grid_thw")
        if grid is None:  # text only: transformers' default positions 0..n-1 on every axis
            out.append(torch.arange(ids.shape[1]).expand(3, -1))
            continue
        pos, _ = model.model.get_rope_index(ids, (ids == model.config.image_token_id).int(), image_grid_thw=grid)
        out.append(pos[:, 0])
    return out


def _grids(batch):
    return [d.get("image_grid_thw", torch.zeros(0, 3, dtype=torch.long)) for d in batch.multi_modal]


def test_positions_equal_transformers_get_rope_index(vlm):
    model, batch = vlm
    tok = model.config.image_token_id
    for i, ref in enumerate(_hf_positions(model, batch)):
        ids = batch.input_ids[i][batch.attention_mask[i].bool()]
        assert torch.equal(rope_index(ids, _grids(batch)[i], image_token=tok, merge=2), ref), i


def test_packed_and_compact_rows_restart_positions_per_sequence(vlm):
    model, batch = vlm
    ref = _hf_positions(model, batch)
    tok = model.config.image_token_id
    c = build_model_inputs(batch)
    pos = mrope_positions(c.tokens, c.num_tokens, None, _grids(batch), image_token=tok, merge=2)
    for i, r in enumerate(ref):
        assert torch.equal(pos[:, i, :r.shape[1]], r), i
    p = build_packed_inputs(batch, pad_to_multiple=8)  # alignment padding: one more (empty) sequence
    pos = mrope_positions(p.tokens, p.num_tokens, p.cu_seqlens, _grids(batch), image_token=tok, merge=2)
    for i, r in enumerate(ref):
        a = int(p.cu_seqlens[i])
        assert torch.equal(pos[:, 0, a:a + r.shape[1]], r), i


def test_image_tokens_and_pictures_must_agree():
    ids = torch.tensor([1, 5, 5, 5, 2])
    with pytest.raises(ValueError, match="fewer image tokens"):
        rope_index(ids, torch.tensor([[1, 4, 4]]), image_token=5, merge=2)  # 4 tokens needed, 3 given
    with pytest.raises(ValueError, match="has 1 pictures but image tokens for 0"):
        rope_index(torch.tensor([1, 2]), torch.tensor([[1, 4, 4]]), image_token=5, merge=2)


def test_an_image_token_past_the_pictures_is_text():
    """A response may sample the image token's id; the engine embeds and positions it as text (no picture is merged
    at decode), so positions go on by one and no feature replaces it."""
    ids = torch.tensor([[1, 5, 5, 5, 5, 2, 5, 3]])  # prompt: text, one 4-token picture, text; response: 5 sampled, 3
    grid = torch.tensor([[1, 4, 4]])  # 2x2 merged tokens at (t, row, col) + 1, then text from 1 + max(2, 2) = 3
    want = torch.tensor([[0, 1, 1, 1, 1, 3, 4, 5], [0, 1, 1, 2, 2, 3, 4, 5], [0, 1, 2, 1, 2, 3, 4, 5]])
    assert torch.equal(rope_index(ids[0], grid, image_token=5, merge=2), want)
    mask = picture_tokens(ids, torch.tensor([8]), None, [grid], image_token=5, merge=2)
    assert mask.tolist() == [[False, True, True, True, True, False, False, False]]
    no_pictures = picture_tokens(ids, torch.tensor([8]), None, [torch.zeros(0, 3, dtype=torch.long)], image_token=5,
                                 merge=2)
    assert not no_pictures.any()
    assert torch.equal(rope_index(ids[0], torch.zeros(0, 3, dtype=torch.long), image_token=5, merge=2),
                       torch.arange(8).expand(3, 8))


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_rotary_table_equals_transformers(kind):
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VLRotaryEmbedding,
    )
    from transformers.models.qwen3_vl.modeling_qwen3_vl import (
        Qwen3VLTextRotaryEmbedding,
    )

    section = [8, 3, 5]  # head_dim 32: 16 frequencies, the three axes' shares all different
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}
    if kind == "qwen2_5_vl":
        cfg = Qwen2_5_VLConfig(text_config={"hidden_size": 128, "num_attention_heads": 4, "rope_parameters": rope})
        hf = Qwen2_5_VLRotaryEmbedding(cfg.text_config)
    else:
        cfg = Qwen3VLConfig(text_config={"hidden_size": 128, "num_attention_heads": 4, "head_dim": 32,
                                         "rope_parameters": {**rope, "mrope_interleaved": True}})
        hf = Qwen3VLTextRotaryEmbedding(cfg.text_config)
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 4000, (3, 2, 9), generator=g)
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), pos)  # [b, L, d]
    table = mrope_table(hf.inv_freq, pos, section, interleaved=kind == "qwen3_vl")  # [L, b, 1, d]
    assert torch.equal(table.cos()[:, :, 0].transpose(0, 1), cos)
    assert torch.equal(table.sin()[:, :, 0].transpose(0, 1), sin)


def test_multi_modal_travels_with_its_rows(vlm):
    model, batch = vlm
    B = batch.batch_size
    tag = lambda b: [int(d["image_grid_thw"].sum()) if d else 0 for d in b.multi_modal]
    full = tag(batch)
    assert tag(batch.select(["advantages"])) == full
    assert tag(batch.index([3, 0, 2])) == [full[3], full[0], full[2]]
    assert tag(batch.slice(1, 3)) == full[1:3]
    assert tag(TrainBatch.concat([batch.slice(0, 1), batch.slice(1, B)])) == full
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(B, generator=g).tolist()
    minis = list(make_minibatch_iterator(batch, mini_batch_size=2, shuffle=True, seed=0, select_keys=["advantages"]))
    assert [t for m in minis for t in tag(m)] == [full[i] for i in perm]
    for m in minis:  # each row's pictures still match its image tokens
        for i in range(m.batch_size):
            n_img = int((m.input_ids[i] == model.config.image_token_id).sum())
            grid = m.multi_modal[i].get("image_grid_thw", torch.zeros(0, 3))
            assert n_img == int((grid.prod(-1) // 4).sum())
    with pytest.raises(ValueError, match="one per sample"):
        batch.replace(multi_modal=batch.multi_modal[:-1])
