"""A full disk, reported as one line: which file or directory, how much is free there, and (for a
checkpoint save) that the previous checkpoint is still the latest. A save that runs out of space fails
in Megatron's writer on every rank (torch's CheckpointException, wrapped in Ray's error text); the
``latest`` pointer is only written after a whole save (driver/state.py), so it never names the partial
one, and the partial directory is removed here to give the space back (issue 33: a 3 MB tmpfs gave a
CheckpointException traceback, and the resume an OSError traceback from the metrics log writer)."""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from mrl.errors import RunStoppedError

#: what an out-of-space write says, in an exception's own text or in a remote traceback carried as text
_MARKERS = (f"[Errno {errno.ENOSPC}]", f"[Errno {errno.EDQUOT}]", f"[Errno {errno.EFBIG}]",
            os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT), os.strerror(errno.EFBIG))


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def free_space(path: str | os.PathLike | None) -> str:
    """'X MiB free of Y MiB on the filesystem of <dir>' for the nearest existing directory of ``path``."""
    p = Path(path or ".").absolute()
    while not p.is_dir() and p != p.parent:
        p = p.parent
    try:
        u = shutil.disk_usage(p)
    except OSError:
        return f"free space of {p} unknown"
    return f"{_mib(u.free)} free of {_mib(u.total)} on the filesystem of {p}"


def disk_full_message(filename: str | os.PathLike | None, reason: str, run_dir: str | None = None) -> str:
    """One line for an out-of-space error the driver met writing ``filename`` (unknown: a file under
    ``run_dir``, the run's directory)."""
    where = f"writing {filename}" if filename else f"writing a file under {run_dir or '.'}"
    return (f"no space left {where} ({reason}): {free_space(filename or run_dir)}; fix: free space there, or point "
            "trainer.default_local_dir (checkpoints, logs, metrics.log) at a filesystem with room")


def is_disk_full(e: BaseException) -> bool:
    """``e`` (or what it wraps) is an out-of-space write, by errno or, for a rank's error that reached
    the driver as Ray's text, by the message the OS gives."""
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return True
        if any(m in str(x) for m in _MARKERS):
            return True
        x = x.__cause__ or x.__context__
    return False


@contextlib.contextmanager
def checkpoint_save(root: str, step: int) -> Iterator[None]:
    """Run one checkpoint save of ``step`` under ``root``; when it runs out of space, remove the partial
    ``global_step_<step>`` (never a complete one: it has no trainer_state.json yet) and stop the run with
    a RunStoppedError naming the directory, the free space and the latest complete checkpoint (what
    ``latest_checkpointed_iteration.txt`` still names), the one to resume from."""
    from mrl.driver.state import complete_steps

    latest = max((s for s in complete_steps(root) if s != step), default=None)
    d = Path(root) / f"global_step_{step}"
    try:
        yield
    except Exception as e:
        # torch's zip writer reports a short write as "[enforce fail at inline_container.cc] unexpected pos",
        # not ENOSPC: a failed save that left less room than a checkpoint takes is a full disk too.
        prev = _size(Path(root) / f"global_step_{latest}") if latest is not None else 0
        if not (is_disk_full(e) or _free(root) < max(prev, _LOW)):
            raise
        if d.is_dir() and not (d / "trainer_state.json").is_file():
            shutil.rmtree(d, ignore_errors=True)
        last = (f"the latest checkpoint is still {Path(root) / f'global_step_{latest}'} (complete; a resume "
                f"loads it)" if latest is not None else "no earlier checkpoint exists")
        raise RunStoppedError(
            f"the checkpoint of step {step} did not fit in {d} (no space left on device; the partial save was "
            f"removed): {free_space(root)}; {last}; fix: free space there or point trainer.default_local_dir at a "
            "filesystem with room (trainer.max_ckpt_to_keep bounds how many checkpoints are kept)") from None


def _size(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


_LOW = 1 << 20  # under 1 MiB free after a failed save: that is why it failed


def _free(path: str | os.PathLike) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 1 << 62


def check_room(root: str | None, save_freq: int, latest: Path | None) -> None:
    """Before anything starts: a run that will checkpoint needs room for one more checkpoint as large as
    its latest one (saves are whole before ``latest`` moves on, and pruning happens after), else it would
    train for a while and stop at the first save. RunStoppedError naming the directory and the space."""
    if not root or save_freq <= 0 or latest is None or not latest.is_dir():
        return
    need = _size(latest)
    p = Path(root).absolute()
    try:
        free = shutil.disk_usage(p).free
    except OSError:
        return
    if free < need:
        raise RunStoppedError(
            f"no room for the next checkpoint in trainer.default_local_dir={root}: the latest one ({latest}) takes "
            f"{_mib(need)}, {free_space(p)}; nothing was started; fix: free space there, or point "
            "trainer.default_local_dir at a filesystem with room (a resume then needs trainer.resume_mode="
            f"{latest})")
