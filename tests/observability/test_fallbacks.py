"""Megatron/torch fallback warnings: recorded and reported once; every other warning still shows."""
from __future__ import annotations

import subprocess
import sys
import textwrap

from mrl.observability.fallbacks import classify, summary_line


def test_known_fallbacks_are_named_and_others_are_not() -> None:
    assert classify("Apex is not installed. Falling back to Torch Norm") == "torch LayerNorm/RMSNorm (no Apex)"
    assert classify("`torch.distributed.all_gather_into_tensor` is deprecated. Please use ...") == (
        "torch.distributed.all_gather_into_tensor as Megatron calls it (deprecated name)")
    assert classify("something else went wrong") is None


def test_collected_in_a_process_and_summarised_once() -> None:
    code = textwrap.dedent("""
        import json, warnings
        from mrl.observability.fallbacks import collect_fallbacks, fallbacks_in_use
        collect_fallbacks(); collect_fallbacks()
        warnings.warn("Apex is not installed. Falling back to Torch Norm")
        warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.")
        warnings.warn("an unrelated warning")
        print(json.dumps(fallbacks_in_use()))
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert p.stdout.strip() == '["torch LayerNorm/RMSNorm (no Apex)", "torch Adam (no Transformer Engine/Apex fused Adam)"]'
    assert "an unrelated warning" in p.stderr and "Falling back" not in p.stderr
    line = summary_line([["a", "b"], ["b", "c"], []])
    assert line is not None and line.endswith(": a; b; c")
    assert summary_line([[], []]) is None
