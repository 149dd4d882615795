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
    back = unflatten(flat.clone(), bucket.names, bucket.dtypes, bucket.shapes)
    for (n0, t0), (n1, t1) in zip(named, back):
        assert n0 == n1 and t1.dtype == t0.dtype and torch.equal(t0, t1)


def test_non_contiguous_tensor_packs_its_logical_values():
    t = torch.arange(12.0).reshape(3, 4).t()  # transposed view
    (bucket,) = list(iter_buckets([("t", t)], 1024))
    ((_, back),) = unflatten(bucket.flatten(), ["t"], ["float32"], [[4, 3]])
    assert torch.equal(back, t)


def test_bad_bucket_size_names_the_key():
    with pytest.raises(ValueError, match="bucket_mb"):
        list(iter_buckets(_named(), 0))
    assert dtype_name(torch.bfloat16) == "bfloat16"
