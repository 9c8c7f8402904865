"""
An OpenAI-compatible HTTP server for a GPT from any source sample.py loads, and a chat page to talk to it.

    python serve.py --out_dir=out-chat                      # http://127.0.0.1:8000: the chat page
    python serve.py --init_from=path/to/SmolLM2-135M-Instruct --port=8080
    NANOFORMER_API_KEY=secret python serve.py --out_dir=out-chat --host=0.0.0.0

    GET  /v1/models             the one model, named after its source
    POST /v1/completions        prompt (text, ids, or a list of either), logprobs and echo to score a prompt
    POST /v1/chat/completions   messages, rendered with the model's chat template (the one sample.py --chat uses)
    POST /tokenize, /detokenize and GET /tokenizer_info: the model's tokenizer, as vLLM serves it (lm-eval asks)
    GET  /health                200 once the model is loaded, 503 before
    GET  /metrics               Prometheus text: requests running and waiting, tokens generated, tokens a second
    GET  /                      the chat page (serve.html); a completion box for a model without a chat template

How several clients share one model: the handlers (API, on uvicorn's asyncio loop) turn each request into
engine.Requests, one per prompt with a row per sample, and Choices, which turn each row's ids into text. One worker
thread (engine.Engine) owns the model and decodes every running row in one forward pass a step (continuous
batching): rows that end leave between steps, and waiting requests join as the budget (--max_batch rows,
--max_positions positions) allows. What a step produces reaches its request through the loop; a request whose
client leaves is cancelled, and its rows are freed before the next step.
"""

import asyncio
import contextlib
import functools
import hmac
import json
import os
import re
import secrets
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

import engine
from chat import model_format
from config import ConfigError, parse_config
from generate import check_sampling_args, end_of_text, fit_conversation, prompt_start
from log import one_line
from runtime import DTYPES, pick_threads, resolve_device, resolve_dtype
from start import load_configured

PAGE = Path(__file__).resolve().parent / "serve.html"  # the chat page, one self-contained file
API_KEY_VARIABLE = "NANOFORMER_API_KEY"  # the key, when --api_key is not given (a command line shows in `ps`)
MAX_STOPS = 256  # stop strings a request may give (OpenAI allows 4; lm-eval sends its task's and eos)
MAX_STOP_CHARS = 256  # characters of each: every token checks whether the text ends in the start of one
MAX_CHOICES = 64  # prompts x n of one completion request
# the smallest temperature that is not 0: logits divided by less overflow to inf, and the softmax to NaN
MIN_TEMPERATURE = 0.01
SHUTDOWN_GRACE = 5  # seconds the HTTP server waits at exit for responses to go out before it cancels them
RETRY_AFTER = 1  # seconds a client refused for a full waiting line is told to wait (429's Retry-After)
CONTEXT_IDS = 6  # ids decoded before a new one, so that its text comes out as it does in context (a leading space)


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
    max_batch: int = 16  # rows (prompts x n) decoded together at most; further requests wait
    max_positions: int = 0  # KV cache positions of all rows (rows x the longest row's); 0: max_batch x block_size
    prefill_chunk: int = 256  # prompt ids fed a step: a long prompt takes several, and the running rows keep pace
    context: str = "drop"  # a chat longer than the context: "drop" its oldest turns (as sample.py --chat), "refuse"
    max_messages: int = 10_000  # messages a conversation may hold; more are refused with 400
    max_waiting: int = 1024  # prompts that may wait for room in the batch; then requests get 429 and Retry-After
    request_timeout: float = 1800.0  # seconds a request may take once accepted, waiting included (then 504); 0: none
    strict: bool = False  # refuse unknown request fields with 400; False: ignore them (each named once on stderr)
    device: str = "auto"  # "cpu", "cuda", "cuda:1", "mps"; "auto": cuda, else mps, else cpu
    dtype: str = "auto"  # "float32", "bfloat16" or "float16" (autocast); "auto": as in train.py
    compile: bool = False  # torch.compile the layers: a slow first step, faster ones after it
    threads: int = 0  # the model's intra-op threads; 0: the cores other jobs leave free, less one for the HTTP loop

    def __post_init__(self):
        if not 1 <= self.port <= 65535:
            raise ValueError(f"port must be in [1, 65535], got {self.port}")
        if self.max_body < 1:
            raise ValueError(f"max_body must be at least 1 byte, got {self.max_body}")
        if self.max_batch < 1 or self.max_positions < 0 or self.prefill_chunk < 1 or self.threads < 0:
            raise ValueError("max_batch and prefill_chunk must be at least 1, max_positions and threads at least 0")
        if self.max_messages < 1 or self.max_waiting < 1 or self.request_timeout < 0:
            raise ValueError("max_messages and max_waiting must be at least 1, request_timeout at least 0")
        if self.context not in ("drop", "refuse"):
            raise ValueError(f"context must be 'drop' or 'refuse', got {self.context!r}")
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

    def special_ids(self):
        """The ids that stand for no text: the meta's special tokens and a tokenizer.json's own."""
        ids = set(self.meta["special_tokens"].values())
        if self.tokenizer.hf is not None:
            ids |= {i for i, token in self.tokenizer.hf.get_added_tokens_decoder().items() if token.special}
        return frozenset(ids)


def model_name(cfg):
    """The served model's name: its run folder's, or its checkpoint file's, folder's or hub id's."""
    if cfg.init_from == "resume":
        return Path(cfg.out_dir).name
    return Path(cfg.init_from).name if Path(cfg.init_from).expanduser().exists() else cfg.init_from


# -----------------------------------------------------------------------------
# Text: a choice's ids as text, sent as it becomes final


