"""What ``mrl plan`` / ``mrl train`` know of the prompt files before anything starts: each configured file
is a readable .jsonl / .parquet with rows and the columns ``data.prompt_key`` / ``data.ground_truth_key`` name
(dotted for nested, as the dataset reads them), and one step's batch fits in the training set.

Counting is cheap: a .parquet file's row count is in its footer (pyarrow reads only the metadata); a
.jsonl file is read line by line, its first ``PARSE_LINES`` non-blank lines parsed as JSON objects and
the rest counted; the columns are looked up in the first row (a .parquet file: in its schema). Every row is parsed and checked again, with ``file:row`` errors, when ``mrl train``
loads the dataset before Ray starts: ``mrl.data.dataset``). Prompts longer than ``data.max_prompt_length``
are dropped only at that load (they need the tokenizer), so a batch that fits here can still be refused
there.

A missing file is an error for ``mrl train`` and a note for ``mrl plan`` (a plan may be made before the
data is on the host); every other problem is an error for both.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from mrl.config.root import MRLConfig

PARSE_LINES = 1000


class DataFileError(ValueError):
    """A configured prompt file that cannot be a dataset; the message names the problem (the caller adds key and fix)."""


def count_rows(path: str | Path, columns: tuple[str, ...] = ()) -> int:
    """Rows of a .jsonl or .parquet file; raises :class:`DataFileError` saying why it has none, or which of
    ``columns`` (dotted for nested) its first row (a parquet file: its schema) lacks."""
    p = Path(path)
    if p.is_dir():
        raise DataFileError("is a directory, not a file")
    if not p.exists():
        raise DataFileError("does not exist")
    if not p.is_file():
        raise DataFileError("is not a regular file")
    try:
        if p.stat().st_size == 0:
            raise DataFileError("is empty (0 bytes)")
        if p.suffix == ".parquet":
            return _parquet_rows(p, columns)
        return _jsonl_rows(p, columns)
    except OSError as e:  # unreadable (permissions, I/O)
        raise DataFileError(f"cannot be read ({e.strerror or e})") from None


def _parquet_rows(p: Path, columns: tuple[str, ...]) -> int:
    import pyarrow as pa  # only when a parquet file is configured: plan stays fast otherwise
    import pyarrow.parquet as pq

    try:
        f = pq.ParquetFile(p)
        n, schema = f.metadata.num_rows, f.schema_arrow
    except (pa.ArrowException, OSError) as e:
        raise DataFileError(f"is not a parquet file ({e})") from None
    if n == 0:
        raise DataFileError("is a parquet file with 0 rows")
    for key in columns:
        if not _in_schema(schema, key):
            raise DataFileError(_no_column(key, schema.names))
    return n


def _in_schema(schema: object, key: str) -> bool:
    """A flat column literally named ``key``, or the struct path ``a.b`` (mrl.data.dataset.get_dotted's rule)."""
    import pyarrow as pa

    if key in schema.names:  # type: ignore[attr-defined]
        return True
    fields = schema  # a pa.Schema, then a pa.StructType: both index fields by name
    for part in key.split("."):
        idx = fields.get_field_index(part)  # type: ignore[attr-defined]
        if idx < 0:
            return False
        t = fields.field(idx).type  # type: ignore[attr-defined]
        fields = t if pa.types.is_struct(t) else None
        if fields is None and part != key.split(".")[-1]:
            return False
    return True


def _has_key(row: dict, key: str) -> bool:
    if key in row:
        return True
    cur: object = row
    for part in key.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return False
        cur = cur[part]
    return True


def _no_column(key: str, names: list[str]) -> str:
    return f"has no column {key!r} (its columns: {', '.join(sorted(names)) or 'none'})"


def _jsonl_rows(p: Path, columns: tuple[str, ...]) -> int:
    n = 0
    with p.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            n += 1
            if n > PARSE_LINES:
                continue
            try:
                row = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                msg = e.msg if isinstance(e, json.JSONDecodeError) else "not UTF-8"
                raise DataFileError(f"line {lineno} is not JSON ({msg}); a .jsonl file holds one JSON object per line") from None
            if not isinstance(row, dict):
                raise DataFileError(f"line {lineno} is a JSON {type(row).__name__}, not an object; a .jsonl file holds "
                                    "one JSON object per line")
            if n == 1:
                for key in columns:
                    if not _has_key(row, key):
                        raise DataFileError(_no_column(key, list(row)))
    if n == 0:
        raise DataFileError("has only blank lines (no rows)")
    return n


@dataclass
class DataCheck:
    """Errors (refuse), notes (say) and the row counts found, per key."""

    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    rows: dict[str, int] = field(default_factory=dict)  # "data.train_files" -> rows over its files
    images: list[str] = field(default_factory=list)  # vision-language prompts: the pictures (config/data_images.py)

    def summary(self, cfg: MRLConfig | None = None) -> str:
        """The lines ``mrl plan`` prints under the plan: the rows, and with ``cfg`` the run length they give."""
        if not self.rows:
            return ""
        text = "  data rows: " + ", ".join(f"{k}={v}" for k, v in self.rows.items())
        text += "".join(f"\n  pictures: {line}" for line in self.images)
        return text + (f"\n  run length: {run_length_text(cfg, self.rows.get('data.train_files'))}" if cfg else "")


def run_length_text(cfg: MRLConfig, train_rows: int | None) -> str:
    """How many RL steps the run makes and why (the same rule as RunPlan.total_steps); the rows are
    before the length filter (data.filter_overlong_prompts), which ``mrl train`` applies when it loads them."""
    t = cfg.trainer
    if t.total_training_steps:
        return f"{t.total_training_steps} steps (trainer.total_training_steps)"
    if train_rows is None:
        return f"trainer.total_epochs={t.total_epochs} x the training set's batches (rows unknown until the files exist)"
    if cfg.data.sampler.class_path != "resumable":
        return (f"trainer.total_epochs={t.total_epochs} x the batches per epoch of data.sampler.class_path="
                f"{cfg.data.sampler.class_path} (known when mrl train loads the data)")
    from mrl.config.run_plan import run_length

    key, batch = step_batch(cfg)
    per_epoch = train_rows // batch  # the built-in sampler's batches_per_epoch
    return (f"{run_length(cfg, per_epoch)} steps (trainer.total_epochs={t.total_epochs} x {per_epoch} batches of "
            f"{batch} prompts ({key}) in {train_rows} rows)")


def step_batch(cfg: MRLConfig) -> tuple[str, int]:
    """(key, prompts) one generation round draws: gen_batch_size with DAPO's filter_groups, else train_batch_size."""
    d = cfg.data
    if cfg.algorithm.filter_groups.enable and d.gen_batch_size:
        return "data.gen_batch_size", d.gen_batch_size
    return "data.train_batch_size", d.train_batch_size


def check_data_files(cfg: MRLConfig, *, require_present: bool) -> DataCheck:
    """Count the rows of every configured prompt file and check one step's batch fits the training set.
    ``require_present``: a missing file is an error (``mrl train``), else a note (``mrl plan``)."""
    out = DataCheck()
    columns = (cfg.data.prompt_key, cfg.data.ground_truth_key)
    for key, files in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
        total, complete = 0, bool(files)
        for i, f in enumerate(files):
            if not f.endswith((".jsonl", ".parquet")):
                complete = False  # check_config names it
                continue
            try:
                total += count_rows(f, columns)
            except DataFileError as e:
                complete = False
                if not Path(f).exists() and not Path(f).is_symlink() and not require_present:
                    continue  # check_config's note says it
                fix = ("data.prompt_key / data.ground_truth_key = the file's column (dotted for nested, e.g. "
                       "reward_model.ground_truth)" if "has no column" in str(e) else _fix(key, f))
                out.errors.append(f"{key}[{i}]={f!r} {e}; fix: {fix}")
        if complete:
            out.rows[key] = total
    key, batch = step_batch(cfg)
    rows = out.rows.get("data.train_files")
    if rows is not None and batch > rows:
        out.errors.append(
            f"{key}={batch} prompts per step exceeds the {rows} rows of data.train_files "
            f"({', '.join(cfg.data.train_files)}); fix: lower {key} to at most {rows} or add prompts")
    if not out.errors:  # the pictures of readable files (vision-language prompts)
        from mrl.config.data_images import scan_images

        scan = scan_images(cfg)
        out.errors += scan.errors
        out.images = scan.lines + scan.notes
    return out


def _fix(key: str, path: str) -> str:
    for name, demo in (("quickstart_agent", "agent"), ("quickstart_moe_deepseek", "moe --family deepseek_v3"),
                       ("quickstart_moe_glm", "moe --family glm4_moe"), ("quickstart_moe", "moe"), ("quickstart", "base")):
        if f"outputs/{name}/" in path:
            return (f"write the quickstart's assets first (`make train` does, or `python -m mrl.quickstarts {demo} "
                    f"--out outputs/{name}`)")
    kind = "parquet (e.g. pandas.DataFrame.to_parquet)" if path.endswith(".parquet") else "JSON lines, one object per row"
    return f"point {key} at a {kind} file with at least one prompt row"
