"""
engine.py's continuous batching against generate.py decoding each prompt alone: greedy replies of requests that
share the batch, join it late and leave it early are what each gives by itself; the budget makes requests wait. A
long prompt is fed a chunk a forward pass, as the scheduler says, and scores as one plain forward pass over it.
"""

import math
import threading

import pytest
import torch

from engine import DONE, Engine, Request, Runner, Sampling, Scheduler
from generate import generate
from model import GPT, KVCache, ModelConfig

SHAPES = {
    "learned": dict(pos_encoding="learned"),
    # rotary, grouped-query heads and a window shorter than the replies: each row's mask must be its own
    "rope-window": dict(pos_encoding="rope", n_kv_head=1, window_size=5, norm="rmsnorm", activation="swiglu"),
}


def tiny_model(**options):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=50, block_size=32, n_layer=2, n_head=2, n_embd=16, **options)
    model = GPT(config).eval()
    with torch.no_grad():  # larger weights than GPT-2's init: logits far apart, so that no argmax is a near tie
        for p in model.parameters():
            p.mul_(8 if p.dim() > 1 else 1)
    return model


class Collector:
    """Each request's ids per row, as the engine delivers them; `done` once every request has ended."""

    def __init__(self, count):
        self.ids, self.failures, self.left, self.done = [None] * count, [], count, threading.Event()

    def deliver(self, k, n):
        self.ids[k] = [[] for _ in range(n)]

        def take(item):
            if item == DONE or isinstance(item, Exception):
                self.failures += [item] if isinstance(item, Exception) else []
                self.left -= 1
                if not self.left:
                    self.done.set()
                return
            for token in item.tokens:
                self.ids[k][token.row].append(token.id)

        return take


def run_engine(model, requests, *, max_rows=16, chunk=256, max_positions=None):
    engine = Engine(
        Runner(model, model.config.vocab_size, max_rows=max_rows, max_positions=max_positions),
        Scheduler(max_rows, max_positions or max_rows * model.config.block_size, chunk=chunk),
        torch.device("cpu"),
        torch.float32,
    )
    engine.start()
    try:
        for request in requests:
            engine.submit(request)
        yield engine
    finally:
        engine.stop()


def recorded_forward_passes(model, alone_only=False):
    """
    The ids of each forward pass through model.body from now on (a list of rows of ids), recorded by a hook; alone_only:
    only those that fill a request's own KV cache (model.KVCache, not the batch's slots), prompts prefilled alone.
    Returns (the list, filled as passes run; the hook's handle, to remove it).
    """
    passes = []

    def record(module, args, kwargs):
        cache = kwargs.get("cache")
        if not alone_only or (cache is not None and isinstance(cache[0][0], KVCache)):
            passes.append(args[0].tolist())

    return passes, model.body.register_forward_pre_hook(record, with_kwargs=True)


def alone(model, prompt, max_tokens):
    """generate.py's greedy continuation of one prompt by itself: its new ids."""
    out = generate(model, torch.tensor([prompt]), max_tokens, temperature=0)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("shape", SHAPES)
def test_eight_greedy_requests_together_are_each_what_it_gives_alone(shape):
    model = tiny_model(**SHAPES[shape])
    prompts = [[(7 * k + i) % 50 for i in range(1 + 3 * k)] for k in range(8)]  # 1 to 22 ids
    max_tokens = [10 - k % 3 for k in range(8)]
    got = Collector(8)
    requests = [
        Request(p, m, sampling=Sampling(temperature=0), deliver=got.deliver(k, 1))
        for k, (p, m) in enumerate(zip(prompts, max_tokens))
    ]
    # a chunk of 4 prompt ids a step: the long prompts are prefilled over several steps while others decode
    fed_alone, hook = recorded_forward_passes(model, alone_only=True)
    for _ in run_engine(model, requests, chunk=4):
        assert got.done.wait(60)
    hook.remove()  # the references below run the plain model
    assert not got.failures
    # each prompt of more than 4 ids went in alone, in arrival order, 4 ids a forward pass: ceil(len / 4) passes
    assert fed_alone == [[p[i : i + 4]] for p in prompts if len(p) > 4 for i in range(0, len(p), 4)]
    assert len(fed_alone) == sum(math.ceil(len(p) / 4) for p in prompts if len(p) > 4) == 24
    assert [rows[0] for rows in got.ids] == [alone(model, p, m) for p, m in zip(prompts, max_tokens)]


def test_the_samples_of_a_prompt_share_its_prefill_and_draw_as_one_batch():
    """n rows with one seeded generator draw what generate.py draws for the prompt repeated n times, seeded alike."""
    model = tiny_model(**SHAPES["learned"])
    prompt, n = [3, 1, 4, 1, 5], 3
    got = Collector(2)
    requests = [
        Request(prompt, 9, n=n, generators=[torch.Generator().manual_seed(5)], deliver=got.deliver(0, n)),
        Request([2, 7], 6, sampling=Sampling(temperature=0), deliver=got.deliver(1, 1)),  # a neighbour in the batch
    ]
    for _ in run_engine(model, requests):
        assert got.done.wait(60)
    expected = generate(
        model, torch.tensor([prompt] * n), 9, temperature=1.0, generator=torch.Generator().manual_seed(5)
    )
    assert got.ids[0] == expected[:, len(prompt) :].tolist() and len(set(map(tuple, got.ids[0]))) > 1
    assert got.ids[1] == [alone(model, [2, 7], 6)]


@pytest.mark.parametrize("shape", SHAPES)
def test_a_long_prompt_fed_a_chunk_a_step_scores_as_one_plain_forward_pass(shape):
    """
    22 prompt ids with a chunk of 4: ceil(22 / 4) = 6 forward passes of 4, 4, 4, 4, 4 and 2 ids (the rope-window
    shape's window of 5 reaching back across chunks), and nothing else (max_tokens=1: the prefill draws the only id).
    The prompt's scores and the first id are those of one forward pass of the plain model over the whole prompt.
    """
    model = tiny_model(**SHAPES[shape])
    prompt = [(5 * i + 3) % 50 for i in range(22)]
    with torch.no_grad():
        reference = model(torch.tensor([prompt]))[0][0].double().log_softmax(dim=-1)  # (22, V)
    passes, _ = recorded_forward_passes(model)
    got, done = [], threading.Event()

    def deliver(item):
        got.append(item)
        if item == DONE or isinstance(item, Exception):
            done.set()

    options = dict(sampling=Sampling(temperature=0), logprobs=2, prompt_logprobs=True)
    for _ in run_engine(model, [Request(prompt, 1, deliver=deliver, **options)], chunk=4):
        assert done.wait(60)
    assert passes == [[prompt[i : i + 4]] for i in range(0, 22, 4)] and len(passes) == math.ceil(22 / 4)
    produced, end = got
    assert end == DONE
    # position t predicts prompt id t + 1: its log p, and the two likeliest ids
    expected = reference[torch.arange(21), prompt[1:]].tolist()
    assert [logprob for logprob, _ in produced.prompt] == pytest.approx(expected, abs=1e-5)
    assert [[i for i, _ in top] for _, top in produced.prompt] == reference[:21].topk(2).indices.tolist()
    (token,) = produced.tokens
    assert token.id == reference[21].argmax().item()
    assert token.logprob == pytest.approx(reference[21].max().item(), abs=1e-5)
