"""generate.py against references written here: beam search's length penalty against an exhaustive search under
the GNMT formula, and sample_next's frequencies against softmax(logits / temperature) filtered in float64."""

import itertools
import math

import pytest
import torch

from generate import beam_search, draw, sample_next
from model import EncoderDecoder, ModelConfig

# -----------------------------------------------------------------------------
# Beam search: which length the penalty counts

V = 8  # PAD, BOS, EOS and five words: small enough to score every sequence
PAD, BOS, EOS = 0, 1, 2


def next_token_table(rows):
    """A (V, V) table of next-token probabilities from the listed ones; each row's rest is shared by its other ids."""
    table = []
    for prev in range(V):
        listed = rows.get(prev, {EOS: 0.02})  # an unlisted token: a near-uniform spread that rarely ends
        rest = (1 - sum(listed.values())) / (V - len(listed))
        table.append([listed.get(t, rest) for t in range(V)])
    return table


class TableDecoder(EncoderDecoder):
    """An encoder-decoder whose next-token probabilities are the table's row of the last token; the source is unread."""

    def __init__(self, table):
        config = ModelConfig(arch="encoder_decoder", vocab_size=V, block_size=8, n_layer=1, n_head=1, n_embd=8)
        super().__init__(config)
        self.log_table = torch.tensor(table).log()  # (V, V)

    def decode(self, tgt, memory, src_mask, cache=None):
        return self.log_table[tgt]  # (B, T, V): beam_search feeds one token a step, so only the last one matters


def exhaustive_best(table, max_len, length_penalty, length):
    """
    The sequence of at most max_len tokens with the best log P / ((5 + length(sequence)) / 6) ** length_penalty, each
    scored in float64 from the table: every sequence ending at its first EOS, and every max_len tokens without one.
    """
    words = [t for t in range(V) if t != EOS]
    sequences = [[*w, EOS] for n in range(max_len) for w in itertools.product(words, repeat=n)]
    sequences += [list(w) for w in itertools.product(words, repeat=max_len)]
    scores = {}
    for seq in sequences:
        log_p = math.fsum(math.log(table[prev][t]) for prev, t in zip([BOS, *seq], seq))
        scores[tuple(seq)] = log_p / ((5 + length(seq)) / 6) ** length_penalty
    best, second = sorted(scores, key=scores.get, reverse=True)[:2]
    assert scores[best] - scores[second] > 1e-3  # a clear winner, far beyond float32 rounding in beam_search's sums
    return list(best)


def with_eos(seq):  # GNMT's |Y| as beam_search counts it: the output tokens, EOS included, BOS not
    return len(seq)


def without_eos(seq):
    return len(seq) - (seq[-1] == EOS)


def with_bos(seq):
    return len(seq) + 1


def with_bos_when_unended(seq):  # bos counted in a hypothesis that ran out of steps only
    return len(seq) + (seq[-1] != EOS)


@pytest.mark.parametrize(
    "rows,length_penalty,wrong_length",
    [
        # "eos" (log 0.164 = -1.808) beats "3 eos" (log(0.8 * 0.169) = -2.001): -1.808 / 1 > -2.001 / (7/6)^0.6 =
        # -1.824. Counting without eos, "3 eos" wins: -1.808 / (5/6)^0.6 = -2.017 < -2.001 / 1.
        ({BOS: {EOS: 0.164, 3: 0.8}, 3: {EOS: 0.169}}, 0.6, without_eos),
        # the other way at length_penalty 2: "3 eos" (log(0.7 * 0.193) = -2.002) beats "eos" (log 0.223 = -1.501):
        # -2.002 / (7/6)^2 = -1.471 > -1.501. Counting bos too, "eos" wins: -1.501 / (7/6)^2 = -1.103 >
        # -2.002 / (8/6)^2 = -1.126.
        ({BOS: {EOS: 0.223, 3: 0.7}, 3: {EOS: 0.193}}, 2.0, with_bos),
        # "eos" (log 0.4677 = -0.760) beats "3 3 3 3", which ran out of steps (log(0.4966 * 0.905^3) = -1.000):
        # -1.000 / (9/6)^0.6 = -0.784. Counting bos in it, it wins: -1.000 / (10/6)^0.6 = -0.736. Its prefixes stay
        # likely enough (-0.9 / (9/6)^0.6 = -0.706 after 3) that the search never stops before running out of steps.
        ({BOS: {EOS: 0.4677, 3: 0.4966}, 3: {3: 0.905, EOS: 0.01}}, 0.6, with_bos_when_unended),
    ],
    ids=["eos_counted", "bos_not_counted", "bos_not_counted_when_out_of_steps"],
)
def test_beam_search_length_penalty_counts_eos_and_not_bos(rows, length_penalty, wrong_length):
    """beam_search's winner is the exhaustive search's under |Y| = output tokens with eos; another count flips it."""
    table, max_len = next_token_table(rows), 4
    best = exhaustive_best(table, max_len, length_penalty, with_eos)
    assert exhaustive_best(table, max_len, length_penalty, wrong_length) != best  # the case tells the counts apart
    model = TableDecoder(table).eval()
    src = torch.tensor([[3, 4]])
    got = beam_search(model, src, max_len, BOS, EOS, beam_size=2, length_penalty=length_penalty)
    assert got[0].tolist() == best


