"""A prompt, clean stop on SIGTERM or Ctrl-C (SIGINT): within ``HARD_STOP_AFTER_S`` of the signal nothing of the run
runs, the last complete checkpoint is untouched and named in one line. Slurm and Kubernetes give 30 s between SIGTERM
and SIGKILL; a long step (minutes on CPU) must not be waited for.

1. The first signal raises :class:`RunInterrupted` in the driver's main thread wherever it waits (a rank call, an
   engine request, a save): the phase's remote calls are abandoned, not waited for.
2. ``build``'s teardown runs in stop mode. A run on a Ray instance of its own (``cluster.address`` unset): every
   process of that instance (GCS, raylet, rank and engine-launcher workers, the engine servers below them) is
   SIGKILLed from here, with no Ray call — a rank busy in a step cannot answer a close, and a SIGTERM sent to the
   whole process group (``timeout``, Slurm) has stopped Ray's GCS already, after which every Ray call waits 60 s
   for it ("Failed to connect to GCS within 60 seconds"). A run joined to a cluster: the usual teardown through Ray
   with ``STOP_CLOSE_GRACE_S`` for each group's close (a busy rank is then killed).
3. A watchdog: a teardown still going ``HARD_STOP_AFTER_S`` after the signal ends as a second signal does.

A second signal: every process below the driver is SIGKILLed and the driver exits at once. Exit code 128 + the
signal's number (143 SIGTERM, 130 SIGINT). A checkpoint is complete once its ``trainer_state.json`` exists
(``mrl/driver/state.py``), so a save cut off anywhere leaves the previous one as the newest complete checkpoint.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

HARD_STOP_AFTER_S = 20.0  # the whole stop, well inside the 30 s before a scheduler's SIGKILL
STOP_CLOSE_GRACE_S = 2.0  # a joined cluster's group close after a signal: an idle rank answers in milliseconds
KILLED_GONE_S = 5.0  # a SIGKILLed process with gigabytes mapped takes a moment to exit; the driver waits that long
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class RunInterrupted(KeyboardInterrupt):
    """The run was stopped by ``signum``; ``str()`` is the one line ``mrl train`` prints (set by ``build``).

    A KeyboardInterrupt: no ``except Exception`` on the way keeps it, and Ray's blocking calls (``ray.wait``,
    ``ray.get``) give up at once on it — they turn it into a plain KeyboardInterrupt (any other exception a
    signal handler raises is held until the call returns), which ``build`` turns back (``RunStop.requested``)."""

    def __init__(self, signum: int, message: str = "") -> None:
        super().__init__(message or f"stopped by {signal.Signals(signum).name}")
        self.signum = signum
        self.exit_now = False  # Ray's own processes were killed: the driver exits without Ray's atexit shutdown

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def last_checkpoint(root: str | None) -> str:
    """``last complete checkpoint: <dir>`` (the newest with ``trainer_state.json``), or ``no checkpoint was saved``."""
    from mrl.driver.state import complete_steps, step_dir

    steps = complete_steps(root) if root else []
    return f"last complete checkpoint: {step_dir(root, steps[-1])}" if steps else "no checkpoint was saved"


def stop_line(signum: int, step: int | None, root: str | None, how: str = "") -> str:
    """``stopped by SIGTERM at step 3; last complete checkpoint: <dir>`` (``step``: the step running, 1-based;
    None: before the first)."""
    where = f"at step {step}" if step else "before the first step"
    return f"stopped by {signal.Signals(signum).name} {where}{how}; {last_checkpoint(root)}"


def _children() -> dict[int, list[int]]:
    """{ppid: [pid, ...]} of every process (Linux /proc; empty elsewhere)."""
    kids: dict[int, list[int]] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return kids
    for d in proc.iterdir():
        if d.name.isdigit():
            try:  # field 4 of stat, after the parenthesised command (which may hold spaces)
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    return kids


def tree(roots: list[int]) -> set[int]:
    """``roots`` and every process below them."""
    kids, out, todo = _children(), set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo.extend(kids.get(pid, []))
    return out


def kill_tree(roots: list[int], senders: list[int] = (), gone_within_s: float = KILLED_GONE_S) -> set[int]:
    """SIGKILL ``roots`` and everything below them; returns the pids killed. Each process is first stopped
    (SIGSTOP), and the tree walked again until no new process appears: a process that forked between the walk
    and the kill would otherwise outlive its killed parent, re-parented away from the tree. The /dev/shm segments
    of the weight senders among them, and of ``senders`` (ranks that may have exited already: a SIGTERM to the
    process group reaches them too), are unlinked.

    Returns once every killed process has exited (or ``gone_within_s`` passed): SIGKILL only queues the death, and
    a rank tearing down gigabytes of memory on a loaded host still runs for a moment after it — the driver must not
    exit before its processes have, or a scheduler's next job (and a test's check) finds them alive."""
    seen: set[int] = set()
    for _ in range(20):
        new = tree(roots) - seen
        if not new:
            break
        for pid in new:
            _signal(pid, signal.SIGSTOP)
        seen |= new
    for pid in seen:
        _signal(pid, signal.SIGKILL)
    try:  # a rank killed before its close leaves its weight sender's /dev/shm segment
        from mrl.rollout.weight_sync.transports import TensorTransport

        TensorTransport.remove_segments([*seen, *senders])
    except Exception:  # noqa: BLE001, S110 - best effort, the stop goes on
        pass
    deadline = time.monotonic() + gone_within_s
    while any(not _exited(pid) for pid in seen) and time.monotonic() < deadline:
        time.sleep(0.02)
    return seen


def _exited(pid: int) -> bool:
    """``pid`` has exited: no such process, or a zombie (dead, waiting for its parent to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class RunStop:
    """The run's SIGTERM/SIGINT handling from ``build``'s start to its end (main thread only; elsewhere a no-op).

    ``step``: the step running (the trainer sets it), named in the stop line. ``ray_roots``: the processes
    ``ray.init`` started for a Ray instance of the run's own (their trees are killed on a stop)."""

    def __init__(self, checkpoint_dir: str | None, hard_stop_after_s: float = HARD_STOP_AFTER_S) -> None:
        self.root, self.hard_stop_after_s = checkpoint_dir, hard_stop_after_s
        self.signum: int | None = None
        self.step: int | None = None
        self.ray_roots: list[int] = []
        self.senders: list[int] = []  # the trainer ranks on this node (weight senders: /dev/shm segments)
        self.ray_killed = False
        self.raising = True  # False once the run's body has ended: a signal then only shortens the teardown
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def install(self) -> None:
        """(Re-)install the handlers: ``ray.init`` puts its own SIGTERM handler (``sys.exit``) in place."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in _SIGNALS:
            prev = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, prev)

    def restore(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)  # type: ignore[arg-type]
        self._previous = {}

    def own_ray(self, started: list[int]) -> None:
        """``started``: the driver's children that ``ray.init`` of a local instance added."""
        self.ray_roots = started

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum is not None:  # the second signal: at once
            self.hard_stop(f" (a second {signal.Signals(signum).name}: every process of the run was killed at once)")
        self.signum = signum
        threading.Thread(target=self._watchdog, name="mrl-stop-watchdog", daemon=True).start()
        if self.raising:
            raise RunInterrupted(signum)

    def _watchdog(self) -> None:
        time.sleep(self.hard_stop_after_s)
        self.hard_stop(f" (the teardown took over {self.hard_stop_after_s:.0f} s: every process of the run was "
                       "killed)")

    def hard_stop(self, how: str) -> None:
        """Kill every process below the driver, print the stop line and exit now (no teardown, no atexit)."""
        assert self.signum is not None
        kill_tree([p for p in tree([os.getpid()]) if p != os.getpid()], self.senders)
        line = f"\nmrl train: {stop_line(self.signum, self.step, self.root, how)}\n"
        try:  # os.write: the main thread may be inside a print to stderr (a buffered write is not re-entrant)
            os.write(sys.stderr.fileno(), line.encode())
        finally:
            os._exit(128 + self.signum)

    def kill_own_ray(self) -> None:
        """Stop mode on a Ray instance of the run's own: kill its processes (ranks, engines and Ray's daemons),
        so that no teardown step waits on a busy rank or a GCS the signal has already stopped."""
        if self.requested and self.ray_roots and not self.ray_killed:
            kill_tree(self.ray_roots, self.senders)
            self.ray_killed = True


def children_of_self() -> set[int]:
    """The driver's direct child processes now."""
    return set(_children().get(os.getpid(), []))
