"""
Continuous batching: the requests serve.py receives, decoded together, one forward pass a step for all of them.

    Request    a prompt to continue n times (its rows), how to sample them, and where what they produce goes
    Scheduler  which requests run: waiting ones are admitted in order while the budget of rows and positions allows,
               and how their prompts are fed this step (Admitted: together, or a long one alone, a chunk of it)
    Runner     the model: admitted prompts are prefilled as the scheduler says into slots (rows) of the batch's
               cache, and one forward pass decodes a token for every row
    Engine     the worker thread: take new requests, free the rows that ended, run one step, hand out its tokens

The pieces follow nano-vllm's engine/ (sequence, scheduler, model runner, engine) without its paged cache: a slot
holds its row's positions from 0, so the cache is a rectangle of rows x the longest row's positions (SlotCache).
Rows sit at different positions: model.py reads each row's position and masks each row's keys past its own
(Stack's `positions`). A freed slot is taken by the last row, so that the rows of a step are slots 0 to B - 1.

    engine = Engine(Runner(model, 50257, dtype=dtype), Scheduler(max_rows=16, max_positions=16384), device, dtype)
    engine.start()
    engine.submit(Request(ids, max_tokens=50, deliver=print))   # Produced items, then DONE, on the worker thread

Shape letters as in model.py (B rows of the batch, T positions, V vocabulary).
"""

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from generate import draw, next_probs
from model import MIN_CACHE
from runtime import autocast

DONE = "done"  # what a request's deliver gets once all its rows have ended
RATE_WINDOW = 10.0  # seconds over which Engine.stats counts tokens per second


@dataclass(frozen=True)
class Sampling:
    """How a request's next ids are picked, as generate.sample_next takes it, after a bias added to the logits."""

    temperature: float = 1.0  # 0: greedy
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    logit_bias: tuple = ()  # (id, bias) pairs added to those ids' logits before anything else


class Token(NamedTuple):
    """A row's new id: which row of its request, the id, and when asked its log p and the likeliest beside it."""

    row: int
    id: int
    logprob: float | None = None
    top: list | None = None  # [(id, log p)], the likeliest first


@dataclass
class Produced:
    """What one step produced for a request: a Token for each of its rows that drew one, and the prompt's scores."""

    tokens: list
    # once, when the prompt is all fed and its scores were asked for: (log p, top) of each prompt id after the first
    prompt: list | None = None


@dataclass(eq=False)
class Request:
    """
    A prompt (ids, as the model reads them) to continue n times: rows 0 to n - 1, each up to max_tokens ids (0: the
    prompt is only scored), a row ending at any of stop_ids. generators: one torch.Generator (or None) that the rows
    share, drawing together as sample.py's batch does, or one per row. logprobs: each new id's log p and that many
    likeliest beside it (None: none); prompt_logprobs: the same for the prompt's ids. deliver is called on the worker
    thread with each Produced, then DONE, or with the exception that failed the request.
    """

    ids: list
    max_tokens: int
    n: int = 1
    sampling: Sampling = Sampling()
    generators: list = field(default_factory=lambda: [None])
    stop_ids: frozenset = frozenset()
    logprobs: int | None = None
    prompt_logprobs: bool = False
    deliver: Callable[[Any], None] | None = None  # set before it is submitted
    # set by the request's side, read by the worker between steps
    cancelled: bool = False  # the client left: every row ends
    ended: list = field(default_factory=list)  # ended[j]: row j wants no more ids (its text reached a stop string)
    # the worker's own
    cache: list | None = None  # the prompt's KV cache while it is prefilled
    fed: int = 0  # prompt ids prefilled so far
    scored: list = field(default_factory=list)  # the prompt's (log p, top) so far, when asked for
    live: int = 0  # rows decoding

    def __post_init__(self):
        self.ended = [False] * self.n

    @property
    def positions(self):
        """The most positions a row fills: the prompt and max_tokens (the last id drawn is never fed)."""
        return len(self.ids) + self.max_tokens


class Admitted(NamedTuple):
    """
    The prefill of one step, as the scheduler decides it: the requests whose prompts are fed, either together, each
    prompt whole in one forward pass, or (alone) one request by itself, `feed` more of its prompt ids this step.
    """

    requests: list
    alone: bool = False
    feed: int = 0  # alone: the prompt ids fed this step (a chunk at most); together every prompt goes in whole


