"""Plan-time rules of ``reward.judge`` across sections (docs/judge.md), the judge engines' ports and ``mrl plan``'s
lines for the judge: everything about the judge that reads more than its own section (the section itself, its
placeholders and defaults: mrl/config/judge.py)."""
from __future__ import annotations

import json
import re
from pathlib import Path

from mrl.config.judge import PLACEHOLDERS, JudgeParseConfig, template_fields
from mrl.config.root import MRLConfig

_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def check_judge(cfg: MRLConfig, errors: list[str], notes: list[str]) -> None:
    """Plan-time checks of ``reward.judge`` (no Ray, reads config.json only)."""
    j = cfg.reward.judge
    if not j.enable:
        return
    if (j.model is None) == (j.url is None):
        errors.append("reward.judge.enable=true needs exactly one of reward.judge.model (a causal-LM checkpoint served "
                      "by judge engines) and reward.judge.url (an external OpenAI-compatible server); fix: set one")
    if j.model is not None:
        _check_model(cfg, errors, notes)
    if j.url is not None:
        _check_url(cfg, errors, notes)
    _check_template(j.prompt_template, errors)
    _check_parse(j.parse, errors)
    if j.api == "chat" and j.batch_size != 1:
        notes.append("reward.judge.api=chat: one conversation per request (reward.judge.batch_size applies to "
                     "completions only)")
    if cfg.reward_model.enable:
        errors.append("reward.judge.enable=true with reward_model.enable=true: one model-based reward at a time; "
                      "fix: reward_model.enable=false, or reward.judge.enable=false")
    if cfg.algorithm.adv_estimator == "remax":
        errors.append("reward.judge.enable=true with algorithm.adv_estimator=remax: the greedy baseline is scored by "
                      "reward.function only; fix: another estimator, or reward.judge.enable=false")
    if j.combine == "function" and ":" not in cfg.reward.function:
        errors.append(f"reward.judge.combine=function but reward.function={cfg.reward.function!r} is a built-in scorer, "
                      "which ignores extra_info['judge_score']; fix: reward.function=path/to/file.py:fn reading "
                      "extra_info['judge_score'], or reward.judge.combine=judge")
    if j.combine == "judge":
        notes.append("reward.judge.combine=judge: the judge's verdict is the reward, in training and validation; "
                     + (f"reward.function={cfg.reward.function!r} is only reported (rule_score, acc)" if j.report_rule
                        else "reward.function is not called"))


def _check_model(cfg: MRLConfig, errors: list[str], notes: list[str]) -> None:
    j = cfg.reward.judge
    conf = Path(str(j.model)) / "config.json"
    if not conf.is_file():
        notes.append(f"reward.judge.model={j.model!r} has no config.json here (yet); the run needs it")
    else:
        try:
            archs = json.loads(conf.read_text()).get("architectures") or []
        except (OSError, ValueError) as e:
            errors.append(f"reward.judge.model: {conf} is unreadable ({e}); fix: point it at a HF causal-LM checkpoint")
            archs = None
        if archs is not None and (len(archs) != 1 or not archs[0].endswith("ForCausalLM")):
            errors.append(f"reward.judge.model={j.model!r} has architectures {archs}, not a *ForCausalLM model that "
                          "writes verdicts; fix: a causal-LM checkpoint (a *ForSequenceClassification scorer is "
                          "reward_model's)")
    if j.token_env is not None:
        errors.append("reward.judge.token_env is set with reward.judge.model: judge engines use the run's own control "
                      "token; fix: remove reward.judge.token_env (it is for reward.judge.url)")
    if cfg.cluster.device != "cpu" and cfg.rollout.engine == "torch" and j.engines > 1:
        notes.append("reward.judge: embedded judge engines on GPU share the rollout engines' devices")
    base = j.port_base if j.port_base is not None else cfg.rollout.port_base + 100
    ours = range(cfg.rollout.port_base, cfg.rollout.port_base + max(cfg.rollout.num_engines or 0, cfg.cluster.world_size))
    clash = [p for p in range(base, base + j.engines) if p in ours]
    if clash:
        errors.append(f"reward.judge.port_base={base}: judge engine ports {clash} are the rollout engines' "
                      f"(rollout.port_base={cfg.rollout.port_base}); fix: reward.judge.port_base={ours.stop + 100}")


