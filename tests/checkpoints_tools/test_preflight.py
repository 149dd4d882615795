"""``mrl-ckpt`` refuses before it spawns (issue 33): a layout the model cannot take (heads, KV heads,
layers), more CPU ranks than the host holds, a truncated safetensors (named); its ranks die with it;
its temp directory does not outlive it (SIGTERM: removed at once; SIGKILL: swept by the next run)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from checkpoints_tools.cli import main
from checkpoints_tools.preflight import PreflightError, check_host, sweep_stale_tmp
from tests.helpers.tiny_models import make_tiny_hf

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf(tmp_path_factory.mktemp("pre") / "hf", "qwen2")  # 4 heads, 2 KV heads, 4 layers


@pytest.mark.parametrize("flags, needle", [
    (["--tp", "3"], "does not divide the model's 4 attention heads"),
    (["--tp", "4"], "does not divide the model's 2 KV heads"),
    (["--pp", "3"], "the 4 layers"),
    (["--pp", "3", "--num-layers-in-last-pipeline-stage", "3"], "--num-layers-in-last-pipeline-stage=3"),
    (["--num-layers-in-first-pipeline-stage", "1"], "an uneven split needs --pp > 1"),
])
def test_a_layout_the_model_cannot_take_is_refused_before_any_rank(
        flags: list[str], needle: str, hf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["hf-to-mcore", "--hf", str(hf), "--out", str(out), "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err
    assert needle in err and "fix:" in err and "Traceback" not in err, err
    assert not out.exists() and not list(tmp_path.glob(".out.mrl-ckpt-tmp-*"))  # nothing was started


def test_more_cpu_ranks_than_the_host_holds_are_refused() -> None:
    with pytest.raises(PreflightError, match="CPU ranks on"):
        check_host(4 * (os.cpu_count() or 1) + 1, "cpu")
    check_host(1, "cpu")


def test_a_truncated_safetensors_is_named(hf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "hf"
    shutil.copytree(hf, bad)
    f = bad / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    assert main(["hf-to-mcore", "--hf", str(bad), "--out", str(tmp_path / "out"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert str(f) in err and ("truncated" in err or "header length" in err) and "Traceback" not in err, err


@pytest.mark.parametrize("where", ["under_a_file", "in_proc"])
def test_an_out_that_cannot_be_written_is_named_not_the_temp_dir(
        where: str, hf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 45 item 5: --out under a file, or where no directory can be made (/proc/<pid>: ENOENT even for root),
    is a usage error naming --out and why; before, a raw `[Errno 2]` on the hidden temp directory, exit 1."""
    if where == "under_a_file":
        (tmp_path / "afile").write_text("")
        out, why = tmp_path / "afile" / "sub" / "out", f"{tmp_path / 'afile'} is a file, not a directory"
    else:
        out, why = Path(f"/proc/{os.getpid()}/out"), f"a directory cannot be created in /proc/{os.getpid()}"
    assert main(["hf-to-mcore", "--hf", str(hf), "--out", str(out), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mrl-ckpt: error: --out {out} cannot be written: {why}"), err
    assert "fix:" in err and "mrl-ckpt-tmp" not in err and "Errno" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("given, hint", [
    ("config.json", "that is a Hugging Face file; pass a Megatron checkpoint directory"),  # not what inspect reads
    ("notes.txt", "pass a Megatron checkpoint directory"),
])
def test_inspect_given_a_file_says_it_is_a_file(given: str, hint: str, hf: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    f = hf / given if given == "config.json" else tmp_path / given
    f.touch()
    assert main(["inspect", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mrl-ckpt: error: inspect was given {f}: that is a file, not a checkpoint directory"), err
    assert f"fix: {hint}" in err and "does not exist" not in err and "Traceback" not in err, err


def test_a_file_inside_a_checkpoint_directory_points_at_the_directory(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("metadata.json", "common.pt", ".metadata", "__0_0.distcp"):
        (tmp_path / name).write_text("")
    assert main(["inspect", str(tmp_path / "__0_0.distcp")]) == 2
    assert f"pass the checkpoint directory that holds it: {tmp_path}" in capsys.readouterr().err
    assert main(["mcore-to-hf", "--mcore", str(tmp_path / "common.pt"), "--out", str(tmp_path / "o")]) == 2
    assert f"--mcore {tmp_path / 'common.pt'}: that is a file" in capsys.readouterr().err


def test_stale_temp_dirs_of_dead_runs_are_swept(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".out.mrl-ckpt-tmp-{dead.pid}"
    mine = tmp_path / f".out.mrl-ckpt-tmp-{os.getpid()}"  # a live pid: another conversion's, kept
    other = tmp_path / f".other.mrl-ckpt-tmp-{dead.pid}"  # another --out's, kept
    for d in (stale, mine, other):
        d.mkdir()
    assert sweep_stale_tmp(tmp_path / "out") == [stale]
    assert not stale.exists() and mine.exists() and other.exists()


def _started_rank(p: psutil.Process) -> bool:
    """A rank of mrl.local_ranks, past its first statement: a fork of the conversion's forkserver that
    made itself a process group leader (``_entry``'s ``os.setpgrp``; its parent watch starts next)."""
    try:
        return "multiprocessing.forkserver" in " ".join(p.cmdline()) and os.getpgid(p.pid) == p.pid
    except (psutil.Error, ProcessLookupError):
        return False


def _start(hf: Path, out: Path) -> tuple[subprocess.Popen, list[psutil.Process]]:
    """A 2-rank conversion, once its ranks run (their temp directory exists before they start)."""
    proc = subprocess.Popen([sys.executable, "-m", "checkpoints_tools.cli", "hf-to-mcore", "--hf", str(hf), "--out",
                             str(out), "--tp", "2", "--device", "cpu", "--timeout", "240"], cwd=ROOT,
                            env=dict(os.environ, PYTHONWARNINGS="ignore"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while True:
        kids = psutil.Process(proc.pid).children(recursive=True)
        ranks = [k for k in kids if _started_rank(k)]
        if len(ranks) >= 2:
            return proc, kids
        assert proc.poll() is None, f"mrl-ckpt exited early ({proc.returncode})"
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.1)


def _gone(procs: list[psutil.Process], within_s: float) -> bool:
    _, alive = psutil.wait_procs(procs, timeout=within_s)
    return not alive


@pytest.mark.slow
def test_ranks_die_with_a_killed_parent_and_the_next_run_sweeps_its_temp_dir(hf: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc, kids = _start(hf, out)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert _gone(kids, 30), [k.pid for k in kids if k.is_running()]  # before: they outlived it
    assert list(tmp_path.glob(".out.mrl-ckpt-tmp-*"))  # SIGKILL runs no clean-up ...
    sweep_stale_tmp(out)  # ... the next conversion to this --out removes it first
    assert not list(tmp_path.glob(".out.mrl-ckpt-tmp-*"))


@pytest.mark.slow
def test_sigterm_removes_the_temp_dir_and_the_ranks(hf: Path, tmp_path: Path) -> None:
    proc, kids = _start(hf, tmp_path / "out")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert _gone(kids, 30)
    assert not list(tmp_path.glob(".out.mrl-ckpt-tmp-*")) and not (tmp_path / "out").exists()