class Scheduler:
    """
    Which requests run. Requests wait in arrival order and are admitted while their rows fit the budget: at most
    max_rows rows in all, and rows x the most positions one of them fills (Request.positions) at most max_positions,
    the size of the batch's KV cache. Prompts of at most `chunk` ids together are prefilled in one step; a longer
    prompt (or one only scored) is admitted alone, and a long one is fed a chunk a step. Then their rows run. The
    scheduler alone decides this: the runner feeds what admit's Admitted says.
    """

    def __init__(self, max_rows, max_positions, chunk=256):
        self.max_rows, self.max_positions, self.chunk = max_rows, max_positions, chunk
        self.waiting = deque()
        self.prefilling = []  # the admitted requests whose prompts are being fed
        self.running = []  # requests whose rows decode

    def fits_alone(self, n, positions):
        """Whether a request of n rows that fill `positions` each can ever run: else it would wait forever."""
        return n <= self.max_rows and n * positions <= self.max_positions

    def add(self, request):
        self.waiting.append(request)

    def alone(self, request):
        """Whether a request is prefilled by itself: a prompt longer than a chunk, or one only scored."""
        return len(request.ids) > self.chunk or request.max_tokens == 0

    def admit(self):
        """
        This step's prefill (Admitted): the request whose prompt is being fed, else waiting ones that fit now; none
        when nothing waits or fits.
        """
        if not self.prefilling:
            self.fill()
        requests = list(self.prefilling)  # a copy: prefilling empties as they start
        if len(requests) == 1 and self.alone(requests[0]):
            request = requests[0]
            return Admitted(requests, alone=True, feed=min(self.chunk, len(request.ids) - request.fed))
        return Admitted(requests)

    def fill(self):
        """Admit waiting requests in order while they fit the budget and may be prefilled together."""
        rows = sum(r.live for r in self.running)
        width = max([r.positions for r in self.running], default=0)
        ids = 0
        while self.waiting:
            first = self.waiting[0]
            together = not self.alone(first) and ids + len(first.ids) <= self.chunk
            if self.prefilling and (not together or any(self.alone(r) for r in self.prefilling)):
                break
            rows, width, ids = rows + first.n, max(width, first.positions), ids + len(first.ids)
            if rows > self.max_rows or rows * width > self.max_positions:
                break
            self.prefilling.append(self.waiting.popleft())

    def started(self, request):
        """A prefilled request's rows decode from now on (none for a prompt only scored: then it is done)."""
        self.prefilling.remove(request)
        if request.live:
            self.running.append(request)

    def requests(self):
        """Every request the engine holds: waiting, prefilling, running."""
        return [*self.waiting, *self.prefilling, *self.running]

    def idle(self):
        return not self.waiting and not self.prefilling and not self.running

    def remove(self, request):
        """Forget a request that ended (the runner has freed its rows)."""
        for queue_ in (self.prefilling, self.running, self.waiting):
            if request in queue_:
                queue_.remove(request)


class SlotView:
    """
    One layer's view of the batch's cache for one forward pass, used as model.py's attention uses a KVCache: append
    stores row b's new keys and values at positions[b] and returns every row's up to the batch's width. With
    positions None every row is at the same place, `length`: the new keys go after it, as a KVCache's do.
    """

    def __init__(self, k, v, positions, rows, length=None):
        self.k, self.v, self.positions = k, v, positions  # (B, H, width, D) views of the buffers; (B, T) or None
        self.rows, self.length = rows, length  # (B, 1): 0 to B - 1; the positions every row holds (positions None)

    def append(self, k, v):
        if self.positions is None:
            at = slice(self.length, self.length + k.size(2))
            self.k[:, :, at], self.v[:, :, at] = k, v
            return self.k, self.v
        # (B, H, T, D) -> (B, T, H, D): the layout of buffer[rows, :, positions]
        self.k[self.rows, :, self.positions] = k.transpose(1, 2).to(self.k.dtype)
        self.v[self.rows, :, self.positions] = v.transpose(1, 2).to(self.v.dtype)
        return self.k, self.v


