"""
engine.py's continuous batching against the plain model: every reply (ids, log p, the likeliest ids, draws) of
requests that share the batch, join it late, leave it early or wait for room is what one forward pass of the model
over the prompt and the ids so far gives at each step (no cache, no batch), and what the request gets alone. The
model is a tiny GPT with fixed random weights whose logits move far beyond the tolerance when what a position reads
changes (a wrong mask, a wrong position, another row's keys), which its fixture checks. Requests are queued before the
engine starts, so that its first step admits them together; a late one is submitted from the worker thread when an
earlier one has drawn a given number of ids. No test waits on time.
"""

import functools
import threading
from typing import NamedTuple

import pytest
import torch

from engine import DONE, Engine, Request, Runner, Sampling, Scheduler
from generate import draw, next_probs
from model import GPT, KVCache, ModelConfig

SHAPES = {
    # absolute positions: a row read at a wrong position shows at once
    "learned": dict(pos_encoding="learned"),
    # rotary, grouped-query heads and a window shorter than the replies: each row's mask must be its own
    "rope-window": dict(pos_encoding="rope", n_kv_head=1, window_size=5, norm="rmsnorm", activation="swiglu"),
}
GREEDY = Sampling(temperature=0)
TOLERANCE = 1e-4  # on log p: float32 through other kernels (a padded batch, a mask, a cache) agrees to 4e-6
REACH = 0.1  # the fixture's model: changing the farthest id a position reads moves its logits by more than this
MARGIN = 1e-3  # a greedy reference's likeliest id leads the next by more than this, so no rounding flips an argmax


