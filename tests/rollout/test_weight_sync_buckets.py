"""Flat buckets: grouping by size, byte-exact round trip with mixed dtypes (receiver view)."""
import pytest
import torch

from mrl.rollout.weight_sync.buckets import dtype_name, iter_buckets, unflatten


def _named():
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(4, 8, generator=g)),                       # 128 B
        ("b", torch.randn(16, generator=g).to(torch.bfloat16)),      # 32 B
        ("c", torch.randint(0, 9, (3, 5), generator=g)),             # 120 B (int64)
        ("big", torch.randn(64, generator=g)),                       # 256 B > limit: alone
        ("d", torch.randn(2, 2, generator=g).to(torch.float16)),     # 8 B
    ]


def test_buckets_respect_size_and_order():
    buckets = list(iter_buckets(_named(), bucket_bytes=200))
    assert [b.names for b in buckets] == [["a", "b"], ["c"], ["big"], ["d"]]
    assert [b.nbytes for b in buckets] == [160, 120, 256, 8]
    assert buckets[0].dtypes == ["float32", "bfloat16"] and buckets[1].shapes == [[3, 5]]


def test_flatten_unflatten_is_byte_exact_for_mixed_dtypes():
    named = _named()
    (bucket,) = list(iter_buckets(named, bucket_bytes=1 << 20))
    flat = bucket.flatten()
    assert flat.dtype == torch.uint8 and flat.numel() == bucket.nbytes == 544
    back = dict(unflatten(flat.clone(), bucket.names, bucket.dtypes, bucket.shapes))
    assert list(back) == bucket.names and sorted(back) == sorted(n for n, _ in named)
    for n0, t0 in named:
        assert back[n0].dtype == t0.dtype and torch.equal(t0, back[n0])


def test_buckets_keep_every_offset_aligned_and_unflatten_refuses_misalignment():
    """SGLang's receiver refuses a tensor whose byte offset is not a multiple of its itemsize; a
    bf16 vector of odd length before an fp32 matrix would be one. Buckets order by itemsize."""
    named = [("odd_bf16", torch.ones(3, dtype=torch.bfloat16)), ("f32", torch.arange(4.0)),
             ("u8", torch.ones(5, dtype=torch.uint8)), ("f16", torch.ones(2, dtype=torch.float16))]
    (bucket,) = list(iter_buckets(named, 1 << 20))
    assert bucket.names == ["f32", "odd_bf16", "f16", "u8"]  # itemsize 4, 2, 2, 1 (stable)
    off = 0
    for t in bucket.tensors:
        assert off % t.element_size() == 0
        off += t.numel() * t.element_size()
    arrival = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in named])
    with pytest.raises(ValueError, match="unaligned tensor 'f32'"):
        unflatten(arrival, [n for n, _ in named], ["bfloat16", "float32", "uint8", "float16"], [[3], [4], [5], [2]])


def test_non_contiguous_tensor_packs_its_logical_values():
    t = torch.arange(12.0).reshape(3, 4).t()  # transposed view
    (bucket,) = list(iter_buckets([("t", t)], 1024))
    ((_, back),) = unflatten(bucket.flatten(), ["t"], ["float32"], [[4, 3]])
    assert torch.equal(back, t)


def test_bad_bucket_size_names_the_key():
    with pytest.raises(ValueError, match="bucket_mb"):
        list(iter_buckets(_named(), 0))
    assert dtype_name(torch.bfloat16) == "bfloat16"
