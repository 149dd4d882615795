"""mrl vs TRL's ``GRPOTrainer`` on one task, model and data set, one after the other (docs/vs_trl.md).

Task: single-digit addition, prompts ``"3+4="``, reward 1 when the first integer of the answer is the
sum (``mrl.rewards.scorers.arith``, used by both sides). Model: a random Llama (seeded per seed) with a
character tokenizer (digits, ``+=``, letters, 4 specials), written locally — nothing is downloaded.
Identical settings on both sides: 32 prompts × 8 samples per step, one optimizer step per step
(TRL: per-device batch 256, ``steps_per_generation=1``, ``num_iterations=1``), Adam lr 3e-4 constant,
no weight decay, grad-norm clip 1.0, no KL (TRL ``beta=0``; mrl: no reference), no entropy bonus,
token-mean loss (TRL ``loss_type=dapo``), group-std advantages, ε = 0.2, temperature 1, no top-k/p,
the same data order (no shuffling). mrl runs ``mrl train mrl_configs/quickstart.yaml`` with overrides
(2 CPU ranks, each hosting an embedded engine: ``rollout.weight_sync.transport=inprocess``); TRL runs in a subprocess on all cores (``torch`` threads = cores,
``--trl-threads``).

Sizes (``--sizes``): ``tiny`` = hidden 128 × 4 layers, 4 new tokens (overhead-bound);
``compute`` = hidden 512 × 8 layers, 64 new tokens (compute-bound). Per size and seed it reports
the median s/step over steps ≥ 3 (the first steps include warm-up), generated tokens/s
(Σ response tokens / step time), their ratio (TRL time / mrl time), the reward per step (the
learning curves, mean over seeds, printed every 10 steps and drawn into ``--out``/vs_trl.png) and
mrl's step time as a multiple of the FLOP floor (2·N·tokens generated + 6·N·tokens trained at the
host's measured matmul rate in the run's dtype).

TRL is not a dependency of mrl: ``pip install -e .[bench]`` (setup.py's ``bench`` extra), or
``make bench-deps`` (``--no-deps`` into ``.venv/bench-trl``, which this script puts on the path).
The script installs nothing.

    .venv/bin/python benchmarks/vs_trl.py --sizes tiny --seeds 0 1 2 --steps 100
    .venv/bin/python benchmarks/vs_trl.py --sizes compute --seeds 0 --steps 6
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sqlite3
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH_DEPS = Path(os.environ.get("MRL_TRL_PATH", REPO / ".venv" / "bench-trl"))  # `make bench-deps` (the tests use .venv/oracles)
SIZES = {  # name: (hidden, layers, new tokens)
    "tiny": (128, 4, 4),
    "compute": (512, 8, 64),
}
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = list("0123456789+=-*? abcdefghijklmnopqrstuvwxyz:")
PROMPTS, N = 32, 8  # prompts per step, samples per prompt
# mrl's micro-batch per rank: tiny = the rank's whole share (128 samples of 7-9 tokens: one GEMM-sized batch,
# measured no faster split); compute = 16 (length-sorted micro-batches padded to their own longest sample:
# the update's padding goes from ~26 % to a few %; interleaved A/B, bf16: 6.1 s per update at 16, 9.1 s at 128)
MICRO_BATCH = {"tiny": PROMPTS * N // 2, "compute": 16}
# actor.shared_prefix and rollout.weight_sync.transport: mrl's defaults (auto, mrl/config/auto.py) choose what this
# benchmark used to set by hand: tiny = shared prefix on (P 16 >= R 4) and compute = off (R 64 > P 16); inprocess
# engines in both (CPU, colocated, TP = PP = 1). `mrl plan` prints the choice; docs/vs_trl.md the measured effects.
LR = 3e-4
# Tasks (``--task``): the prompts, their answers (both sides score with ``mrl.rewards.scorers.arith``: the first
# integer of the answer equals the ground truth) and the Llama's key/value heads (4 query heads).
#   add:      "3+4=" -> "7", 100 prompts; multi-head attention (the benchmark's task since issue 15).
#   digitsum: "47=" -> "1" (the digit sum mod 10), 100 prompts; GQA (2 key/value heads) -- issue 30's setup
#             (random Llama with GQA and untied embeddings, character tokenizer, digit-sum task). With 3 digits
#             (1000 prompts) neither side gets off chance (0.1) in 400 steps: mrl 0.05 -> 0.10, seed 0.
TASKS = {"add": 4, "digitsum": 2}  # task: num_key_value_heads
DIGITS = 2  # digitsum: digits per prompt


# ---- assets ---------------------------------------------------------------------------------
def problems(seed: int, task: str = "add") -> list[tuple[str, str]]:
    """Every (prompt, answer) of ``task`` once, in the order ``seed`` shuffles them to."""
    import random

    if task == "add":
        rows = [(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10)]
    elif task == "digitsum":
        rows = [(f"{n:0{DIGITS}d}=", str(sum(map(int, f"{n:0{DIGITS}d}")) % 10)) for n in range(10 ** DIGITS)]
    else:
        raise ValueError(f"unknown task {task!r}; choose one of {sorted(TASKS)}")
    random.Random(seed).shuffle(rows)
    return rows


def write_assets(out: Path, size: str, seed: int, steps: int, task: str = "add") -> tuple[Path, Path, int]:
    """Char tokenizer + random Llama (``seed``; ``task``'s key/value heads, untied embeddings) in ``out/model``,
    ``steps`` × 32 prompts of ``task`` in ``out/train.jsonl`` and ``out/train_trl.jsonl`` (same rows, same order);
    returns (model dir, data dir, parameters)."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    hidden, layers, _ = SIZES[size]
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIALS + CHARS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.save_pretrained(str(model_dir))
    tc = json.loads((model_dir / "tokenizer_config.json").read_text())
    tc["tokenizer_class"] = "TokenizersBackend"  # load as saved, not as a Llama SentencePiece tokenizer
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tc))
    cfg = LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=TASKS[task], max_position_embeddings=128, rms_norm_eps=1e-6,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config.pad_token_id = 0
    model.save_pretrained(str(model_dir), safe_serialization=True)
    rows = problems(seed, task)
    rows = (rows * math.ceil(steps * PROMPTS / len(rows) + 1))[: steps * PROMPTS + PROMPTS]
    with (out / "train.jsonl").open("w") as f, (out / "train_trl.jsonl").open("w") as g:
        for p, a in rows:
            f.write(json.dumps({"data_source": "arith", "prompt": p, "reward_model": {"ground_truth": a}}) + "\n")
            g.write(json.dumps({"prompt": p, "ground_truth": a}) + "\n")
    n_params = sum(p.numel() for p in model.parameters())
    return model_dir, out, n_params


