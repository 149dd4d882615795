"""A crafted ``.metadata`` in a checkpoint directory must not run code (torch DCP pickles it).

Genuine DCP indexes (written by ``torch.distributed.checkpoint``) still load through the restricted
unpickler; a payload whose ``__reduce__`` would create a marker file is refused by
``verify_checkpoint`` (which resume and ``mrl-ckpt`` go through), by torch's own
``FileSystemReader`` once installed (what Megatron's loader calls), and by ``mrl-ckpt inspect``,
and the marker never appears.
"""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # what an attacker puts in .metadata
        return (os.system, (f"touch {self.marker}",))


def _genuine_dcp(d: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    dcp.save(state, checkpoint_id=str(d), no_dist=True)
    return d


def _fake_mrl_checkpoint(d: Path, marker: Path) -> Path:
    d.mkdir(parents=True)
    (d / "mrl_checkpoint.json").write_text(json.dumps({"format": "mrl-mcore-torch_dist-v1"}))
    (d / "metadata.json").write_text("{}")
    (d / "common.pt").write_bytes(b"")
    (d / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    return d


def test_genuine_dcp_metadata_loads_through_the_restricted_unpickler(tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    from mrl.megatron import safe_metadata

    d = _genuine_dcp(tmp_path / "ok")
    md = safe_metadata.load_dcp_metadata(d)
    assert tuple(md.state_dict_metadata["w"].size) == (2, 3)
    assert md.state_dict_metadata["b"].properties.dtype == torch.bfloat16
    safe_metadata.install()
    assert tuple(FileSystemReader(str(d)).read_metadata().state_dict_metadata["w"].size) == (2, 3)
    out = {"w": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)}
    import torch.distributed.checkpoint as dcp

    dcp.load(out, checkpoint_id=str(d), no_dist=True)  # saving/loading still work after install
    assert torch.equal(out["w"], torch.arange(6, dtype=torch.float32).reshape(2, 3))


def test_malicious_metadata_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    from mrl.megatron import safe_metadata
    from mrl.megatron.checkpoint import CheckpointError, verify_checkpoint

    marker = tmp_path / "pwned"
    d = _fake_mrl_checkpoint(tmp_path / "evil", marker)
    with pytest.raises(CheckpointError, match=r"refusing the tensor index .*\.metadata.*(os|posix)\.system"):
        verify_checkpoint(d)
    assert not marker.exists()
    safe_metadata.install()
    with pytest.raises(pickle.UnpicklingError, match="not a torch checkpoint metadata type"):
        FileSystemReader(str(d)).read_metadata()  # the reader Megatron's loader uses
    assert not marker.exists()


def test_mrl_ckpt_inspect_refuses_malicious_metadata(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    d = _fake_mrl_checkpoint(tmp_path / "evil", marker)
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "checkpoints_tools.cli", "inspect", str(d)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode != 0 and "refusing the tensor index" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not marker.exists()
