"""
An OpenAI-compatible HTTP server for a GPT from any source sample.py loads, and a chat page to talk to it.

    python serve.py --out_dir=out-chat                      # http://127.0.0.1:8000: the chat page
    python serve.py --init_from=path/to/SmolLM2-135M-Instruct --port=8080
    NANOFORMER_API_KEY=secret python serve.py --out_dir=out-chat --host=0.0.0.0

    GET  /v1/models             the one model, named after its source
    POST /v1/completions        prompt (text, ids, or a list of either), logprobs and echo to score a prompt
    POST /v1/chat/completions   messages, rendered with the model's chat template (the one sample.py --chat uses)
    GET  /                      the chat page (serve.html); a completion box for a model without a chat template

How several clients share one model: one worker thread owns it (Engine) and every request becomes a Job, a Python
generator over generate.py's decoding (generate_stream, reply_tokens) that computes one token per step with its own
KV cache. The worker advances every active job by one step in turn, round-robin: each client gets a token per
round, none waits for another's whole reply, and each reply is exactly what sample.py decodes alone (its batch,
its seeded generator). What the worker produces reaches the request through the asyncio loop; a request that
ends (finished, its stop string seen, its client gone) marks its jobs cancelled, and the worker drops them (their
KV caches with them) before its next step. Requests are not batched with each other: docs/serving.md has the
numbers and why.
"""

import asyncio
import hmac
import json
import os
import queue
import secrets
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from chat import model_format
from config import ConfigError, parse_config
from generate import check_sampling_args, end_of_text, generate_stream, prompt_start, reply_tokens
from log import one_line
from runtime import DTYPES, autocast, resolve_device, resolve_dtype
from start import load_configured

PAGE = Path(__file__).resolve().parent / "serve.html"  # the chat page, one self-contained file
API_KEY_VARIABLE = "NANOFORMER_API_KEY"  # the key, when --api_key is not given (a command line shows in `ps`)
DONE = "done"  # what a Job hands over when its steps run out
MAX_STOPS = 4  # stop strings a request may give, as OpenAI allows
MAX_STOP_CHARS = 256  # characters of each: every token checks whether the text ends in the start of one
MAX_CHOICES = 64  # prompts x n of one completion request: each row holds a KV cache while it decodes
# the smallest temperature that is not 0: logits divided by less overflow to inf, and the softmax to NaN
MIN_TEMPERATURE = 0.01


@dataclass
class ServeConfig:
    init_from: str = "resume"  # "resume": out_dir's weights; a checkpoint file (ours, nanoGPT's); a HF id or folder
    out_dir: str = "out-shakespeare"  # the folder train.py wrote its checkpoints to
    checkpoint: str = ""  # which file of out_dir: "" the best weights (best.pt, else ckpt.pt), "ckpt.pt" the latest
    dataset: str = ""  # nanoGPT character-level checkpoints only: the prepared dataset of their characters
    host: str = "127.0.0.1"  # the address to listen on; 0.0.0.0 opens the server to other machines
    port: int = 8000  # the TCP port
    api_key: str = ""  # every /v1 request must send "Authorization: Bearer KEY"; "": $NANOFORMER_API_KEY, else none
    max_body: int = 1_000_000  # bytes a request body may hold; a longer one gets 413
    device: str = "auto"  # "cpu", "cuda", "cuda:1", "mps"; "auto": cuda, else mps, else cpu
    dtype: str = "auto"  # "float32", "bfloat16" or "float16" (autocast); "auto": as in train.py
    compile: bool = False  # torch.compile the layers: a slow first step, faster ones after it

    def __post_init__(self):
        if not 1 <= self.port <= 65535:
            raise ValueError(f"port must be in [1, 65535], got {self.port}")
        if self.max_body < 1:
            raise ValueError(f"max_body must be at least 1 byte, got {self.max_body}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")


@dataclass(frozen=True)
class Served:
    """The model a server answers with, and what it needs to read and write its text."""

    model: torch.nn.Module  # a GPT in eval mode, on device
    tokenizer: Any  # tokens.Tokenizer
    meta: dict  # its data's meta: special tokens, tokenizer
    name: str  # what /v1/models calls it, and requests may name
    chat: Any  # chat.ChatFormat of its template, or None: the model has none (completions only)
    device: torch.device
    dtype: torch.dtype