# ---- mrl -------------------------------------------------------------------------------------
def mrl_overrides(work: Path, model_dir: Path, size: str, seed: int, steps: int, port: int, extra: list[str],
                  dtype: str = "float32") -> list[str]:
    """The task's settings on top of mrl_configs/quickstart.yaml: the same values TRL gets in ``trl_worker``.
    ``lr_schedule=constant`` is mrl's default, restated because the quickstart file decays the lr (cosine to 0.1 x
    over the run), which TRL's side (``lr_scheduler_type="constant"``) does not (issue 30: the learning gap)."""
    new_tokens = SIZES[size][2]
    return [f"model.path={model_dir}", f"data.train_files=[{work}/train.jsonl]", "data.val_files=[]",
            "data.shuffle=false", "data.max_prompt_length=16", f"data.train_batch_size={PROMPTS}",
            f"actor.ppo_mini_batch_size={PROMPTS}", f"rollout.n={N}", f"rollout.max_response_length={new_tokens}",
            "actor.use_kl_loss=false", "actor.entropy_coeff=0", "actor.loss_agg_mode=token-mean",
            f"actor.optim.lr={LR}", "actor.optim.lr_schedule=constant", "actor.optim.weight_decay=0",
            "actor.optim.clip_grad=1.0",
            f"actor.ppo_micro_batch_size_per_gpu={MICRO_BATCH[size]}", "rollout.temperature=1.0",
            "algorithm.norm_adv_by_std_in_grpo=true", "trainer.val_before_train=false", "trainer.test_freq=-1",
            f"trainer.total_training_steps={steps}", "trainer.logger=[mlflow]",
            f"trainer.mlflow_tracking_uri=sqlite:///{work / 'mrl_mlflow.db'}", f"trainer.default_local_dir={work}/mrl_ckpt",
            f"trainer.seed={seed}", f"rollout.port_base={port}", f"model.dtype={dtype}",
            *extra]


