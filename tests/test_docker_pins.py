"""The GPU image's pins (docker/Dockerfile's ARGs: Transformer Engine, apex, the CUDA architectures) are the
ones setup.py's gpu extra and docs/gpus.md state, and the build uses them and checks them in its smoke step.

Docker cannot run on the CI machines; these read the Dockerfile as text.
"""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from mrl.config.auto import choose_attention_backend

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "Dockerfile"
CONSTRAINTS = "-c /opt/base-constraints.txt"
RECIPE = "mrl_configs/qwen2.5-0.5b_grpo_1x8.yaml"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of each Dockerfile instruction, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or (not pending and not line.strip()):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


def arg_values(text: str) -> dict[str, list[str]]:
    """Every value each ARG is given (an ARG re-declared without a value inherits the global one)."""
    values: dict[str, list[str]] = {}
    for word, rest in instructions(text):
        if word == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            values.setdefault(name.strip(), []).append(value.strip().strip('"'))
    return values


def pins() -> dict[str, str]:
    values = arg_values(DOCKERFILE.read_text())
    for name in ("TRANSFORMER_ENGINE_VERSION", "TRANSFORMER_ENGINE_COMMIT", "APEX_COMMIT", "CUDA_ARCHS",
                 "SGLANG_VERSION", "MEGATRON_CORE_VERSION"):
        assert len(values.get(name, [])) == 1, f"docker/Dockerfile gives ARG {name} {values.get(name)}: one value, once"
    return {name: vs[0] for name, vs in values.items()}


def run_steps() -> list[str]:
    return [rest for word, rest in instructions(DOCKERFILE.read_text()) if word == "RUN"]