def model_name(cfg):
    """The served model's name: its run folder's, or its checkpoint file's, folder's or hub id's."""
    if cfg.init_from == "resume":
        return Path(cfg.out_dir).name
    return Path(cfg.init_from).name if Path(cfg.init_from).expanduser().exists() else cfg.init_from


# -----------------------------------------------------------------------------
# The worker: one thread owns the model and advances every job a step at a time


class Job:
    """
    One request's work for the worker: `steps`, a generator whose every next() runs the model once; each item it
    yields is handed to `deliver` (called on the worker thread), then DONE, or the exception it raised.
    """

    def __init__(self, steps, deliver):
        self.steps, self.deliver = steps, deliver
        self.cancelled = False  # set by the request: the worker drops the job (and its KV cache) at its next turn


class Engine:
    """The worker thread: round-robin over the active jobs, one step of each per round, the model in `dtype`."""

    def __init__(self, device, dtype):
        self.device, self.dtype = device, dtype
        self.incoming = queue.SimpleQueue()  # new jobs, and None to stop
        self.active = []  # the jobs the worker is advancing (the worker's alone to change)
        self.thread = threading.Thread(target=self.run, name="serve-engine", daemon=True)

    def submit(self, job):
        self.incoming.put(job)
        return job

    def stop(self):
        self.incoming.put(None)
        self.thread.join()

    def run(self):
        active = self.active
        # no_grad and autocast hold per thread: they are entered here, where the model runs
        with torch.no_grad(), autocast(self.device, self.dtype):
            while True:
                # idle: wait for a job; busy: take the jobs that arrived, without waiting
                arrived = [self.incoming.get()] if not active else []
                while not self.incoming.empty():
                    arrived.append(self.incoming.get())
                if None in arrived:
                    return
                active += arrived
                for job in list(active):
                    if not job.cancelled:
                        try:
                            job.deliver(next(job.steps))
                            continue
                        except StopIteration:
                            job.deliver(DONE)
                        except Exception as err:  # the request fails, the server goes on
                            job.deliver(err)
                    job.steps.close()  # a cancelled job's generator ends now: its cache is freed
                    active.remove(job)


def completion_steps(model, prompt, n, max_tokens, sampling, *, stop, generator, vocab):
    """n continuations of prompt (ids) in one batch, as sample.py draws them: a list of n ids per step."""
    idx = torch.tensor([prompt] * n, dtype=torch.long, device=next(model.parameters()).device)
    steps = generate_stream(model, idx, max_tokens, **sampling, stop_token=stop, generator=generator, vocab_size=vocab)
    for step in steps:  # (n, 1)
        yield step[:, 0].tolist()


def reply_steps(model, prompt, max_tokens, sampling, *, end_of_turn, generator, vocab):
    """A chat reply to the rendered prompt, as sample.py --chat decodes it: [id] per step, through end-of-turn."""
    cache, end = model.new_cache(), set(end_of_turn)
    for token in reply_tokens(model, cache, prompt, max_tokens, end, **sampling, generator=generator, vocab_size=vocab):
        yield [token]


def score_steps(model, ids, vocab_size, top):
    """
    One step: ([None, then log p(ids[i] | ids[:i]) for each later id], [None, then the `top` likeliest (id, log p)
    at each of those positions]), from one forward pass over ids, over the tokenizer's vocab_size ids.
    """
    logits, _ = model(torch.tensor([ids], dtype=torch.long, device=next(model.parameters()).device))
    logprobs = logits[0, :-1, :vocab_size].float().log_softmax(dim=-1)  # (T - 1, V): predicts ids[1:]
    chosen = logprobs.gather(1, torch.tensor(ids[1:], dtype=torch.long, device=logprobs.device)[:, None])[:, 0]
    values, index = logprobs.topk(min(top, logprobs.size(-1)), dim=-1)  # (T - 1, top): no more than there are
    tops = [list(zip(i, v)) for i, v in zip(index.tolist(), values.tolist())]
    yield [None, *chosen.tolist()], [None, *tops]


