"""mrl/driver/stop.py on real processes, without a run: the first signal raises RunInterrupted in the main thread
(also out of a Ray-like blocking call, as a KeyboardInterrupt); a second signal, or a teardown that outlives the
watchdog, kills every process below the driver (a grandchild included) and exits 128 + signal with the one line.
The whole run is tests/driver/test_stop_e2e.py."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mrl.driver.state import write_trainer_state
from mrl.driver.stop import RunInterrupted, kill_tree, stop_line, tree
from tests.helpers.e2e import ROOT
from tests.helpers.faults import left_running

# A driver stand-in: RunStop installed, a child with a grandchild (in a session of its own, as an engine server),
# the step set; it waits in a loop until the first signal, then "tears down" forever (a stuck teardown).
DRIVER = r"""
import os, subprocess, sys, time
from mrl.driver.stop import RunInterrupted, RunStop, tree
stop = RunStop(sys.argv[1], hard_stop_after_s=float(sys.argv[2]))
stop.install()
stop.step = 3
grandchild = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], "
              "start_new_session=True); time.sleep(600)")
subprocess.Popen([sys.executable, "-c", grandchild], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # not our pipes
while len(tree([os.getpid()])) < 3:
    time.sleep(0.01)
try:  # the signal comes once the pids are read: possibly while this print still returns
    print(" ".join(str(p) for p in sorted(tree([os.getpid()]) - {os.getpid()})), flush=True)
    while True:
        time.sleep(0.01)
except RunInterrupted as e:
    assert e.signum == int(sys.argv[3])
    stop.raising = False  # the teardown: a signal no longer raises
    print("tearing down", flush=True)
    while True:
        time.sleep(0.01)
"""


def _kill_left(kids: dict[int, str]) -> None:
    """A failed test does not leave its sleepers behind (same pid, same command line)."""
    import os

    for pid in left_running(kids, timeout_s=0.0):
        os.kill(int(pid.split(":")[0]), signal.SIGKILL)


def _driver(root: Path, hard_stop_after_s: float, sig: int) -> tuple[subprocess.Popen, dict[int, str]]:
    p = subprocess.Popen([sys.executable, "-c", DRIVER, str(root), str(hard_stop_after_s), str(int(sig))], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = [int(x) for x in p.stdout.readline().split()]
    from tests.helpers.faults import cmdline

    return p, {pid: cmdline(pid) for pid in pids}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_kills_every_process_below_the_driver_at_once(tmp_path: Path, sig: int) -> None:
    write_trainer_state(tmp_path, 2, {})
    p, kids = _driver(tmp_path, 600.0, sig)
    assert len(kids) == 2
    try:
        p.send_signal(sig)
        assert p.stdout.readline().strip() == "tearing down"
        assert p.poll() is None  # the first signal alone does not end a teardown that is running
        p.send_signal(sig)
        rc = p.wait(timeout=60)
        left = left_running(kids, timeout_s=0.0)  # before the clean-up below
    finally:
        p.kill()
        _kill_left(kids)
    err = p.stderr.read()
    assert rc == 128 + sig, err
    name = signal.Signals(sig).name
    assert err.strip().splitlines()[-1] == (f"mrl train: stopped by {name} at step 3 (a second {name}: every process "
                                            f"of the run was killed at once); last complete checkpoint: "
                                            f"{tmp_path / 'global_step_2'}"), err
    assert left == []


def test_a_teardown_that_outlives_the_watchdog_is_cut_short(tmp_path: Path) -> None:
    p, kids = _driver(tmp_path, 1.0, signal.SIGTERM)
    try:
        p.send_signal(signal.SIGTERM)
        assert p.stdout.readline().strip() == "tearing down"
        rc = p.wait(timeout=60)
        left = left_running(kids, timeout_s=0.0)  # before the clean-up below
    finally:
        p.kill()
        _kill_left(kids)
    err = p.stderr.read()
    assert rc == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1] == ("mrl train: stopped by SIGTERM at step 3 (the teardown took over 1 s: "
                                            "every process of the run was killed); no checkpoint was saved"), err
    assert left == []


def test_the_interrupt_leaves_a_blocking_call_that_holds_other_exceptions(tmp_path: Path) -> None:
    # Ray's ray.wait/ray.get run signal handlers but give up only on KeyboardInterrupt/SystemExit (another
    # exception is held until the call returns, measured with Ray 2.60): RunInterrupted must be one of them.
    assert issubclass(RunInterrupted, KeyboardInterrupt)
    assert RunInterrupted(signal.SIGTERM).exit_code == 143 and RunInterrupted(signal.SIGINT).exit_code == 130


def test_stop_line_names_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    assert stop_line(signal.SIGTERM, None, None) == "stopped by SIGTERM before the first step; no checkpoint was saved"
    write_trainer_state(tmp_path, 4, {})
    (tmp_path / "global_step_6" / "actor").mkdir(parents=True)  # a save cut short: not complete
    assert stop_line(signal.SIGINT, 6, str(tmp_path)) == (f"stopped by SIGINT at step 6; last complete checkpoint: "
                                                          f"{tmp_path / 'global_step_4'}")


def test_kill_tree_takes_children_that_left_the_process_group_and_returns_once_they_exited() -> None:
    # each holds 512 MiB it has written: its exit (unmapping that) outlasts the SIGKILL's return by ~50 ms, so a
    # kill_tree that did not wait for the exits leaves them running when it returns (in about half the runs on a 2-core host)
    hold = 'b = b"x" * (1 << 29); time.sleep(600)'
    code = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; {hold}'], "
            f"start_new_session=True); {hold}")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while len(tree([p.pid])) < 2 or min(_rss_mib(pid) for pid in tree([p.pid])) < 512:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # imported here: kill_tree's own first import of it (~1 s) would otherwise hide a missing wait
        from mrl.rollout.weight_sync.transports import TensorTransport  # noqa: F401
        from tests.helpers.faults import cmdline

        procs = {pid: cmdline(pid) for pid in tree([p.pid])}
        assert kill_tree([p.pid]) == set(procs)
        # gone on return (a zombie counts): the child, and the grandchild re-parented once its parent died
        assert left_running(procs, timeout_s=0.0) == []
        p.wait(timeout=60)
    finally:
        p.kill()


def _rss_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    return 0


def test_a_rank_gone_before_the_stop_leaves_no_weight_segment() -> None:
    # a SIGTERM to the process group ends the ranks too, often before the driver walks the tree: the segments
    # their weight senders named after them (mrl_ws_<pid>_...) are unlinked from the ranks' recorded pids
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(timeout=60)  # gone, and reaped: not in any process tree
    seg = Path(f"/dev/shm/mrl_ws_{p.pid}_1_test")
    seg.write_bytes(b"w" * 64)
    try:
        assert kill_tree([], senders=[p.pid]) == set()
        assert not seg.exists()
    finally:
        seg.unlink(missing_ok=True)
