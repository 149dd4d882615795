"""A tool that leaves processes behind (tests/agent/test_runner_tree.py)."""
import subprocess
import time


def spawn_and_hang(n: int, pidfile: str) -> str:
    """Start ``n`` sleepers (their pids into ``pidfile``), then hang past the call's limit."""
    pids = [subprocess.Popen(["sleep", "600"]).pid for _ in range(n)]
    with open(pidfile, "w") as f:
        f.write(" ".join(map(str, pids)))
    time.sleep(600)
    return "never"
