"""One SGLang version everywhere, and our launch command as SGLang's own argument parser reads it."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from mrl.rollout.sglang_launcher import (
    SGLANG_VERSION,
    EngineLaunchError,
    SGLangLaunchSpec,
    build_sglang_command,
    check_sglang_version,
)
from tests.helpers.sglang_real import require

REPO = Path(__file__).resolve().parents[3]


def test_one_sglang_version_pinned_everywhere():
    pins = {
        "setup.py": re.findall(r'"sglang==([^"]+)"', (REPO / "setup.py").read_text()),
        "docker/Dockerfile": re.findall(r"ARG SGLANG_VERSION=(\S+)", (REPO / "docker/Dockerfile").read_text()),
        "requirements-sglang-cpu.txt": re.findall(r"^sglang==(\S+)", (REPO / "requirements-sglang-cpu.txt").read_text(), re.MULTILINE),
        "README.md": re.findall(r"SGLang (\d+\.\d+\.\d+\S*) is the supported", (REPO / "README.md").read_text()),
    }
    for where, found in pins.items():
        assert found and set(found) == {SGLANG_VERSION}, f"{where} pins {found}, mrl speaks SGLang {SGLANG_VERSION}"
    assert require().__version__ == SGLANG_VERSION  # the code the conformance suite runs is that release


def test_other_sglang_versions_are_refused_with_the_fix():
    assert check_sglang_version(SGLANG_VERSION) == SGLANG_VERSION
    with pytest.raises(EngineLaunchError, match=rf"pip install sglang=={re.escape(SGLANG_VERSION)}"):
        check_sglang_version("0.5.1.post3")


def test_launch_command_parses_with_sglang_server_args():
    require()
    from sglang.srt.server_args import ServerArgs

    spec = SGLangLaunchSpec(model_path="/models/m", port=30001, host="127.0.0.1", tp_size=2, mem_fraction_static=0.6,
                            colocated=True, base_gpu_id=4, dtype="bfloat16", random_seed=7, admin_api_key="tok",
                            extra_args=["--max-running-requests", "256"])  # rollout.max_num_seqs
    cmd = build_sglang_command(spec, python="python")
    assert cmd[:3] == ["python", "-m", "sglang.launch_server"]
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(cmd[3:])  # exits (SystemExit) on a flag SGLang does not know
    assert (args.model_path, args.port, args.tp_size, args.base_gpu_id) == ("/models/m", 30001, 2, 4)
    assert args.mem_fraction_static == 0.6 and args.enable_memory_saver and args.random_seed == 7
    assert args.dtype == "bfloat16" and args.admin_api_key == "tok" and args.api_key is None and args.skip_server_warmup
    assert args.max_running_requests == 256
    assert not args.enable_return_routed_experts
    moe = build_sglang_command(SGLangLaunchSpec(model_path="/m", port=1, enable_return_routed_experts=True), "python")
    assert parser.parse_args(moe[3:]).enable_return_routed_experts  # routing replay (R3)


def test_the_run_token_guards_sglangs_control_routes_and_leaves_generate_open():
    """SGLang's own auth rule over its own routes' auth levels, with the key our launch sets: what
    the pool and the weight syncer send (Bearer token) opens the control routes; /generate needs none
    (so sglang_router can forward generations)."""
    require()
    from sglang.srt.entrypoints import http_server as hs
    from sglang.srt.utils.auth import decide_request_auth

    levels = {r.path: getattr(r.endpoint, "_auth_level", None) for r in hs.app.routes if hasattr(r, "endpoint")}

    def allowed(path, header):
        return decide_request_auth(method="POST", path=path, authorization_header=header, api_key=None,
                                   admin_api_key="tok", auth_level=levels[path]).allowed

    for path in ("/generate", "/v1/completions", "/health_generate"):
        assert allowed(path, None), path
    for path in ("/pause_generation", "/update_weights_from_distributed", "/begin_weight_update",
                 "/init_weights_update_group", "/release_memory_occupation", "/flush_cache"):
        assert not allowed(path, None) and not allowed(path, "Bearer nope") and allowed(path, "Bearer tok"), path


def test_engine_process_refuses_an_sglang_launch_without_the_supported_release(tmp_path, monkeypatch):
    """The check runs where SGLang would start (the engine's node), before any process is spawned."""
    import importlib.metadata as md

    from mrl.rollout.sglang_launcher import EngineProcess

    real = md.version
    monkeypatch.setattr(md, "version", lambda name: "0.5.1.post3" if name == "sglang" else real(name))
    proc = EngineProcess(build_sglang_command(SGLangLaunchSpec(model_path="/m", port=1)), "http://127.0.0.1:1",
                         log_path=tmp_path / "engine.log")
    with pytest.raises(EngineLaunchError, match="SGLang 0.5.1.post3 is installed"):
        proc.start(wait=False)
    assert not proc.alive() and not (tmp_path / "engine.log").exists()