def tiny_model(shape):
    """
    A 2-layer, 32-wide GPT with fixed random weights, 16 times GPT-2's init: its next ids depend on what each position
    reads. Checked here: changing the farthest id the last position may read (the prompt's first, or the window's
    first) moves the last logits by more than REACH, a thousand times TOLERANCE.
    """
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=50, block_size=48, n_layer=2, n_head=4, n_embd=32, **SHAPES[shape])
    model = GPT(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(16 if p.dim() > 1 else 1)
        ids = prompt(0, 20)
        far = len(ids) - (config.window_size or len(ids))  # keys fewer than window_size positions back are read
        changed = ids[:far] + [(ids[far] + 1) % 50] + ids[far + 1 :]
        logits = [model(torch.tensor([p]))[0][0, -1] for p in (ids, changed)]
    assert (logits[0] - logits[1]).abs().max() > REACH
    return model


def prompt(seed, length):
    """A prompt of `length` ids drawn with `seed`."""
    return torch.randint(50, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


class Reply:
    """
    What the engine delivers for one request (its deliver, called on the worker thread): each row's Tokens, the
    prompt's scores, and the end (DONE or the exception). then: (count, call) pairs, each called once when row 0 has
    `count` ids: a late request submitted from the worker thread, while this one decodes.
    """

    def __init__(self, n):
        self.tokens, self.prompt, self.end, self.then = [[] for _ in range(n)], None, None, []
        self.ended = threading.Event()

    def __call__(self, item):
        if item == DONE or isinstance(item, Exception):
            self.end = item
            self.ended.set()
            return
        self.prompt = self.prompt if item.prompt is None else item.prompt
        for token in item.tokens:
            self.tokens[token.row].append(token)
        for count, call in [(count, call) for count, call in self.then if len(self.tokens[0]) >= count]:
            self.then.remove((count, call))
            call()

    @property
    def ids(self):
        return [[token.id for token in row] for row in self.tokens]


def ask(prompt, max_tokens, sampling=GREEDY, seeds=(), **options):
    """A Request whose deliver is a Reply; seeds: one generator per row, seeded so (none: the rows share None)."""
    generators = [torch.Generator().manual_seed(seed) for seed in seeds] or [None]
    reply = Reply(options.get("n", 1))
    return Request(prompt, max_tokens, sampling=sampling, generators=generators, deliver=reply, **options)


class Pass(NamedTuple):
    """
    One forward pass of the engine's model: its ids (rows of ids), whether it fed a prompt's own KV cache (a prompt
    fed alone) rather than the batch's slots, and the slots' (rows, width) when it ran.
    """

    ids: list
    alone: bool
    slots: tuple

    @property
    def decode(self):
        """Whether the pass decoded the running rows (one id a row, into the slots)."""
        return not self.alone and len(self.ids[0]) == 1


def run(model, requests, *, late=(), max_rows=8, max_positions=None, chunk=256):
    """
    Serve requests with an Engine over model, queued before it starts (its first step admits all that fit, together),
    until each has ended. late: (request, earlier, count) triples, request submitted once earlier has `count` ids.
    Checks that every request ended well and that the slots never held more than max_positions positions (rows x
    width) at any forward pass or after the last. Returns the forward passes (Pass) in order.
    """
    max_positions = max_positions or max_rows * model.config.block_size
    runner = Runner(model, model.config.vocab_size, max_rows=max_rows, max_positions=max_positions)
    engine = Engine(runner, Scheduler(max_rows, max_positions, chunk=chunk), torch.device("cpu"), torch.float32)
    passes = []

    def record(module, args, kwargs):
        passes.append(Pass(args[0].tolist(), isinstance(kwargs["cache"][0][0], KVCache), runner.slots.size()))

    hook = model.body.register_forward_pre_hook(record, with_kwargs=True)
    for request, earlier, count in late:
        earlier.deliver.then.append((count, functools.partial(engine.submit, request)))
    for request in requests:
        engine.submit(request)
    everything = [*requests, *(request for request, _, _ in late)]
    engine.start()
    try:
        assert all(request.deliver.ended.wait(60) for request in everything)
    finally:
        engine.stop()
        hook.remove()
    assert [request.deliver.end for request in everything] == [DONE] * len(everything)
    for rows, width in [p.slots for p in passes] + [runner.slots.size()]:
        assert rows * width <= max_positions
    return passes


@torch.no_grad()
def plain(model, ids, max_tokens, sampling=GREEDY, seed=None):
    """
    The reference: at each step one forward pass of the plain model over the prompt ids and the ids so far (no cache,
    no batch), the next id the last position's argmax, or drawn as generate.py draws (next_probs, then draw with a
    generator seeded `seed`). Returns (the new ids, their log-probabilities (max_tokens, V) in float64).
    """
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    ids = list(ids)
    for _ in range(max_tokens):
        logits = model(torch.tensor([ids]))[0][0, -1:]  # (1, V)
        if sampling.temperature == 0:
            first, second = logits[0].topk(2).values.tolist()
            assert first - second > MARGIN, "a near tie: the reference's argmax is not robust, change the prompt"
            ids.append(int(logits.argmax()))
        else:
            probs = next_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)
            ids.append(int(draw(probs, generator)))
    prompt_length = len(ids) - max_tokens
    logits = model(torch.tensor([ids[:-1]]))[0][0, prompt_length - 1 :]  # position t predicts id t + 1
    return ids[prompt_length:], logits.double().log_softmax(dim=-1)


def assert_scores(scores, ids, logprobs, top):
    """scores [(log p, [(id, log p)] likeliest first)] are ids' log p by the rows of logprobs, and their top ids."""
    expected = logprobs.topk(top, dim=-1)
    assert [logprob for logprob, _ in scores] == pytest.approx(logprobs[range(len(ids)), ids].tolist(), abs=TOLERANCE)
    assert [[i for i, _ in likeliest] for _, likeliest in scores] == expected.indices.tolist()
    for (_, likeliest), values in zip(scores, expected.values.tolist(), strict=True):
        assert [p for _, p in likeliest] == pytest.approx(values, abs=TOLERANCE)


def assert_plain(model, request, seeds=(None,)):
    """request's rows got what the plain model gives (row j drawn with seeds[j]), their scores and its prompt's too."""
    for tokens, seed in zip(request.deliver.tokens, seeds, strict=True):
        ids, logprobs = plain(model, request.ids, request.max_tokens, request.sampling, seed)
        assert [token.id for token in tokens] == ids
        if request.logprobs is not None:
            assert_scores([(token.logprob, token.top) for token in tokens], ids, logprobs, request.logprobs)
    if request.prompt_logprobs:
        with torch.no_grad():
            logprobs = model(torch.tensor([request.ids]))[0][0, :-1].double().log_softmax(dim=-1)
        assert_scores(request.deliver.prompt, request.ids[1:], logprobs, request.logprobs or 0)


def assert_same(request, alone):
    """Two requests alike (one served among others, one alone) got the same ids, log p and likeliest ids."""
    got, expected = request.deliver, alone.deliver
    assert got.ids == expected.ids
    for row, row_alone in zip(got.tokens, expected.tokens):
        assert [t.logprob for t in row] == pytest.approx([t.logprob for t in row_alone], abs=TOLERANCE)
        assert [[i for i, _ in t.top or ()] for t in row] == [[i for i, _ in t.top or ()] for t in row_alone]


def served_alone(model, spec):
    """A request made from spec (ask's arguments), served by an engine of its own."""
    request = ask(**spec)
    run(model, [request])
    return request


@pytest.mark.parametrize("shape", SHAPES)
def test_requests_admitted_together_reply_as_the_plain_model_and_as_each_alone(shape):
    """
    Six greedy requests, 3 to 18 prompt ids, queued before the engine starts: one forward pass prefills their
    right-padded prompts, then their rows decode together at six different positions; the rows that end first free
    slots that the last row moves into. Each reply (ids, log p and the two likeliest ids, one prompt's scores) is the
    plain model's, and what the request gets alone.
    """
    model = tiny_model(shape)
    specs = [dict(prompt=prompt(k, 3 + 3 * k), max_tokens=m, logprobs=2) for k, m in enumerate([4, 14, 6, 12, 8, 10])]
    specs[2]["prompt_logprobs"] = True
    requests = [ask(**spec) for spec in specs]
    passes = run(model, requests)
    prefill = passes[0]  # all six prompts in one pass, each padded to the longest
    assert [row[: len(r.ids)] for row, r in zip(prefill.ids, requests)] == [r.ids for r in requests]
    assert len(prefill.ids) == 6 and not prefill.alone
    assert [len(p.ids) for p in passes[1:]] == [6] * 3 + [5] * 2 + [4] * 2 + [3] * 2 + [2] * 2 + [1] * 2
    for spec, request in zip(specs, requests):
        assert_plain(model, request)
        assert_same(request, served_alone(model, spec))


@pytest.mark.parametrize("shape", SHAPES)
def test_a_long_prompt_joins_late_and_is_fed_a_chunk_a_step_while_the_others_decode(shape):
    """
    A decodes alone; once it has 3 ids, B (22 prompt ids, over the chunk of 4), C (4) and D (6, only scored) arrive.
    B's prompt goes into its own cache 4 ids a forward pass, A decoding between its chunks (the window shape's window
    of 5 reaching back across chunks, B's cache then put into a slot); then C is prefilled beside the two decoding
    rows, and D's prompt is scored alone. Every reply, B's and D's prompt scores included, is the plain model's.
    """
    model = tiny_model(shape)
    specs = [
        dict(prompt=prompt(10, 3), max_tokens=16, logprobs=1),
        dict(prompt=prompt(11, 22), max_tokens=8, logprobs=2, prompt_logprobs=True),
        dict(prompt=prompt(12, 4), max_tokens=6, logprobs=1),
        dict(prompt=prompt(13, 6), max_tokens=0, logprobs=1, prompt_logprobs=True),
    ]
    a, b, c, d = (ask(**spec) for spec in specs)
    passes = run(model, [a], late=[(b, a, 3), (c, a, 3), (d, a, 3)], chunk=4)
    alone = [p for p in passes if p.alone]
    chunks = [[b.ids[i : i + 4]] for i in range(0, 22, 4)]
    assert [p.ids for p in alone] == [*chunks, [d.ids[:4]], [d.ids[4:]]]
    first, last = passes.index(alone[0]), passes.index(alone[len(chunks) - 1])
    # A had decoded twice when B came (its third id came from a decoding step), and decodes between B's chunks
    assert [len(p.ids) for p in passes[:first] if p.decode] == [1, 1]
    assert sum(p.decode for p in passes[first:last]) >= 2
    # C joins A and B: prefilled in a pass of its own, into the slot after theirs, then three rows decode
    joined = next(i for i in range(last, len(passes)) if passes[i].ids == [c.ids])
    assert {len(p.ids) for p in passes[last:joined] if p.decode} == {2}
    assert [len(p.ids) for p in passes[joined:] if p.decode][:2] == [3, 3]
    for request in (a, b, c, d):
        assert_plain(model, request)


def test_the_cache_stays_within_its_position_budget_and_requests_wait_for_room():
    """
    A budget of 48 positions: A (16 positions: prompt and max_tokens) decodes alone; once it has 2 ids B, C and D
    (16 each) arrive. B and C join A (3 rows x 16), D waits until A ends. At no pass do the slots hold more than 48
    positions: A alone was given the block's whole width of 48, which three rows cannot keep.
    """
    model = tiny_model("learned")
    a, b, c, d = (ask(prompt(24 + k, 4 + k), 12 - k, logprobs=1) for k in range(4))
    passes = run(model, [a], late=[(b, a, 2), (c, a, 2), (d, a, 2)], max_rows=4, max_positions=48)
    assert max(len(p.ids) for p in passes if p.decode) == 3
    # D is prefilled between two decoding passes of three rows: when A's row has ended
    waited = next(i for i, p in enumerate(passes) if p.ids == [d.ids])
    assert [len(p.ids) for p in (passes[waited - 1], passes[waited + 1])] == [3, 3]
    assert passes[waited - 1].decode and passes[waited + 1].decode
    for request in (a, b, c, d):
        assert_plain(model, request)


def test_a_seeded_request_draws_the_same_among_others_as_alone():
    """
    Sampled requests with seeded generators beside a greedy one: two under one Sampling (one distribution for both
    their rows), one under top_k, one of two rows with a generator each, whose rows end up in reverse order in the
    batch. Each row draws what the plain model's distributions give with its seed, and what the request draws alone
    with the same seeds.
    """
    model = tiny_model("learned")
    hot = Sampling(temperature=1.5)
    specs = [
        dict(prompt=prompt(30, 5), max_tokens=10),
        dict(prompt=prompt(31, 3), max_tokens=10, sampling=hot, seeds=[1], logprobs=1),
        dict(prompt=prompt(32, 8), max_tokens=8, sampling=hot, seeds=[2]),
        dict(prompt=prompt(33, 4), max_tokens=6, sampling=Sampling(temperature=0.8, top_k=5), seeds=[3]),
        # its row 1 moves into slot 3 when the request before it ends: its rows then sit in slots 3 and 4, reversed
        dict(prompt=prompt(34, 6), max_tokens=12, sampling=hot, seeds=[4, 5], n=2),
    ]
    requests = [ask(**spec) for spec in specs]
    run(model, requests)
    for spec, request in zip(specs, requests):
        assert_plain(model, request, spec.get("seeds", [None]))
        assert_same(request, served_alone(model, spec))
    # the draws are draws: not always the likeliest id, and a request's two rows differ
    assert any(token.id != token.top[0][0] for token in requests[1].deliver.tokens[0])
    assert requests[4].deliver.ids[0] != requests[4].deliver.ids[1]


def test_the_samples_of_a_prompt_share_its_prefill_and_draw_as_one_batch():
    """
    n rows with one seeded generator draw as one (n, V) batch, as sample.py does: each step the generator's next n
    uniform numbers, one a row, each row from the plain model's distribution over its own ids so far.
    """
    model, n = tiny_model("learned"), 3
    request = ask(prompt(40, 5), 9, sampling=Sampling(), n=n, seeds=[5])
    neighbour = ask(prompt(41, 2), 6)  # a greedy request beside it in the batch
    passes = run(model, [request, neighbour])
    assert len(passes[0].ids) == 2  # one prefill of both prompts: the three rows copy the first's
    generator, rows = torch.Generator().manual_seed(5), [list(request.ids) for _ in range(n)]
    with torch.no_grad():
        for _ in range(9):
            logits = model(torch.tensor(rows))[0][:, -1]  # (n, V)
            for row, drawn in zip(rows, draw(next_probs(logits, 1.0), generator)[:, 0].tolist()):
                row.append(drawn)
    assert request.deliver.ids == [row[len(request.ids) :] for row in rows]
    assert len({tuple(row) for row in request.deliver.ids}) > 1
    assert_plain(model, neighbour)
