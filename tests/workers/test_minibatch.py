"""make_minibatch_iterator key selection, micro-batch splits and compact model inputs (pure torch)."""
import pytest
import torch

from mrl.workers.batch import TrainBatch
from mrl.workers.minibatch import (
    build_model_inputs,
    loss_keys,
    make_minibatch_iterator,
    restore_order,
    split_by_length,
    split_dynamic,
    split_fixed,
)
from tests.workers.batches import ragged_batch


@pytest.mark.parametrize("use_kl, use_is", [(False, False), (True, False), (True, True), (False, True)])
def test_minibatch_selects_ref_log_prob_iff_use_kl_loss(use_kl, use_is):
    batch = ragged_batch(with_rollout=True)
    keys = loss_keys(use_kl_loss=use_kl, use_rollout_log_probs=use_is)
    mbs = list(make_minibatch_iterator(batch, mini_batch_size=4, epochs=2, select_keys=keys))
    assert len(mbs) == 4
    for mb in mbs:
        assert (mb.ref_log_prob is not None) == use_kl
        assert (mb.rollout_log_probs is not None) == use_is
        assert mb.old_log_probs is not None and mb.advantages is not None
        assert mb.uid is None and mb.batch_size == 4
    torch.testing.assert_close(mbs[1].input_ids, batch.input_ids[4:8], rtol=0, atol=0)


def test_missing_key_names_its_producer():
    batch = ragged_batch(with_ref=False)
    with pytest.raises(KeyError, match="ref_log_prob.*compute_ref_log_prob"):
        next(make_minibatch_iterator(batch, mini_batch_size=4, select_keys=loss_keys(
            use_kl_loss=True, use_rollout_log_probs=False)))
    with pytest.raises(ValueError, match="divisible"):
        next(make_minibatch_iterator(batch, mini_batch_size=3))


def test_shuffle_is_a_seeded_permutation_per_epoch():
    batch = ragged_batch()
    a = list(make_minibatch_iterator(batch, mini_batch_size=8, epochs=2, shuffle=True, seed=3))
    b = list(make_minibatch_iterator(batch, mini_batch_size=8, epochs=2, shuffle=True, seed=3))
    assert torch.equal(a[0].input_ids, b[0].input_ids) and torch.equal(a[1].input_ids, b[1].input_ids)
    assert not torch.equal(a[0].input_ids, a[1].input_ids)
    assert sorted(map(tuple, a[0].input_ids.tolist())) == sorted(map(tuple, batch.input_ids.tolist()))


def test_fixed_and_dynamic_splits_restore_order():
    lens = [13, 4, 9, 2, 11, 7, 5, 3]
    parts = split_dynamic(lens, max_tokens=20)
    assert len(parts) == 3  # ceil(54 / 20)
    assert sorted(i for p in parts for i in p) == list(range(8))
    assert max(sum(lens[i] for i in p) for p in parts) <= 20 + max(lens)
    x = torch.arange(8.0)[:, None] * torch.ones(1, 3)
    assert torch.equal(restore_order([x[p] for p in parts], parts), x)
    assert split_fixed(5, 2) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="ppo_max_token_len_per_gpu"):
        split_dynamic(lens, max_tokens=10)


def test_length_sorted_split_groups_similar_lengths_and_restores_order():
    lens = [13, 4, 9, 2, 11, 7, 5, 3, 9]
    parts = split_by_length(lens, 3)
    assert parts == [[3, 7, 1], [6, 5, 2], [8, 4, 0]]  # stable: the two 9s keep their order
    # each micro-batch is padded to its longest sample: 3*(4 + 9 + 13) = 78 columns, 3*(13 + 11 + 9) = 99 in order
    assert sum(len(p) * max(lens[i] for i in p) for p in parts) == 78
    x = torch.arange(9.0)[:, None] * torch.ones(1, 2)
    assert torch.equal(restore_order([x[p] for p in parts], parts), x)
    assert split_by_length([5, 1], 4) == [[1, 0]]


def test_compact_inputs_align_labels_with_responses():
    batch = ragged_batch()
    mi = build_model_inputs(batch, pad_to_multiple=4)
    assert mi.tokens.shape[1] % 4 == 0
    n = batch.attention_mask.sum(-1)
    for i in range(batch.batch_size):
        valid = batch.input_ids[i][batch.attention_mask[i].bool()]
        assert torch.equal(mi.tokens[i, : n[i]], valid)
        assert torch.equal(mi.position_ids[i, : n[i]], torch.arange(int(n[i])))
    # the label scored at resp_index is the response token itself
    got = mi.labels.gather(1, mi.resp_index) * mi.resp_valid
    assert torch.equal(got, batch.responses * batch.attention_mask[:, batch.prompt_length:])


def test_batch_shape_errors_name_the_field():
    b = ragged_batch()
    with pytest.raises(ValueError, match="advantages"):
        TrainBatch(b.input_ids, b.attention_mask, b.position_ids, b.responses, b.response_mask,
                   advantages=torch.zeros(3, 3))


def test_padding_mask_marks_exactly_the_columns_without_a_token():
    """Megatron's padding mask for MoE routers (``ModelInputs.padding_mask``) in each row layout: as many masked
    columns as ``padding()`` counts, every column a prediction reads unmasked, the masked ones hold token 0."""
    from mrl.workers.minibatch import build_packed_inputs, build_shared_prefix_inputs
    from tests.workers.batches import grouped_batch

    for name, mi in (("compact", build_model_inputs(ragged_batch(), pad_to_multiple=8)),
                     ("packed", build_packed_inputs(ragged_batch(), pad_to_multiple=64)),
                     ("shared prefix", build_shared_prefix_inputs(grouped_batch(), pad_to_multiple=8))):
        pad = mi.padding_mask()
        assert pad.shape == mi.tokens.shape and pad.dtype == torch.bool, name
        assert int(pad.sum()) == mi.padding() > 0, name  # each layout here has padding to find
        assert not bool(mi.tokens[pad].any()), name
        rows = mi.resp_row if mi.resp_row is not None else torch.arange(len(mi.resp_index))  # compact: a row each
        read = mi.resp_index[mi.resp_valid]
        owners = rows[:, None].expand_as(mi.resp_index)[mi.resp_valid]
        assert not bool(pad[owners, read].any()), name  # no column a response token is predicted from is masked


def test_at_least_halves_the_largest_part_until_there_are_enough() -> None:
    from mrl.workers.minibatch import at_least

    assert at_least([[0, 1, 2, 3, 4]], 2) == [[0, 1], [2, 3, 4]]
    assert at_least([[5], [0, 1, 2], [3, 4]], 4) == [[5], [0], [1, 2], [3, 4]]
    assert at_least([[0], [1]], 4) == [[0], [1]]  # one sample each: cannot be split further
    assert at_least([[0, 1], [2]], 1) == [[0, 1], [2]]


def test_vpp_group_size_meets_megatrons_interleaved_schedule() -> None:
    from mrl.workers.megatron_model import vpp_group_size

    for pp in (2, 3, 4):
        for n in range(pp, 25):
            g = vpp_group_size(n, pp)
            assert pp <= g <= n and (n % g == 0 or n % g >= pp), (n, pp, g)
            if n % pp == 0:
                assert g == pp  # Megatron-LM's default where it fits
    with pytest.raises(ValueError, match="at least pipeline_model_parallel_size=4 micro-batches"):
        vpp_group_size(3, 4)
