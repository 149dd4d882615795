"""Every checkpoint path of a run, checked before anything starts: ``mrl plan`` (cheap file checks,
:mod:`mrl.config.checkpoint_files`) and ``mrl train`` before Ray (strict: absent paths are errors, and
the tokenizers are loaded for real). Errors name the key, the path and the fix; `mrl` exits 2."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from mrl.config.checkpoint_files import model_dir_problems

if TYPE_CHECKING:
    from mrl.config.root import MRLConfig


def _same_dir(a: str, b: str) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return a == b


def check_checkpoints(cfg: MRLConfig, errors: list[str], notes: list[str], *, strict: bool = False) -> None:
    """The model, critic and reward-model directories (see checkpoint_files.model_dir_problems)."""
    m = cfg.model
    if m.path:
        e, n = model_dir_problems("model.path", m.path, strict=strict)
        errors += e
        notes += n
    if m.tokenizer_path and not (m.path and _same_dir(m.tokenizer_path, m.path)):
        # The trainer, the engines and the reward-model retokeniser all read model.path's tokenizer; a
        # second tokenizer would make the prompt ids and the engines' ids disagree without a word.
        errors.append(f"model.tokenizer_path={m.tokenizer_path!r} differs from model.path={m.path!r}, but every part "
                      "of a run (trainer, engines, reward model) reads the tokenizer from model.path; fix: copy the "
                      "tokenizer files into model.path and remove model.tokenizer_path")
    if cfg.critic_enabled and cfg.critic.model_path and not (m.path and _same_dir(cfg.critic.model_path, m.path)):
        e, n = model_dir_problems("critic.model_path", cfg.critic.model_path, strict=strict, architectures="any",
                                  need_tokenizer=False)
        errors += e
        notes += n
    rm = cfg.reward_model
    if rm.enable and rm.model.path:
        # the class (*ForSequenceClassification) is reward_model.check_reward_model's rule; its tokenizer is
        # read only when it retokenises (input_tokenizer set)
        e, n = model_dir_problems("reward_model.model.path", rm.model.path, strict=strict, architectures="seq_cls",
                                  need_tokenizer=rm.model.input_tokenizer is not None)
        errors += e
        notes += n
    if cfg.teacher.enable and cfg.teacher.path:  # its vocabulary against the student's: validate_teacher.py
        e, n = model_dir_problems("teacher.path", cfg.teacher.path, strict=strict)
        errors += e
        notes += n


def _load_tokenizer(key: str, path: str, trust_remote_code: bool) -> str | None:
    """The error of loading ``path``'s tokenizer as the run will (local files only), or None."""
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - transformers raises ValueError/OSError/KeyError/... for a bad tokenizer
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        return (f"{key}={path!r}: its tokenizer does not load ({type(e).__name__}: {first}); fix: copy the "
                "checkpoint's tokenizer files (tokenizer.json / tokenizer_config.json) into it")
    return None


def train_preflight(cfg: MRLConfig) -> list[str]:
    """``mrl train``'s checks before Ray: every checkpoint present and readable, and its tokenizer loads."""
    errors: list[str] = []
    check_checkpoints(cfg, errors, [], strict=True)
    if errors:
        return errors
    if cfg.model.path:
        err = _load_tokenizer("model.path", cfg.model.path, cfg.model.trust_remote_code)
        if err:
            errors.append(err)
    rm = cfg.reward_model
    if rm.enable and rm.model.path and rm.model.input_tokenizer is not None:
        err = _load_tokenizer("reward_model.model.path", rm.model.path, cfg.model.trust_remote_code)
        if err:
            errors.append(err)
    if cfg.teacher.enable and cfg.teacher.path and cfg.model.path:
        from mrl.config.validate_teacher import tokenizer_mismatch

        err = tokenizer_mismatch(cfg.model.path, cfg.teacher.path, cfg.model.trust_remote_code)
        if err:
            errors.append(err)
    return errors
