"""``mrl from-verl`` on hostile scripts (issue 53): bounded expansion, every refusal one line with exit 2 (no
MemoryError/RecursionError traceback, no minutes of quadratic work), -o problems named, an unclosed ``${`` noted
and an unbalanced quote named."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mrl.cli import EXIT_CONFIG, main
from mrl.config.verl_script import MAX_EXPANDED_CHARS, MAX_NESTING, MAX_TERMS, expand

LAUNCH = "python3 -m verl.trainer.main_ppo data.train_batch_size=8 "


def _refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], script: str, *needles: str) -> str:
    f = tmp_path / "run.sh"
    f.write_text(script)
    assert main(["from-verl", str(f)]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.startswith("mrl from-verl: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert all(n in err for n in needles), err
    return err


@pytest.mark.parametrize("expr,needle", [
    ("-" * 100_000 + "1", f"gives more than {MAX_EXPANDED_CHARS} characters"),  # MemoryError in Python's parser before
    ("+".join(["1"] * 200_000), f"gives more than {MAX_EXPANDED_CHARS} characters"),  # RecursionError before
    ("-" * 5_000 + "1", f"has 5000 operators, more than {MAX_TERMS}"),
    ("+".join(["1"] * 20_000), f"has 19999 operators, more than {MAX_TERMS}"),
    ("*".join(["7"] * 3000), f"has 2999 operators, more than {MAX_TERMS}"),
])
def test_arithmetic_beyond_the_caps_is_refused(expr: str, needle: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    _refused(tmp_path, capsys, f"N=$(({expr}))\n{LAUNCH}trainer.total_epochs=$N\n", needle)


def test_arithmetic_within_the_caps_still_works() -> None:
    assert expand("$((" + "+".join(["1"] * (MAX_TERMS + 1)) + "))", {}, set()) == str(MAX_TERMS + 1)  # MAX_TERMS "+"
    assert expand("$((-(-3) * 4 % 5))", {}, set()) == "2"


def test_64_bit_overflow_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _refused(tmp_path, capsys, f"N=$(({'*'.join(['1000000'] * 4)}))\n{LAUNCH}\n", "overflows bash's 64-bit integers")


def test_nested_defaults_beyond_the_cap_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    deep = "${A:-" * 20_000 + "1" + "}" * 20_000
    _refused(tmp_path, capsys, f"{LAUNCH}trainer.total_epochs={deep}\n", f"nested more than {MAX_NESTING} deep")
    ok = "${A:-" * MAX_NESTING + "3" + "}" * MAX_NESTING
    assert expand(ok, {}, set()) == "3"


def test_a_doubling_variable_stops_at_the_size_cap(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 40 doublings of 251 characters would be 2.7e14 characters (181 s for 18 of them before)
    script = "A=" + "x" * 251 + "\n" + "A=$A$A\n" * 40 + f"{LAUNCH}trainer.experiment_name=$A\n"
    _refused(tmp_path, capsys, script, f"gives more than {MAX_EXPANDED_CHARS} characters", "A=$A$A")


def test_a_huge_script_is_refused_without_reading_it_as_shell(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _refused(tmp_path, capsys, LAUNCH + "trainer.experiment_name=" + "$x" * 5_000_000 + "\n", "not a launch script")


def test_a_long_line_under_the_cap_expands_in_linear_time() -> None:
    """60k variables on one line (under the script cap): one pass, not a slice of the rest per "$"."""
    line = "$v" * 30_000
    assert expand(line, {"v": "a"}, set()) == "a" * 30_000


def test_an_unclosed_default_is_noted_and_kept_as_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f, out = tmp_path / "run.sh", tmp_path / "out.yaml"
    f.write_text(f"{LAUNCH}trainer.total_epochs=${{A:-1\n")
    assert main(["from-verl", str(f), "-o", str(out)]) == 0
    text = out.read_text()
    assert "opens ${ without its }" in text, text  # a note in the YAML's head
    assert yaml.safe_load(text)["trainer"]["total_epochs"] == "${A:-1", text  # not '' as before


@pytest.mark.parametrize("line,quote", [
    (LAUNCH + 'trainer.experiment_name="abc trainer.total_epochs=2\n', '"'),
    ("NAME='abc\n" + LAUNCH + "\n", "'"),
])
def test_an_unbalanced_quote_is_named(line: str, quote: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _refused(tmp_path, capsys, line, f"the {quote} quote at", "is never closed")


def test_output_paths_that_cannot_be_written_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "run.sh"
    f.write_text(f"{LAUNCH}trainer.total_epochs=2\n")
    for out in (tmp_path, tmp_path / "missing" / "x.yaml", Path("/proc/mrl-from-verl.yaml")):
        assert main(["from-verl", str(f), "-o", str(out)]) == EXIT_CONFIG, out
        err = capsys.readouterr().err
        assert err.startswith(f"mrl from-verl: cannot write -o {str(out)!r} (") and "fix:" in err, err
        assert err.count("\n") == 1 and "Traceback" not in err, err
