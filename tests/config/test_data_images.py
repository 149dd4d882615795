"""`mrl plan` / `mrl train` with vision-language prompt files (docs/vision.md): the pictures are counted and
checked before anything starts (bad ones named by file:row, or counted with data.filter_bad_images), the
largest picture's image tokens are reported (reference: transformers' image processor); a Qwen2.5-VL checkpoint is
accepted (its Megatron actor exists) and a vision-language architecture mrl does not build is refused in one line after
the plan."""
from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest

from mrl.cli import EXIT_CONFIG, EXIT_UNSUPPORTED, main
from tests.helpers.tiny_vlm import png, save_vlm_files

REPO = Path(__file__).resolve().parents[2]
QUICK = str(REPO / "mrl_configs" / "quickstart.yaml")
SMALL = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=4",
         "trainer.test_freq=-1", "trainer.val_before_train=false", "data.val_files=[]"]
SIZES = [(40, 60), (30, 30), (400, 300), (50, 50)]  # (width, height); row 3 holds the last two


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    d = tmp_path_factory.mktemp("vlm")
    save_vlm_files(d, "qwen2_5_vl")
    return d


def _row(text: str, images: list) -> str:
    return json.dumps({"prompt": [{"role": "user", "content": text}], "images": images,
                       "reward_model": {"ground_truth": "1"}}) + "\n"


def _b64(w: int, h: int, seed: int = 0) -> dict:
    return {"bytes": base64.b64encode(png(w, h, seed)).decode()}


def _files(tmp_path: Path, extra: str = "") -> Path:
    (tmp_path / "p.png").write_bytes(png(*SIZES[3]))
    f = tmp_path / "train.jsonl"
    f.write_text(_row("<image> a", [_b64(*SIZES[0])]) + _row("<image> b", [_b64(*SIZES[1])])
                 + _row("<image> and <image>", [_b64(*SIZES[2]), str(tmp_path / "p.png")]) + _row("no picture", [])
                 + extra)
    return f