def docs_table() -> dict[str, str]:
    """docs/gpus.md's "What the image holds" table: piece -> the backticked value of its "pinned" cell."""
    text = (REPO / "docs" / "gpus.md").read_text()
    section = text.split("## What the image holds", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and line.lstrip().startswith("|"):
            m = re.fullmatch(r"`([^`]+)`", cells[1])
            rows[cells[0]] = m.group(1) if m else cells[1]
    return rows


def test_the_pins_are_well_formed():
    p = pins()
    assert re.fullmatch(r"\d+\.\d+\.\d+", p["TRANSFORMER_ENGINE_VERSION"])
    assert re.fullmatch(r"[0-9a-f]{40}", p["TRANSFORMER_ENGINE_COMMIT"])
    assert re.fullmatch(r"[0-9a-f]{40}", p["APEX_COMMIT"])
    archs = p["CUDA_ARCHS"].split(";")
    assert all(re.fullmatch(r"\d{2,3}", a) for a in archs), archs
    assert {"90", "100", "120"} <= set(archs), f"the image must cover Hopper and Blackwell, CUDA_ARCHS={archs}"


def test_setup_gpu_extra_pins_the_image_transformer_engine():
    found = re.findall(r'"transformer-engine\[pytorch\]==([^"]+)"', (REPO / "setup.py").read_text())
    assert found == [pins()["TRANSFORMER_ENGINE_VERSION"]], (
        f"setup.py's gpu extra pins transformer-engine {found}, docker/Dockerfile builds "
        f"{pins()['TRANSFORMER_ENGINE_VERSION']}")


def test_docs_table_lists_the_dockerfile_pins():
    p, table = pins(), docs_table()
    expected = {
        "base image": f"lmsysorg/sglang:v{p['SGLANG_VERSION']}",
        "SGLang": p["SGLANG_VERSION"],
        "megatron-core": p["MEGATRON_CORE_VERSION"],
        "Transformer Engine": p["TRANSFORMER_ENGINE_VERSION"],
        "apex": p["APEX_COMMIT"],
        "GPU architectures": p["CUDA_ARCHS"],
    }
    for piece, value in expected.items():
        assert table.get(piece) == value, f"docs/gpus.md says {piece} is {table.get(piece)!r}, docker/Dockerfile {value!r}"
    assert p["BASE_IMAGE"] == "lmsysorg/sglang:v${SGLANG_VERSION}"
    section = (REPO / "docs" / "gpus.md").read_text().split("## What the image holds", 1)[1].split("\n## ", 1)[0]
    assert p["TRANSFORMER_ENGINE_COMMIT"] in section, "docs/gpus.md does not name the Transformer Engine commit"


def test_transformer_engine_and_apex_are_built_from_the_pins_against_the_image_torch():
    te = [s for s in run_steps() if "TransformerEngine.git" in s]
    apex = [s for s in run_steps() if "NVIDIA/apex.git" in s]
    assert len(te) == 1 and len(apex) == 1
    te, apex = te[0], apex[0]
    assert 'fetch -q --depth 1 origin "${TRANSFORMER_ENGINE_COMMIT}"' in te
    assert 'test "$(cat build_tools/VERSION.txt)" = "${TRANSFORMER_ENGINE_VERSION}"' in te
    for needed in ("NVTE_FRAMEWORK=pytorch", 'NVTE_CUDA_ARCHS="${CUDA_ARCHS}"', 'MAX_JOBS="${MAX_JOBS}"',
                   "--no-build-isolation", CONSTRAINTS):
        assert needed in te, f"the Transformer Engine build lacks {needed}"
    assert 'fetch -q --depth 1 origin "${APEX_COMMIT}"' in apex
    for needed in ("APEX_CPP_EXT=1", "APEX_CUDA_EXT=1", 'TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}"',
                   "--no-build-isolation", CONSTRAINTS):
        assert needed in apex, f"the apex build lacks {needed}"
    # apex's TORCH_CUDA_ARCH_LIST is derived from CUDA_ARCHS by a Python one-liner: run it on the pin
    archs = pins()["CUDA_ARCHS"]
    code = re.search(r'python -c "(print\(.+?\))"\)', apex).group(1).replace("${CUDA_ARCHS}", archs)
    derived = eval(code.replace("print(", "(", 1))  # the Dockerfile's own expression, on the pinned list
    assert derived == ";".join(f"{a[:-1]}.{a[-1]}" for a in archs.split(";")), derived  # 90;100 -> 9.0;10.0
    assert f"`TORCH_CUDA_ARCH_LIST={derived}`" in (REPO / "docs" / "gpus.md").read_text()


def test_every_pip_install_keeps_the_base_image_torch():
    for step in run_steps():
        for call in re.findall(r"pip install[^&;]*", step):
            assert CONSTRAINTS in call, f"a pip install without the base image's constraints: {call.strip()}"


def test_smoke_step_imports_te_and_apex_and_plans_a_gpu_recipe_on_te():
    smoke = run_steps()[-1]
    assert "import transformer_engine.pytorch, apex, amp_C, fused_layer_norm_cuda" in smoke
    assert "specs.HAVE_TE and specs.HAVE_APEX" in smoke
    assert "'${TRANSFORMER_ENGINE_VERSION}'" in smoke  # the installed TE is the pinned one
    assert f"mrl plan {RECIPE} actor.megatron.attention_backend=te" in smoke
    recipe = yaml.safe_load((REPO / RECIPE).read_text())
    assert recipe["cluster"]["device"] == "cuda", f"{RECIPE} must target CUDA for attention_backend=te to validate"
    assert not recipe.get("actor", {}).get("lora", {}).get("enabled"), f"{RECIPE}: LoRA would keep auto on sdpa"
    # `auto` picks TE in the image: the build greps the plan for the line mrl.config.auto writes for it
    auto_line = choose_attention_backend("auto", device="cuda", te_importable=True, lora=False).line()
    assert auto_line.startswith("actor.megatron.attention_backend=te: ")
    assert f'grep -F "{auto_line}"' in smoke, f"the smoke step does not grep the plan for {auto_line!r}"
