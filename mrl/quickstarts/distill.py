"""The distillation demo's teacher, written locally with no download: ``python -m mrl.quickstarts distill``.

``<out>/tiny-qwen2-teacher/``: the quickstart's tiny Qwen2 (same tokenizer, same shape, another seed)
warm-started on the same task until it answers ``TEACHER_TARGET`` of the problems greedily, where the
student (``<out>/tiny-qwen2``, written too when missing) stops at 0.30. ``mrl_configs/quickstart_distill.yaml``
then trains the student with on-policy distillation from it (docs/distillation.md): the student samples,
the teacher scores the student's own tokens. The arithmetic rule is not the reward there; it is only
measured (val).
"""
from __future__ import annotations

from pathlib import Path

from mrl.quickstarts.base import WARM_START_CHECK, write_assets, write_model
from mrl.quickstarts.cli import Demo, UsageError

TEACHER_DIR = "tiny-qwen2-teacher"
TEACHER_TARGET = 0.95
TEACHER_MAX_STEPS = 2000
TEACHER_SEED_OFFSET = 100  # the teacher's weights are not the student's: another init and batch order


def write_teacher(out: str | Path, *, seed: int = 0, force: bool = False, max_steps: int = TEACHER_MAX_STEPS
                  ) -> dict[str, str]:
    """Write ``<out>/tiny-qwen2-teacher`` (and the quickstart's student and data when missing)."""
    out = Path(out)
    status = write_assets(out, seed=seed)
    path = out / TEACHER_DIR
    if not force and (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        status[str(path)] = "kept"
        return status
    steps, acc = write_model(path, seed + TEACHER_SEED_OFFSET, max_steps, target=TEACHER_TARGET)
    status[str(path)] = f"written (warm start: {steps} steps, greedy accuracy {acc:.2f})"
    return status


def _add_arguments(p) -> None:
    p.add_argument("--max-steps", type=int, default=TEACHER_MAX_STEPS,
                   help=f"most supervised steps of the teacher; it stops at greedy accuracy {TEACHER_TARGET} "
                        f"(checked every {WARM_START_CHECK} steps, then every step)")


def _write(args) -> dict[str, str]:
    if args.max_steps < 1:
        raise UsageError("--max-steps must be >= 1")
    return write_teacher(args.out, seed=args.seed, force=args.force, max_steps=args.max_steps)


DEMO = Demo("distill", "the distillation demo's teacher: the quickstart's model trained to ~0.95", "outputs/quickstart",
            0, _add_arguments, _write)
