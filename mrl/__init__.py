"""mrl: Megatron-Core based RL trainer for LLMs."""
__version__ = "0.1.0"