class Choice:
    """
    One row's text as its ids arrive. Each new id is decoded with a few ids before it (after `shown`, the prompt ids
    its text continues), so that its text is what it is in context, and only text that is final goes out: a
    character that BPE split over several ids waits for the rest (U+FFFD until then), and an ending that may be the
    start of a stop string waits for what follows. Ids in `end` finish it, ids in `skip` give no text (specials).
    Each id's log p and likeliest (engine.Token) are kept for the logprobs.
    """

    def __init__(self, index, decode, *, shown=(), end=(), stops=(), skip=()):
        self.index, self.decode, self.end, self.stops, self.skip = index, decode, set(end), stops, set(skip)
        self.window = [i for i in shown if i not in self.skip][-CONTEXT_IDS:]  # ids decoded before the new ones
        self.head = decode(self.window)  # their text, cut from what the window decodes to
        self.longest = max(map(len, stops), default=0)
        self.starts = {}  # stops by their first character: candidates for a held ending
        for stop in stops:
            self.starts.setdefault(stop[0], []).append(stop)
        self.tokens = []  # every id drawn (engine.Token), an ending end-of-text or end-of-turn id included
        self.prompt = None  # the prompt's [(log p, top)] when scored
        self.text = ""  # the text so far
        self.sent = 0  # characters of it handed out
        self.finish = None  # "stop" (end token or stop string) or "length"

    def add(self, token):
        """Take the next engine.Token; returns the text that may go out now."""
        self.tokens.append(token)
        if token.id in self.end:
            self.finish = "stop"
            return self.rest()
        if token.id in self.skip:
            return ""
        self.window.append(token.id)
        decoded = self.decode(self.window)
        # U+FFFD: an incomplete UTF-8 character, whose next bytes come with the next id
        if decoded.endswith("\ufffd"):
            return ""
        checked = max(0, len(self.text) - self.longest + 1)  # a stop string found now ends in the new text
        self.text += decoded[len(self.head) :]
        self.window = self.window[-CONTEXT_IDS:]
        self.head = self.decode(self.window)
        found = [at for at in (self.text.find(stop, checked) for stop in self.stops) if at >= 0]
        if found:
            self.text, self.finish = self.text[: min(found)], "stop"
            return self.take(len(self.text))
        return self.take(len(self.text) - self.held())

    def held(self):
        """Characters at the end of the text that start a stop string: the longest such ending."""
        tail = self.text[max(0, len(self.text) - self.longest + 1) :]
        for i, c in enumerate(tail):
            if any(stop.startswith(tail[i:]) for stop in self.starts.get(c, ())):
                return len(tail) - i
        return 0

    def end_at_length(self):
        """The ids ran out (max_tokens) before an end: the held-back text goes out."""
        self.finish = self.finish or "length"
        return self.rest()

    def rest(self):
        """All the text not sent yet, with that of bytes whose character never completed (as U+FFFD)."""
        self.text += self.decode(self.window)[len(self.head) :]
        self.head = self.decode(self.window)
        return self.take(len(self.text))

    def take(self, upto):
        new = self.text[self.sent : upto]
        self.sent = max(self.sent, upto)
        return new


async def generate(engine_, plans, live, timeout=0):
    """
    Run plans, each (engine.Request, its Choices: one a row), on the engine; yield (choice, new text) as text becomes
    final, and for each choice one last time with choice.finish set. What arrived together goes out together: a
    choice's text of several steps in one piece, when the loop is behind the engine. A row whose text reached a stop
    string is ended at once; every request is cancelled when the caller stops early (its client gone), or when it
    runs past `timeout` seconds (0: no limit), which raises APIError 504. The requests are in the set `live` while
    they run, so that API.close can end them.
    """
    inbox = Inbox(asyncio.get_running_loop())
    until = time.monotonic() + timeout if timeout else None
    for k, (request, _) in enumerate(plans):
        request.deliver = functools.partial(inbox.put, k)
        live.add(request)
        engine_.submit(request)
    running = set(range(len(plans)))
    try:
        # checked after they joined `live`: a server that stopped its engine before then will not end them
        if not engine_.thread.is_alive():
            raise shutting_down()
        while running:
            new = {}  # choice -> its text from the items taken now
            try:
                items = await inbox.take(until)
            except TimeoutError:
                raise APIError(
                    f"the request ran past this server's time limit of {timeout:g} s (--request_timeout): ask for "
                    "fewer tokens, or try again when the server is less busy",
                    status=504,
                    kind="timeout",
                ) from None
            for k, item in items:
                if k in running:
                    add_item(item, *plans[k], new, running, k)
            for choice, text in new.items():
                yield choice, text
    finally:
        for request, _ in plans:
            request.cancelled = True
            live.discard(request)


def add_item(item, request, choices, new, running, k):
    """What the engine handed plan k (request, choices): its text gathered in `new`; k leaves `running` when done."""
    if isinstance(item, Exception):
        raise item
    if item == engine.DONE:
        running.discard(k)
        for choice in choices:
            if not choice.finish:
                new[choice] = new.get(choice, "") + choice.end_at_length()
        return
    for choice in choices if item.prompt is not None else ():
        choice.prompt = item.prompt
    for token in item.tokens:
        choice = choices[token.row]
        if choice.finish:  # drawn before the engine saw that its text had ended
            continue
        text = choice.add(token)
        request.ended[token.row] = choice.finish is not None
        if text or choice.finish:
            new[choice] = new.get(choice, "") + text


class Inbox:
    """
    What the worker thread hands a request's plans, for the loop: put (on the worker thread) appends and wakes the
    loop unless a wake-up is already on its way, take (on the loop) returns all that arrived.
    """

    def __init__(self, loop):
        self.loop, self.items, self.ready = loop, deque(), asyncio.Event()
        self.waking = False  # a wake-up is scheduled on the loop and has not run yet

    def put(self, k, item):
        self.items.append((k, item))
        if not self.waking:
            self.waking = True
            self.loop.call_soon_threadsafe(self.wake)

    def wake(self):
        self.waking = False
        self.ready.set()

    async def take(self, until=None):
        """All that arrived, once something has; TimeoutError past `until` (a time.monotonic()), when given."""
        while True:
            if until is not None and time.monotonic() > until:
                raise TimeoutError
            if self.items:
                return [self.items.popleft() for _ in range(len(self.items))]
            self.ready.clear()
            if until is None:
                await self.ready.wait()
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.ready.wait(), until - time.monotonic())