def _run(capsys, *args: str, cmd: str = "plan") -> tuple[int, str, str]:
    rc = main([cmd, QUICK, *SMALL, *args, *(["--dry-run"] if cmd == "train" else [])])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _hf_largest(vlm: Path) -> int:
    from PIL import Image
    from transformers import AutoImageProcessor

    proc = AutoImageProcessor.from_pretrained(vlm, backend="pil")
    imgs = [Image.open(io.BytesIO(png(w, h))).convert("RGB") for w, h in SIZES]
    return max(int(g.prod()) // proc.merge_size ** 2 for g in proc(images=imgs, return_tensors="pt")["image_grid_thw"])


@pytest.mark.parametrize("cmd", ["plan", "train"])
def test_plan_reports_pictures_and_accepts_a_qwen2_5_vl_checkpoint(capsys, vlm, tmp_path, cmd):
    f = _files(tmp_path)
    rc, out, err = _run(capsys, f"model.path={vlm}", f"data.train_files={f}", cmd=cmd)
    assert rc == 0, err
    assert ("model (qwen2_5_vl): vision tower (2 blocks, transformers' own module) on the first pipeline stage, "
            "replicated over TP") in out, out[-3000:]
    line = [ln for ln in out.splitlines() if "pictures:" in ln]
    want = (f"  pictures: data.train_files: 4 pictures in 3 rows (at most 2 per row); largest picture 400x300 "
            f"= {_hf_largest(vlm)} image tokens ({f}:3) of data.max_prompt_length=64")
    assert line == [want]


@pytest.mark.parametrize("cmd", ["plan", "train"])
def test_an_unbuilt_vision_language_architecture_is_refused_in_one_line(capsys, vlm, tmp_path, cmd):
    import shutil

    other = tmp_path / "glm4v"
    shutil.copytree(vlm, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["architectures"] = ["Glm4vForConditionalGeneration"]
    (other / "config.json").write_text(json.dumps(cfg))
    f = _files(tmp_path)
    rc, _, err = _run(capsys, f"model.path={other}", f"data.train_files={f}", cmd=cmd)
    assert rc == EXIT_UNSUPPORTED, err
    want = (f"mrl {cmd}: model.path={str(other)!r} (Glm4vForConditionalGeneration) is a vision-language "
            "model whose architecture the Megatron actor does not build (it builds Qwen2_5_VLForConditionalGeneration, "
            "Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration, Qwen3_5ForConditionalGeneration: "
            "docs/vision.md); fix: one of those, or a text-only checkpoint")
    assert err.strip().splitlines() == [want]


def test_bad_pictures_refused_before_start_or_counted(capsys, vlm, tmp_path):
    f = _files(tmp_path, _row("<image> x", [str(tmp_path / "gone.png")]) + _row("<image>", [_b64(1200, 1000)]))
    rc, _, err = _run(capsys, f"model.path={vlm}", f"data.train_files={f}")
    assert rc == EXIT_CONFIG
    assert f"{f}:5: column 'images' (data.image_key): image 1 of 1: image file {str(tmp_path / 'gone.png')!r} does not exist" in err
    assert f"{f}:6: column 'images' (data.image_key): image 1 of 1: the image is 1200x1000 = 1200000 pixels" in err
    rc, out, _ = _run(capsys, f"model.path={vlm}", f"data.train_files={f}", "data.filter_bad_images=true")
    assert rc == 0
    assert "pictures: data.train_files: 2 row(s) with unusable pictures will be dropped (data.filter_bad_images=true)" in out


def test_pictures_for_a_text_model_are_refused(capsys, tiny_model, tmp_path):
    f = _files(tmp_path)
    rc, _, err = _run(capsys, f"model.path={tiny_model}", f"data.train_files={f}")
    assert rc == EXIT_CONFIG
    assert f"{f}:1: column 'images' (data.image_key) holds 1 image(s), but model.path={str(tiny_model)!r} is not a " \
           "vision-language checkpoint" in err


def test_pictures_not_checked_without_the_model_here(capsys, tmp_path):
    f = _files(tmp_path)
    rc, out, _ = _run(capsys, "model.path=Qwen/Qwen2.5-VL-7B-Instruct", f"data.train_files={f}")
    assert rc == 0  # a plan made before the download
    assert "pictures: not checked: model.path='Qwen/Qwen2.5-VL-7B-Instruct' has no config.json here" in out, out[-2000:]


def test_from_verl_carries_data_image_key(tmp_path, capsys):
    script = tmp_path / "run.sh"
    script.write_text("python3 -m verl.trainer.main_ppo data.train_files=t.parquet data.image_key=pics "
                      "actor_rollout_ref.model.path=m\n")
    assert main(["from-verl", str(script), "-o", str(tmp_path / "out.yaml")]) == 0
    import yaml

    assert yaml.safe_load((tmp_path / "out.yaml").read_text())["data"]["image_key"] == "pics"
    assert "image_key" not in capsys.readouterr().err  # mapped, not listed among the keys mrl cannot carry


def test_pictures_for_a_release_whose_tower_is_carried_are_refused(capsys, tmp_path):
    """Qwen3.5-MoE's tower travels through checkpoints but is not run (dense Qwen3.5 runs its own), so prompt
    files with pictures are refused in one line naming data.image_key (not silently trained without them)."""
    from tests.helpers.tiny_hybrid import make_tiny_hybrid_hf
    from tests.helpers.tiny_vlm import save_tokenizer

    ckpt = make_tiny_hybrid_hf(tmp_path / "q35", "qwen3_5_moe")
    save_tokenizer(ckpt)
    rc, _, err = _run(capsys, f"model.path={ckpt}", f"data.train_files={_files(tmp_path)}")
    assert rc == EXIT_CONFIG, err
    assert ("data.image_key='images': the prompt files hold pictures, but mrl trains model.path=" in err
            and "(Qwen3_5MoeForConditionalGeneration) on text only" in err), err


@pytest.fixture(scope="module")
def vlm3(tmp_path_factory):
    d = tmp_path_factory.mktemp("vlm3")
    save_vlm_files(d, "qwen3_vl")
    cfg = json.loads((d / "config.json").read_text())
    cfg["vision_config"]["deepstack_visual_indexes"] = [0, 1]  # deepstack into decoder layers 0 and 1 (of 2)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("override,want", [
    ("actor.shared_prefix=true", ("actor.shared_prefix=true with the vision-language model.path "
     "(Qwen3VLForConditionalGeneration): its 3-D positions are computed per whole sequence; fix: "
     "actor.shared_prefix=false (or auto)")),
    ("actor.megatron.pipeline_model_parallel_size=2", ("actor.megatron.pipeline_model_parallel_size=2: "
     "Qwen3VLForConditionalGeneration adds deepstack image features after decoder layers 0..1, which must all be on "
     "the first pipeline stage (it holds 1); fix: actor.megatron.num_layers_in_first_pipeline_stage>=2 or a smaller "
     "pipeline_model_parallel_size")),
    ("actor.megatron.context_parallel_size=2", ("actor.megatron.context_parallel_size=2 with the vision-language "
     "model.path (Qwen3VLForConditionalGeneration) is not supported; fix: actor.megatron.context_parallel_size=1")),
    ("actor.megatron.tensor_model_parallel_size=2 actor.megatron.sequence_parallel=true",
     ("actor.megatron.sequence_parallel=true with the vision-language model.path (Qwen3VLForConditionalGeneration) is "
     "not supported yet (the image features join the whole embedding); fix: actor.megatron.sequence_parallel=false")),
])
def test_vision_language_layouts_mrl_cannot_run_are_refused_before_start(capsys, vlm3, override, want):
    rc, _, err = _run(capsys, f"model.path={vlm3}", *override.split(), "cluster.n_gpus_per_node=2")
    assert rc == EXIT_CONFIG
    assert want in err, err
