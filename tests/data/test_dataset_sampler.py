"""ResumableSampler: deterministic per-epoch shuffles, exact resume from state_dict, errors."""
import pytest

from mrl.data.sampler import ResumableSampler


def test_epochs_cover_all_prompts_and_reshuffle_deterministically():
    s = ResumableSampler(10, 3, seed=7)
    batches = [s.next_batch() for _ in range(6)]  # 3 batches per epoch, the 10th prompt dropped each epoch
    assert s.batches_per_epoch == 3 and s.epoch == 1
    e0, e1 = [i for b in batches[:3] for i in b], [i for b in batches[3:] for i in b]
    assert len(set(e0)) == len(set(e1)) == 9 and e0 != e1
    assert [ResumableSampler(10, 3, seed=7).next_batch() for _ in range(1)] == batches[:1]
    assert ResumableSampler(10, 3, seed=8).next_batch() != batches[0]
    assert ResumableSampler(5, 2, shuffle=False).next_batch() == [0, 1]


def test_resume_continues_exactly():
    ref = ResumableSampler(11, 4, seed=3)
    full = [ref.next_batch() for _ in range(7)]
    a = ResumableSampler(11, 4, seed=3)
    for _ in range(4):
        a.next_batch()
    state = a.state_dict()
    b = ResumableSampler(11, 4, seed=3)
    b.load_state_dict(state)
    assert [b.next_batch() for _ in range(3)] == full[4:]
    assert state == {"epoch": 1, "position": 8, "seed": 3, "num_items": 11, "batch_size": 4, "shuffle": True}


def test_errors_name_the_key():
    with pytest.raises(ValueError, match=r"data.train_batch_size=8 prompts exceeds the 5 prompts"):
        ResumableSampler(5, 8)
    s = ResumableSampler(10, 2, seed=1).state_dict()
    with pytest.raises(ValueError, match=r"seed=1 but this run has 2 \(data.seed\).*resume_mode=disable"):
        ResumableSampler(10, 2, seed=2).load_state_dict(s)
    with pytest.raises(ValueError, match=r"num_items=10 .*training prompt count"):
        ResumableSampler(12, 2, seed=1).load_state_dict(s)