def _check_url(cfg: MRLConfig, errors: list[str], notes: list[str]) -> None:
    from urllib.parse import urlparse

    j = cfg.reward.judge
    u = urlparse(str(j.url))
    if u.scheme not in ("http", "https") or not u.netloc:
        errors.append(f"reward.judge.url={j.url!r} is not an http(s) URL; fix: e.g. reward.judge.url=http://host:8000 "
                      "(requests go to {url}/v1/completions or /v1/chat/completions)")
    if u.path.rstrip("/").endswith("/v1"):
        errors.append(f"reward.judge.url={j.url!r} ends with /v1, which mrl adds itself; fix: "
                      f"reward.judge.url={j.url.rstrip('/')[:-3]}")
    if j.token_env is not None and not _ENV_RE.match(j.token_env):
        errors.append(f"reward.judge.token_env={j.token_env!r} is not an environment variable name (a token in the YAML "
                      "would leak into logs and checkpoints); fix: export JUDGE_TOKEN=<token> and "
                      "reward.judge.token_env=JUDGE_TOKEN")
    if j.engines != 1:
        errors.append(f"reward.judge.engines={j.engines} with reward.judge.url: mrl starts no engines for an external "
                      "server; fix: remove reward.judge.engines, or use reward.judge.model")
    if j.token_env is None:
        notes.append(f"reward.judge.url={j.url}: no reward.judge.token_env, requests carry no bearer token")
    if u.scheme == "http" and u.hostname not in ("127.0.0.1", "localhost", "::1") and j.token_env is not None:
        notes.append(f"reward.judge.url={j.url} is plain http: the bearer token crosses the network unencrypted")


def _check_template(template: str, errors: list[str]) -> None:
    try:
        fields = template_fields(template)
    except ValueError as e:
        errors.append(f"reward.judge.prompt_template is malformed ({e}); fix: placeholders are {{prompt}}, {{response}}, "
                      "{{ground_truth}}; write {{{{ and }}}} for literal braces")
        return
    bad = [f for f in fields if f not in PLACEHOLDERS]
    if bad:
        errors.append(f"reward.judge.prompt_template has unknown placeholder(s) {', '.join('{' + f + '}' for f in bad)}; "
                      f"fix: use only {{prompt}}, {{response}}, {{ground_truth}} (write {{{{ and }}}} for literal braces)")
    if "response" not in fields:
        errors.append("reward.judge.prompt_template has no {response}: the judge would never see the answer it "
                      "judges; fix: add {response}")


def _check_parse(p: JudgeParseConfig, errors: list[str]) -> None:
    if p.type == "regex":
        try:
            rx = re.compile(p.pattern)
        except re.error as e:
            errors.append(f"reward.judge.parse.pattern={p.pattern!r} is not a valid regex ({e}); fix: e.g. "
                          r"'(?i)\b(yes|no)\b'")
            return
        if rx.groups < 1:
            errors.append(f"reward.judge.parse.pattern={p.pattern!r} has no group: the verdict is its first group (or "
                          r"the group named 'verdict'); fix: e.g. '(?i)\b(yes|no)\b'")
    elif not p.key or any(not part for part in p.key.split(".")):
        errors.append(f"reward.judge.parse.key={p.key!r} is not a dotted key path; fix: e.g. reward.judge.parse.key=score")
    if p.scores is not None:
        if not p.scores:
            errors.append("reward.judge.parse.scores is empty; fix: e.g. {yes: 1.0, no: 0.0}, or null when the "
                          "verdict is a number")
        lowered = [k.strip().lower() for k in p.scores]
        if len(set(lowered)) != len(lowered):
            errors.append(f"reward.judge.parse.scores has keys equal after strip()/lower() ({list(p.scores)}); "
                          "fix: one key per verdict")


def judge_port_base(cfg: MRLConfig) -> int:
    j = cfg.reward.judge
    return j.port_base if j.port_base is not None else cfg.rollout.port_base + 100


def judge_plan_lines(cfg: MRLConfig, dtype: str) -> list[str]:
    """``mrl plan``'s lines for the judge: where it runs and its engines' weights in ``dtype`` (the plan's)."""
    j = cfg.reward.judge
    if not j.enable:
        return []
    if j.url is not None:
        return [(f"    {'judge':12s} external OpenAI-compatible server {j.url} (api={j.api}, "
                 f"{j.max_concurrency} request(s) in flight); no local memory")]
    engine = "torch" if cfg.cluster.device == "cpu" else cfg.rollout.engine
    lines = [(f"    {'judge':12s} {j.engines:4d} x {engine} judge engine(s) of {j.model} next to the rollout engines "
              f"(ports {judge_port_base(cfg)}..{judge_port_base(cfg) + j.engines - 1}, {j.max_concurrency} request(s) "
              "in flight)")]
    try:
        from mrl.config.hf import read_model_shape
        from mrl.dtypes import itemsize

        shape = read_model_shape(str(j.model))
    except (ValueError, OSError):
        shape = None
    if shape is None:  # no config.json here (yet): check_judge noted it
        return lines
    b = shape.param_count() * itemsize(dtype)
    size = f"{b / 1024**2:.1f} MiB" if b < 1024**3 else f"{b / 1024**3:.2f} GiB"
    lines.append(f"    {'':12s} judge weights {size} per engine ({shape.param_count() / 1e6:.2f}M params, {dtype}; "
                 "KV cache not included)" + ("" if cfg.cluster.device == "cpu" else
                                            f", SGLang mem_fraction_static={j.mem_fraction_static}"))
    return lines
