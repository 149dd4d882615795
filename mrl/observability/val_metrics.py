"""Validation metrics with verl's names (``process_validation_metrics`` + ``_val_metrics_update``).

Input: one entry per generated answer (sample) — its ``data_source``, the ``uid`` of its prompt
and per-variable values (``reward``, plus whatever else is known: ``acc``, ``pred``...). For each
data source ``s``, numeric variable ``v`` and prompt ``u`` with N answers ``x_1..x_N``:

    mean@N        = (1/N) Σ_i x_i
    std@N         = sqrt((1/N) Σ_i (x_i − mean@N)²)            (population std, numpy's default)
    best@k/mean   = E_b[ max(x_{j_b1}, ..., x_{j_bk}) ]          over B bootstrap draws b
    best@k/std    = Std_b[ max(...) ]                            (indices j drawn with replacement)
    worst@k/*     = the same with min
    maj@k/*       = the same with the value of the majority ``pred`` of the draw (needs ``pred``)

for k in 2, 4, 8, ... (< N) and N itself (only when N > 1). Each prompt's numbers are then averaged
over the prompts of ``s`` that have them. Metric key: ``<section>/<s>/<v>/<name>`` where
section = ``val-core`` for the core variable (``acc`` if present, else ``reward``) and names
mean@N_max, best@N_max/*, maj@N_max/* (N_max = the largest N of that variable), else ``val-aux``.

The bootstrap draws ``B = 1000`` index rows with ``numpy.random.RandomState(seed).choice`` — the
same draws as verl's ``np.random.seed(seed); np.random.choice(...)`` — from a private generator, so
results are reproducible and independent of call order, and the global numpy state is untouched.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence
from functools import lru_cache
from typing import Any

import numpy as np

N_BOOTSTRAP = 1000
SEED = 42
CORE_PREFIXES = ("mean", "maj", "best")


def subset_sizes(n: int) -> list[int]:
    """k values of best@k/worst@k/maj@k for N = n answers: 2, 4, 8, ... below n, then n; [] if n <= 1."""
    if n <= 1:
        return []
    ks, k = [], 2
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


@lru_cache(maxsize=64)
def _draws(n: int, k: int, n_bootstrap: int, seed: int) -> np.ndarray:
    """[n_bootstrap, k] indices into n items, drawn with replacement. They depend on (n, k, seed)
    only — every prompt with n answers uses the same rows, as in verl — so they are cached."""
    idx = np.random.RandomState(seed).choice(n, size=(n_bootstrap, k), replace=True)
    idx.flags.writeable = False
    return idx


def majority_value(values: Sequence[float], preds: Sequence[Hashable]) -> float:
    """Value of the first answer whose ``pred`` is the most frequent; ties go to the pred seen first
    (verl's ``calc_maj_val``: insertion-ordered counts, first maximum)."""
    counts: dict[Hashable, int] = {}
    first: dict[Hashable, float] = {}
    for v, p in zip(values, preds, strict=True):
        counts[p] = counts.get(p, 0) + 1
        first.setdefault(p, float(v))
    top = max(counts.values())
    return next(first[p] for p, c in counts.items() if c == top)


def majority_values(values: np.ndarray, preds: Sequence[Hashable], idx: np.ndarray) -> np.ndarray:
    """``majority_value`` of every draw row at once: ``values`` [N], ``preds`` N, ``idx`` [D, k] -> [D]."""
    ids: dict[Hashable, int] = {}
    codes = np.array([ids.setdefault(p, len(ids)) for p in preds])  # [N] one integer per distinct pred
    sub = codes[idx]  # [D, k]
    onehot = sub[:, :, None] == np.arange(codes.max() + 1)  # [D, k, C]
    counts = onehot.sum(axis=1)  # [D, C]
    k = idx.shape[1]
    first = np.where(counts > 0, onehot.argmax(axis=1), k)  # [D, C] first position of each pred in the row
    winner_pos = np.where(counts == counts.max(axis=1, keepdims=True), first, k).min(axis=1)  # tie: seen first
    return values[idx[np.arange(len(idx)), winner_pos]]


def prompt_metrics(values: Sequence[float], preds: Sequence[Hashable] | None = None, *,
                   n_bootstrap: int = N_BOOTSTRAP, seed: int = SEED) -> dict[str, float]:
    """The metrics of ONE prompt's N answers (see the module docstring): mean@N, and for N > 1
    std@N, best@k/{mean,std}, worst@k/{mean,std}, maj@k/{mean,std} (maj only with ``preds``)."""
    x = np.asarray(values, dtype=np.float64)
    n = len(x)
    if n == 0:
        return {}
    out = {f"mean@{n}": float(x.mean())}
    if n == 1:
        return out
    out[f"std@{n}"] = float(x.std())
    for k in subset_sizes(n):
        idx = _draws(n, k, n_bootstrap, seed)  # the same rows for best, worst and maj, as verl
        sub = x[idx]
        for name, red in (("best", sub.max(axis=1)), ("worst", sub.min(axis=1))):
            out[f"{name}@{k}/mean"], out[f"{name}@{k}/std"] = float(red.mean()), float(red.std())
        if preds is not None:
            maj = majority_values(x, preds, idx)
            out[f"maj@{k}/mean"], out[f"maj@{k}/std"] = float(maj.mean()), float(maj.std())
    return out


def _is_numeric(v: Any) -> bool:
    return isinstance(v, bool | int | float | np.integer | np.floating)


def process_validation_metrics(data_sources: Sequence[str | None], uids: Sequence[Hashable],
                               infos: Mapping[str, Sequence[Any]], *, n_bootstrap: int = N_BOOTSTRAP,
                               seed: int = SEED) -> dict[str, dict[str, dict[str, float]]]:
    """``{data_source: {variable: {metric_name: value}}}``: per-prompt metrics averaged over prompts.

    ``infos[var][i]`` is variable ``var`` of sample i (B samples, aligned with ``data_sources`` and
    ``uids``). Non-numeric variables (``pred`` strings) get no metrics of their own; ``pred`` (when
    present) is the vote of maj@k for every numeric variable. ``None`` data source -> ``unknown``.
    """
    B = len(uids)
    if len(data_sources) != B or any(len(v) != B for v in infos.values()):
        raise ValueError(f"{B} uids but {len(data_sources)} data sources and infos of lengths "
                         f"{ {k: len(v) for k, v in infos.items()} }; every entry needs one value per sample")
    # data_source -> uid -> sample indices, in first-seen order
    groups: dict[str, dict[Hashable, list[int]]] = defaultdict(lambda: defaultdict(list))
    for i, (ds, uid) in enumerate(zip(data_sources, uids)):
        groups[ds or "unknown"][uid].append(i)
    preds = infos.get("pred")
    out: dict[str, dict[str, dict[str, float]]] = {}
    for ds, by_uid in groups.items():
        per_var: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for idx in by_uid.values():
            p = [preds[i] for i in idx] if preds is not None else None
            for var, vals in infos.items():
                sample = [vals[i] for i in idx]
                if not _is_numeric(sample[0]):
                    continue
                for name, v in prompt_metrics([float(s) for s in sample], p, n_bootstrap=n_bootstrap, seed=seed).items():
                    per_var[var][name].append(v)
        out[ds] = {var: {name: float(np.mean(vs)) for name, vs in m.items()} for var, m in per_var.items()}
    return out


def _n_of(name: str) -> int:
    """``best@4/mean`` -> 4, ``mean@8`` -> 8."""
    return int(name.split("@")[-1].split("/")[0])


def validation_metric_dict(nested: Mapping[str, Mapping[str, Mapping[str, float]]]) -> dict[str, float]:
    """Flatten ``process_validation_metrics`` to verl's keys ``val-core|val-aux/<source>/<var>/<name>``."""
    out: dict[str, float] = {}
    for ds, var2m in nested.items():
        core_var = "acc" if "acc" in var2m else "reward"
        for var, m in var2m.items():
            n_max = max(_n_of(name) for name in m)
            for name, v in m.items():
                core = var == core_var and name.startswith(CORE_PREFIXES) and _n_of(name) == n_max
                out[f"{'val-core' if core else 'val-aux'}/{ds}/{var}/{name}"] = v
    return out
