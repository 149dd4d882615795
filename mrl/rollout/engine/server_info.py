"""``/model_info`` and ``/server_info`` of the embedded engine, in SGLang 0.5.23's shape.

SGLang's ``/model_info`` keys are all present (values this engine does not have — parsers,
disaggregation, audio — are their "off" values; ``has_image_understanding`` is true for a vision-language model). Its ``/server_info`` is the server's
resolved launch arguments plus scheduler state; here: the arguments this engine has (model,
dtype, device, ``max_running_requests``, parallel sizes 1, ``context_length``), the
scheduler limits (``max_total_num_tokens``, ``max_req_input_len``), ``internal_states`` (one
entry, as for one DP rank), ``version`` (the SGLang protocol release this engine speaks, so a
client negotiating on it picks that protocol), plus mrl's own ``engine``, ``stats``, ``paused``,
``released`` and ``decode_path``.
"""
from __future__ import annotations

from typing import Any

from mrl.rollout.sglang_launcher import SGLANG_VERSION

SGLANG_PROTOCOL_VERSION = SGLANG_VERSION  # the SGLang release whose HTTP protocol the engine implements


def model_info(engine) -> dict[str, Any]:
    runner, sched = engine.runner, engine.scheduler
    cfg = runner.config
    return {
        "model_path": runner.model_path, "served_model_name": runner.model_path,
        "tokenizer_path": runner.model_path if runner.tokenizer else None,
        "is_generation": True, "preferred_sampling_params": None, "weight_version": sched.weight_version,
        "load_format": "safetensors", "reasoning_parser": None, "tool_call_parser": None,
        "disaggregation_mode": "null", "has_image_understanding": runner.vision is not None, "has_audio_understanding": False,
        "model_type": getattr(cfg, "model_type", None), "architectures": getattr(cfg, "architectures", None),
        "engine": "mrl-torch",
    }


def context_length(engine) -> int:
    cfg = engine.runner.config
    return int(getattr(cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg, "max_position_embeddings", 0) or 0)


def server_info(engine, startup_time: float) -> dict[str, Any]:
    runner, sched = engine.runner, engine.scheduler
    ctx = context_length(engine)
    state = {"num_running": sched.num_running, "num_waiting": sched.num_waiting, "paused": sched.paused,
             "released": runner.released, "stats": dict(sched.stats)}
    return {
        "model_path": runner.model_path, "tokenizer_path": runner.model_path if runner.tokenizer else None,
        "served_model_name": runner.model_path, "skip_tokenizer_init": False, "load_format": "safetensors",
        "dtype": str(runner.dtype).removeprefix("torch."), "device": str(runner.device),
        "context_length": ctx,
        "max_running_requests": sched.max_running, "tp_size": 1, "dp_size": 1, "pp_size": 1, "ep_size": 1,
        "max_total_num_tokens": ctx * sched.max_running, "max_req_input_len": max(ctx - 1, 0),
        "enable_return_routed_experts": bool(getattr(engine, "enable_return_routed_experts", False)),
        "weight_version": sched.weight_version, "internal_states": [state], "version": SGLANG_PROTOCOL_VERSION,
        "frontend": "python", "startup_time": startup_time, "engine": "mrl-torch", "decode_path": runner.decode_path, **state,
    }
