"""OpenAI-compatible routes of the embedded engine (SGLang serves the same): ``GET /v1/models``,
``POST /v1/completions``, ``POST /v1/chat/completions``.

Supported request fields: ``model`` (any name is served by the one model, as SGLang does),
``prompt`` (str, [str], [int] or [[int]]) / ``messages`` (text content; the tokenizer's chat
template with the generation prompt), ``max_tokens`` (completions default 16; chat default: the
rest of the context; ``max_completion_tokens`` too), ``temperature``, ``top_p``, ``n``, ``stop``,
``seed`` (choice i samples with seed + i, so n seeded choices differ and each is reproducible),
``logprobs`` (completions: an int, the number of top alternatives; chat: a bool with
``top_logprobs``), ``stream`` (Server-Sent Events ending ``data: [DONE]``) with
``stream_options.include_usage``, ``user``; SGLang's extras ``top_k``, ``min_p``, ``stop_token_ids``,
``ignore_eos``, ``skip_special_tokens``, ``no_stop_trim``, ``stop_regex``. Anything else (``echo``,
penalties, ``logit_bias``, ``tools``, ``response_format``, ...) is refused with a 400 naming the
field: this engine would otherwise sample differently from what was asked. Log-probs are those of
``/generate`` (full-vocabulary ``log_softmax(z / T)``).
"""
from __future__ import annotations

import contextlib
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mrl.rollout.engine import serving as S
from mrl.rollout.engine.server_info import context_length
from mrl.rollout.protocol import MAX_N, MAX_TOP_LOGPROBS, SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    """Fields both routes take (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str = "default"
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False

    def sampling(self, max_new_tokens: int, i: int) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_new_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, stop=self.stop, stop_regex=self.stop_regex, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens, no_stop_trim=self.no_stop_trim,
            sampling_seed=None if self.seed is None else self.seed + i)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


def error(message: str, param: str | None = None, status: int = 400) -> JSONResponse:
    """SGLang's OpenAI error body (the ``openai`` client raises BadRequestError with it)."""
    return JSONResponse({"object": "error", "message": message, "type": "BadRequestError", "param": param,
                         "code": status}, status_code=status)


async def parse(http: HTTPRequest, model: type[BaseModel]) -> BaseModel | JSONResponse:
    try:
        raw = await http.json()
    except ValueError:
        return error("request body is not valid JSON")
    if not isinstance(raw, dict):
        return error("request body must be a JSON object")
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        return error(f"{loc}: {first['msg']} (got {first.get('input')!r})"[:500], param=loc)


def _finish(r) -> tuple[str | None, Any]:
    fr = r.finish_reason or {}
    return fr.get("type"), fr.get("matched")


def _usage(jobs: list[S.Job], prompt_of: list[int]) -> dict[str, int]:
    # Each prompt counts once (SGLang: the n samples of a prompt share its prefill).
    p = sum(len(jobs[prompt_of.index(i)].req.prompt_ids) for i in sorted(set(prompt_of)))
    c = sum(len(j.req.output_ids) for j in jobs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _visible(r, final: bool) -> int:
    """Output tokens that belong to the text: a trimmed stop token does not."""
    n = min(len(r.output_ids), len(r.logprobs))
    kind, matched = _finish(r)
    if final and kind == "stop" and isinstance(matched, int) and not r.params.no_stop_trim:
        n -= 1
    return max(n, 0)


def _token_strs(engine, ids: list[int]) -> list[str]:
    tok = engine.runner.tokenizer
    return tok.batch_decode([[t] for t in ids]) if tok is not None and ids else [str(t) for t in ids]


def _completion_lp(engine, r, a: int, b: int, offset: int) -> dict[str, Any]:
    ids = r.output_ids[a:b]
    strs = _token_strs(engine, ids)
    offsets = []
    for s_ in strs:
        offsets.append(offset)
        offset += len(s_)
    tops = None
    if r.top_logprobs_num > 0:
        tops = []
        for e in r.top_logprobs[a:b]:  # most likely first: of tokens sharing a text, the likeliest keeps the key
            d: dict[str, float] = {}
            for s_, (v, _) in zip(_token_strs(engine, [t for _, t in e]), e):
                d.setdefault(s_, v)
            tops.append(d)
    return {"tokens": strs, "token_logprobs": list(r.logprobs[a:b]), "top_logprobs": tops, "text_offset": offsets}


def _chat_lp(engine, r, a: int, b: int) -> dict[str, Any]:
    def entry(s_: str, lp: float) -> dict[str, Any]:
        return {"token": s_, "logprob": lp, "bytes": list(s_.encode())}

    out = []
    for k, (s_, lp) in enumerate(zip(_token_strs(engine, r.output_ids[a:b]), r.logprobs[a:b])):
        tops = r.top_logprobs[a + k] if r.top_logprobs_num > 0 else []
        out.append({**entry(s_, lp), "top_logprobs": [entry(ts, v) for ts, (v, _) in
                                                       zip(_token_strs(engine, [t for _, t in tops]), tops)]})
    return {"content": out}


def add_openai_routes(app: FastAPI, engine) -> None:
    """Register the ``/v1`` routes on ``app`` (see the module docstring)."""
    created = int(time.time())

    @app.get("/v1/models")
    async def models():
        name = engine.runner.model_path
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "mrl",
                                            "root": name, "max_model_len": context_length(engine)}]}

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        req = await parse(http, CompletionRequest)
        if isinstance(req, JSONResponse):
            return req
        p = req.prompt
        try:
            if isinstance(p, str):
                prompts = [S.encode(engine, p)]
            elif p and all(isinstance(x, str) for x in p):
                prompts = [S.encode(engine, x) for x in p]
            elif p and all(isinstance(x, int) for x in p):
                prompts = [list(p)]
            else:
                prompts = [list(x) for x in p]
        except ValueError as e:
            return error(str(e), "prompt")
        if not prompts or any(not x for x in prompts):
            return error("prompt: must not be empty", "prompt")
        lp = req.logprobs is not None
        return await _serve(engine, http, "text_completion", req, prompts, lp, req.logprobs or 0,
                            lambda ids: req.max_tokens)

    @app.post("/v1/chat/completions")
    async def chat(http: HTTPRequest):
        req = await parse(http, ChatRequest)
        if isinstance(req, JSONResponse):
            return req
        tok = engine.runner.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            return error("messages: the model's tokenizer has no chat_template; use /v1/completions", "messages")
        if req.top_logprobs and not req.logprobs:
            return error("top_logprobs: needs logprobs=true", "top_logprobs")
        msgs = [{"role": m.role, "content": m.content if isinstance(m.content, str) else "".join(x.text for x in m.content)}
                for m in req.messages]
        try:
            text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - a template may refuse a conversation (jinja raise_exception)
            return error(f"messages: the chat template refused them: {e}", "messages")
        ids = tok.encode(text, add_special_tokens=False)
        ctx = context_length(engine)
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        return await _serve(engine, http, "chat.completion", req, [ids], req.logprobs, req.top_logprobs or 0,
                            lambda ids_: limit if limit is not None else max(ctx - len(ids_), 0))