# -----------------------------------------------------------------------------
# Requests: what the API takes, checked before anything runs

Temperature = Annotated[float | None, Field(ge=0, le=2)]  # 0: greedy; None: 1, OpenAI's default
TopP = Annotated[float | None, Field(gt=0, le=1)]  # None: 1, all tokens
TopK = Annotated[int | None, Field(ge=-1)]  # vLLM's extension: -1, 0 or None keep every token
MinP = Annotated[float | None, Field(ge=0, le=1)]  # vLLM's extension: 0 or None keep every token
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = StopText | Annotated[list[StopText], Field(max_length=MAX_STOPS)] | None
Seed = Annotated[int | None, Field(ge=0, lt=2**63)]
NoPenalty = Annotated[float, Field(ge=0, le=0)]  # accepted so that clients sending 0 work; anything else is refused
Bias = Annotated[float, Field(ge=-100, le=100)]  # OpenAI's range
TopLogprobs = Annotated[int | None, Field(ge=0, le=20)]


# what a field must be, in words, for the fields whose pydantic errors would not say it plainly: unions (whose errors
# name the member tried) and fields accepted only at the value that changes nothing
FIELD_RULES = {
    "prompt": "must be a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": f"must be a string or a list of at most {MAX_STOPS} strings, each of 1 to {MAX_STOP_CHARS} characters",
    "presence_penalty": "only 0 is supported",
    "frequency_penalty": "only 0 is supported",
    "suffix": "only null or an empty string is supported: inserting text is not implemented",
    "tools": "only none or an empty list is supported: calling tools is not implemented",
    "functions": "only none or an empty list is supported: calling functions is not implemented",
}


class Options(BaseModel):
    """
    What both endpoints take. Fields this server does not know are kept apart (model_extra) for API.ready, which
    ignores them or, with --strict, refuses them; known ones whose value would change the output in a way not
    implemented are refused.
    """

    model_config = ConfigDict(extra="allow")

    model: str | None = None  # the served model's name; None: the one model
    temperature: Temperature = None
    top_p: TopP = None
    top_k: TopK = None
    min_p: MinP = None
    logit_bias: dict[str, Bias] | None = None  # token id (a string, as JSON keys are) -> added to its logit
    stop: Stop = None
    n: Annotated[int, Field(ge=1, le=16)] = 1
    seed: Seed = None  # None: a fresh random seed
    stream: bool = False
    stream_options: dict | None = None  # {"include_usage": true}: a last chunk with the usage
    presence_penalty: NoPenalty = 0.0
    frequency_penalty: NoPenalty = 0.0
    response_format: dict | None = None  # only {"type": "text"}, which is what every reply is

    def sampling(self, vocab_size):
        """engine.Sampling of these options, OpenAI's defaults filled in; 400 for an invalid mix."""
        temperature = 1.0 if self.temperature is None else self.temperature
        if 0 < temperature < MIN_TEMPERATURE:
            raise APIError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}", "temperature")
        if self.response_format is not None and self.response_format.get("type") != "text":
            kind = self.response_format.get("type")
            raise APIError(f"response_format: type {kind!r} is not supported; only 'text' is", "response_format")
        bias = []
        for key, value in (self.logit_bias or {}).items():
            # ASCII digits, not isdigit()'s ("²", which int() refuses), and few: int() refuses 5,000 of them
            if not re.fullmatch("[0-9]{1,18}", key) or int(key) >= vocab_size:
                raise APIError(
                    f"logit_bias: its keys are token ids, 0 to {vocab_size - 1}; {key[:20]!r} is not one", "logit_bias"
                )
            bias.append((int(key), value))
        top_k = self.top_k if self.top_k and self.top_k > 0 else None
        try:
            check_sampling_args(temperature, top_k, self.top_p, self.min_p)
        except ValueError as err:
            raise APIError(str(err)) from None
        return engine.Sampling(temperature, top_k, self.top_p, self.min_p or None, tuple(bias))

    def stops(self):
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def generators(self, device, count):
        """count torch.Generators on device, seeded with seed, seed + 1, ...: the same seed gives the same text."""
        seed = secrets.randbits(62) if self.seed is None else self.seed
        return [torch.Generator(device).manual_seed(seed + k) for k in range(count)]

    def include_usage(self):
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(Options):
    # a text, a list of ids, or a list of either; "" starts where a document starts (sample.py's empty --start)
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Annotated[int | None, Field(ge=0)] = 16  # OpenAI's default; None: up to the context's end
    logprobs: Annotated[int | None, Field(ge=0, le=20)] = None  # each token's log p and the k likeliest beside
    echo: bool = False  # the prompt's text (and with logprobs its tokens) before the completion
    best_of: Annotated[int | None, Field(ge=1)] = None  # accepted as n: the best of more is not implemented
    suffix: Annotated[str | None, Field(max_length=0)] = None  # insertion is not implemented
    truncate_prompt_tokens: Annotated[int | None, Field(ge=1)] = None  # vLLM's: keep the prompt's last N ids
    skip_special_tokens: bool = True  # vLLM's: special tokens (end-of-turn) give no text