def run_mrl(work: Path, model_dir: Path, size: str, seed: int, steps: int, port: int, extra: list[str],
            dtype: str = "float32") -> dict:
    db = work / "mrl_mlflow.db"
    args = mrl_overrides(work, model_dir, size, seed, steps, port, extra, dtype)
    env = {**os.environ, "PYTHONPATH": str(REPO), "MLFLOW_DISABLE_TELEMETRY": "true"}
    t0 = time.time()
    for attempt in range(3):  # Ray gives its node 30 s to register: on an overloaded host it may not start at all
        with (work / "mrl.log").open("w") as log:
            p = subprocess.run([sys.executable, "-m", "mrl", "train", "mrl_configs/quickstart.yaml", *args], cwd=REPO,
                               env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
        if not p.returncode or "timed out during startup" not in (work / "mrl.log").read_text() or attempt == 2:
            break
        print(f"mrl: Ray did not start (host overloaded), retrying ({attempt + 1}/2)", flush=True)
        db.unlink(missing_ok=True)  # nothing ran: no step was logged or checkpointed
        t0 = time.time()
    if p.returncode:
        raise RuntimeError(f"mrl train failed (rc {p.returncode}); see {work / 'mrl.log'}")
    with sqlite3.connect(db) as c:
        def series(key: str) -> dict[int, float]:
            return dict(c.execute("SELECT step, value FROM metrics WHERE key = ?", (key,)).fetchall())
        step_s, score, resp = series("timing_s/step"), series("critic/score/mean"), series("response_length/mean")
        phases = {k: series(k) for (k,) in c.execute("SELECT DISTINCT key FROM metrics WHERE key LIKE 'timing_s/%'")}
    steps_done = sorted(step_s)
    return {"step_s": [step_s[s] for s in steps_done], "reward": [score[s] for s in steps_done],
            "tokens": [resp[s] * PROMPTS * N for s in steps_done], "wall_s": time.time() - t0,
            "phases": {k: statistics.median([v[s] for s in steps_done[2:]] or list(v.values())) for k, v in phases.items()}}


# ---- TRL (a subprocess: `vs_trl.py --trl-worker ARGS.json`) -----------------------------------
def run_trl(work: Path, model_dir: Path, size: str, seed: int, steps: int, threads: int,
            dtype: str = "float32") -> dict:
    spec = work / "trl_args.json"
    spec.write_text(json.dumps({"work": str(work), "model": str(model_dir), "size": size, "seed": seed, "steps": steps,
                                "threads": threads, "dtype": dtype}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCH_DEPS), str(REPO)])}
    t0 = time.time()
    with (work / "trl.log").open("w") as log:
        p = subprocess.run([sys.executable, __file__, "--trl-worker", str(spec)], env=env, stdout=log,
                           stderr=subprocess.STDOUT, check=False)
    if p.returncode:
        raise RuntimeError(f"TRL failed (rc {p.returncode}); see {work / 'trl.log'}")
    res = json.loads((work / "trl_result.json").read_text())
    res["wall_s"] = time.time() - t0
    return res


