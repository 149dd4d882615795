"""A plugin that holds a real run in one phase until it is stopped: the stop tests' long update and long save,
made long by a file, not by timing luck (tests/driver/test_stop_e2e.py).

``MRL_BLOCK_DIR`` names a directory. When ``<dir>/block_update`` exists and the path it holds exists too (an empty
file: at once), the policy loss (run in the trainer ranks' update) writes ``<dir>/update_blocked.<pid>`` and then
never returns; likewise ``<dir>/block_save`` holds the sampler's ``state_dict`` (called by the driver's save after
the ranks wrote the actor's checkpoint, before the step's ``trainer_state.json`` marks the checkpoint complete),
marker ``<dir>/save_blocked``. Otherwise both are the built-ins (``vanilla``, ``resumable``).
"""
import os
import time
from pathlib import Path

from mrl.algorithms import compute_policy_loss_vanilla, register_policy_loss
from mrl.data.sampler import ResumableSampler, register_sampler


def _hold(flag: str, marker: str) -> None:
    d = os.environ.get("MRL_BLOCK_DIR")
    if not d or not (Path(d) / flag).exists():
        return
    after = (Path(d) / flag).read_text().strip()
    if after and not Path(after).exists():
        return
    (Path(d) / marker).touch()
    while True:  # a phase that does not end by itself: only the stop ends it
        time.sleep(0.05)


@register_policy_loss("blocking_vanilla")
def blocking_vanilla(old_log_prob, log_prob, advantages, response_mask, **kwargs):
    """``vanilla`` (PPO clip), held while ``block_update`` exists."""
    _hold("block_update", f"update_blocked.{os.getpid()}")
    return compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, **kwargs)


@register_sampler("blocking_resumable")
class BlockingSampler(ResumableSampler):
    """The built-in sampler whose checkpointed state is held while ``block_save`` exists."""

    def state_dict(self):
        _hold("block_save", "save_blocked")
        return super().state_dict()


def blocking_reward(solution_str, ground_truth, data_source=None, extra_info=None):
    """The quickstart's ``arith`` score, held while ``block_reward`` exists (in a reward worker process)."""
    from mrl.rewards import get_reward_fn

    _hold("block_reward", f"reward_blocked.{os.getpid()}")
    return get_reward_fn("arith")(solution_str=solution_str, ground_truth=ground_truth, data_source=data_source,
                                  extra_info=extra_info)