async def _serve(engine, http: HTTPRequest, obj: str, req: _Common, prompts: list[list[int]], lp: bool,
                 top: int, max_new) -> Any:
    if engine.runner.released:
        return error("weights released; call /resume_memory_occupation", status=503)
    chat = obj == "chat.completion"
    jobs, prompt_of = [], []
    try:
        for i, ids in enumerate(prompts):
            for _ in range(req.n):
                jobs.append(S.new_job(engine, ids, req.sampling(max_new(ids), len(jobs)), lp, -1, top, None))
                prompt_of.append(i)
        await S.run(engine, jobs)
    except ValueError as e:
        return error(str(e))
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    head = {"id": rid, "created": int(time.time()), "model": req.model}

    def choice_final(k: int, j: S.Job) -> dict[str, Any]:
        r = j.req
        text = S.output_text(engine, r, list(r.output_ids), True)
        kind, matched = _finish(r)
        n = _visible(r, True)
        logprobs = None
        if lp:
            logprobs = _chat_lp(engine, r, 0, n) if chat else _completion_lp(engine, r, 0, n, 0)
        body = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        return {"index": k, **body, "logprobs": logprobs, "finish_reason": kind, "matched_stop": matched}

    if not req.stream:
        if not await S.wait_all(engine, http, jobs):
            return JSONResponse({}, status_code=499)
        return {**head, "object": obj, "choices": [choice_final(k, j) for k, j in enumerate(jobs)],
                "usage": _usage(jobs, prompt_of)}

    async def events():
        chunk = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        sent_text, sent_tok = [""] * len(jobs), [0] * len(jobs)
        if chat:
            for k in range(len(jobs)):
                yield S.sse({**chunk, "choices": [{"index": k, "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None}]})
        async with contextlib.aclosing(S.progress(engine, http, jobs)) as progress:  # closed -> aborts
            async for k, err in progress:
                if err is not None:
                    yield err
                    continue
                r = jobs[k].req
                final = r.future.done()
                text = S.output_text(engine, r, list(r.output_ids[: _visible(r, False)]), final)
                delta = text[len(sent_text[k]):] if text.startswith(sent_text[k]) else ""
                n = _visible(r, final)
                logprobs = None
                if lp and n > sent_tok[k]:
                    logprobs = (_chat_lp(engine, r, sent_tok[k], n) if chat
                                else _completion_lp(engine, r, sent_tok[k], n, len(sent_text[k])))
                if not delta and logprobs is None and not final:
                    continue
                sent_text[k], sent_tok[k] = sent_text[k] + delta, max(n, sent_tok[k])
                kind, matched = _finish(r) if final else (None, None)
                body = {"delta": {"content": delta} if delta or not final else {}} if chat else {"text": delta}
                yield S.sse({**chunk, "choices": [{"index": k, **body, "logprobs": logprobs, "finish_reason": kind,
                                                   **({"matched_stop": matched} if final else {})}]})
        if req.stream_options is not None and req.stream_options.include_usage:
            yield S.sse({**chunk, "choices": [], "usage": _usage(jobs, prompt_of)})
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
