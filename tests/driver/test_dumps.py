"""The JSONL dump writers of trainer.rollout_data_dir / validation_data_dir (verl's _dump_generations)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mrl.driver.dumps import GenerationRows, dump_generations, dump_lines


def test_lines_are_verls_keys_in_order_with_extra_keys_after() -> None:
    rows = GenerationRows(["1+1=", "Zähle"], ["2", "drei ✓"], ["2", ["3", "three"]], [1.0, 0.5],
                          {"acc": [1.0, 0.0], "pred": ["2", None]})
    assert dump_lines(rows, 7) == [
        '{"input": "1+1=", "output": "2", "gts": "2", "score": 1.0, "step": 7, "acc": 1.0, "pred": "2"}',
        '{"input": "Zähle", "output": "drei ✓", "gts": ["3", "three"], "score": 0.5, "step": 7, "acc": 0.0, "pred": null}',
    ]


def test_extra_key_named_like_a_base_key_replaces_it_in_place_and_short_lists_are_left_out() -> None:
    # verl: base_data[k] = v for every extra key of one value per sample (a scorer's own "score" wins)
    rows = GenerationRows(["a"], ["b"], [None], [0.25], {"score": [0.5], "bad": [1, 2], "n": [np.int64(3)]})
    assert dump_lines(rows, 0) == ['{"input": "a", "output": "b", "gts": null, "score": 0.5, "step": 0, "n": 3}']


def test_file_is_named_by_step_one_line_per_sample(tmp_path) -> None:
    rows = GenerationRows(["p", "q"], ["x", "y"], ["1", "2"], torch.tensor([1.0, 0.0]).tolist(),
                          {"acc": [np.float32(1.0), torch.tensor(0.0)]})
    path = dump_generations(tmp_path / "rollouts", 3, rows)
    assert path == tmp_path / "rollouts" / "3.jsonl"
    assert path.read_text(encoding="utf-8") == (
        '{"input": "p", "output": "x", "gts": "1", "score": 1.0, "step": 3, "acc": 1.0}\n'
        '{"input": "q", "output": "y", "gts": "2", "score": 0.0, "step": 3, "acc": 0.0}\n')


def test_rows_of_different_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="2 inputs, 1 outputs"):
        GenerationRows(["a", "b"], ["x"], [None, None], [0.0, 0.0])
