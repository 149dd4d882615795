"""mrl: a Megatron-Core based RL trainer for LLMs (GRPO/PPO family)."""
from setuptools import find_packages, setup

setup(
    name="mrl",
    version="0.1.0",
    description="Megatron-Core based reinforcement-learning trainer for LLMs (GRPO, PPO, RLOO, REINFORCE++)",
    python_requires=">=3.11",
    packages=find_packages(include=["mrl", "mrl.*", "checkpoints_tools", "checkpoints_tools.*"]),
    # config.json copies of hub models the GPU recipes name, for `mrl plan` on hosts without the weights
    package_data={"mrl.config": ["hub_shapes/*.json"]},
    install_requires=[
        # torch is pinned by the Makefile (CPU wheel on CPU hosts) or the docker base image (CUDA);
        # the range here only says which releases mrl supports.
        "torch>=2.6",
        "megatron-core>=0.16.1",
        "ray>=2.40",
        "pydantic>=2",
        "pyyaml>=6",
        "mlflow>=2.18",
        "transformers>=4.50",
        "safetensors>=0.4",
        "pyarrow>=15",
        "fastapi>=0.110",
        "uvicorn>=0.29",
        "httpx>=0.27",  # synchronous control calls (weight sync, launcher health polls)
        "aiohttp>=3.9",  # the rollout pool's concurrent /generate calls (mrl/rollout/pool.py says why)
        "tqdm>=4.66",
        "matplotlib>=3.8",  # the run's learning-curve PNG (mrl/observability/progress.py)
        "numpy>=1.26",
        # megatron-core's dist_checkpointing writer needs it but does not declare it.
        "psutil>=5.9",
        "regex>=2023.8",  # the engine's stop_regex search with a timeout (a catastrophic pattern cannot freeze it)
        "math-verify>=0.7",  # reward.function=math: LaTeX answer equivalence (the library verl and TRL use)
    ],
    extras_require={
        # THE supported SGLang release (one pin everywhere: docker/Dockerfile, requirements-sglang-cpu.txt,
        # mrl.rollout.sglang_launcher.SGLANG_VERSION; tests/rollout/conformance/test_launch_and_pins.py checks)
        # and the image's Transformer Engine (docker/Dockerfile's TRANSFORMER_ENGINE_VERSION; its PyTorch
        # extension builds against the installed torch: pip install --no-build-isolation; tests/test_docker_pins.py)
        "gpu": ["transformer-engine[pytorch]==2.18.0", "sglang==0.5.23"],
        # benchmarks/vs_trl.py's other side (TRL's GRPOTrainer); `make bench-deps` installs the same pins
        # --no-deps into .venv/bench-trl where accelerate/pyarrow/pandas are already there
        "bench": ["trl==1.16.0", "datasets==5.2.0"],
        # sglang-router (SGLang's Rust router) runs without a GPU: CI tests rollout.router=sglang_router with it
        "dev": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.8", "ruff>=0.5", "sglang-router>=0.3", "peft>=0.13",
                # real clients of `mrl engine` (tests/rollout/clients/) and the pure-Python modules SGLang's
                # code imports when the conformance suite runs it on CPU (requirements-sglang-cpu.txt)
                "openai>=1.40", "pybase64", "msgspec", "pyzmq", "dill", "ipython", "gguf", "loguru",
                "sentencepiece", "partial-json-parser", "apache-tvm-ffi", "uvloop", "einops", "soundfile",
                "python-multipart"],
    },
    entry_points={
        "console_scripts": [
            "mrl=mrl.cli:main",
            "mrl-ckpt=checkpoints_tools.cli:main",
        ]
    },
)