def trl_worker(spec_path: str) -> None:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from mrl.rewards.scorers import arith

    a = json.loads(Path(spec_path).read_text())
    work, new_tokens = Path(a["work"]), SIZES[a["size"]][2]
    torch.set_num_threads(a["threads"])
    tok = AutoTokenizer.from_pretrained(a["model"])
    model = AutoModelForCausalLM.from_pretrained(a["model"], dtype=torch.float32)
    data = load_dataset("json", data_files=str(work / "train_trl.jsonl"), split="train")

    def reward(completions, ground_truth, **_):
        return [float(arith(c, g)) for c, g in zip(completions, ground_truth, strict=True)]

    class Clock(TrainerCallback):
        def __init__(self):
            self.t, self.step_s, self.logs = 0.0, [], []

        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.step_s.append(time.perf_counter() - self.t)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                self.logs.append(logs)

    cfg = GRPOConfig(
        output_dir=str(work / "trl_out"), per_device_train_batch_size=PROMPTS * N, gradient_accumulation_steps=1,
        num_generations=N, steps_per_generation=1, num_iterations=1, max_completion_length=new_tokens,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, beta=0.0, epsilon=0.2, loss_type="dapo",
        scale_rewards="group", temperature=1.0, top_p=1.0, top_k=0, max_steps=a["steps"], logging_steps=1,
        report_to="none", save_strategy="no", seed=a["seed"], shuffle_dataset=False, use_cpu=True,
        bf16=a.get("dtype") == "bfloat16",  # HF Trainer's autocast: fp32 weights, bf16 matmuls (mrl: fp32 main weights too)
        disable_tqdm=True, log_completions=False, dataloader_num_workers=0,
        gradient_checkpointing=False,  # TRL's default recomputes activations; mrl does not (actor.recompute_granularity)
    )
    clock = Clock()
    GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok,
                callbacks=[clock]).train()
    logs = clock.logs[: len(clock.step_s)]
    (work / "trl_result.json").write_text(json.dumps({
        "step_s": clock.step_s, "reward": [lg["reward"] for lg in logs],
        "tokens": [lg["completions/mean_length"] * PROMPTS * N for lg in logs]}))


# ---- report ----------------------------------------------------------------------------------
def matmul_gflops(seconds: float = 1.0, dtype: str = "float32") -> float:
    """GFLOP/s of a 1024² matmul in ``dtype`` on all cores: the floor's compute rate."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    dt = getattr(torch, dtype)
    a, b = torch.randn(1024, 1024, dtype=dt), torch.randn(1024, 1024, dtype=dt)
    a @ b
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
    return 2 * 1024 ** 3 * n / (time.perf_counter() - t0) / 1e9


def median_from(xs: list[float], start: int = 2) -> float:
    return statistics.median(xs[start:] if len(xs) > start else xs)


def smooth(xs: list[float], k: int = 10) -> list[float]:
    return [statistics.fmean(xs[max(0, i - k + 1): i + 1]) for i in range(len(xs))]


def window_mean(rewards: list[float], step: int, k: int = 10) -> float:
    """Mean reward of steps ``step - k + 1 .. step`` (1-based), the learning table's per-run value."""
    return statistics.fmean(rewards[step - k: step])


def interval(xs: list[float]) -> tuple[float, float]:
    """(mean, half-width of its 95 % Student-t interval) over seeds."""
    from scipy.stats import t

    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, math.nan
    return m, t.ppf(0.975, len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))


def learning_table(runs: dict, at: tuple[int, ...] = (100, 200, 400)) -> list[str]:
    """Markdown rows: per curve (task, size) and step in ``at``, the 10-step mean reward of each side as mean ± 95 %
    interval over seeds, and the paired difference mrl − TRL (a seed gives both sides the same weights and data)."""
    groups: dict[str, list[dict]] = {}
    for key, run in runs.items():
        if "mrl" in run and "trl" in run:
            groups.setdefault(run.get("curve", key.rsplit("_s", 1)[0]), []).append(run)
    rows = ["| task, size | step | seeds | mrl mean ± 95 % | TRL mean ± 95 % | mrl − TRL (paired) ± 95 % | intervals |",
            "|---|---|---|---|---|---|---|"]
    for curve, rs in groups.items():
        for step in at:
            rs_at = [r for r in rs if min(len(r["mrl"]["reward"]), len(r["trl"]["reward"])) >= step]
            if not rs_at:
                continue
            m = [window_mean(r["mrl"]["reward"], step) for r in rs_at]
            t = [window_mean(r["trl"]["reward"], step) for r in rs_at]
            (mm, mh), (tm, th), (dm, dh) = interval(m), interval(t), interval([a - b for a, b in zip(m, t, strict=True)])
            apart = "mrl ahead" if mm - mh > tm + th else "TRL ahead" if tm - th > mm + mh else "overlap"
            rows.append(f"| {curve} | {step} | {len(rs_at)} | {mm:.3f} ± {mh:.3f} | {tm:.3f} ± {th:.3f} | "
                        f"{dm:+.3f} ± {dh:.3f} | {apart} |")
    return rows