# -----------------------------------------------------------------------------
# Text: a choice's ids as text, sent as it becomes final


class Choice:
    """
    One choice's text as its ids arrive. The ids are decoded whole each time (after `shown`, the prompt ids its
    text continues) and only text that is final goes out: a character BPE has split over several tokens waits for
    the rest, and so does an ending that may be the start of a stop string.
    """

    def __init__(self, index, decode, *, shown=(), end=(), stops=()):
        self.index, self.decode, self.shown, self.end, self.stops = index, decode, list(shown), set(end), stops
        self.head = decode(self.shown)
        self.tokens = []  # every id sampled, an ending end-of-text or end-of-turn id included
        self.text = ""  # the text so far
        self.sent = 0  # characters of it handed out
        self.finish = None  # "stop" (end token or stop string) or "length"

    def add(self, token):
        """Take the next sampled id; returns the text that may go out now."""
        self.tokens.append(token)
        if token in self.end:
            self.finish = "stop"
            return self.rest()
        self.text = self.decode(self.shown + self.tokens)[len(self.head) :]
        found = [at for at in (self.text.find(stop) for stop in self.stops) if at >= 0]
        if found:
            self.text, self.finish = self.text[: min(found)], "stop"
            return self.rest()
        # U+FFFD: an incomplete UTF-8 character, whose next bytes come with the next token
        if self.text.endswith("\ufffd"):
            return ""
        held = max((k for stop in self.stops for k in range(1, len(stop)) if self.text.endswith(stop[:k])), default=0)
        return self.take(len(self.text) - held)

    def end_at_length(self):
        """The steps ran out (max_tokens) before an end: the held-back text goes out."""
        self.finish = self.finish or "length"
        return self.rest()

    def rest(self):
        return self.take(len(self.text))

    def take(self, upto):
        new = self.text[self.sent : upto]
        self.sent = max(self.sent, upto)
        return new


async def generate(engine, plans):
    """
    Run plans, each (steps, the Choices it fills, a row each), on the engine; yield (choice, new text) as text
    becomes final, and for each choice one last time with choice.finish set. The jobs are cancelled when their
    choices are finished, and all of them when the caller stops early (a client gone).
    """
    loop, events = asyncio.get_running_loop(), asyncio.Queue()

    def deliverer(i):  # runs on the worker thread: hands item over to this loop
        return lambda item: loop.call_soon_threadsafe(events.put_nowait, (i, item))

    jobs = [engine.submit(Job(steps, deliverer(i))) for i, (steps, _) in enumerate(plans)]
    running = set(range(len(jobs)))
    try:
        while running:
            i, item = await events.get()
            if i not in running:  # a step delivered before the job was seen to be finished
                continue
            rows = plans[i][1]
            if isinstance(item, Exception):
                raise item
            if item == DONE:
                running.discard(i)
                for choice in rows:
                    if not choice.finish:
                        yield choice, choice.end_at_length()
                continue
            for choice, token in zip(rows, item):
                if not choice.finish:
                    text = choice.add(token)
                    if text or choice.finish:
                        yield choice, text
            if all(choice.finish for choice in rows):  # every row ended (a stop string may end one early)
                jobs[i].cancelled = True
                running.discard(i)
    finally:
        for job in jobs:
            job.cancelled = True


async def one_result(engine, steps):
    """The one item that steps (a generator of one step) yields, computed on the engine's thread."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    engine.submit(Job(steps, lambda item: loop.call_soon_threadsafe(settle, done, item)))
    return await done


def settle(future, item):
    """Resolve a one-step job's future with its item, or its exception; DONE, which follows the item, is dropped."""
    if future.done():
        return
    if isinstance(item, Exception):
        future.set_exception(item)
    else:
        future.set_result(item)


# -----------------------------------------------------------------------------
# Requests: what the API takes, checked before anything runs

