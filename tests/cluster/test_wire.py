"""mrl/cluster/wire.py without Ray: the encoding is the tensor's bytes, and the rebuilt tensor owns them."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from mrl.cluster.wire import tensor_from_wire, tensor_to_wire


@pytest.mark.parametrize("t", [
    torch.randn(3, 4), torch.randn(3, 4).to(torch.bfloat16), torch.randn(5).half(), torch.arange(6).reshape(2, 3),
    torch.tensor([True, False, True]), torch.complex(torch.randn(3), torch.randn(3)).conj(),
    torch.tensor(-2.5), torch.empty(0, 7), torch.randn(4, 6)[:, ::2].t(), -torch.randn(3).to(torch.float64),
])
def test_round_trip_is_bitwise_and_owned(t):
    w = tensor_to_wire(t)
    assert w[0] == "raw" and isinstance(w[1], np.ndarray) and w[1].dtype == np.uint8
    back = tensor_from_wire(pickle.loads(pickle.dumps(w, protocol=5)))
    want = t.resolve_conj().contiguous()
    assert back.dtype == t.dtype and back.shape == t.shape and back.is_contiguous()
    if t.numel():
        assert torch.equal(back.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
        back.view(-1)[0] = back.view(-1)[1] if t.numel() > 1 else back.view(-1)[0]  # writable
        assert not np.shares_memory(back.reshape(-1).view(torch.uint8).numpy(), w[1])  # a copy, not a view


def test_what_torch_must_pickle_itself_keeps_its_pickling():
    p = torch.ones(3, requires_grad=True)
    w = tensor_to_wire(p)
    assert w[0] == "pickle"
    back = tensor_from_wire(w)
    assert back.requires_grad and torch.equal(back.detach(), p.detach())
    sp = torch.eye(3).to_sparse()
    assert tensor_to_wire(sp)[0] == "pickle" and torch.equal(tensor_from_wire(tensor_to_wire(sp)).to_dense(), torch.eye(3))
