"""PromptDataset: jsonl/parquet, chat template vs plain text, dotted ground truth, overlong prompts, errors."""
import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer

from mrl.config.data import DataConfig
from mrl.data.dataset import (
    DataError,
    PromptDataset,
    check_batch_fits,
    read_rows,
    repeat_interleave,
)
from mrl.data.tokenize import left_pad, position_ids_from_mask
from tests.helpers.tiny_tokenizer import save_tiny_tokenizer

ROWS = [
    {"prompt": "question: what is 3 + 4 ? answer:", "reward_model": {"ground_truth": "7"}, "data_source": "arith"},
    {"prompt": [{"role": "user", "content": "what is 1 + 1 ?"}], "reward_model": {"ground_truth": "2"},
     "extra_info": {"index": 1}},
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(d)
    return AutoTokenizer.from_pretrained(d)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_and_parquet_give_the_same_prompts(tok, tmp_path):
    j = _jsonl(tmp_path / "p.jsonl", ROWS)
    # A parquet column has one type: verl's parquet files hold chat messages in every row.
    # (from_pylist takes its schema from the first row, so row 0 gets an extra_info too.)
    chat = [dict(ROWS[0], prompt=[{"role": "user", "content": ROWS[0]["prompt"]}], extra_info={"index": 0}), ROWS[1]]
    pq.write_table(pa.Table.from_pylist(chat), tmp_path / "p.parquet")
    a = PromptDataset([j], tok, max_prompt_length=32)
    b = PromptDataset([tmp_path / "p.parquet"], tok, max_prompt_length=32)
    assert len(a) == len(b) == 2
    assert [p.prompt_ids for p in a.prompts] == [p.prompt_ids for p in b.prompts]
    assert b[1].extra_info == {"index": 1} and b[0].ground_truth == "7" and b[1].data_source is None
    assert [p.ground_truth for p in a.prompts] == ["7", "2"]
    assert a[0].data_source == "arith" and a[1].extra_info == {"index": 1} and a[0].source.endswith("p.jsonl:1")
    # No chat template: plain text, and messages become their contents.
    assert tok.decode(a[0].prompt_ids) == ROWS[0]["prompt"]
    assert tok.decode(a[1].prompt_ids) == "what is 1 + 1 ?"


def test_chat_template_is_applied_to_messages_only(tok, tmp_path):
    tok.chat_template = "{% for m in messages %}<s>{{ m.role }}: {{ m.content }}</s>{% endfor %}{% if add_generation_prompt %}<s>assistant:{% endif %}"
    try:
        ds = PromptDataset([_jsonl(tmp_path / "p.jsonl", ROWS)], tok, max_prompt_length=64)
        assert tok.decode(ds[1].prompt_ids) == "<s>user: what is 1 + 1 ?</s><s>assistant:"
        assert ds[1].prompt_ids[0] == tok.bos_token_id  # the template's own special token, not a second one
        assert tok.decode(ds[0].prompt_ids) == ROWS[0]["prompt"]
    finally:
        tok.chat_template = None


def test_collate_left_pads_to_max_prompt_length(tok, tmp_path):
    ds = PromptDataset([_jsonl(tmp_path / "p.jsonl", ROWS)], tok, max_prompt_length=24)
    b = ds.collate([0, 1])
    assert b.input_ids.shape == b.attention_mask.shape == (2, 24)
    for i in range(2):
        n = len(ds[i].prompt_ids)
        assert b.attention_mask[i].tolist() == [0] * (24 - n) + [1] * n
        assert b.input_ids[i, 24 - n:].tolist() == ds[i].prompt_ids
        assert (b.input_ids[i, :24 - n] == tok.pad_token_id).all()
        assert b.position_ids[i, 24 - n:].tolist() == list(range(n)) and (b.position_ids[i, :24 - n] == 0).all()
    ids, mask = left_pad([[5], [6, 7]], 0)
    assert ids.tolist() == [[0, 5], [6, 7]] and position_ids_from_mask(mask).tolist() == [[0, 0], [0, 1]]
    with pytest.raises(ValueError, match="more than the padded length 1"):
        left_pad([[1, 2]], 0, 1)


def test_overlong_prompts_filtered_with_a_count_or_an_error(tok, tmp_path, caplog):
    rows = ROWS + [{"prompt": "x " * 100, "reward_model": {"ground_truth": "0"}}]
    f = _jsonl(tmp_path / "p.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="mrl.data"):
        ds = PromptDataset([f], tok, max_prompt_length=24)
    assert len(ds) == 2 and ds.num_filtered == 1
    assert "dropped 1 of 3 prompts longer than data.max_prompt_length=24" in caplog.text
    with pytest.raises(ValueError, match=r"p.jsonl:3: prompt has \d+ tokens > data.max_prompt_length=24.*filter_overlong_prompts=true"):
        PromptDataset([f], tok, max_prompt_length=24, filter_overlong_prompts=False)


def test_errors_name_file_row_key_and_columns(tok, tmp_path):
    f = _jsonl(tmp_path / "p.jsonl", [ROWS[0], {"question": "q", "reward_model": {"ground_truth": "1"}}])
    with pytest.raises(DataError, match=r"p.jsonl:2: no column 'prompt' \(data.prompt_key\); columns: question, reward_model"):
        PromptDataset([f], tok)
    g = _jsonl(tmp_path / "g.jsonl", [{"prompt": "a", "answer": "1"}])
    with pytest.raises(DataError, match=r"g.jsonl:1: no column 'reward_model.ground_truth'.*columns: answer, prompt"):
        PromptDataset([g], tok)
    assert PromptDataset([g], tok, ground_truth_key="answer")[0].ground_truth == "1"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
        read_rows(bad)
    with pytest.raises(ValueError, match=r"neither .jsonl nor .parquet"):
        read_rows(_jsonl(tmp_path / "p.csv", ROWS))
    with pytest.raises(DataError, match="data.train_files"):
        read_rows(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match=r"data.val_files is empty"):
        PromptDataset.from_config(DataConfig(train_files=[str(f)]), tok, split="val")


def test_from_config(tok, tmp_path):
    f = _jsonl(tmp_path / "p.jsonl", ROWS)
    ds = PromptDataset.from_config(DataConfig(train_files=[str(f)], max_prompt_length=16), tok)
    assert len(ds) == 2 and ds.collate([1]).input_ids.shape == (1, 16)


def test_repeat_interleave_groups_like_verl():
    items, uids = repeat_interleave(["a", "b", "c"], 2, uids=["u0", "u1", "u2"])
    assert items == ["a", "a", "b", "b", "c", "c"] and uids == ["u0", "u0", "u1", "u1", "u2", "u2"]
    _, fresh = repeat_interleave(["a", "b"], 3)
    assert len(set(fresh)) == 2 and fresh[0] == fresh[2] != fresh[3]
    with pytest.raises(ValueError, match="rollout.n must be >= 1"):
        repeat_interleave(["a"], 0)
    # The uids feed the GRPO group index directly.
    from mrl.algorithms import compute_grpo_outcome_advantage
    r = torch.tensor([[1.0], [0.0], [1.0], [1.0]])
    adv, _ = compute_grpo_outcome_advantage(r, torch.ones(4, 1), index=repeat_interleave(["p", "q"], 2)[1])
    assert adv[2:].abs().max() == 0 and adv[0, 0] > 0 > adv[1, 0]


BAD_ROWS = [  # (file content, scalar ground truth?, substrings of the error) — issue 19: none named file+row+key
    (b'{"prompt": "a", "reward_model": {"ground_truth": "1"}}\n{"prompt": "\xff", "reward_model": {"ground_truth": "1"}}\n',
     False, ["r.jsonl:2", "0xff", "not UTF-8"]),
    (b'{"prompt": "a", "reward_model": {"ground_truth": "1"}}\n{"prompt": 42, "reward_model": {"ground_truth": "1"}}\n',
     False, ["r.jsonl:2", "'prompt' (data.prompt_key)", "int (42)", "chat messages"]),
    (b'{"prompt": [{"role": "user"}], "reward_model": {"ground_truth": "1"}}\n',
     False, ["r.jsonl:1", "'prompt'", "list"]),
    (b'{"prompt": "  ", "reward_model": {"ground_truth": "1"}}\n', False, ["r.jsonl:1", "prompt is empty"]),
    # issue 53: a chat prompt with empty content trained; a lone surrogate stopped the run with the tokenizer's TypeError
    (b'{"prompt": [{"role": "user", "content": ""}], "reward_model": {"ground_truth": "1"}}\n', False,
     ["r.jsonl:1", "prompt is empty"]),
    ((b'{"prompt": "a", "reward_model": {"ground_truth": "1"}}\n{"prompt": [{"role": "system", "content": "Be brief."}, '
     b'{"role": "user", "content": " "}], "reward_model": {"ground_truth": "1"}}\n'), False,
     ["r.jsonl:2", "chat message 1 (role user) has empty content", "fix:"]),
    ((b'{"prompt": "a", "reward_model": {"ground_truth": "1"}}\n{"prompt": "x \\udcff y", "reward_model": '
     b'{"ground_truth": "1"}}\n'), False, ["r.jsonl:2", "lone UTF-16 surrogate '\\udcff' at character 2", "fix:"]),
    (b'{"prompt": [{"role": "user", "content": "q\\ud800"}], "reward_model": {"ground_truth": "1"}}\n', False,
     ["r.jsonl:1", "chat message 0", "lone UTF-16 surrogate"]),
    (b'{"prompt": "a", "reward_model": {"ground_truth": null}}\n', False,
     ["r.jsonl:1", "'reward_model.ground_truth' (data.ground_truth_key)", "null"]),
    (b'{"prompt": "a", "reward_model": {"ground_truth": "1"}}\n{"prompt": "b", "reward_model": {"ground_truth": {"x": 1}}}\n',
     True, ["r.jsonl:2", "'reward_model.ground_truth'", "dict", "string or number"]),
    (b'{"prompt": "a", "reward_model": {"ground_truth": true}}\n', True, ["r.jsonl:1", "bool"]),
    (b'[1, 2]\n', False, ["r.jsonl:1", "expected a JSON object"]),
]


@pytest.mark.parametrize("content, scalar, must", BAD_ROWS)
def test_row_schema_is_checked_when_the_dataset_loads(tok, tmp_path, content, scalar, must):
    f = tmp_path / "r.jsonl"
    f.write_bytes(content)
    with pytest.raises(DataError) as ei:
        PromptDataset([f], tok, scalar_ground_truth=scalar)
    assert all(s in str(ei.value) for s in must), str(ei.value)


def test_custom_scorers_may_take_structured_ground_truth(tok, tmp_path):
    f = _jsonl(tmp_path / "s.jsonl", [{"prompt": "a", "reward_model": {"ground_truth": {"x": [1, 2]}}}])
    assert PromptDataset([f], tok)[0].ground_truth == {"x": [1, 2]}


def test_batch_larger_than_filtered_dataset_is_refused():
    with pytest.raises(DataError, match=r"data.train_batch_size=8 prompts exceeds the 5 prompts of a.jsonl after dropping 3 overlong"):
        check_batch_fits(5, 8, ["a.jsonl"], 3)
    check_batch_fits(5, 5, ["a.jsonl"], 0)
