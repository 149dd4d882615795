"""Fault injection into a real `mrl train` subprocess: start it, wait until a checkpoint of step 1 is
complete (a file, not a delay), find the run's own processes (descendants of the driver, never another
run's), kill one, and afterwards check that nothing of the run is left."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.e2e import ROOT
from tests.helpers.ray_cluster import shared_ray

# 4 steps of 4 prompts x 4 samples, a checkpoint every step, engines as their own server processes
# (transport=tensor: the CPU default, inprocess, serves from inside the trainer ranks).
SMALL_RUN = ("data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=2",
             "actor.ppo_micro_batch_size_per_gpu=4", "trainer.total_training_steps=4", "trainer.save_freq=1",
             "trainer.test_freq=-1", "trainer.val_before_train=false", "data.val_files=[]", "trainer.logger=[console]",
             "rollout.weight_sync.transport=tensor")


def start_train(tmp: Path, assets: Path, port: int, *overrides: str, join_ray: bool = False) -> subprocess.Popen:
    """The run, with a local Ray instance of its own (its whole process tree below the driver), or joined to the
    test session's (``join_ray``: its ranks and engines are then the instance's processes, found by port)."""
    cmd = [sys.executable, "-m", "mrl", "train", "mrl_configs/quickstart.yaml", f"model.path={assets}/tiny-qwen2",
           f"data.train_files=[{assets}/data/train.jsonl]", f"rollout.port_base={port}",
           f"trainer.default_local_dir={tmp}/ckpt", *SMALL_RUN, *overrides]
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "PYTHONWARNINGS": "ignore"}
    if join_ray:
        address, auth = shared_ray()
        cmd.append(f"cluster.address={address}")
        env.update(auth)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=(tmp / "stdout.txt").open("w"),
                            stderr=(tmp / "stderr.txt").open("w"), start_new_session=True)


def wait_for_checkpoint(p: subprocess.Popen, ckpt: Path, step: int = 1, timeout_s: float = 900.0) -> None:
    """Until ``latest_checkpointed_iteration.txt`` names ``step`` (the save is whole by then)."""
    latest = ckpt / "latest_checkpointed_iteration.txt"
    deadline = time.monotonic() + timeout_s
    while not (latest.is_file() and latest.read_text().strip() == str(step)):
        assert p.poll() is None, f"the run ended (rc {p.returncode}) before checkpoint {step}"
        assert time.monotonic() < deadline, f"no checkpoint of step {step} within {timeout_s}s"
        time.sleep(0.02)


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def descendants(root: int) -> dict[int, str]:
    """{pid: command line} of every process below ``root``."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    out: dict[int, str] = {}
    todo = [root]
    while todo:
        for k in kids.get(todo.pop(), []):
            out[k] = cmdline(k)
            todo.append(k)
    return out


def kill_one(p: subprocess.Popen, needle: str) -> tuple[int, dict[int, str]]:
    """SIGKILL one of the run's processes whose command line holds ``needle``; (its pid, every process of
    the run at that moment)."""
    procs = descendants(p.pid)
    victims = sorted(pid for pid, c in procs.items() if needle in c)
    assert victims, f"no process of the run matches {needle!r}: {sorted(procs.values())}"
    os.kill(victims[0], signal.SIGKILL)
    return victims[0], procs


def kill_engine(port: int) -> int:
    """SIGKILL the engine server listening on ``port`` (a run's rollout.port_base + i: no other run's), wherever
    it runs: below the driver, or below a joined Ray instance's raylet; its pid."""
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            line = f" {cmdline(int(d.name))} "
            if " mrl.rollout.engine.server " in line and f" --port {port} " in line:
                os.kill(int(d.name), signal.SIGKILL)
                return int(d.name)
    raise AssertionError(f"no engine server on port {port}")


def finish(p: subprocess.Popen, tmp: Path, timeout_s: float = 600.0) -> tuple[int, str]:
    """(exit code, stderr) once the run ends; a run still going after ``timeout_s`` is killed and fails."""
    try:
        rc = p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        raise AssertionError(f"the run did not stop within {timeout_s}s of the fault: "
                             + (tmp / "stderr.txt").read_text()[-4000:]) from None
    return rc, (tmp / "stderr.txt").read_text()


def left_running(procs: dict[int, str], timeout_s: float = 60.0) -> list[str]:
    """Processes of ``procs`` still alive (same pid, same command line) ``timeout_s`` after the run ended."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [f"{pid}: {c[:120]}" for pid, c in procs.items() if c and cmdline(pid) == c and not _zombie(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def port_free(port: int) -> bool:
    """Nothing is bound to ``port`` (SO_REUSEADDR, as the engines bind: connections the run closed may
    linger in TIME_WAIT, which does not keep a new server from binding)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def shm_of(pids: set[int]) -> list[str]:
    """/dev/shm segments the weight sender names after its process (``mrl_ws_<pid>_...``) for ``pids``."""
    return sorted(f.name for f in Path("/dev/shm").glob("mrl_ws_*") if f.name.split("_")[2].isdigit()
                  and int(f.name.split("_")[2]) in pids)


def port_holders(port: int) -> list[str]:
    """Processes with a TCP socket bound to local ``port`` (from /proc/net/tcp*), for a failure message."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{f[9]}]")
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if any(os.readlink(fd) in inodes for fd in (d / "fd").iterdir()):
                    out.append(f"{d.name}: {cmdline(int(d.name))[:120]}")
            except OSError:
                continue
    return out or [f"{len(inodes)} socket(s) with no process (TIME_WAIT or closing)"] if inodes else out


def ports_released(ports: list[int], timeout_s: float = 60.0) -> list[str]:
    """Who still holds any of ``ports`` ``timeout_s`` after the run ended (empty: all free)."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = [f"{p}: {port_holders(p)}" for p in ports if not port_free(p)]
        if not held or time.monotonic() > deadline:
            return held
        time.sleep(0.5)
