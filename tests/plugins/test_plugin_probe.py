"""A plugin module is imported in a child process (with a timeout) before ``mrl plan`` imports it itself:
one that calls sys.exit, raises KeyboardInterrupt, hangs or crashes the interpreter at import time is a
config error naming the key, not a silent exit 0, a traceback or a frozen plan (issue 33)."""
from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

import mrl.plugins
from mrl.cli import EXIT_CONFIG, main
from mrl.config import ConfigError, load_config

GOOD = "def score(solution_str, ground_truth, data_source=None, extra_info=None):\n    return 1.0\n"
BAD = {
    "exit0": ("import sys\nsys.exit(0)\n", "called sys.exit(0)"),
    "interrupt": ("raise KeyboardInterrupt\n", "raised KeyboardInterrupt"),
    "hang": ("import time\ntime.sleep(600)\n", "did not finish within 2 s"),
    "crash": ("import os\nos.abort()\n", "crashed the interpreter (signal 6)"),
}


@pytest.fixture(autouse=True)
def _short_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mrl.plugins, "IMPORT_TIMEOUT_S", 2.0)


@pytest.mark.parametrize("case", list(BAD))
def test_a_plugin_that_would_stop_or_hang_plan_is_a_named_error(case: str, tmp_path: Path) -> None:
    body, needle = BAD[case]
    f = tmp_path / f"{case}.py"
    f.write_text(body + GOOD)
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.path=/nonexistent", "data.train_files=[/nonexistent/t.jsonl]",
                           f"reward.function={f}:score"])
    assert any(e_.startswith(f"reward.function='{f}:score'") and needle in e_ and "fix:" in e_ for e_ in e.value.errors), \
        e.value.errors


def test_a_plugin_that_imports_cleanly_passes(tmp_path: Path) -> None:
    f = tmp_path / "good.py"
    f.write_text(GOOD)
    with pytest.raises(ConfigError) as e:  # the default config lacks batch sizes: those errors only
        load_config(None, ["model.path=/nonexistent", "data.train_files=[/nonexistent/t.jsonl]",
                           f"reward.function={f}:score"])
    assert e.value.errors and not [x for x in e.value.errors if "reward.function" in x], e.value.errors


def test_mrl_plan_exits_2_on_a_plugin_calling_sys_exit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "exit0.py"
    f.write_text(BAD["exit0"][0] + GOOD)
    (tmp_path / "run.yaml").write_text("")
    assert main(["plan", str(tmp_path / "run.yaml"), "model.path=/nonexistent", "data.train_files=[/nonexistent/t.jsonl]",
                 f"reward.function={f}:score"]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "called sys.exit(0)" in err and "Traceback" not in err


def test_the_in_process_import_turns_sys_exit_into_an_error(tmp_path: Path) -> None:
    """Second line of defence (a worker loading the plugin): SystemExit at import is a ValueError."""
    f = tmp_path / "exit_inproc.py"
    f.write_text(BAD["exit0"][0] + GOOD)
    with pytest.raises(ValueError, match="SystemExit"):
        mrl.plugins.load_callable(f"{f}:score", "reward.function")


def test_a_plugin_slower_than_the_check_is_refused_and_not_imported_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 45 item 5: the child-process check's timeout is a verdict. `mrl plan` refuses (exit 2, the key, the
    timeout, the fix) and nothing imports the module in-process afterwards: the check's child is its one import."""
    marker = tmp_path / "imports.txt"
    f = tmp_path / "slow.py"
    f.write_text(f"import os, time\nwith open({str(marker)!r}, 'a') as m:\n    m.write(f'{{os.getpid()}}\\n')\n"
                 "time.sleep(3)\n" + GOOD)
    monkeypatch.setenv(mrl.plugins.TIMEOUT_ENV, "0.5")
    (tmp_path / "run.yaml").write_text("")
    assert main(["plan", str(tmp_path / "run.yaml"), "model.path=/nonexistent", "data.train_files=[/nonexistent/t.jsonl]",
                 f"reward.function={f}:score"]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert f"reward.function='{f}:score': importing '{f}' did not finish within 0.5 s" in err, err
    assert "fix:" in err and f"{mrl.plugins.TIMEOUT_ENV}=<seconds>" in err and "Traceback" not in err, err
    with pytest.raises(ValueError, match="did not finish within 0.5 s"):  # a later in-process load: same verdict
        mrl.plugins.load_callable(f"{f}:score", "reward.function")
    pids = marker.read_text().split()
    assert len(pids) == 1 and int(pids[0]) != os.getpid(), pids  # imported once, in the check's child


def test_a_timed_out_check_does_not_wait_for_a_process_the_import_set_loose(tmp_path: Path) -> None:
    """A plugin that starts a process in a session of its own (out of reach of the group kill) holding the check's
    stderr pipe: the check still returns at its timeout, instead of waiting for that process to end."""
    pid_file = tmp_path / "pid"
    f = tmp_path / "loose.py"
    f.write_text(f"import subprocess, time\np = subprocess.Popen(['sleep', '30'], start_new_session=True)\n"
                 f"open({str(pid_file)!r}, 'w').write(str(p.pid))\ntime.sleep(600)\n" + GOOD)
    t0 = time.monotonic()
    try:
        with pytest.raises(ValueError, match="did not finish within 0.5 s"):
            mrl.plugins.probe_import(f"{f}:score", "reward.function", timeout_s=0.5)
        assert time.monotonic() - t0 < 10
    finally:
        if pid_file.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_a_bad_timeout_setting_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(mrl.plugins.TIMEOUT_ENV, "soon")
    f = tmp_path / "good2.py"
    f.write_text(GOOD)
    with pytest.raises(ValueError, match=f"{mrl.plugins.TIMEOUT_ENV}='soon' is not a positive number"):
        mrl.plugins.probe_import(f"{f}:score", "reward.function")


def test_mrl_plan_imports_a_sound_plugin_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 53: a plugin whose import took 40 s was imported twice by `mrl plan` (the check's child, then the plan's
    own process). Now its import, signature check and (for a tool) schema all happen in the check's child: one import,
    none in this process; a wrong signature is still named."""
    marker = tmp_path / "imports.txt"
    record = f"import os\nwith open({str(marker)!r}, 'a') as m:\n    m.write(f'{{os.getpid()}}\\n')\n"
    f = tmp_path / "scorer.py"
    f.write_text(record + GOOD + "def calc(x: int) -> str:\n    '''Echo x.\n\n    Args:\n        x: a number\n    '''\n"
                 "    return str(x)\n" + "def bad(a):\n    return 0.0\n")
    (tmp_path / "run.yaml").write_text("")
    base = ["plan", str(tmp_path / "run.yaml"), "model.path=/nonexistent", "data.train_files=[/nonexistent/t.jsonl]"]
    main([*base, f"reward.function={f}:score", "agent.enable=true", f"agent.tools=[calculator,{f}:calc]"])
    err = capsys.readouterr().err
    assert "reward.function" not in err and "agent.tools" not in err, err
    pids = marker.read_text().split()
    assert len(pids) == 2 and str(os.getpid()) not in pids, pids  # one child per check, none in this process
    assert main([*base, f"reward.function={f}:bad"]) == EXIT_CONFIG
    assert f"reward.function='{f}:bad': bad(a) cannot be called as mrl calls it" in capsys.readouterr().err
