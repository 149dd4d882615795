"""The engine as users run it: a real ``python -m mrl.rollout.engine.server`` process answering HTTP,
and its refusal to bind off loopback without a token."""
from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from tests.helpers.dist import free_port
from tests.helpers.serving import wait_http_ok
from tests.helpers.tiny_models import make_tiny_hf

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.mark.slow
def test_served_by_subprocess(tmp_path):
    d = make_tiny_hf(tmp_path / "m", "qwen2")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mrl.rollout.engine.server", "--model", str(d), "--port", str(port), "--max-running", "8"],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(url, proc)
        r = httpx.post(f"{url}/generate", timeout=60, json={
            "text": "hello", "return_logprob": True,
            "sampling_params": {"temperature": 0.7, "max_new_tokens": 6, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        out = r.json()
        assert len(out["output_ids"]) == 6 and out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
        assert out["meta_info"]["weight_version"] == "default"
        assert [t for _, t, _ in out["meta_info"]["output_token_logprobs"]] == out["output_ids"]
        assert httpx.get(f"{url}/health_generate", timeout=60).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_refuses_off_loopback_without_token(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mrl.rollout.engine.server", "--model", str(tmp_path), "--port", "1", "--host", "0.0.0.0"],
        env=_env(), capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode != 0
    assert "--token-env" in proc.stderr and "0.0.0.0" in proc.stderr
