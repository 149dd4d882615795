"""Importing Megatron through mrl defers ``torch.compile`` (mrl/megatron/import_hooks.py): no TorchDynamo at
start-up, the same compiled function on first call."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from mrl.megatron.import_hooks import lazy_compile

_CHILD = textwrap.dedent("""
    import sys
    import mrl.megatron
    from megatron.core.models.gpt import GPTModel  # noqa: F401  (decorates megatron's fusion functions)
    import megatron.core.jit as jit
    from megatron.core.fusions import fused_bias_geglu
    from mrl.megatron.import_hooks import lazy_compile
    print(jit.jit_fuser is lazy_compile, "torch._dynamo" in sys.modules, fused_bias_geglu.geglu.__wrapped__.__name__)
""")


def test_megatron_imported_through_mrl_has_no_dynamo_until_a_fused_function_runs() -> None:
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", _CHILD], check=False, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False", "geglu"]  # swapped; dynamo not imported; functions still decorated


def test_lazy_compile_is_torch_compile_made_on_first_call() -> None:
    from torch._dynamo.testing import CompileCounter

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x) * 2

    backend = CompileCounter()  # an eager backend that counts the graphs dynamo hands it
    g = lazy_compile(f, backend=backend)
    x = torch.randn(5)
    assert g.__name__ == "f" and backend.frame_count == 0  # nothing traced at decoration
    torch.testing.assert_close(g(x), f(x), rtol=0, atol=0)
    assert backend.frame_count == 1 and backend.op_count == 2  # compiled by torch.compile on the first call
    g(x)
    assert backend.frame_count == 1  # ... once: the second call ran the compiled graph