class SlotCache:
    """
    The KV cache of the rows being decoded: for every layer keys and values (rows, n_kv_head, width, D) in `dtype`,
    slot s holding its row's positions from 0. The buffers grow (doubling, within the budget) as rows and positions
    are needed; they are kept when no row is left, as allocating and zeroing them again costs more than a step
    (GPT-2 124M's for 8 rows: 0.3 s).
    """

    def __init__(self, config, dtype, device, max_rows, max_positions):
        self.config, self.dtype, self.device = config, dtype, device
        self.max_rows, self.max_positions = max_rows, max_positions
        self.layers = None  # [(k, v)] per layer, or None before the first row

    def size(self):
        """(rows, width) of the buffers; (0, 0) when empty."""
        return (0, 0) if self.layers is None else (self.layers[0][0].size(0), self.layers[0][0].size(2))

    def reserve(self, rows, width):
        """
        Buffers of at least `rows` slots and `width` positions, the most that any row, running or new, fills. The slots
        or positions held beyond those are kept only within the budget: a row alone may have taken the whole width.
        """
        held_rows, held_width = self.size()
        if rows <= held_rows and width <= held_width:
            return
        if max(rows, held_rows) * max(width, held_width) <= self.max_positions:
            rows, width = max(rows, held_rows), max(width, held_width)
        # doubled, so that growing is rare, within the caps; exactly what is needed where doubling passes the budget
        doubled = min(self.config.block_size, max(width, 2 * held_width, MIN_CACHE))
        width = doubled if rows * doubled <= self.max_positions else width
        doubled = min(self.max_rows, max(rows, 2 * held_rows))
        rows = doubled if doubled * width <= self.max_positions else rows
        shape = (rows, self.config.n_kv_head, width, self.config.head_dim)
        # zeros, not garbage: a row reads the batch's width, and 0 x NaN in the attention's sum would be NaN
        layers = [
            tuple(torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in "kv")
            for _ in range(self.config.n_layer)
        ]
        kept = (slice(min(rows, held_rows)), slice(None), slice(min(width, held_width)))
        for (k, v), (old_k, old_v) in zip(layers, self.layers or []):  # the slots so far move over
            k[kept], v[kept] = old_k[kept], old_v[kept]
        self.layers = layers

    def put(self, slot, cache):
        """Copy a prefilled KVCache of one row (model.new_cache()) into slot: its positions from 0."""
        for (k, v), (layer, _) in zip(self.layers, cache):
            # a sliding window's cache holds its last positions only: they go where they belong, the rest is never read
            kept = min(layer.k.size(2), layer.length)
            k[slot, :, layer.length - kept : layer.length] = layer.k[0, :, :kept]
            v[slot, :, layer.length - kept : layer.length] = layer.v[0, :, :kept]

    def move(self, source, slot, length):
        """Slot `source`'s first `length` positions into `slot`."""
        for k, v in self.layers:
            k[slot, :, :length], v[slot, :, :length] = k[source, :, :length], v[source, :, :length]

    def views(self, count, width, positions=None, first=0):
        """
        model.body's cache for `count` slots from `first` that read `width` positions: the new keys go at positions
        (count, T), or with None after width - 1 in every row (a decoding step whose rows are all at one place).
        """
        rows, index = slice(first, first + count), torch.arange(count, device=self.device)[:, None]
        length = width - 1 if positions is None else None
        return [
            (SlotView(k[rows, :, :width], v[rows, :, :width], positions, index, length), None) for k, v in self.layers
        ]


def distribution(logits, options):
    """
    The distribution (B, V) that rows of logits (B, V) draw from under options (a Sampling): options.logit_bias added
    first; at temperature 0 all its mass on the likeliest id.
    """
    logits = logits.float()
    if options.logit_bias:
        ids, values = zip(*options.logit_bias)
        add = torch.zeros(logits.size(-1), device=logits.device)
        add[list(ids)] = torch.tensor(values, device=logits.device)
        logits = logits + add
    if options.temperature == 0:
        return torch.zeros_like(logits).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return next_probs(logits, options.temperature, options.top_k, options.top_p, options.min_p)


@dataclass(eq=False)
class Row:
    """One row being decoded: its request, which of its rows, the positions its slot holds, the id to feed next."""

    request: Request
    index: int
    length: int
    token: int = -1
    drawn: int = 0  # ids drawn so far


