"""File checksums written at save (mrl_checkpoint.json "files") and compared by verify_checkpoint: the
driver's pre-Ray resume check and every mrl-ckpt command. 64 bytes of 0xff inside a tensor shard, a
truncated or overwritten common.pt: each named with the file and what it holds (issue 33: inspect
exited 0 with sum nan, the resume trained on NaN)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoints_tools.cli import main
from mrl.megatron.checkpoint import CheckpointError, verify_checkpoint
from tests.helpers.tiny_models import make_tiny_hf

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sums")
    hf = make_tiny_hf(root / "hf", "qwen2")
    out = root / "m"
    p = subprocess.run([sys.executable, "-m", "checkpoints_tools.cli", "hf-to-mcore", "--hf", str(hf), "--out", str(out),
                        "--device", "cpu", "--timeout", "240"], cwd=ROOT, env=dict(os.environ, PYTHONWARNINGS="ignore"),
                       capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    return out


def _copy(ckpt: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(ckpt, tmp_path / "c"))


def test_the_save_records_every_file_and_a_clean_checkpoint_verifies(ckpt: Path) -> None:
    info = verify_checkpoint(ckpt)
    files = info["metadata"]["files"]
    assert {"common.pt", "metadata.json", ".metadata"} <= set(files) and any(f.endswith(".distcp") for f in files)


def test_flipped_bytes_in_a_shard_are_named(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    c = _copy(ckpt, tmp_path)
    shard = max(c.glob("*.distcp"), key=lambda f: f.stat().st_size)
    raw = bytearray(shard.read_bytes())
    mid = len(raw) // 2
    raw[mid:mid + 64] = b"\xff" * 64
    shard.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=rf"{shard.name} \(a tensor shard holding .*\) is corrupt: CRC32"):
        verify_checkpoint(c)
    assert main(["inspect", str(c)]) == 1  # before: exit 0 with sum nan
    err = capsys.readouterr().err
    assert shard.name in err and "corrupt" in err and "Traceback" not in err


@pytest.mark.parametrize("damage", ["truncated", "0xff", "zeros"])
def test_a_damaged_common_pt_is_named_with_its_role(damage: str, ckpt: Path, tmp_path: Path) -> None:
    c = _copy(ckpt, tmp_path)
    f = c / "common.pt"
    n = f.stat().st_size
    f.write_bytes({"truncated": f.read_bytes()[: n // 2], "0xff": b"\xff" * n, "zeros": b"\0" * n}[damage])
    with pytest.raises(CheckpointError, match=r"common.pt \(Megatron's common \(non-tensor\) state"):
        verify_checkpoint(c)
