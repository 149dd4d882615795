"""The agent loop: multi-turn, tool-calling trajectories through the engine pool, token-in/token-out.

``AgentClient`` has the rollout client's interface (``generate(RolloutRequest) -> RolloutResult``),
so the train step, validation and ReMax's baseline use it unchanged. For each of the P·n samples,
concurrently (one coroutine each on the pool's event loop)::

    ids = []                                   # the response: every token after the prompt
    repeat:
        POST /generate {input_ids: prompt + ids, max_new_tokens: budget - len(ids), return_logprob}
        ids += output_ids       (loss mask 1, the engine's log-probs)
        stop unless the turn ended on a stop token and holds tool calls (agent.format), or after agent.max_turns turns
        run the calls (mrl/agent/runner.py: subprocess, timeout, memory limit; a failure is the message)
        ids += tool segment     (loss mask 0, log-prob 0: the chat template's tool messages and the
                                 next generation prompt, mrl/agent/template.py)
    until an answer (a turn without a call), max_turns, or budget = rollout.max_response_length tokens

Only ``/generate`` with ``input_ids`` is used (no server-side chat state): real SGLang serves it as
the embedded engine does. The model's text is decoded only to find its tool calls; its ids are
never re-encoded. Each turn of a seeded sample gets its own ``sampling_seed``.
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from mrl.agent.parser import ToolCall, parse_tool_calls
from mrl.agent.runner import ERROR, OK, TIMEOUT, ToolOutcome, ToolRunner
from mrl.agent.template import tool_segment_ids
from mrl.agent.tools import ToolSpec
from mrl.plugins import is_spec
from mrl.rollout.client import RolloutClient, parse_generate_response
from mrl.rollout.types import (
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    RolloutRequest,
    RolloutResult,
    RolloutSample,
)

_TURN_SEED_STRIDE = 1_000_003  # turn t of a sample seeded s samples with (s + t * stride) mod 2**31
_VERL_KWARGS = {"create_kwargs", "execute_kwargs", "calc_reward_kwargs", "release_kwargs"}


def row_tool_kwargs(tools_kwargs: dict[str, Any] | None, name: str) -> dict[str, Any]:
    """The keyword arguments a row binds to tool ``name``: ``extra_info.tools_kwargs[name]``, either a
    plain dict or verl's ``{"create_kwargs": {...}, "execute_kwargs": {...}}`` (both merged)."""
    kw = (tools_kwargs or {}).get(name) or {}
    if set(kw) and set(kw) <= _VERL_KWARGS:
        return {**(kw.get("create_kwargs") or {}), **(kw.get("execute_kwargs") or {})}
    return dict(kw)