Temperature = Annotated[float | None, Field(ge=0, le=2)]  # 0: greedy; None: 1, OpenAI's default
TopP = Annotated[float | None, Field(gt=0, le=1)]  # None: 1, all tokens
TopK = Annotated[int | None, Field(ge=-1)]  # vLLM's extension: -1, 0 or None keep every token
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = StopText | Annotated[list[StopText], Field(max_length=MAX_STOPS)] | None
Seed = Annotated[int | None, Field(ge=0, lt=2**63)]
NoPenalty = Annotated[float, Field(ge=0, le=0)]  # accepted so that clients sending 0 work; anything else is refused


class Sampling(BaseModel):
    """The options both endpoints take. Unknown fields are refused, not ignored."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # the served model's name; None: the one model
    temperature: Temperature = None
    top_p: TopP = None
    top_k: TopK = None
    stop: Stop = None
    n: Annotated[int, Field(ge=1, le=16)] = 1
    seed: Seed = None  # None: a fresh random seed
    stream: bool = False
    stream_options: dict | None = None  # usage is always sent at the end of a stream
    user: str | None = None  # OpenAI's abuse monitoring; not used
    presence_penalty: NoPenalty = 0.0
    frequency_penalty: NoPenalty = 0.0

    def sampling(self):
        """generate.py's temperature, top_k and top_p, OpenAI's defaults filled in; 400 for an invalid mix."""
        options = {
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_k": self.top_k if self.top_k and self.top_k > 0 else None,
            "top_p": self.top_p,
        }
        if 0 < options["temperature"] < MIN_TEMPERATURE:
            raise APIError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}", "temperature")
        try:
            check_sampling_args(**options)
        except ValueError as err:
            raise APIError(str(err)) from None
        return options

    def stops(self):
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def generators(self, device, count):
        """count torch.Generators on device, seeded with seed, seed + 1, ...: the same seed gives the same text."""
        seed = secrets.randbits(62) if self.seed is None else self.seed
        return [torch.Generator(device).manual_seed(seed + k) for k in range(count)]


class CompletionRequest(Sampling):
    # a text, a list of ids, or a list of either; "" starts where a document starts (sample.py's empty --start)
    prompt: str | list[str] | list[int] | list[list[int]] = ""
    max_tokens: Annotated[int | None, Field(ge=0)] = 16  # OpenAI's default; None: up to the context's end
    logprobs: Annotated[int | None, Field(ge=0, le=20)] = None  # each token's log p and the k likeliest beside
    echo: bool = False  # the prompt's text (and with logprobs its tokens) before the completion


class ChatRequest(Sampling):
    messages: Annotated[list[dict], Field(min_length=1)]
    max_tokens: Annotated[int | None, Field(ge=1)] = None  # None: up to the context's end
    max_completion_tokens: Annotated[int | None, Field(ge=1)] = None  # OpenAI's newer name for max_tokens
    logprobs: Annotated[bool, Field(le=False)] = False  # /v1/completions gives logprobs; chat does not


class APIError(Exception):
    """A request the server refuses: answered with `status` and OpenAI's error body."""

    def __init__(self, message, param=None, status=400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def error_body(message, param=None, kind="invalid_request_error"):
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def fitted_max_tokens(asked, prompt_length, block_size, prompt_param):
    """max_tokens, checked to fit the context after the prompt; None (not given) is all the room left."""
    room = block_size - prompt_length
    if room < 0 or room == 0 and asked != 0:
        raise APIError(
            f"the prompt has {prompt_length} tokens, and this model's context holds {block_size} with at least one "
            "to generate: shorten it",
            prompt_param,
        )
    if asked is not None and asked > room:
        raise APIError(
            f"max_tokens={asked} does not fit: this model's context holds {block_size} tokens and the prompt has "
            f"{prompt_length}, so at most {room} more",
            "max_tokens",
        )
    return room if asked is None else asked


def text_message(message):
    """A message whose content is OpenAI's list of parts, with their text as its content; any other as it is."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    if not all(isinstance(part, dict) and isinstance(part.get("text"), str) for part in content):
        raise APIError("messages: only text content parts ({'type': 'text', 'text': ...}) are read", "messages")
    return {**message, "content": "".join(part["text"] for part in content)}


# -----------------------------------------------------------------------------
# Responses


def usage(prompt_tokens, choices):
    completion = sum(len(choice.tokens) for choice in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def sse(obj):
    """One server-sent event of a stream."""
    return f"data: {json.dumps(obj)}\n\n"


def logprobs_object(tokenizer, ids, logprobs, tops, start):
    """OpenAI's completion logprobs for ids[start:]: token strings, their log p, the likeliest beside, offsets."""
    strings = [tokenizer.decode([i]) for i in ids]
    offsets, at = [], 0
    for string in strings[start:]:
        offsets.append(at)
        at += len(string)
    return {
        "tokens": strings[start:],
        "token_logprobs": logprobs[start:],
        "top_logprobs": [None if top is None else {tokenizer.decode([i]): lp for i, lp in top} for top in tops[start:]],
        "text_offset": offsets,
    }


# -----------------------------------------------------------------------------
# The app


def make_app(served, *, api_key="", max_body=1_000_000):
    """The FastAPI app that serves `served`; its engine thread runs while the app does."""
    engine = Engine(served.device, served.dtype)
    model, tokenizer, block = served.model, served.tokenizer, served.model.config.block_size
    vocab = tokenizer.vocab_size  # ids are drawn below it: a padded embedding has rows that the tokenizer lacks
    created = int(time.time())

    async def lifespan(app):
        engine.thread.start()
        yield
        engine.stop()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Gate, api_key=api_key, max_body=max_body)
    app.state.engine = engine
    page = PAGE.read_text(encoding="utf-8")  # read once, here: no request reads a file

    @app.exception_handler(APIError)
    async def refused(request, err):
        return JSONResponse(error_body(err.message, err.param), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, err):
        first = err.errors()[0]
        if first["type"] == "json_invalid":
            return JSONResponse(error_body(f"the body is not valid JSON: {first['msg']}"), status_code=400)
        where = [str(part) for part in first["loc"] if part != "body"]
        if not where:  # not an object; or not read as JSON, for want of its Content-Type (curl -d sends a form's)
            message = "the body must be a JSON object, sent with 'Content-Type: application/json'"
            return JSONResponse(error_body(message), status_code=400)
        return JSONResponse(error_body(f"{'.'.join(where)}: {first['msg']}", where[0]), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request, err):
        return JSONResponse(error_body(str(err.detail)), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def failed(request, err):  # a bug, or the model failing: this request fails, the server goes on
        return JSONResponse(error_body(f"the server failed: {one_line(err)}", kind="server_error"), status_code=500)

    @app.get("/", response_class=HTMLResponse)
    async def chat_page():
        return page

    @app.get("/v1/models")
    async def models():
        entry = {"id": served.name, "object": "model", "created": created, "owned_by": "nanoformer"}
        # beside OpenAI's fields: the context length, as vLLM gives it, and whether chat works (the page asks)
        entry |= {"max_model_len": block, "chat": served.chat is not None}
        return {"object": "list", "data": [entry]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model, served)
        if body.logprobs is not None and body.stream:
            raise APIError("logprobs are given with stream=false only", "logprobs")
        prompts = completion_prompts(body.prompt, served)
        if len(prompts) * body.n > MAX_CHOICES:
            raise APIError(f"{len(prompts)} prompts x n={body.n} is more than {MAX_CHOICES} choices a request", "n")
        max_tokens = fitted_max_tokens(body.max_tokens, max(len(ids) for ids, _ in prompts), block, "prompt")
        sampling, stops, stop = body.sampling(), body.stops(), end_of_text(served.meta)
        end = [] if stop is None else [stop]
        plans = []  # prompt p's n samples: one batch, as sample.py --num_samples=n draws them; choices p * n + j
        for p, ((ids, shown), generator) in enumerate(zip(prompts, body.generators(served.device, len(prompts)))):
            rows = [Choice(p * body.n + j, tokenizer.decode, shown=shown, end=end, stops=stops) for j in range(body.n)]
            steps = completion_steps(
                model, ids, body.n, max_tokens, sampling, stop=stop, generator=generator, vocab=vocab
            )
            plans.append((steps, rows))
        choices = [choice for _, rows in plans for choice in rows]
        echoes = [tokenizer.decode(shown) if body.echo else "" for _, shown in prompts for _ in range(body.n)]
        head = {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": int(time.time())}
        head["model"] = served.name
        used = sum(len(ids) for ids, _ in prompts)

        def choice_chunk(index, text, finish):
            return {**head, "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish}]}

        if body.stream:

            async def chunks():
                for choice, echo in zip(choices, echoes):
                    if echo:
                        yield choice_chunk(choice.index, echo, None)
                async for choice, text in generate(engine, plans):
                    yield choice_chunk(choice.index, text, choice.finish)
                yield {**head, "choices": [], "usage": usage(used, choices)}

            return event_stream(chunks())

        async def whole():
            texts = list(echoes)
            async for choice, text in generate(engine, plans):
                texts[choice.index] += text
            scores = [None] * len(choices)
            if body.logprobs is not None:  # each choice scored after the fact, by one forward pass over it all
                for (ids, shown), rows in zip(prompts, (rows for _, rows in plans)):
                    for choice in rows:
                        full = ids + choice.tokens
                        found = await one_result(engine, score_steps(model, full, tokenizer.vocab_size, body.logprobs))
                        # echoed: from the prompt's shown text on, without the ids put before it (a bos)
                        start = len(ids) - len(shown) if body.echo else len(ids)
                        scores[choice.index] = logprobs_object(tokenizer, full, *found, start)
            return {
                **head,
                "choices": [
                    {"index": c.index, "text": texts[c.index], "logprobs": scores[c.index], "finish_reason": c.finish}
                    for c in choices
                ],
                "usage": usage(used, choices),
            }

        return await unless_disconnected(request, whole())

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        check_model(body.model, served)
        if served.chat is None:
            raise APIError(f"{served.name} has no chat template: use /v1/completions", "messages")
        try:
            prompt = served.chat.prompt_ids([text_message(m) for m in body.messages])
        except ValueError as err:  # a bad role or content, or a template that refuses the conversation
            raise APIError(f"messages: {one_line(err)}", "messages") from None
        max_tokens = fitted_max_tokens(body.max_completion_tokens or body.max_tokens, len(prompt), block, "messages")
        sampling, stops, end = body.sampling(), body.stops(), served.chat.end_of_turn
        plans = []  # each of the n replies decoded on its own, with seed + j: reply 0 is what n=1 gives
        for j, generator in enumerate(body.generators(served.device, body.n)):
            steps = reply_steps(model, prompt, max_tokens, sampling, end_of_turn=end, generator=generator, vocab=vocab)
            plans.append((steps, [Choice(j, tokenizer.decode, end=end, stops=stops)]))
        choices = [rows[0] for _, rows in plans]
        head = {"id": f"chatcmpl-{secrets.token_hex(12)}", "created": int(time.time()), "model": served.name}

        if body.stream:

            def delta_chunk(index, delta, finish):
                choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
                return {**head, "object": "chat.completion.chunk", "choices": [choice]}

            async def chunks():
                for choice in choices:
                    yield delta_chunk(choice.index, {"role": "assistant", "content": ""}, None)
                async for choice, text in generate(engine, plans):
                    yield delta_chunk(choice.index, {"content": text} if text else {}, choice.finish)
                yield {**head, "object": "chat.completion.chunk", "choices": [], "usage": usage(len(prompt), choices)}

            return event_stream(chunks())

        async def whole():
            texts = [""] * len(choices)
            async for choice, text in generate(engine, plans):
                texts[choice.index] += text
            replies = [{"role": "assistant", "content": text} for text in texts]
            return {
                **head,
                "object": "chat.completion",
                "choices": [
                    {"index": c.index, "message": replies[c.index], "logprobs": None, "finish_reason": c.finish}
                    for c in choices
                ],
                "usage": usage(len(prompt), choices),
            }

        return await unless_disconnected(request, whole())

    return app


def check_model(name, served):
    """404, as OpenAI answers, when a request names another model than the one served."""
    if name is not None and name != served.name:
        raise APIError(f"the model {name!r} does not exist; this server serves {served.name!r}", "model", status=404)


def completion_prompts(prompt, served):
    """
    [(ids the model reads, ids its text continues)] for each prompt of a request: a text gets the ids sample.py puts
    before it (a template's bos; "" starts where a document starts); ids are read as given.
    """
    single = isinstance(prompt, str) or bool(prompt) and isinstance(prompt[0], int)
    texts = [prompt] if single else prompt
    if not texts:
        raise APIError("prompt is an empty list", "prompt")
    vocab = served.tokenizer.vocab_size
    prompts = []
    for text in texts:
        if not isinstance(text, str):
            if not text or not all(0 <= i < vocab for i in text):
                raise APIError(f"prompt: a list of ids must be non-empty, each id below {vocab}", "prompt")
            prompts.append((text, text))
            continue
        try:
            shown = served.tokenizer.encode(text)
            prompts.append((prompt_start(served.tokenizer, served.meta, text) + shown, shown))
        except ValueError as err:  # characters outside a char vocabulary, or no start token for ""
            raise APIError(f"prompt: {one_line(err)}", "prompt") from None
    return prompts


def event_stream(chunks):
    """A text/event-stream response of chunks (dicts), ended by [DONE]; a failure mid-way is sent as an error."""

    async def events():
        try:
            async for chunk in chunks:
                yield sse(chunk)
        except Exception as err:  # the headers are sent: the error can only travel in the stream
            yield sse(error_body(f"generation failed: {one_line(err)}", kind="server_error"))
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def unless_disconnected(request, work):
    """
    The result of coroutine `work`, unless the client goes away first: then work is cancelled (and with it the
    request's jobs) and the answer, which nobody reads, is a bare 499.
    """
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(disconnected(request))
    await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    if not task.done():
        task.cancel()
        return Response(status_code=499)
    return task.result()


async def disconnected(request):
    """Returns when the client closes its connection."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Gate:
    """
    ASGI middleware in front of everything: /v1 requests without the API key (when one is set) get 401, and a body
    longer than max_body gets 413, before any of it is parsed.
    """

    def __init__(self, app, api_key, max_body):
        self.app, self.api_key, self.max_body = app, api_key, max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key and scope["path"].startswith("/v1"):
            given = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                message = "a valid API key is needed: send the header 'Authorization: Bearer KEY'"
                return await refuse(send, 401, message)
        if int(headers.get(b"content-length", b"0") or 0) > self.max_body:
            return await refuse(send, 413, f"the request body is longer than {self.max_body} bytes")
        received = 0

        async def limited():  # a body sent in chunks without a length is counted as it comes
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_body:
                raise HTTPException(413, f"the request body is longer than {self.max_body} bytes")
            return message

        await self.app(scope, limited, send)


async def refuse(send, status, message):
    """A JSON error response sent straight through ASGI."""
    body = json.dumps(error_body(message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# -----------------------------------------------------------------------------
# The command line


def load_served(cfg):
    """The Served model of cfg's source; ConfigError when it is not a GPT."""
    device = resolve_device(cfg.device, 0)
    dtype = resolve_dtype(cfg.dtype, device)
    model, tokenizer, meta, _ = load_configured(cfg, device)
    arch = model.config.arch
    if arch != "gpt":
        raise ConfigError(
            f"{model_name(cfg)} holds an {arch.replace('_', '-')} model; serve.py serves GPTs (decoders) only: "
            "use sample.py for it"
        )
    try:
        chat_format = model_format(meta, cfg.init_from)
    except ValueError:  # no chat template: completions (and the page's completion box) only
        chat_format = None
    return Served(model, tokenizer, meta, model_name(cfg), chat_format, device, dtype)


def main(cfg):
    """Load the model and serve it until interrupted."""
    api_key = cfg.api_key or os.environ.get(API_KEY_VARIABLE, "")
    served = load_served(cfg)
    app = make_app(served, api_key=api_key, max_body=cfg.max_body)
    print(f"serving {served.name} on http://{cfg.host}:{cfg.port} (the chat page at /)", file=sys.stderr)
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning")


def cli(argv):
    """The command line; returns the exit status: 2 with a one-line message for bad input."""
    try:
        main(parse_config(ServeConfig, argv))
    except (ValueError, OSError, ImportError) as err:
        print(f"serve.py: error: {one_line(err)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