class Runner:
    """
    The model's side of the engine: prefill requests as the scheduler admits them (Admitted), decode every row by one
    id, draw each row's id as its request asks, free rows. rows[s] is the row in slot s of the batch's cache, whose
    keys and values are in `dtype` (the autocast dtype, or float32 for the model's own); max_rows and max_positions
    bound it (default: max_rows x block_size positions).
    """

    def __init__(self, model, vocab_size, *, dtype=torch.float32, max_rows=16, max_positions=None):
        self.model, self.vocab_size = model, vocab_size
        self.device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype if dtype == torch.float32 else dtype
        max_positions = max_positions or max_rows * model.config.block_size
        self.slots = SlotCache(model.config, dtype, self.device, max_rows, max_positions)
        self.rows = []

    def prefill(self, admitted):
        """
        Feed the prompts of Scheduler.admit's Admitted: a request alone, admitted.feed of its ids (prefill_alone);
        else all of them whole in one forward pass (prefill_together). Returns {request: Produced} for the requests
        whose prompts are all fed: their first ids, and their scores if asked.
        """
        if admitted.alone:
            (request,) = admitted.requests
            produced = self.prefill_alone(request, admitted.feed)
            return {} if produced is None else {request: produced}
        return self.prefill_together(admitted.requests)

    def reserve(self, requests):
        """Slots for the rows of requests after the running rows', as wide as the most positions any of them fills."""
        width = max(r.positions for r in [*requests, *(row.request for row in self.rows)])
        self.slots.reserve(len(self.rows) + sum(r.n for r in requests), width)

    def prefill_together(self, requests):
        """
        Prompts of different lengths, right-padded, in one forward pass straight into slots: request b's first row
        takes slot first + b, each of its other rows a copy of it (the n samples of a prompt share one prefill). A
        padded position's keys are written past the row's prompt, where its first decode step writes over them
        before any query may read them. Returns {request: Produced}.
        """
        first, lengths = len(self.rows), [len(r.ids) for r in requests]
        T = max(lengths)
        self.reserve(requests)
        idx = torch.tensor([r.ids + [0] * (T - len(r.ids)) for r in requests], device=self.device)  # (k, T)
        positions = torch.arange(T, device=self.device).expand(len(requests), T)  # (k, T)
        x, _ = self.model.body(
            idx, cache=self.slots.views(len(requests), T, positions, first), positions=positions
        )  # (k, T, C)
        self.rows += [Row(r, 0, length=len(r.ids)) for r in requests]
        for b, request in enumerate(requests):
            for j in range(1, request.n):
                self.slots.move(first + b, len(self.rows), len(request.ids))
                self.rows.append(Row(request, j, length=len(request.ids)))
            request.live = request.n
        last = self.model.head(x[torch.arange(len(requests)), torch.tensor(lengths) - 1])  # (k, V)
        owner = {request: b for b, request in enumerate(requests)}
        produced = self.pick(last[[owner[row.request] for row in self.rows[first:]]], self.rows[first:])
        for b, request in enumerate(requests):
            if request.prompt_logprobs:  # each position predicts the next prompt id: all but the prompt's last
                logits = self.model.head(x[b, : lengths[b] - 1])[:, : self.vocab_size]
                produced[request].prompt = self.scores(logits, request.ids[1:], request.logprobs or 0)
        return produced

    def prefill_alone(self, request, feed):
        """
        Feed the next `feed` ids of request's prompt into a KV cache of its own. At its end: its scores if asked, and
        with max_tokens > 0 its rows' slots and first ids. Returns the Produced to deliver then, else None.
        """
        if request.cache is None:
            request.cache = self.model.new_cache()
        start, ids = request.fed, request.ids
        chunk = ids[start : start + feed]
        x, _ = self.model.body(torch.tensor([chunk], device=self.device), cache=request.cache)  # (1, T, C)
        if request.prompt_logprobs:  # each position predicts the next prompt id: all but the prompt's last
            targets = ids[start + 1 : start + len(chunk) + 1]
            logits = self.model.head(x[0, : len(targets)])[:, : self.vocab_size]
            request.scored += self.scores(logits, targets, request.logprobs or 0)
        request.fed += len(chunk)
        if request.fed < len(ids):
            return None
        cache, request.cache = request.cache, None
        prompt = request.scored if request.prompt_logprobs else None
        if request.max_tokens == 0:
            return Produced([], prompt)
        first = len(self.rows)
        self.reserve([request])
        for j in range(request.n):  # the prompt computed once, copied into each row's slot
            self.slots.put(first + j, cache)
            self.rows.append(Row(request, j, length=len(ids)))
        request.live = request.n
        logits = self.model.head(x[:, -1]).expand(request.n, -1)  # (n, V): every row's first distribution
        produced = self.pick(logits, self.rows[first:])[request]
        produced.prompt = prompt
        return produced

    def decode(self):
        """One id for every row, in one forward pass. Returns {request: Produced}."""
        rows = self.rows
        tokens = torch.tensor([[row.token] for row in rows], device=self.device)  # (B, 1)
        lengths = [row.length for row in rows]
        width = max(lengths) + 1
        # rows all at one place (one client, or a prompt's n samples) need no mask: the model's own KVCache path
        positions = None
        if min(lengths) < width - 1:
            positions = torch.tensor(lengths, device=self.device)[:, None]  # (B, 1): where each goes
        x, _ = self.model.body(tokens, cache=self.slots.views(len(rows), width, positions), positions=positions)
        for row in rows:
            row.length += 1
        return self.pick(self.model.head(x[:, -1]), rows)  # (B, V)

    def pick(self, logits, rows):
        """The next id of each row from its logits (B, V), as its request draws. Returns {request: Produced}."""
        logits = logits[:, : self.vocab_size]  # ids past the tokenizer's (a padded embedding's) are never drawn
        members = {}  # each request's (slot, row) pairs
        for slot, row in enumerate(rows):
            members.setdefault(row.request, []).append((slot, row))
        plain = None  # what greedy rows without a logit bias take, when there are any
        greedy = {
            request for request in members if request.sampling.temperature == 0 and not request.sampling.logit_bias
        }
        groups = {}  # Sampling -> the slots of the rows that draw under it
        for request, pairs in members.items():
            if request not in greedy:
                groups.setdefault(request.sampling, []).extend(slot for slot, _ in pairs)
        # Sampling -> ({slot: its row}, the distribution of those rows): computed once for the requests sharing it
        shared = {
            o: ({s: k for k, s in enumerate(slots)}, distribution(logits[slots], o)) for o, slots in groups.items()
        }
        out = {}
        for request, pairs in members.items():
            slots = [slot for slot, _ in pairs]
            if request in greedy:
                plain = logits.argmax(dim=-1).tolist() if plain is None else plain
                ids = [plain[slot] for slot in slots]
            else:
                at, probs = shared[request.sampling]
                ids = self.draw_rows(probs, [at[slot] for slot in slots], pairs, request)
            scores = [(None, None)] * len(ids)
            if request.logprobs is not None:
                scores = self.scores(logits[slots], ids, request.logprobs)
            for (_, row), token in zip(pairs, ids):
                row.token, row.drawn = token, row.drawn + 1
            out[request] = Produced([Token(row.index, t, *s) for (_, row), t, s in zip(pairs, ids, scores)])
        return out

    @staticmethod
    def draw_rows(probs, at, pairs, request):
        """
        The ids of a request's rows (pairs of slot, row), row k's distribution probs[at[k]]. Rows sharing one
        generator draw as one (n, V) batch, as sample.py does, a row that ended drawing from a uniform distribution:
        what the others draw does not depend on when it ended.
        """
        if len(request.generators) > 1:  # a generator each
            return [int(draw(probs[i : i + 1], request.generators[row.index])) for i, (_, row) in zip(at, pairs)]
        indices = [row.index for _, row in pairs]
        batch = probs[list(at)]  # (n, V) when every row is live, in order
        if indices != list(range(request.n)):
            batch = probs.new_ones(request.n, probs.size(1)).index_copy(0, torch.tensor(indices), batch)
        drawn = draw(batch, request.generators[0])[:, 0].tolist()
        return [drawn[row.index] for _, row in pairs]

    @staticmethod
    def scores(logits, ids, top):
        """[(log p of ids[i] by row i of logits (N, V), the `top` likeliest [(id, log p)])], in float32."""
        logprobs = logits.float().log_softmax(dim=-1)  # (N, V)
        chosen = logprobs.gather(1, torch.tensor(ids, device=logprobs.device)[:, None])[:, 0].tolist()
        values, index = logprobs.topk(min(top, logprobs.size(-1)), dim=-1)  # (N, top): no more than there are
        return list(zip(chosen, [list(zip(i, v)) for i, v in zip(index.tolist(), values.tolist())]))

    def ended(self):
        """The rows that want no more ids: a stop id drawn, max_tokens reached, or their request's side said so."""
        return [
            row
            for row in self.rows
            if row.token in row.request.stop_ids
            or row.drawn >= row.request.max_tokens
            or row.request.cancelled
            or row.request.ended[row.index]
        ]

    def free(self, rows):
        """Free the slots of rows: the last row moves into each freed slot. Returns the requests left with none."""
        emptied = []
        for row in rows:
            slot, last = self.rows.index(row), self.rows.pop()
            if last is not row:
                self.slots.move(len(self.rows), slot, last.length)
                self.rows[slot] = last
            row.request.live -= 1
            if not row.request.live:
                emptied.append(row.request)
        return emptied


