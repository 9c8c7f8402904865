"""
What a batch is for each architecture: a GPT's shifted windows, a masked LM's corrupted windows (BERT's 80/10/10),
an encoder-decoder's padded (source, target) pairs; the special ids each needs (Objective); and the seeds that
make a micro-batch depend on its seed alone. train.py draws its training and evaluation batches here, eval.py its
masked windows and pairs.
"""

from dataclasses import dataclass

import numpy as np
import torch

from config import ConfigError
from model import IGNORE_INDEX


@dataclass(frozen=True)
class Objective:
    """What a batch is for each architecture, and the special ids that needs."""

    arch: str
    data_vocab: int  # ids the dataset holds; masked LM draws its random replacements from these
    mask_id: int | None = None
    mask_prob: float = 0.15
    pad_id: int | None = None
    bos_id: int | None = None
    eos_id: int | None = None


def make_objective(arch, meta, mask_prob):
    """(Objective, model vocabulary size, meta to store in checkpoints) for arch on a dataset with this meta."""
    kind = "seq2seq" if arch == "encoder_decoder" else "lm"
    if meta["kind"] != kind:
        examples = "reverse, sort, num2words, translation" if kind == "seq2seq" else "shakespeare_char, shakespeare"
        raise ConfigError(f"arch={arch} needs a {kind} dataset ({examples}); {meta.get('name')} is {meta['kind']}")
    # the special ids each arch needs: pad, bos and eos to frame pairs; [MASK] for the encoder; none for a GPT
    vocab, special = meta["vocab_size"], meta["special_tokens"]
    if arch == "encoder_decoder":
        objective = Objective(arch, vocab, pad_id=special["pad"], bos_id=special["bos"], eos_id=special["eos"])
    elif arch == "encoder" and "mask" not in special:
        # a new id after the vocabulary, recorded so the checkpoint's tokenizer knows it
        meta = {**meta, "vocab_size": vocab + 1, "special_tokens": {**special, "mask": vocab}}
        objective = Objective(arch, vocab, mask_id=vocab, mask_prob=mask_prob)
    else:
        objective = Objective(arch, vocab, mask_id=special.get("mask"), mask_prob=mask_prob)
    model_vocab = meta["vocab_size"]
    if meta["tokenizer"]["type"] == "tiktoken":
        model_vocab = -(-model_vocab // 64) * 64  # 50257 -> 50304: faster matmuls; the data never holds the extra ids
    return objective, model_vocab, meta


def windows(tokens, batch_size, length, generator):
    """batch_size windows of `length` consecutive tokens at random offsets: (B, length) int64."""
    # + 1: a window may end at the very last token
    starts = torch.randint(len(tokens) - length + 1, (batch_size,), generator=generator).tolist()
    # the file's uint16 or uint32 ids widened to int64, which embeddings and cross_entropy take
    return torch.from_numpy(np.stack([tokens[s : s + length] for s in starts]).astype(np.int64))


def mask_tokens(tokens, objective, generator):
    """BERT's corruption of tokens (B, T): (inputs, targets), targets IGNORE_INDEX where nothing is to be predicted."""
    # (B, T) bool: the positions the model must predict
    chosen = torch.rand(tokens.shape, generator=generator) < objective.mask_prob
    action = torch.rand(tokens.shape, generator=generator)  # < 0.8: [MASK], < 0.9: random token, else unchanged
    # drawn for every position, used only where action picks a random token; never [MASK] itself
    random_tokens = torch.randint(objective.data_vocab, tokens.shape, generator=generator)
    inputs = torch.where(chosen & (action < 0.8), objective.mask_id, tokens)
    inputs = torch.where(chosen & (action >= 0.8) & (action < 0.9), random_tokens, inputs)
    # targets at every chosen position, the unchanged ones included: the model cannot tell which they are
    return inputs, torch.where(chosen, tokens, IGNORE_INDEX)


def seq2seq_batch(pairs, rows, objective):
    """
    Pairs `rows` as (src (B, S), tgt_in (B, T), targets (B, T)): tgt_in = [bos] + target, targets = target + [eos],
    right-padded with pad_id (IGNORE_INDEX in targets) to the longest of the batch.
    """
    examples = [pairs[int(i)] for i in rows]
    # + 1: tgt_in has bos before the target, targets has eos after it
    S, T = max(len(s) for s, _ in examples), max(len(t) for _, t in examples) + 1
    # all padding at first; each row's real tokens then overwrite its start
    src = torch.full((len(examples), S), objective.pad_id)
    tgt_in = torch.full((len(examples), T), objective.pad_id)
    targets = torch.full((len(examples), T), IGNORE_INDEX)
    for b, (s, t) in enumerate(examples):
        s, t = torch.from_numpy(s.astype(np.int64)), torch.from_numpy(t.astype(np.int64))
        src[b, : len(s)] = s
        tgt_in[b, 0], tgt_in[b, 1 : len(t) + 1] = objective.bos_id, t
        targets[b, : len(t)], targets[b, len(t)] = t, objective.eos_id
    return src, tgt_in, targets


def get_batch(data, objective, batch_size, block_size, generator):
    """One micro-batch of a split drawn with generator: (model inputs tuple, targets), int64 CPU tensors."""
    if objective.arch == "encoder_decoder":
        pairs, usable = data
        # random pairs among those that fit block_size (with replacement, like the windows)
        rows = usable[torch.randint(len(usable), (batch_size,), generator=generator).numpy()]
        src, tgt_in, targets = seq2seq_batch(pairs, rows, objective)
        return (src, tgt_in), targets
    if objective.arch == "encoder":
        # masked LM: the window is both the input (corrupted) and the targets (at the chosen positions)
        inputs, targets = mask_tokens(windows(data, batch_size, block_size, generator), objective, generator)
        return (inputs,), targets
    # a GPT predicts each next token: inputs and targets are the same window shifted by one, (B, block_size) each
    tokens = windows(data, batch_size, block_size + 1, generator)
    return (tokens[:, :-1],), tokens[:, 1:]


def micro_seeds(generator, n):
    """Seeds for the next n micro-batches: a micro-batch depends only on its seed, whichever rank draws it."""
    return torch.randint(2**62, (n,), generator=generator).tolist()


def count_targets(targets):
    """How many positions of targets hold a real target: what a step's mean loss divides by."""
    return int((targets != IGNORE_INDEX).sum())


def count_tokens(inputs, objective):
    """Input tokens of a batch, padding left out: what tokens/s counts."""
    return sum(x.numel() if objective.pad_id is None else int((x != objective.pad_id).sum()) for x in inputs)
