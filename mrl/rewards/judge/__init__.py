"""The generative judge's pure parts (docs/judge.md): prompt rendering, verdict parsing and the
OpenAI-compatible HTTP client. No Ray, no engine code: the driver starts the judge's servers."""
from mrl.rewards.judge.client import JudgeClient, JudgeHTTPError
from mrl.rewards.judge.parse import UnparsableVerdict, parse_verdict
from mrl.rewards.judge.scorer import JudgeResult, JudgeScorer, render

__all__ = ["JudgeClient", "JudgeHTTPError", "JudgeResult", "JudgeScorer", "UnparsableVerdict", "parse_verdict", "render"]