class Engine:
    """
    The worker thread that owns the model: each step it takes new requests, frees the rows that ended (and drops the
    requests whose client left), prefills one chunk of the admitted requests and hands out their first ids, then
    decodes every row once and hands each request what it got (unless more requests wait: see step). A failing step
    fails the requests in it; the engine goes on.
    """

    def __init__(self, runner, scheduler, device, dtype):
        self.runner, self.scheduler, self.device, self.dtype = runner, scheduler, device, dtype
        self.incoming = queue.SimpleQueue()  # new requests, and None to stop
        self.thread = threading.Thread(target=self.run, name="serve-engine", daemon=True)
        self.lock = threading.Lock()  # guards the counters below, read by other threads
        self.generated, self.recent = 0, deque()  # ids drawn in all; (time, ids) of the last RATE_WINDOW seconds
        self.decoded = True  # the last step decoded the running rows

    def start(self):
        self.thread.start()

    def submit(self, request):
        self.incoming.put(request)
        return request

    def stop(self):
        self.incoming.put(None)
        self.thread.join()

    def run(self):
        # no_grad and autocast hold per thread: they are entered here, where the model runs
        with torch.no_grad(), autocast(self.device, self.dtype):
            while self.take():
                self.step()

    def take(self):
        """Move new requests to the scheduler, waiting for one when there is nothing to do; False: stop."""
        while self.scheduler.idle() or not self.incoming.empty():
            request = self.incoming.get()
            if request is None:
                return False
            self.scheduler.add(request)
        return True

    def step(self):
        scheduler, runner = self.scheduler, self.runner
        self.finish(runner.free(runner.ended()))
        self.finish([r for r in scheduler.requests() if r.cancelled and not r.live])
        # prefill first, its first ids handed out at once: a new request waits for the step under way, not for the
        # running rows' decoding as well
        admitted = scheduler.admit()
        if admitted.requests:
            self.prefill(admitted)
        # a burst of requests arrived while this one was prefilled: they are prefilled before the running rows' next
        # id, never twice in a row (running rows wait one prefill chunk at most)
        burst = not self.incoming.empty() or scheduler.waiting
        if admitted.requests and burst and self.decoded and 0 < len(runner.rows) < scheduler.max_rows:
            self.decoded = False
        elif runner.rows:
            try:
                self.deliver(runner.decode())
            except Exception as err:  # every running request fails; the engine goes on
                self.fail(scheduler.running, err)
            self.decoded = True

    def prefill(self, admitted):
        """Prefill the admitted requests (Admitted); those whose prompts are all fed get their first ids."""
        prefilled = {}
        try:
            prefilled = self.runner.prefill(admitted)
        except Exception as err:  # these requests fail; the others go on
            self.fail(admitted.requests, err)
        for request in prefilled:
            self.scheduler.started(request)
        self.deliver(prefilled)
        self.finish([request for request in prefilled if not request.live])  # prompts only scored: done at once
        self.finish(self.runner.free(self.runner.ended()))  # rows whose first id ended them

    def deliver(self, produced):
        for request, items in produced.items():
            request.deliver(items)
        drawn = sum(len(items.tokens) for items in produced.values())
        now = time.monotonic()
        with self.lock:
            self.generated += drawn
            self.recent.append((now, drawn))
            while self.recent and self.recent[0][0] < now - RATE_WINDOW:
                self.recent.popleft()

    def finish(self, requests):
        """Requests with no row left: forgotten, and told DONE."""
        for request in requests:
            self.scheduler.remove(request)
            request.cache = None
            request.deliver(DONE)

    def fail(self, requests, err):
        for request in list(requests):
            self.runner.free([row for row in self.runner.rows if row.request is request])
            request.cache = None
            self.scheduler.remove(request)
            request.deliver(err)

    def stats(self):
        """
        (requests running, requests waiting, ids drawn in all, ids a second over the last RATE_WINDOW seconds), read
        from another thread: the counts are the scheduler's as they are now (a length is read whole).
        """
        scheduler = self.scheduler
        running = len(scheduler.running) + len(scheduler.prefilling)
        waiting = len(scheduler.waiting) + self.incoming.qsize()
        with self.lock:
            recent = sum(count for t, count in self.recent if t >= time.monotonic() - RATE_WINDOW)
            return running, waiting, self.generated, recent / RATE_WINDOW
