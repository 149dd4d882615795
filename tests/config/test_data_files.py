"""`mrl plan` / `mrl train` read the prompt files before anything starts (issue 31 item 3, issue 33): rows are
counted, a batch larger than the training set and every unreadable file are refused with the key, the path
and the fix, exit 2, no traceback."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mrl.cli import EXIT_CONFIG, main
from mrl.config.data_files import DataFileError, count_rows

REPO = Path(__file__).resolve().parents[2]
QUICK = str(REPO / "mrl_configs" / "quickstart.yaml")  # data.train_batch_size: 32
ROW = json.dumps({"prompt": "1+1=", "reward_model": {"ground_truth": "2"}})


def _jsonl(path: Path, n: int) -> Path:
    path.write_text("".join(ROW + "\n" for _ in range(n)))
    return path


def _parquet(path: Path, n: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "1+1=", "reward_model": {"ground_truth": "2"}}] * n,
                                        schema=pa.schema([("prompt", pa.string()),
                                                          ("reward_model", pa.struct([("ground_truth", pa.string())]))])),
                   path)
    return path


def _plan(capsys: pytest.CaptureFixture[str], *overrides: str, cmd: str = "plan") -> tuple[int, str, str]:
    rc = main([cmd, QUICK, *overrides, *(["--dry-run"] if cmd == "train-dry" else [])] if cmd != "train-dry"
              else ["train", QUICK, *overrides, "--dry-run"])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_rows_are_counted_for_jsonl_and_parquet(tmp_path: Path) -> None:
    f = _jsonl(tmp_path / "a.jsonl", 5)
    f.write_text(f.read_text() + "\n  \n")  # trailing blank lines are not rows
    assert count_rows(f) == 5
    assert count_rows(_parquet(tmp_path / "a.parquet", 7)) == 7


def test_plan_prints_the_row_counts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    train, val = _jsonl(tmp_path / "t.jsonl", 40), _parquet(tmp_path / "v.parquet", 9)
    rc, out, err = _plan(capsys, f"data.train_files=[{train}]", f"data.val_files=[{val}]")
    assert rc == 0, err
    assert "data rows: data.train_files=40, data.val_files=9" in out


@pytest.mark.parametrize("cmd", ["plan", "train"])
def test_batch_larger_than_the_dataset_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], cmd: str) -> None:
    a, b = _jsonl(tmp_path / "a.jsonl", 10), _parquet(tmp_path / "b.parquet", 11)  # 21 rows < 32 prompts per step
    rc, _, err = _plan(capsys, f"data.train_files=[{a},{b}]", f"data.val_files=[{a}]", cmd=cmd)
    assert rc == EXIT_CONFIG
    assert "data.train_batch_size=32 prompts per step exceeds the 21 rows of data.train_files" in err
    assert "fix: lower data.train_batch_size to at most 21" in err and "Traceback" not in err


def test_dapo_gen_batch_size_is_the_one_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _jsonl(tmp_path / "a.jsonl", 40)
    rc, _, err = _plan(capsys, f"data.train_files=[{a}]", f"data.val_files=[{a}]", "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score",
                       "data.gen_batch_size=48")
    assert rc == EXIT_CONFIG and "data.gen_batch_size=48 prompts per step exceeds the 40 rows" in err


def _bad_files(tmp: Path) -> dict[str, tuple[Path, str]]:
    (tmp / "dir.jsonl").mkdir()
    (tmp / "empty.jsonl").write_text("")
    (tmp / "blank.jsonl").write_text("\n   \n\t\n")
    (tmp / "text.jsonl").write_text("question,answer\n1+1,2\n")
    (tmp / "list.jsonl").write_text(ROW + "\n[1, 2]\n")
    (tmp / "latin1.jsonl").write_bytes(b'{"prompt": "caf\xe9"}\n')
    (tmp / "text.parquet").write_text("not a parquet file at all\n")
    _parquet(tmp / "zero.parquet", 0)
    return {
        "directory": (tmp / "dir.jsonl", "is a directory"),
        "empty": (tmp / "empty.jsonl", "is empty (0 bytes)"),
        "blank lines only": (tmp / "blank.jsonl", "has only blank lines"),
        "not JSON": (tmp / "text.jsonl", "line 1 is not JSON"),
        "a JSON list": (tmp / "list.jsonl", "line 2 is a JSON list, not an object"),
        "not UTF-8": (tmp / "latin1.jsonl", "line 1 is not JSON (not UTF-8)"),
        "not parquet": (tmp / "text.parquet", "is not a parquet file"),
        "parquet without rows": (tmp / "zero.parquet", "is a parquet file with 0 rows"),
    }


CASES = ["directory", "empty", "blank lines only", "not JSON", "a JSON list", "not UTF-8", "not parquet",
         "parquet without rows"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("key", ["data.train_files", "data.val_files"])
def test_unreadable_files_are_refused_with_key_path_and_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            case: str, key: str) -> None:
    path, why = _bad_files(tmp_path)[case]
    good = _jsonl(tmp_path / "good.jsonl", 40)
    other = "data.val_files" if key == "data.train_files" else "data.train_files"
    rc, _, err = _plan(capsys, f"{key}=[{good},{path}]", f"{other}=[{good}]")
    assert rc == EXIT_CONFIG, err
    assert f"{key}[1]={str(path)!r} {why}" in err and "fix: point " + key in err, err
    assert "Traceback" not in err
    with pytest.raises(DataFileError, match=why.split(" (")[0]):
        count_rows(path)


def test_missing_file_is_a_plan_note_and_a_train_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good, gone = _jsonl(tmp_path / "good.jsonl", 40), tmp_path / "gone.jsonl"
    args = (f"data.train_files=[{gone}]", f"data.val_files=[{good}]")
    rc, out, err = _plan(capsys, *args)
    assert rc == 0 and "gone.jsonl' does not exist yet" in out, err  # a plan may be made before the data is here
    rc, _, err = _plan(capsys, *args, cmd="train-dry")
    assert rc == 0, err  # --dry-run = the plan
    from tests.helpers.tiny_models import make_tiny_hf

    model = make_tiny_hf(tmp_path / "model", "qwen2")  # a real checkpoint: train's model preflight passes
    rc, _, err = _plan(capsys, *args, f"model.path={model}", cmd="train")
    assert rc == EXIT_CONFIG and f"data.train_files[0]={str(gone)!r} does not exist; fix:" in err, err


def test_quickstart_paths_name_the_asset_command(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no outputs/ here
    rc, _, err = _plan(capsys, cmd="train")
    assert rc == EXIT_CONFIG and "python -m mrl.quickstarts base --out outputs/quickstart" in err


def test_cli_exit_2_without_traceback(tmp_path: Path) -> None:
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    p = subprocess.run([sys.executable, "-m", "mrl", "plan", QUICK, f"data.train_files=[{blank}]"], cwd=REPO,
                       capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 2 and "has only blank lines" in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_columns_the_keys_name_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": "1+1=", "reward_model": {"ground_truth": "2"}}] * 40
    f = tmp_path / f"q.{fmt}"
    if fmt == "jsonl":
        f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), f)
    rc, _, err = _plan(capsys, f"data.train_files=[{f}]", f"data.val_files=[{f}]")
    assert rc == EXIT_CONFIG and f"data.train_files[0]={str(f)!r} has no column 'prompt'" in err
    assert "question" in err and "fix: data.prompt_key" in err
    rc, _, err = _plan(capsys, f"data.train_files=[{f}]", f"data.val_files=[{f}]", "data.prompt_key=question")
    assert rc == 0, err  # reward_model.ground_truth found nested (a struct column in parquet)
    rc, _, err = _plan(capsys, f"data.train_files=[{f}]", f"data.val_files=[{f}]", "data.prompt_key=question",
                       "data.ground_truth_key=reward_model.answer")
    assert rc == EXIT_CONFIG and "has no column 'reward_model.answer'" in err


def test_a_fifo_is_refused_without_reading_it(tmp_path: Path) -> None:
    import os

    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)  # opening it for reading would block: the check must not
    with pytest.raises(DataFileError, match="is not a regular file"):
        count_rows(fifo)
