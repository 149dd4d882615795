"""``mrl-ckpt`` end to end on a tiny Qwen2 (tied embeddings, qkv bias, vocab 300): the first conversion as a
user runs it (the console script, a process of its own), the others through the same ``main`` in this test
process, whose ranks are then forks of this test worker's warm server (tests/helpers/dist.py) instead of a
new interpreter and server per call (~4 CPU-s each).

One chain shares its conversions across tests: HF → mcore at TP2×PP2 (4 gloo ranks) → HF at
TP1×PP1 must be bit-exact per tensor; reshard (2,2) → (1,1) → (2,2) must give stored tensors
identical to the first (2,2) checkpoint. Error paths check exit status and that the message names
the file / tensor / flag to fix.
"""
from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.helpers.tiny_models import make_tiny_hf

pytestmark = pytest.mark.multirank
ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str, own_process: bool = False, timeout: int = 300) -> subprocess.CompletedProcess:
    """``mrl-ckpt args``: its exit status and output. ``own_process``: the installed console script in a
    subprocess; otherwise ``checkpoints_tools.cli.main`` here (argparse's exit included), output captured."""
    if not own_process:
        from checkpoints_tools.cli import main

        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                rc = main(list(args))
            except SystemExit as e:  # argparse's usage errors
                rc = e.code if isinstance(e.code, int) else 1
        return subprocess.CompletedProcess(["mrl-ckpt", *args], rc, out.getvalue(), err.getvalue())
    script = Path(sys.executable).parent / "mrl-ckpt"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "checkpoints_tools.cli"]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run(
        [*cmd, *args], check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt_cli")
    hf = make_tiny_hf(root / "hf", "qwen2")
    m22 = root / "m22"
    out = _ok(_cli("hf-to-mcore", "--hf", str(hf), "--out", str(m22), "--tp", "2", "--pp", "2",
                   "--device", "cpu", "--timeout", "240", own_process=True))
    assert "parameters in (HF): 167,744" in out.stdout, out.stdout
    return {"root": root, "hf": hf, "m22": m22}


def _hf_tensors(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(d / "model.safetensors"))


def test_hf_mcore_hf_roundtrip_is_bit_exact_and_force_guards_output(chain: dict[str, Path]) -> None:
    out = chain["root"] / "hf_back"
    out.mkdir()
    (out / "stale.txt").write_text("left from an older run")
    refused = _cli("mcore-to-hf", "--mcore", str(chain["m22"]), "--out", str(out), "--device", "cpu")
    assert refused.returncode == 2 and "not empty" in refused.stderr and "--force" in refused.stderr
    assert (out / "stale.txt").exists()

    _ok(_cli("mcore-to-hf", "--mcore", str(chain["m22"]), "--out", str(out), "--force", "--device", "cpu"))
    assert not (out / "stale.txt").exists()
    ref, got = _hf_tensors(chain["hf"]), _hf_tensors(out)
    assert sorted(ref) == sorted(got)
    for name, t in ref.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    # The output is a usable HF checkpoint: config + tokenizer travelled with the weights.
    from transformers import AutoConfig, AutoTokenizer

    assert AutoConfig.from_pretrained(out).tie_word_embeddings is True
    assert AutoTokenizer.from_pretrained(out)("hello").input_ids


def test_reshard_there_and_back_gives_identical_tensors(chain: dict[str, Path]) -> None:
    from checkpoints_tools.inspect_ckpt import iter_full_tensors

    m11, back = chain["root"] / "m11", chain["root"] / "m22_again"
    _ok(_cli("reshard", "--in", str(chain["m22"]), "--out", str(m11), "--tp", "1", "--pp", "1", "--device", "cpu"))
    _ok(_cli("reshard", "--ckpt", str(m11), "--out", str(back), "--tp", "2", "--pp", "2", "--device", "cpu"))
    a, b, c = (dict(iter_full_tensors(d)) for d in (chain["m22"], m11, back))
    assert sorted(a) == sorted(b) == sorted(c) and len(a) == 9
    for k in a:
        assert a[k].dtype == c[k].dtype and torch.equal(a[k], c[k]), k
        # TP1 pads the vocab to 384 rows, TP2 to 512: the shared rows agree, the rest are zero.
        rows = min(a[k].shape[0], b[k].shape[0])
        assert torch.equal(a[k][:rows], b[k][:rows]), k
        assert not a[k][rows:].any(), k
    assert a["embedding.word_embeddings.weight"].shape[0] == 512
    assert b["embedding.word_embeddings.weight"].shape[0] == 384


def test_inspect_reports_layout_and_checksums(chain: dict[str, Path]) -> None:
    out = _ok(_cli("inspect", str(chain["m22"]))).stdout
    assert "tp=2 pp=2" in out and "Qwen2ForCausalLM" in out and "181,312" in out
    assert "decoder.layers.self_attention.linear_qkv.weight" in out and "(4, 128, 64)" in out


def test_missing_shard_file_is_named(chain: dict[str, Path]) -> None:
    broken = chain["root"] / "m22_broken"
    shutil.copytree(chain["m22"], broken)
    (broken / "__1_0.distcp").unlink()
    proc = _cli("mcore-to-hf", "--ckpt", str(broken), "--out", str(chain["root"] / "never"), "--device", "cpu")
    assert proc.returncode == 1 and "__1_0.distcp" in proc.stderr and "missing" in proc.stderr, proc.stderr
    assert not (chain["root"] / "never").exists()


def test_not_a_checkpoint_and_bad_sizes_are_usage_errors(chain: dict[str, Path]) -> None:
    proc = _cli("mcore-to-hf", "--ckpt", str(chain["hf"]), "--out", str(chain["root"] / "x"))
    assert proc.returncode == 1 and "hf-to-mcore" in proc.stderr, proc.stderr
    proc = _cli("reshard", "--in", str(chain["m22"]), "--out", str(chain["root"] / "x"), "--tp", "1",
                "--pp", "1", "--vpp", "2")
    assert proc.returncode == 2 and "--vpp" in proc.stderr, proc.stderr


def test_missing_hf_tensor_is_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    hf = make_tiny_hf(tmp_path / "hf", "qwen2")
    tensors = load_file(str(hf / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    proc = _cli("hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "m"), "--tp", "1", "--pp", "1",
                "--device", "cpu", "--timeout", "240")
    # the input's fault: exit 2 and one sentence (tensor, file, fix), as every other refusal (issue 45 item 5)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"mrl-ckpt: error: --hf {hf}: tensor(s) model.layers.1.mlp.up_proj.weight are "
                                  f"missing from {hf / 'model.safetensors'}"), proc.stderr
    assert "fix:" in proc.stderr and "KeyError" not in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "m").exists()
    assert not [p for p in tmp_path.iterdir() if "mrl-ckpt-tmp" in p.name]  # temp dir cleaned up


def test_a_tensor_of_the_wrong_shape_is_named(tmp_path: Path) -> None:
    """A down_proj stored transposed: exit 2, the tensor, its shape and file, the fix; not `ValueError: ...`, exit 1."""
    from safetensors.torch import load_file, save_file

    hf = make_tiny_hf(tmp_path / "hf", "qwen2")
    tensors = load_file(str(hf / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name].t().contiguous()
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    proc = _cli("hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "m"), "--device", "cpu", "--timeout", "240")
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr
    assert err.startswith(f"mrl-ckpt: error: --hf {hf}: the weights do not fit config.json"), err
    assert f"{name} {list(tensors[name].shape)} in {hf / 'model.safetensors'}" in err, err
    assert "fix:" in err and "ValueError" not in err and "Traceback" not in err, err
    assert not (tmp_path / "m").exists() and not [p for p in tmp_path.iterdir() if "mrl-ckpt-tmp" in p.name]
