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


def dict_score(solution_str, ground_truth, **kw):
    """A verl-style dict scorer; some responses break the contract on purpose (see test_dict_returns)."""
    broken = {
        "nokey": {"acc": 1.0},
        "nan": {"score": float("nan"), "acc": 0.0, "pred": None, "length": 3.0},
        "list": {"score": 1.0, "acc": 0.0, "pred": None, "length": [1, 2]},
        "plain": 0.5,
        "fewer": {"score": 1.0, "acc": 1.0},
    }
    if solution_str in broken:
        return broken[solution_str]
    if solution_str == "boom":
        raise ValueError("bad answer format")
    correct = solution_str.strip() == str(ground_truth)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": solution_str.strip() or None,
            "length": len(solution_str)}
