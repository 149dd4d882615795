"""The scheduler's waiting queue: one FIFO per request (a ``/generate`` call's samples), admitted round
robin, so a small request is admitted at the next free slots even behind a 100k-sample one (a single
FIFO served it only after every sample queued before it; docs/performance.md, 'One FIFO per request').

Requests of one submit share a group; retracted requests (``pause(mode="retract")``) go back in a
group of their own that is served first, in their order. Not thread-safe: the scheduler holds its
condition's lock around every call.
"""
from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

_RETRACTED = -1


class FairQueue:
    """Waiting requests by group; ``take(n)`` picks one per group in turn."""

    def __init__(self) -> None:
        self._groups: dict[int, collections.deque[Any]] = {}
        self._len = 0
        self._next_group = itertools.count()
        self._start = 0  # the group offset the next take() starts at (rotates: no group is always first)

    def extend(self, reqs: Iterable[Any]) -> None:
        """Queue ``reqs`` as one new group (one client request)."""
        q = collections.deque(reqs)
        if q:
            self._groups[next(self._next_group)] = q
            self._len += len(q)

    def extendleft(self, reqs: list[Any]) -> None:
        """Put ``reqs`` back in front of everything, in their order (retracted rows resume first)."""
        if not reqs:
            return
        front = self._groups.pop(_RETRACTED, collections.deque())
        front.extendleft(reversed(reqs))
        self._groups = {_RETRACTED: front, **self._groups}
        self._len += len(reqs)

    def take(self, n: int) -> list[Any]:
        """Up to ``n`` requests: the retracted group first, then round robin over the others."""
        out: list[Any] = []
        front = self._groups.get(_RETRACTED)
        while front and len(out) < n:
            out.append(front.popleft())
        keys = [k for k, q in self._groups.items() if q and k != _RETRACTED]
        if keys and len(out) < n:
            s = self._start % len(keys)
            keys = keys[s:] + keys[:s]
            self._start += 1
            while len(out) < n and keys:
                for k in list(keys):
                    q = self._groups[k]
                    out.append(q.popleft())
                    if not q:
                        keys.remove(k)
                    if len(out) >= n:
                        break
        self._len -= len(out)
        self._prune()
        return out

    def popleft(self) -> Any:
        """The next request ``take`` would give (IndexError when empty), as a deque's."""
        got = self.take(1)
        if not got:
            raise IndexError("pop from an empty FairQueue")
        return got[0]

    def remove_if(self, pred: Callable[[Any], bool]) -> None:
        """Drop the requests ``pred`` holds for (finished ones)."""
        for k, q in self._groups.items():
            if any(pred(r) for r in q):
                self._groups[k] = collections.deque(r for r in q if not pred(r))
        self._len = sum(len(q) for q in self._groups.values())
        self._prune()

    def _prune(self) -> None:
        for k in [k for k, q in self._groups.items() if not q]:
            del self._groups[k]

    def __iter__(self) -> Iterator[Any]:
        return itertools.chain.from_iterable(list(self._groups.values()))

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0
