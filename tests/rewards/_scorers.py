"""Module-level scorers for the pool tests (spawned workers import them by name)."""
import os
import time


def sleepy(solution_str, ground_truth, **kw):
    if solution_str == "hang":
        time.sleep(3600)
    return float(len(solution_str))


def crashy(solution_str, ground_truth, **kw):
    if solution_str == "boom":
        raise ValueError("bad answer format")
    if solution_str == "die":
        os._exit(7)
    return 1.0


def pid(solution_str, ground_truth, **kw):
    return float(os.getpid())