def plot_bands(runs: dict, path: Path) -> None:
    """Per curve (task, size): each side's 10-step mean reward, mean over seeds with its 95 % interval as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, dict[str, list[list[float]]]] = {}
    for key, run in runs.items():
        for side in ("mrl", "trl"):
            if side in run:
                groups.setdefault(run.get("curve", key.rsplit("_s", 1)[0]), {}).setdefault(side, []).append(
                    smooth(run[side]["reward"]))
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4), squeeze=False)
    for ax, (curve, sides) in zip(axes[0], groups.items(), strict=True):
        for side, curves in sides.items():
            n = min(map(len, curves))
            stats = [interval([c[i] for c in curves]) for i in range(n)]
            mean = [m for m, _ in stats]
            half = [0.0 if math.isnan(h) else h for _, h in stats]
            x = range(1, n + 1)
            ax.plot(x, mean, label=f"{'TRL' if side == 'trl' else side} (mean of {len(curves)} seeds ± 95 %)")
            ax.fill_between(x, [m - h for m, h in zip(mean, half, strict=True)],
                            [m + h for m, h in zip(mean, half, strict=True)], alpha=0.25)
        ax.set_title(f"{curve}: reward per step (10-step mean)")
        ax.set_xlabel("step")
        ax.set_ylabel("mean reward")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def summarize(dirs: list[str], plot_path: str | None) -> int:
    """``--summary DIR...``: the learning table (and ``--plot``) over the results.json of earlier runs."""
    runs: dict = {}
    for d in dirs:
        res = json.loads((Path(d) / "results.json").read_text())
        print(f"{d}: {res['date']}, load {res['load_before']:.1f} -> {res.get('load_after', math.nan):.1f}, "
              f"{len(res['runs'])} runs")
        for key, run in res["runs"].items():  # a side rerun alone (--only) joins the other side's run
            runs.setdefault(key, {}).update(run)
    print("\n".join(learning_table(runs)))
    if plot_path:
        plot_bands(runs, Path(plot_path))
        print(f"plot: {plot_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", default=["tiny", "compute"], choices=sorted(SIZES))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=None, help="steps per run (default: tiny 200, compute 6)")
    p.add_argument("--out", default="outputs/vs_trl", help="work directory (assets, logs, results.json, vs_trl.png)")
    p.add_argument("--port", type=int, default=31700, help="mrl's rollout.port_base")
    p.add_argument("--only", choices=["mrl", "trl"], help="run one side only")
    p.add_argument("--mrl-args", nargs="*", default=[], help="extra mrl overrides, e.g. actor.on_policy_shortcut=false")
    p.add_argument("--trl-threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads of the TRL process (default: all cores, as a TRL user runs it)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="compute dtype of both sides: mrl model.dtype, TRL bf16 (autocast); bfloat16 pays off on CPUs "
                        "with AMX / AVX512-BF16")
    p.add_argument("--task", choices=sorted(TASKS), default="add",
                   help="add: '3+4=' (the default); digitsum: '47=' -> digit sum mod 10 with a GQA Llama (issue 30)")
    p.add_argument("--summary", nargs="+", metavar="DIR",
                   help="print the learning table (mean ± 95 %% over seeds at steps 100/200/400) of earlier runs' "
                        "results.json and exit; --plot draws it")
    p.add_argument("--plot", help="with --summary: write the curves with their 95 %% bands here")
    p.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.trl_worker:
        trl_worker(args.trl_worker)
        return 0
    if args.summary:
        return summarize(args.summary, args.plot)
    if args.only != "mrl":
        try:
            subprocess.run([sys.executable, "-c", "import trl"], check=True, capture_output=True,
                           env={**os.environ, "PYTHONPATH": str(BENCH_DEPS)})
        except subprocess.CalledProcessError:
            p.error("TRL is not installed: pip install -e .[bench] (or make bench-deps), or pass --only mrl")
    out = Path(args.out).resolve()
    load = os.getloadavg()
    gflops = matmul_gflops(dtype=args.dtype)
    print(f"host: {os.uname().nodename}, {os.cpu_count()} cores, load {load[0]:.1f}, {args.dtype} matmul {gflops:.1f} GFLOP/s",
          flush=True)
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_before": load[0],
                     "gflops": gflops, "dtype": args.dtype, "task": args.task, "argv": sys.argv[1:], "runs": {}}
    out.mkdir(parents=True, exist_ok=True)
    curves: dict = {}
    for size in args.sizes:
        steps = args.steps or (200 if size == "tiny" else 6)
        for seed in args.seeds:
            curve = size if args.task == "add" else f"{args.task} {size}"  # the default task keeps its names
            work = out / f"{curve.replace(' ', '_')}_s{seed}"
            model_dir, _, n_params = write_assets(work, size, seed, steps, args.task)
            run = {"params": n_params, "curve": curve, "size": size, "seed": seed}
            for side in ("mrl", "trl"):
                if args.only and side != args.only:
                    continue
                try:
                    r = (run_mrl(work, model_dir, size, seed, steps, args.port, args.mrl_args, args.dtype) if side == "mrl"
                         else run_trl(work, model_dir, size, seed, steps, args.trl_threads, args.dtype))
                except RuntimeError as e:  # e.g. the host ran out of memory: report it, go on with the next run
                    print(f"{curve} seed {seed} {side}: FAILED: {e}", flush=True)
                    continue
                r["median_step_s"] = median_from(r["step_s"])
                r["tokens_per_s"] = median_from([t / s for t, s in zip(r["tokens"], r["step_s"], strict=False)])
                run[side] = r
                curves.setdefault(curve, {}).setdefault(side, []).append(r["reward"])
                print(f"{curve} seed {seed} {side}: {r['median_step_s']:.3f} s/step, {r['tokens_per_s']:.0f} gen tok/s, "
                      f"reward first10 {statistics.fmean(r['reward'][:10]):.2f} last10 {statistics.fmean(r['reward'][-10:]):.2f}, "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
            if "mrl" in run and "trl" in run:
                run["ratio_step"] = run["trl"]["median_step_s"] / run["mrl"]["median_step_s"]
                run["ratio_tokens"] = run["mrl"]["tokens_per_s"] / run["trl"]["tokens_per_s"]
            if "mrl" in run:  # the FLOP floor of one step: generation 2N/token, training forward+backward 6N/token
                prompt_tok = 4 * PROMPTS * N
                gen_tok = statistics.fmean(run["mrl"]["tokens"])
                flops = 2 * n_params * gen_tok + 6 * n_params * (gen_tok + prompt_tok)
                run["floor_s"] = flops / (gflops * 1e9)
                run["mrl_vs_floor"] = run["mrl"]["median_step_s"] / run["floor_s"]
            results["runs"][work.name] = run
            (out / "results.json").write_text(json.dumps(results, indent=1))  # after every seed: a cut-off run keeps its seeds
    results["load_after"] = os.getloadavg()[0]
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print("\n| size | seed | mrl s/step | TRL s/step | TRL/mrl time | mrl/TRL gen tok/s | mrl / FLOP floor |")
    print("|---|---|---|---|---|---|---|")
    for run in results["runs"].values():
        m, t = run.get("mrl", {}), run.get("trl", {})
        print(f"| {run['curve']} | {run['seed']} | {m.get('median_step_s', math.nan):.3f} | "
              f"{t.get('median_step_s', math.nan):.3f} | {run.get('ratio_step', math.nan):.2f}x | "
              f"{run.get('ratio_tokens', math.nan):.2f}x | {run.get('mrl_vs_floor', math.nan):.1f}x |")
    for size, sides in curves.items():
        print(f"\nlearning curve, {size} (mean reward over seeds, 10-step windows):")
        for side, runs in sides.items():
            n = min(map(len, runs))
            mean = [statistics.fmean(r[i] for r in runs) for i in range(n)]
            print(f"  {side:4s} " + " ".join(f"{statistics.fmean(mean[i:i + 10]):.2f}" for i in range(0, n, 10)))
    print("\n" + "\n".join(learning_table(results["runs"])))
    plot_bands(results["runs"], out / "vs_trl.png")
    print(f"\nplot: {out / 'vs_trl.png'}; results: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