class ChatRequest(Options):
    messages: Annotated[list[dict], Field(min_length=1)]
    max_tokens: Annotated[int | None, Field(ge=1)] = None  # None: up to the context's end
    max_completion_tokens: Annotated[int | None, Field(ge=1)] = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False  # each reply token's log p
    top_logprobs: TopLogprobs = None  # and that many likeliest beside it
    tools: Annotated[list | None, Field(max_length=0)] = None  # calling tools is not implemented: none or []
    functions: Annotated[list | None, Field(max_length=0)] = None  # tools' older name


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a text (with the template's bos when add_special_tokens) or a conversation."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int]


class APIError(Exception):
    """A request the server refuses or ends: answered with `status`, OpenAI's error body (of type `kind`), headers."""

    def __init__(self, message, param=None, status=400, kind="invalid_request_error", headers=None):
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.headers = message, param, status, kind, headers


def shutting_down():
    """The 503 of a request that the server, stopping, will not answer."""
    return APIError("the server is shutting down", status=503, kind="server_error")


def error_body(message, param=None, kind="invalid_request_error"):
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def check_model(name, served):
    """404, as OpenAI answers, when a request names another model than the one served."""
    if name is not None and name != served.name:
        raise APIError(f"the model {name!r} does not exist; this server serves {served.name!r}", "model", status=404)


def fitted_max_tokens(asked, prompt_length, block_size, prompt_param, asked_param="max_tokens"):
    """max_tokens (named asked_param), checked to fit the context after the prompt; None is all the room left."""
    room = block_size - prompt_length
    if room < 0 or room == 0 and asked != 0:
        raise APIError(
            f"the prompt has {prompt_length} tokens, and this model's context holds {block_size} with at least one "
            "to generate: shorten it",
            prompt_param,
        )
    if asked is not None and asked > room:
        raise APIError(
            f"{asked_param}={asked} does not fit: this model's context holds {block_size} tokens and the prompt has "
            f"{prompt_length}, so at most {room} more",
            asked_param,
        )
    return room if asked is None else asked


def completion_prompts(prompt, served, truncate=None):
    """
    [(ids the model reads, ids its text continues)] for each prompt of a request: a text gets the ids sample.py puts
    before it (a template's bos; "" starts where a document starts); ids are read as given. truncate: the most ids
    read, the prompt's last ones kept after the ids put before it (vLLM's truncate_prompt_tokens).
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
            head, shown = [], text
        else:
            try:
                shown = served.tokenizer.encode(text)
                head = prompt_start(served.tokenizer, served.meta, text)
            except ValueError as err:  # characters outside a char vocabulary, or no start token for ""
                raise APIError(f"prompt: {one_line(err)}", "prompt") from None
        if truncate is not None and len(head) + len(shown) > truncate:
            if truncate <= len(head):
                raise APIError(f"truncate_prompt_tokens must keep more than the {len(head)} ids put first", "prompt")
            shown = shown[len(shown) - (truncate - len(head)) :]
        prompts.append((head + shown, shown))
    return prompts


def fit_long_conversation(chat, messages, block_size, room, tokenizer):
    """
    generate.fit_conversation's (messages, prompt ids), found in time linear in the messages: it drops the oldest
    exchange and renders the rest again until they fit, quadratic in a long conversation (8,000 one-letter messages
    held the server for a minute). Here the whole conversation is rendered once and the cut estimated from each
    message's tokens (its content's, and an even share of what the template adds); then only what is kept, about
    half a context, is rendered again, an exchange at a time, until the cut is where fit_conversation puts it.
    """
    prompt = chat.prompt_ids(messages)  # a bad message raises here, before anything else reads it
    if len(prompt) + room <= block_size:
        return messages, prompt
    head = messages[:1] if messages[0]["role"] == "system" else []
    turns = messages[len(head) :]
    # where what is kept may begin, in the order fit_conversation tries them: the first message, each later user
    # message, and last the final message alone
    starts = [0, *(i for i, m in enumerate(turns) if i and m["role"] == "user")]
    if starts[-1] != len(turns) - 1:
        starts.append(len(turns) - 1)
    sizes = [len(ids) for ids in tokenizer.encode_batch([m["content"] for m in messages])]
    share = (len(prompt) - sum(sizes)) / len(messages)  # the template's own tokens, spread over the messages
    target = min(block_size // 2, block_size - room)  # fit_conversation's: at most half the context
    tail = [0.0] * (len(turns) + 1)  # tail[i]: the estimated tokens of turns[i:]
    for i in range(len(turns) - 1, -1, -1):
        tail[i] = tail[i + 1] + sizes[len(head) + i] + share
    base = sum(sizes[: len(head)]) + share * len(head)
    at = next((k for k, start in enumerate(starts) if base + tail[start] <= target), len(starts) - 1)

    def kept(k):
        return [*head, *turns[starts[k] :]]

    ids = chat.prompt_ids(kept(at))
    if len(ids) <= target:  # the estimate may cut too much: earlier exchanges come back while they fit
        while at > 0 and len(chat.prompt_ids(kept(at - 1))) <= target:
            at -= 1
    else:  # or too little: later ones go
        while at < len(starts) - 1 and len(ids) > target:
            at += 1
            ids = chat.prompt_ids(kept(at))
    # what is left fits (returned as it is) or is the final message alone, which fit_conversation refuses or keeps
    return fit_conversation(chat, kept(at), block_size, room)


def text_message(message):
    """A message whose content is OpenAI's list of parts, with their text as its content; any other as it is."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    if not all(isinstance(part, dict) and isinstance(part.get("text"), str) for part in content):
        raise APIError("messages: only text content parts ({'type': 'text', 'text': ...}) are read", "messages")
    return {**message, "content": "".join(part["text"] for part in content)}


# -----------------------------------------------------------------------------
# Responses: what each endpoint's answer and chunks look like