# -----------------------------------------------------------------------------
# Sampling: temperature, top-k and top-p against their frequencies

# distinct logits, so that no two tokens tie at a top-k or top-p boundary; shuffled, so that ids are not ranks
LOGITS = [0.0, 1.5, -1.0, 0.5, -0.5, 1.0]
DRAWS = 100_000
Z = 5  # a frequency's bound in binomial standard deviations: P(|normal| > 5) = 5.7e-7 a token, < 3e-5 over all 8 cases


def filtered_softmax(logits, temperature, top_k, top_p):
    """
    softmax(logits / temperature) in float64; top_k keeps the k likeliest tokens, renormalised; then top_p keeps,
    from the likeliest down, each token whose likelier ones hold less than top_p (the one reaching top_p stays: the
    smallest set holding top_p), renormalised.
    """
    weights = [math.exp(x / temperature) for x in logits]
    probs = [w / math.fsum(weights) for w in weights]
    order = sorted(range(len(probs)), key=probs.__getitem__, reverse=True)
    kept = order[:top_k] if top_k is not None else order
    if top_p is not None:
        mass = math.fsum(probs[t] for t in kept)
        before, nucleus = 0.0, []
        for t in kept:
            assert abs(before - top_p) > 1e-3  # no boundary that float32 rounding in sample_next could move
            if before < top_p:
                nucleus.append(t)
            before += probs[t] / mass
        kept = nucleus
    mass = math.fsum(probs[t] for t in kept)
    return [probs[t] / mass if t in kept else 0.0 for t in range(len(probs))]


@pytest.mark.parametrize("top_p", [None, 0.8])
@pytest.mark.parametrize("top_k", [None, 4])
@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_sample_next_frequencies_follow_the_tempered_filtered_softmax(temperature, top_k, top_p):
    expected = torch.tensor(filtered_softmax(LOGITS, temperature, top_k, top_p), dtype=torch.float64)
    tolerance = Z * (expected * (1 - expected) / DRAWS).sqrt()  # (V,): 0 for a filtered token, never drawn
    # the other temperatures (1: temperature ignored) give distributions far outside these bounds
    for other in {0.5, 1.0, 2.0} - {temperature}:
        elsewhere = torch.tensor(filtered_softmax(LOGITS, other, top_k, top_p), dtype=torch.float64)
        assert (expected - elsewhere).abs().max() > 4 * tolerance.max()

    logits = torch.tensor(LOGITS).repeat(DRAWS, 1)  # (N, V): one draw per row, all in one call
    generator = torch.Generator().manual_seed(0)
    draws = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
    assert draws.shape == (DRAWS, 1)
    frequencies = torch.bincount(draws[:, 0], minlength=len(LOGITS)).double() / DRAWS
    assert ((frequencies - expected).abs() <= tolerance).all(), (frequencies, expected)


def test_draw_never_picks_an_id_of_probability_zero_and_reaches_both_ends():
    probs = torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 1.0], [0, 1e-9, 0, 1.0], [0, 0.5, 0.5, 0]]).repeat(500, 1)
    drawn = draw(probs, torch.Generator().manual_seed(0))[:, 0].view(500, 4)
    assert (drawn[:, 0] == 0).all() and (drawn[:, 1] == 3).all() and (drawn[:, 2] == 3).all()
    assert set(drawn[:, 3].tolist()) == {1, 2}


def test_draw_refuses_a_row_that_is_not_a_distribution():
    for bad in ([0.0, 0.0, 0.0], [float("nan"), 0.5, 0.5]):
        with pytest.raises(ValueError, match="NaN or all zero"):
            draw(torch.tensor([[0.2, 0.3, 0.5], bad]))


def test_the_largest_uniform_still_draws_an_id_of_nonzero_probability(monkeypatch):
    fixed = torch.tensor([[0.25, 0.75, 0.0], [0.1, 0.2, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    shares = torch.rand(1000, 7, generator=torch.Generator().manual_seed(0)) * torch.tensor([1, 1, 1, 1, 1, 1, 0])
    # torch.rand's largest float64, 1 - 2**-53: u x total stays below the total, whatever the total
    monkeypatch.setattr(torch, "rand", lambda *shape, **kw: torch.full(shape, 1 - 2**-53, dtype=kw["dtype"]))
    assert draw(fixed)[:, 0].tolist() == [1, 1, 2]
    assert (draw(shares) == 5).all()  # the last id with a share, never the id of probability 0 after it
