"""Errors a user's run can stop with before anything expensive starts (a leaf module: the entry
point, the driver and the CLI all import it, and it imports nothing of mrl)."""
from __future__ import annotations


class UnsupportedConfigError(RuntimeError):
    """A valid config that this build's driver cannot run yet (or whose inputs are missing).

    Raised before any worker, engine or Ray process starts; the message names each key and the fix.
    """


class InputRefusedError(UnsupportedConfigError):
    """A user's input that the run refuses before anything starts: a checkpoint to resume that was trained
    from another model or is corrupt. A user mistake like a bad config value: ``mrl train`` exits 2 (a
    subclass, so callers that catch UnsupportedConfigError still stop on it)."""


class RunStoppedError(RuntimeError):
    """A run that started and stopped on a fault it cannot survive (an engine that could not be brought
    back, a dead trainer rank, a full disk): the message is the whole report (what, where, the last
    resumable checkpoint), so ``mrl train`` prints it as one line, without the exception type.
    ``resume_hint``: the message does not say where to resume from; the driver adds the last checkpoint."""

    def __init__(self, message: str, *, resume_hint: bool = False) -> None:
        super().__init__(message)
        self.resume_hint = resume_hint