class AgentClient:
    """client: the RolloutClient (its router reaches the engines); tokenizer: model.path's; tools: the
    configured tools by name (``mrl.agent.tools.load_tools``); cfg: the ``agent`` config section."""

    def __init__(self, client: RolloutClient, tokenizer: Any, tools: dict[str, ToolSpec], cfg: Any) -> None:
        self.client, self.router, self.tok, self.cfg = client, client.router, tokenizer, cfg
        # a worker runs in a temporary directory: file tools are handed over by absolute path
        self.tools = {n: t._replace(spec=_absolute(t.spec)) for n, t in tools.items()}
        self.runner = ToolRunner(workers=cfg.tool_workers, timeout_s=cfg.tool_timeout_s, memory_mb=cfg.tool_memory_mb)

    def generate(self, request: RolloutRequest) -> RolloutResult:
        return self.router.pool.loop.run(self.agenerate(request))

    async def agenerate(self, request: RolloutRequest) -> RolloutResult:
        t0 = time.perf_counter()
        jobs = [self.trajectory(request, i, j) for i in range(len(request.prompts)) for j in range(request.n)]
        return RolloutResult(list(await asyncio.gather(*jobs)), request.n, time.perf_counter() - t0)

    async def trajectory(self, request: RolloutRequest, i: int, j: int) -> RolloutSample:
        """Sample j of prompt i: the turns of one conversation as one token list (module docstring)."""
        prompt = request.prompts[i]
        params = dict(request.sampling_params)
        budget = int(params.get("max_new_tokens", 128))
        kwargs = request.tools_kwargs[i] if request.tools_kwargs else None
        ids: list[int] = []
        mask: list[int] = []
        lps: list[float] = []
        versions: list[str | None] = []
        calls: list[dict[str, Any]] = []
        final, stop, reason, url, attempts = "", "answer", FINISH_STOP, None, 0
        turn = 0
        while True:
            turn += 1
            p = {**params, "max_new_tokens": budget - len(ids)}
            if request.sampling_seeds is not None:
                p["sampling_seed"] = (int(request.sampling_seeds[i][j]) + (turn - 1) * _TURN_SEED_STRIDE) % 2**31
            out = await self.router.generate({"input_ids": prompt + ids, "sampling_params": p,
                                              "return_logprob": request.return_logprob}, None, request.timeout_s)
            url, attempts = out.engine_url, attempts + out.attempts
            if out.body is None:
                return self._failed(i, j, prompt, url, attempts, out.error)
            try:
                t_ids, t_lps, reason, wv = parse_generate_response(out.body)
            except Exception as ex:  # noqa: BLE001 - a malformed answer is a failed sample, reported
                return self._failed(i, j, prompt, url, attempts, f"unparseable /generate answer: {ex}")
            if request.return_logprob and len(t_lps) != len(t_ids):
                return self._failed(i, j, prompt, url, attempts, f"{len(t_ids)} output ids but {len(t_lps)} log-probs")
            ids += t_ids
            mask += [1] * len(t_ids)
            lps += t_lps if request.return_logprob else [0.0] * len(t_ids)
            versions += [wv] * len(t_ids)
            # read (never re-encoded): the turn's text, for its tool calls and the scorer's final answer
            final = self.tok.decode(t_ids, skip_special_tokens=True)
            found = parse_tool_calls(final, self.cfg.format) if reason == FINISH_STOP else []
            if reason != FINISH_STOP or not found:
                stop = "answer" if reason == FINISH_STOP else reason
                break
            if turn >= self.cfg.max_turns:
                stop = "max_turns"
                break
            outcomes = await asyncio.gather(*(self.run_call(c, kwargs) for c in found))
            for c, o in zip(found, outcomes, strict=True):
                calls.append({"turn": turn, "name": c.name, "arguments": c.arguments, "status": o.status, "result": o.text})
            seg = tool_segment_ids(self.tok, [o.text for o in outcomes], t_ids[-1] if t_ids else None)
            room = budget - len(ids)
            ids += seg[:room]
            mask += [0] * min(len(seg), room)
            lps += [0.0] * min(len(seg), room)
            versions += [versions[-1] if versions else None] * min(len(seg), room)
            if len(seg) >= room:  # no room left for the model to read the results and answer
                stop, reason = "length", FINISH_LENGTH
                break
        model_versions = {v for v, m in zip(versions, mask, strict=True) if m}
        wv = versions[-1] if versions else None
        agent = {"turns": turn, "tool_calls": calls, "final_response": final, "stop": stop,
                 "tool_errors": sum(c["status"] != OK for c in calls),
                 "tool_timeouts": sum(c["status"] == TIMEOUT for c in calls)}
        return RolloutSample(i, j, prompt, ids, lps, reason, wv, url, None, attempts,
                             token_weight_versions=list(versions) if len(model_versions) > 1 else None,
                             loss_mask=mask, agent=agent)

    async def run_call(self, call: ToolCall, tools_kwargs: dict[str, Any] | None) -> ToolOutcome:
        """One parsed call -> its outcome (malformed and unknown calls are errors the model reads)."""
        if call.error is not None:
            return ToolOutcome(ERROR, f"error: {call.error}")
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolOutcome(ERROR, f"error: unknown tool {call.name!r}; available: {', '.join(sorted(self.tools))}")
        out = await self.runner.call(tool.spec, {**call.arguments, **row_tool_kwargs(tools_kwargs, call.name)})
        cap = self.cfg.max_tool_response_chars
        return out if len(out.text) <= cap else ToolOutcome(out.status, out.text[:cap] + " ...(truncated)")

    @staticmethod
    def _failed(i: int, j: int, prompt: list[int], url: str | None, attempts: int, error: str | None) -> RolloutSample:
        return RolloutSample(i, j, prompt, [], [], FINISH_ERROR, engine_url=url, error=error, attempts=attempts)

    def close(self) -> None:
        self.router.pool.loop.run(self.runner.aclose())


def _absolute(spec: str) -> str:
    if is_spec(spec):
        target, _, attr = spec.rpartition(":")
        if target.endswith(".py"):
            return f"{Path(target).resolve()}:{attr}"
    return spec


def agent_metrics(result: RolloutResult) -> dict[str, float]:
    """agent/turns/mean, agent/tool_calls/mean (per sample), agent/tool_errors and agent/tool_timeouts
    (counts over the batch: a failed call is an error, a timed-out one both); {} for single-turn results."""
    recs = [s.agent for s in result.samples if s.agent is not None]
    if not recs:
        return {}
    return {"agent/turns/mean": sum(r["turns"] for r in recs) / len(recs),
            "agent/turns/max": float(max(r["turns"] for r in recs)),
            "agent/tool_calls/mean": sum(len(r["tool_calls"]) for r in recs) / len(recs),
            "agent/tool_errors": float(sum(r["tool_errors"] for r in recs)),
            "agent/tool_timeouts": float(sum(r["tool_timeouts"] for r in recs)),
            "agent/answered_ratio": sum(r["stop"] == "answer" for r in recs) / len(recs)}
