"""Rules of on-policy distillation across sections: ``algorithm.distill`` needs ``teacher``, the teacher's
placement and layout against its own config.json, and its vocabulary against the student's.

The vocabulary rule is the one distillation cannot do without: the loss and the reward compare
``log π_teacher(a_t|s_t)`` with ``log π_student(a_t|s_t)`` for the *same token id* ``a_t``, so a teacher
that spells text with other ids (another tokenizer) would be scored on tokens it never meant.
"""
from __future__ import annotations

import json
from pathlib import Path

from mrl.config.hf import ModelShape, read_model_shape
from mrl.config.layout import RoleLayout
from mrl.config.parallel import ParallelConfig
from mrl.config.root import MRLConfig
from mrl.config.validate_parallel import (
    GROUP_KEYS,
    check_model_fits,
    check_separate_layout,
)


def check_teacher(cfg: MRLConfig, roles: dict[str, RoleLayout], actor_shape: ModelShape | None,
                  errors: list[str], notes: list[str]) -> None:
    t, dist = cfg.teacher, cfg.algorithm.distill
    if dist.mode != "none" and not t.enable:
        errors.append(f"algorithm.distill.mode={dist.mode} needs a teacher; fix: teacher.enable=true with "
                      "teacher.path=<HF checkpoint with the student's tokenizer>, or algorithm.distill.mode=none")
        return
    if not t.enable:
        for key in ("path", "num_devices", "megatron"):
            if getattr(t, key) is not None:
                errors.append(f"teacher.{key} is set but teacher.enable=false (nothing would read it); fix: "
                              "teacher.enable=true with algorithm.distill.mode, or remove teacher.*")
                return
        return
    if dist.mode == "none":
        errors.append("teacher.enable=true but algorithm.distill.mode=none: the teacher's log-probs would feed nothing; "
                      "fix: algorithm.distill.mode=reverse_kl_reward | kl_loss, or teacher.enable=false")
    if not t.path:
        errors.append("teacher.enable=true but teacher.path is not set; fix: teacher.path=<HF causal-LM checkpoint "
                      "directory whose tokenizer is the student's>")
        return
    _check_placement(cfg, roles, errors)
    lay = roles.get("teacher")
    try:
        shape = read_model_shape(t.path)
    except ValueError as e:
        errors.append(f"teacher.path: {e}")
        return
    if shape is not None and lay is not None:
        key = "teacher.megatron" if t.placement == "separate" else "actor.megatron"
        check_model_fits(key, lay.parallel, shape, f"the teacher's {t.path}/config.json", errors)
        if actor_shape is not None and shape.vocab_size != actor_shape.vocab_size:
            notes.append(f"teacher vocab_size {shape.vocab_size} != the student's {actor_shape.vocab_size} (config.json): "
                         "fine when both tokenizers are the same and only the embedding padding differs; the tokenizers "
                         "are compared id for id")
    err = vocabulary_mismatch(cfg.model.path, t.path)
    if err:
        errors.append(err)


def _check_placement(cfg: MRLConfig, roles: dict[str, RoleLayout], errors: list[str]) -> None:
    t = cfg.teacher
    lay = roles.get("teacher")
    if t.placement == "separate":
        if not t.num_devices:
            errors.append("teacher.placement=separate needs teacher.num_devices; fix: set teacher.num_devices=<devices "
                          "for the teacher>, or teacher.placement=colocated")
            return
        if t.offload:
            errors.append("teacher.offload=true is for a colocated teacher (it shares the actor's devices); a separate "
                          "one keeps its own devices; fix: teacher.offload=false or teacher.placement=colocated")
        if lay is not None:
            check_separate_layout("teacher", "teacher", t.megatron, lay, cfg, errors)
        return
    if t.num_devices is not None:
        errors.append("teacher.num_devices is only used with teacher.placement=separate; fix: remove it or set "
                      "teacher.placement=separate")
    if t.megatron is not None:
        differ = [k for k in GROUP_KEYS if getattr(t.megatron, k) not in (getattr(ParallelConfig(), k),
                                                                          getattr(cfg.actor.megatron, k))]
        if differ:
            k = differ[0]
            errors.append(f"teacher.megatron.{k}={getattr(t.megatron, k)} differs from actor.megatron.{k}="
                          f"{getattr(cfg.actor.megatron, k)}, but a colocated teacher runs in the actor's Megatron "
                          "groups; fix: remove teacher.megatron, or teacher.placement=separate with teacher.num_devices")


def _vocab_of(path: str) -> dict[str, int] | None:
    """token -> id of ``path``'s tokenizer.json (model vocab + added tokens), None when it has none."""
    f = Path(path) / "tokenizer.json"
    if not f.is_file():
        return None
    try:
        tj = json.loads(f.read_text())
    except (OSError, ValueError):
        return None  # preflight names an unreadable tokenizer of either model
    vocab = dict((tj.get("model") or {}).get("vocab") or {})
    if isinstance(vocab, list):  # unigram models: [[piece, score], ...]
        vocab = {piece: i for i, (piece, _) in enumerate(vocab)}
    for tok in tj.get("added_tokens") or []:
        vocab[tok["content"]] = tok["id"]
    return vocab


def vocabulary_mismatch(student: str | None, teacher: str) -> str | None:
    """Why the two tokenizers do not share one vocabulary (token -> id), or None when they do or cannot be
    read yet (``mrl train`` reads them for real: :func:`tokenizer_mismatch`)."""
    if not student:
        return None
    a, b = _vocab_of(student), _vocab_of(teacher)
    if a is None or b is None:
        return None
    return _describe(a, b, student, teacher)


def _describe(a: dict[str, int], b: dict[str, int], student: str, teacher: str) -> str | None:
    if a == b:
        return None
    only_s = sorted(set(a) - set(b))[:3]
    only_t = sorted(set(b) - set(a))[:3]
    moved = sorted((k for k in set(a) & set(b) if a[k] != b[k]), key=lambda k: a[k])[:3]
    what = []
    if only_s:
        what.append(f"tokens only the student has, e.g. {only_s}")
    if only_t:
        what.append(f"tokens only the teacher has, e.g. {only_t}")
    if moved:
        what.append("tokens with other ids, e.g. " + ", ".join(f"{k!r}: {a[k]} vs {b[k]}" for k in moved))
    return (f"teacher.path={teacher!r}: its tokenizer's vocabulary ({len(b)} entries) is not the student's "
            f"(model.path={student!r}, {len(a)} entries): " + "; ".join(what) + ". Token-level distillation compares "
            "the two models' log-probs of the same token ids; fix: a teacher with the student's tokenizer (same "
            "family), or copy the student's tokenizer files into the teacher's directory if it was trained on them")


def tokenizer_mismatch(student: str, teacher: str, trust_remote_code: bool) -> str | None:
    """``mrl train``'s check before Ray: both tokenizers loaded as the run loads them, ``get_vocab()`` compared."""
    from transformers import AutoTokenizer

    try:
        a = AutoTokenizer.from_pretrained(student, local_files_only=True, trust_remote_code=trust_remote_code).get_vocab()
        b = AutoTokenizer.from_pretrained(teacher, local_files_only=True, trust_remote_code=trust_remote_code).get_vocab()
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a bad tokenizer
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        return (f"teacher.path={teacher!r}: its tokenizer does not load ({type(e).__name__}: {first}); fix: copy the "
                "checkpoint's tokenizer files (tokenizer.json / tokenizer_config.json) into it")
    return _describe(a, b, student, teacher)