def usage(prompt_tokens, choices):
    completion = sum(len(choice.tokens) for choice in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def sse(obj):
    """One server-sent event of a stream."""
    return f"data: {json.dumps(obj)}\n\n"


class CompletionShape:
    """/v1/completions' answer: each choice's text (the prompt's first with echo) and legacy logprobs."""

    def __init__(self, served, prompts, body):
        self.tokenizer, self.n, self.echo, self.scored = served.tokenizer, body.n, body.echo, body.logprobs is not None
        self.head = {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": int(time.time())}
        self.head["model"] = served.name
        self.prompts = prompts
        self.prompt_tokens = sum(len(ids) for ids, _ in prompts)
        self.reported = {}  # choice index -> (entries of logprobs sent, their characters), as a stream goes

    def opening(self, choices):
        return []

    def chunk(self, choice, text):
        """A stream's chunk: the choice's new text, and the logprobs of the ids since its last chunk."""
        first = choice.index not in self.reported
        entries, chars = self.reported.get(choice.index, (0, 0))
        shown, logprobs = self.entries(choice), None
        if self.scored:
            logprobs = self.logprobs(shown[entries:], chars)
            self.reported[choice.index] = (len(shown), chars + sum(map(len, logprobs["tokens"])))
        else:
            self.reported[choice.index] = (0, 0)
        text = (self.echo_text(choice) if first else "") + text
        piece = {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": choice.finish}
        return {**self.head, "choices": [piece]}

    def whole(self, choices):
        return {
            **self.head,
            "choices": [
                {
                    "index": c.index,
                    "text": self.echo_text(c) + c.text,
                    "logprobs": self.logprobs(self.entries(c), 0) if self.scored else None,
                    "finish_reason": c.finish,
                }
                for c in choices
            ],
            "usage": usage(self.prompt_tokens, choices),
        }

    def echo_text(self, choice):
        return self.tokenizer.decode(self.prompts[choice.index // self.n][1]) if self.echo else ""

    def entries(self, choice):
        """(id, log p, likeliest) of each id the choice shows: with echo the prompt's (the first has no log p) first."""
        entries = [(t.id, t.logprob, t.top) for t in choice.tokens]
        if not self.echo:
            return entries
        ids, shown = self.prompts[choice.index // self.n]
        scores = [(None, None), *(choice.prompt or [(None, None)] * (len(ids) - 1))]
        return [(i, *score) for i, score in zip(ids, scores)][len(ids) - len(shown) :] + entries

    def logprobs(self, entries, start):
        """OpenAI's completion logprobs of entries: token strings, their log p, the likeliest beside, offsets."""
        strings = [self.tokenizer.decode([i]) for i, _, _ in entries]
        offsets, at = [], start
        for string in strings:
            offsets.append(at)
            at += len(string)
        return {
            "tokens": strings,
            "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [
                None if top is None else {self.tokenizer.decode([i]): v for i, v in top} for *_, top in entries
            ],
            "text_offset": offsets,
        }


class ChatShape:
    """/v1/chat/completions' answer: each choice's message, chat logprobs, and how many old messages were dropped."""

    def __init__(self, served, prompt_tokens, dropped, body):
        self.tokenizer, self.scored = served.tokenizer, body.logprobs
        self.head = {"id": f"chatcmpl-{secrets.token_hex(12)}", "created": int(time.time()), "model": served.name}
        self.prompt_tokens, self.dropped = prompt_tokens, dropped
        self.reported = {}  # choice index -> ids whose logprobs were sent

    def opening(self, choices):
        """The stream's first chunks: each choice's role, and the messages dropped to fit the context."""
        head = {**self.head, "object": "chat.completion.chunk"} | self.said()
        return [self.piece(head, c.index, {"role": "assistant", "content": ""}, None, None) for c in choices]

    def chunk(self, choice, text):
        done = self.reported.get(choice.index, 0)
        self.reported[choice.index] = len(choice.tokens)
        logprobs = self.logprobs(choice.tokens[done:], choice) if self.scored else None
        head = {**self.head, "object": "chat.completion.chunk"}
        return self.piece(head, choice.index, {"content": text} if text else {}, logprobs, choice.finish)

    def whole(self, choices):
        return {
            **self.head,
            "object": "chat.completion",
            **self.said(),
            "choices": [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": self.logprobs(c.tokens, c) if self.scored else None,
                    "finish_reason": c.finish,
                }
                for c in choices
            ],
            "usage": usage(self.prompt_tokens, choices),
        }

    @staticmethod
    def piece(head, index, delta, logprobs, finish):
        return {**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    def said(self):
        """Beside OpenAI's fields: how many of the oldest messages the reply did not see, when any."""
        return {"dropped_messages": self.dropped} if self.dropped else {}

    def logprobs(self, tokens, choice):
        """OpenAI's chat logprobs of engine.Tokens, those that end the reply left out."""
        return {"content": [self.entry(t.id, t.logprob, t.top) for t in tokens if t.id not in choice.end]}

    def entry(self, token, logprob, top):
        """One token of chat logprobs: its text, log p and UTF-8 bytes, and the likeliest beside it."""
        return self.token(token, logprob) | {"top_logprobs": [self.token(i, lp) for i, lp in top or ()]}

    def token(self, token, logprob):
        text = self.tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


# -----------------------------------------------------------------------------
# The API: one handler per endpoint, and one path that runs a request's plans and answers


class API:
    """
    The server's handlers, around the Served model and its engine, which load() sets; until then every endpoint
    but /health (503) and the page answers 503. strict: unknown fields are refused (else ignored, each named once
    on stderr); context: "drop" fits a long conversation by dropping its oldest turns, "refuse" answers 400;
    max_messages, max_waiting and request_timeout as ServeConfig says.
    """

    def __init__(self, *, strict=False, context="drop", max_messages=10_000, max_waiting=1024, request_timeout=1800.0):
        self.strict, self.context, self.max_messages = strict, context, max_messages
        self.max_waiting, self.request_timeout = max_waiting, request_timeout
        self.served = self.engine = None
        self.live = set()  # the engine.Requests being answered, which close() ends
        self.closing = False  # close() was called: requests get 503
        self.special_ids = frozenset()  # the served model's special tokens (Served.special_ids)
        self.specials = {}  # the text of each of them -> its id, for /tokenize
        self.ignored = set()  # unknown fields named so far
        self.page = PAGE.read_text(encoding="utf-8")  # read once, here: no request reads a file
        self.created = int(time.time())

    def load(self, served, *, max_batch=16, max_positions=0, prefill_chunk=256):
        """Serve `served`: its engine starts (rows and positions budgeted as ServeConfig says)."""
        max_positions = max_positions or max_batch * served.model.config.block_size
        runner = engine.Runner(
            served.model,
            served.tokenizer.vocab_size,
            dtype=served.dtype,
            max_rows=max_batch,
            max_positions=max_positions,
        )
        scheduler = engine.Scheduler(max_batch, max_positions, chunk=prefill_chunk)
        self.engine = engine.Engine(runner, scheduler, served.device, served.dtype)
        self.engine.start()
        self.special_ids = served.special_ids()
        decoded = {served.tokenizer.decode([i]): i for i in sorted(self.special_ids)}
        self.specials = {text: i for text, i in decoded.items() if text}
        self.served = served  # the last: requests see the model once all of it is ready

    def close(self):
        """
        Stop the engine (its thread ends after the step under way), then end every request it held: 503, or in a
        stream an error event. Called from another thread than the loop's (Ctrl-C), or again at the app's shutdown.
        """
        self.closing = True
        if self.engine is None:
            return
        self.engine.stop()
        for request in list(self.live):  # a copy, taken at once: the loop's thread adds and removes requests
            request.deliver(shutting_down())

    def ready(self, body=None):
        """The Served model (503 while loading), once body names it (404) and has no unknown field (with strict)."""
        if self.closing:
            raise shutting_down()
        if self.served is None:
            raise APIError(
                "the model is still loading: try again shortly (GET /health answers 200 once it is)", status=503
            )
        if body is not None:
            check_model(body.model, self.served)
            for name in body.model_extra or {}:
                if self.strict:
                    raise APIError(f"{name}: not a field this server reads (--strict refuses unknown fields)", name)
                if name not in self.ignored:
                    self.ignored.add(name)
                    print(f"serve.py: note: ignoring the unknown field {name!r} (--strict refuses it)", file=sys.stderr)
        return self.served

    async def page_html(self):
        return HTMLResponse(self.page)

    async def health(self):
        self.ready()
        return Response(status_code=200)

    async def metrics(self):
        self.ready()
        running, waiting, generated, rate = self.engine.stats()
        lines = []
        for name, kind, value, doc in [
            ("requests_running", "gauge", running, "Requests being prefilled or decoded."),
            (
                "requests_waiting",
                "gauge",
                waiting,
                "Requests waiting for room in the batch (--max_batch, --max_positions).",
            ),
            ("generation_tokens_total", "counter", generated, "Tokens generated since the server started."),
            (
                "generation_tokens_per_second",
                "gauge",
                rate,
                f"Tokens generated a second over the last {engine.RATE_WINDOW:g} s.",
            ),
        ]:
            lines += [
                f"# HELP nanoformer_{name} {doc}",
                f"# TYPE nanoformer_{name} {kind}",
                f"nanoformer_{name} {value:g}",
            ]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def models(self):
        served = self.ready()
        entry = {"id": served.name, "object": "model", "created": self.created, "owned_by": "nanoformer"}
        # beside OpenAI's fields: the context length, as vLLM gives it, and whether chat works (the page asks)
        entry |= {"max_model_len": served.model.config.block_size, "chat": served.chat is not None}
        return {"object": "list", "data": [entry]}

    async def tokenize(self, body: TokenizeRequest):
        served = self.ready(body)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("prompt: give a prompt (a text) or messages, one of the two", "prompt")
        if body.messages is not None:
            if served.chat is None:
                raise APIError(f"{served.name} has no chat template: tokenize a prompt", "messages")
            self.check_length(body.messages)
        ids = await run_in_threadpool(self.tokenize_ids, body)  # a long text takes a while: not on the loop
        return {"count": len(ids), "max_model_len": served.model.config.block_size, "tokens": ids, "token_strs": None}

    def tokenize_ids(self, body):
        """The ids /tokenize answers with: of the messages rendered, or of the prompt after its template's start."""
        try:
            if body.messages is not None:
                messages = [text_message(m) for m in body.messages]
                return self.served.chat.render(messages, add_generation_prompt=body.add_generation_prompt)[0]
            head = self.served.tokenizer.template_prefix() if body.add_special_tokens else []
            return head + self.encode(body.prompt)
        except ValueError as err:
            param = "prompt" if body.messages is None else "messages"
            raise APIError(f"{param}: {one_line(err)}", param) from None

    def encode(self, text):
        """The ids of text, where a special token's text stands for the token, as Hugging Face tokenizers read it."""
        if not self.specials:
            return self.served.tokenizer.encode(text)
        pattern = "|".join(map(re.escape, sorted(self.specials, key=len, reverse=True)))
        parts = re.split(f"({pattern})", text)  # texts, with each special token's text between two of them
        return [
            i
            for k, part in enumerate(parts)
            for i in ([self.specials[part]] if k % 2 else self.served.tokenizer.encode(part))
        ]

    async def detokenize(self, body: DetokenizeRequest):
        served = self.ready(body)
        if not all(0 <= i < served.tokenizer.vocab_size for i in body.tokens):
            raise APIError(f"tokens: each id must be below {served.tokenizer.vocab_size}", "tokens")
        return {"prompt": served.tokenizer.decode(body.tokens)}

    async def tokenizer_info(self):
        """vLLM's /tokenizer_info, as lm-eval reads it: the special tokens' texts (bos: where a document starts)."""
        served = self.ready()
        tokenizer, special = served.tokenizer, served.meta["special_tokens"]
        bos = (tokenizer.template_prefix() or [special.get("bos")])[0]
        eos = end_of_text(served.meta)
        chat = served.meta.get("chat") or {}
        return {
            "tokenizer_class": f"nanoformer ({served.meta['tokenizer']['type']})",
            "model_max_length": served.model.config.block_size,
            "vocab_size": tokenizer.vocab_size,
            "bos_token": None if bos is None else tokenizer.decode([bos]),
            "eos_token": None if eos is None else tokenizer.decode([eos]),
            "pad_token": None,
            "chat_template": None if chat.get("template") in (None, "builtin") else chat["template"],
        }

    async def completions(self, body: CompletionRequest, request: Request):
        served = self.ready(body)
        if body.best_of not in (None, body.n):
            raise APIError("best_of must equal n: drawing more and keeping the best is not implemented", "best_of")
        # a long text takes a while to tokenize: not on the loop, which other requests (and /health) share
        prompts = await run_in_threadpool(completion_prompts, body.prompt, served, body.truncate_prompt_tokens)
        if len(prompts) * body.n > MAX_CHOICES:
            raise APIError(f"{len(prompts)} prompts x n={body.n} is more than {MAX_CHOICES} choices a request", "n")
        longest = max(len(ids) for ids, _ in prompts)
        max_tokens = fitted_max_tokens(body.max_tokens, longest, served.model.config.block_size, "prompt")
        self.check_budget(body.n, longest + max_tokens)
        sampling, stops, end = body.sampling(served.tokenizer.vocab_size), body.stops(), end_of_text(served.meta)
        ends = frozenset() if end is None else frozenset([end])
        skip = self.special_ids if body.skip_special_tokens else ()
        plans = []  # prompt p's n samples: one batch, as sample.py --num_samples=n draws them; choices p * n + j
        for p, ((ids, shown), generator) in enumerate(zip(prompts, body.generators(served.device, len(prompts)))):
            job = engine.Request(
                ids,
                max_tokens,
                n=body.n,
                sampling=sampling,
                generators=[generator],
                stop_ids=ends,
                logprobs=body.logprobs,
                prompt_logprobs=body.echo and body.logprobs is not None,
            )
            decode = served.tokenizer.decode
            rows = [
                Choice(p * body.n + j, decode, shown=shown, end=ends, stops=stops, skip=skip) for j in range(body.n)
            ]
            plans.append((job, rows))
        return await self.respond(request, plans, CompletionShape(served, prompts, body), body)

    async def chat_completions(self, body: ChatRequest, request: Request):
        served = self.ready(body)
        if served.chat is None:
            raise APIError(f"{served.name} has no chat template: use /v1/completions", "messages")
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError("top_logprobs needs logprobs: true", "top_logprobs")
        asked, block = body.max_completion_tokens or body.max_tokens, served.model.config.block_size
        name = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        if asked is not None and asked >= block:
            fitted_max_tokens(asked, 1, block, "messages", name)  # no prompt leaves room for it: the 400 says so
        self.check_length(body.messages)
        # rendering thousands of messages takes a while: not on the loop, which other requests (and /health) share
        messages, prompt, dropped = await run_in_threadpool(self.fit, [text_message(m) for m in body.messages], asked)
        max_tokens = fitted_max_tokens(asked, len(prompt), block, "messages", name)
        self.check_budget(body.n, len(prompt) + max_tokens)
        ends = frozenset(served.chat.reply_ends())  # end-of-turn, or any role marker: another turn began
        # each of the n replies draws with its own generator, seed + j: reply 0 is what n=1 gives
        job = engine.Request(
            prompt,
            max_tokens,
            n=body.n,
            sampling=body.sampling(served.tokenizer.vocab_size),
            generators=body.generators(served.device, body.n),
            stop_ids=ends,
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        )
        skip, stops = self.special_ids, body.stops()
        choices = [Choice(j, served.tokenizer.decode, end=ends, stops=stops, skip=skip) for j in range(body.n)]
        return await self.respond(request, [(job, choices)], ChatShape(served, len(prompt), dropped, body), body)

    def fit(self, messages, asked):
        """(messages, prompt ids, how many were dropped) of a conversation fitted to the context (self.context)."""
        chat, block = self.served.chat, self.served.model.config.block_size
        try:
            if self.context == "refuse":
                return messages, chat.prompt_ids(messages), 0
            fitted, prompt = fit_long_conversation(chat, messages, block, asked or 1, self.served.tokenizer)
        except ValueError as err:  # a bad role or content, a template that refuses it, a message that does not fit
            raise APIError(f"messages: {one_line(err)}", "messages") from None
        return fitted, prompt, len(messages) - len(fitted)

    def check_length(self, messages):
        """400 for more messages than --max_messages."""
        if len(messages) > self.max_messages:
            raise APIError(
                f"messages: {len(messages)} messages are more than this server reads ({self.max_messages}, "
                "--max_messages): send the conversation's last ones",
                "messages",
            )

    def check_budget(self, n, positions):
        """400 for a request whose rows could never fit the batch's budget: it would wait forever."""
        scheduler = self.engine.scheduler
        if not scheduler.fits_alone(n, positions):
            raise APIError(
                f"n={n} rows of up to {positions} positions do not fit this server's batch (max_batch="
                f"{scheduler.max_rows} rows, max_positions={scheduler.max_positions}): ask for fewer or shorter",
                "n",
            )

    async def respond(self, request, plans, shape, body):
        """
        The one answer path: plans (engine.Request, Choices) run on the engine, streamed or answered whole; 429 when
        --max_waiting requests already wait, and each ends after --request_timeout seconds.
        """
        waiting = self.engine.stats()[1]
        if waiting >= self.max_waiting:
            raise APIError(
                f"the server is busy: {waiting} requests wait for room in the batch (--max_waiting={self.max_waiting})"
                ": try again shortly",
                status=429,
                kind="server_busy",
                headers={"Retry-After": str(RETRY_AFTER)},
            )
        choices = [choice for _, rows in plans for choice in rows]
        run = functools.partial(generate, self.engine, plans, self.live, self.request_timeout)
        if body.stream:

            async def chunks():
                for chunk in shape.opening(choices):
                    yield chunk
                async for choice, text in run():
                    yield shape.chunk(choice, text)
                if body.include_usage():
                    yield {**shape.head, "choices": [], "usage": usage(shape.prompt_tokens, choices)}

            return event_stream(chunks())

        async def whole():
            async for _ in run():
                pass
            return shape.whole(choices)

        return await unless_disconnected(request, whole())


ROUTES = (  # (method, path, API handler)
    ("GET", "/", "page_html"),
    ("GET", "/health", "health"),
    ("GET", "/metrics", "metrics"),
    ("GET", "/v1/models", "models"),
    ("POST", "/v1/completions", "completions"),
    ("POST", "/v1/chat/completions", "chat_completions"),
    ("POST", "/tokenize", "tokenize"),
    ("POST", "/detokenize", "detokenize"),
    ("GET", "/tokenizer_info", "tokenizer_info"),
)


def make_app(
    served=None, *, api_key="", max_body=1_000_000, max_batch=16, max_positions=0, prefill_chunk=256, **handling
):
    """
    The FastAPI app: API's handlers behind the Gate. Given `served` it serves it at once, its engine budgeted by
    max_batch, max_positions and prefill_chunk (API.load); else app.state.api.load() does later (503 until then).
    handling: API's strict, context, max_messages, max_waiting and request_timeout.
    """
    api = API(**handling)
    if served is not None:
        api.load(served, max_batch=max_batch, max_positions=max_positions, prefill_chunk=prefill_chunk)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        api.close()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Gate, api_key=api_key, max_body=max_body)
    app.state.api = api
    for kind, handler in ERROR_HANDLERS:
        app.add_exception_handler(kind, handler)
    for method, path, name in ROUTES:
        app.add_api_route(path, getattr(api, name), methods=[method])
    return app


async def refused(request, err):
    return JSONResponse(error_body(err.message, err.param, err.kind), status_code=err.status, headers=err.headers)


async def invalid(request, err):
    first = err.errors()[0]
    if first["type"] == "json_invalid":
        return JSONResponse(error_body(f"the body is not valid JSON: {first['msg']}"), status_code=400)
    where = [str(part) for part in first["loc"] if part != "body"]
    if not where:  # not an object; or not read as JSON, for want of its Content-Type (curl -d sends a form's)
        message = "the body must be a JSON object, sent with 'Content-Type: application/json'"
        return JSONResponse(error_body(message), status_code=400)
    field, rule = where[0], FIELD_RULES.get(where[0])
    if first["type"] == "missing":
        message = f"{field} is required" + (f": it {rule}" if rule else "")
    elif rule:  # a union's error names the member it tried (prompt.str, stop.constrained-str): the rule says it all
        message = f"{field}: {rule}"
    else:  # a field, an item's index or a key, and pydantic's words for what is wrong
        message = f"{'.'.join(where)}: {first['msg'].replace('Input should', 'must')}"
    return JSONResponse(error_body(message, field), status_code=400)


async def http_error(request, err):
    return JSONResponse(error_body(str(err.detail)), status_code=err.status_code)


async def failed(request, err):  # a bug, or the model failing: this request fails, the server goes on
    return JSONResponse(error_body(f"the server failed: {one_line(err)}", kind="server_error"), status_code=500)


ERROR_HANDLERS = (
    (APIError, refused),
    (RequestValidationError, invalid),
    (HTTPException, http_error),
    (Exception, failed),
)


def event_stream(chunks):
    """A text/event-stream response of chunks (dicts), ended by [DONE]; a failure mid-way is sent as an error."""

    async def events():
        try:
            async for chunk in chunks:
                yield sse(chunk)
        except APIError as err:  # the headers are sent: the error can only travel in the stream
            yield sse(error_body(err.message, err.param, err.kind))
        except Exception as err:
            yield sse(error_body(f"generation failed: {one_line(err)}", kind="server_error"))
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def unless_disconnected(request, work):
    """
    The result of coroutine `work`, unless the client goes away first: then work is cancelled (and with it the
    request's rows) and the answer, which nobody reads, is a bare 499.
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


OPEN_PATHS = ("/", "/health", "/metrics")  # what answers without the API key: the page (which asks for it), probes


class Gate:
    """
    ASGI middleware in front of everything: when an API key is set, a request without it gets 401 unless its path
    is one of OPEN_PATHS (whatever else is added later needs the key), and a body longer than max_body gets 413,
    before any of it is parsed.
    """

    def __init__(self, app, api_key, max_body):
        self.app, self.api_key, self.max_body = app, api_key, max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key and scope["path"] not in OPEN_PATHS:
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


def listen(host, port):
    """A socket listening on host:port; a one-line ConfigError naming --port when the port is taken."""
    try:
        return socket.create_server((host, port), reuse_port=False)
    except OSError as err:
        raise ConfigError(f"cannot listen on {host}:{port} ({err.strerror}): choose another port with --port") from None


def main(cfg):
    """Listen, load the model (GET /health answers 503 meanwhile), and serve it until interrupted."""
    api_key = cfg.api_key or os.environ.get(API_KEY_VARIABLE, "")
    sock = listen(cfg.host, cfg.port)
    app = make_app(
        api_key=api_key,
        max_body=cfg.max_body,
        strict=cfg.strict,
        context=cfg.context,
        max_messages=cfg.max_messages,
        max_waiting=cfg.max_waiting,
        request_timeout=cfg.request_timeout,
    )
    # the requests are ended before the HTTP server stops (below): this only bounds a client that reads nothing
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=SHUTDOWN_GRACE))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="serve-http", daemon=True)
    thread.start()
    # a core is left to the HTTP loop: a model thread waiting for it would hold up every op (docs/serving.md)
    threads, note = pick_threads(cfg.threads, 1, spare=1)
    torch.set_num_threads(threads)
    if note:
        print(f"serve.py: {note}", file=sys.stderr)
    try:
        served = load_served(cfg)
        app.state.api.load(
            served, max_batch=cfg.max_batch, max_positions=cfg.max_positions, prefill_chunk=cfg.prefill_chunk
        )
        print(f"serving {served.name} on http://{cfg.host}:{cfg.port} (the chat page at /)", file=sys.stderr)
        thread.join()
    finally:
        # Ctrl-C lands here, on the main thread: the engine stops and the requests in flight end (streams with an
        # error event) before the HTTP server stops, which would otherwise wait for every stream to run its course;
        # no thread is left running torch when the interpreter exits (that aborted the process: SIGABRT)
        app.state.api.close()
        server.should_exit = True
        thread.join()


def cli(argv):
    """The command line; returns the exit status: 2 with a one-line message for bad input, 130 for Ctrl-C."""
    try:
        main(parse_config(ServeConfig, argv))
    except (ValueError, OSError, ImportError) as err:
        print(f"serve.py: error: {one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("serve.py: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
