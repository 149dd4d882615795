"""Runs inside a private mount namespace (``unshare --mount``) whose ``<mount>`` is a tmpfs of a few MiB,
so the writers fail with a real ENOSPC (tests/driver/test_disk_full_e2e.py starts it):

1. train 3 steps with a checkpoint every step: the first fits, the second does not;
2. fill what is left of the disk, then resume with checkpoints on (refused before Ray: no room for one);
3. resume with checkpoints off: the metrics log writer meets the full disk.

``python -m tests.helpers.disk_full_scenario <mount> <assets> <port> <out.json>``; everything it sees goes
to ``out.json`` (outside the tmpfs, which vanishes with the namespace) for the test to assert on."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.e2e import ROOT
from tests.helpers.faults import SMALL_RUN


def train(mount: Path, assets: Path, port: int, *overrides: str) -> dict:
    cmd = [sys.executable, "-m", "mrl", "train", "mrl_configs/quickstart.yaml", f"model.path={assets}/tiny-qwen2",
           f"data.train_files=[{assets}/data/train.jsonl]", f"rollout.port_base={port}",
           f"trainer.default_local_dir={mount}/ckpt", *SMALL_RUN, "trainer.total_training_steps=3",
           # the CPU default: engines in the ranks (the checkpoint writers are under test, not the engines'
           # processes; two of them and their launchers cost ~25 CPU-s over the scenario's runs)
           "rollout.weight_sync.transport=inprocess", *overrides]
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "PYTHONWARNINGS": "ignore"}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    return {"rc": p.returncode, "stderr": p.stderr[-8000:]}


def main() -> None:
    mount, assets, port, out = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    from mrl.megatron.checkpoint import CheckpointError, verify_checkpoint

    ckpt = mount / "ckpt"
    res: dict = {"save": train(mount, assets, port)}
    res["latest"] = (ckpt / "latest_checkpointed_iteration.txt").read_text().strip()
    res["step_dirs"] = sorted(d.name for d in ckpt.glob("global_step_*"))
    try:
        verify_checkpoint(ckpt / "global_step_1" / "actor")
        res["step1_verified"] = True
    except CheckpointError as e:
        res["step1_verified"] = str(e)
    with (mount / "filler").open("wb") as f:  # the rest of the disk
        try:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
        except OSError as e:
            res["filler_errno"] = e.errno
    res["resume_saving"] = train(mount, assets, port)
    res["resume_not_saving"] = train(mount, assets, port, "trainer.save_freq=-1")
    out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
