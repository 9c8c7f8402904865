"""
The masked language model: an encoder predicting the tokens hidden in a window of text (BERT's 80/10/10
corruption). Its batches, its evaluation (the loss at the masked positions, masked as in training) and its sampling
(the [MASK]s of a prompt filled).
"""

import numpy as np
import torch

from log import progress_bar
from model import IGNORE_INDEX
from tasks.base import Task, lm_tokens, windows

MASK = "[MASK]"  # what the prompt writes where a token is to be filled in


class MaskedLM(Task):
    """
    The module's task (corruption: mask_tokens). A dataset without a [MASK] id gets one after its vocabulary, recorded
    in the meta the checkpoints store. data_vocab: the ids random replacements are drawn from (default: the data's).
    """

    name, arch, scores = "masked_lm", "encoder", "masked text with an encoder"
    sample_options, sample_applies = ("candidates",), "--candidates applies to encoder (masked LM) checkpoints only"
    sample_does = "an encoder lists the --candidates likeliest tokens for each [MASK]"

    def __init__(self, meta, *, label_smoothing=0.0, mask_prob=0.15, data_vocab=None):
        special = meta["special_tokens"]
        self.data_vocab = meta["vocab_size"] if data_vocab is None else data_vocab
        if "mask" not in special:
            meta = {**meta, "vocab_size": meta["vocab_size"] + 1, "special_tokens": special | {"mask": self.data_vocab}}
        super().__init__(meta, label_smoothing=label_smoothing)
        self.mask_id, self.mask_prob = meta["special_tokens"]["mask"], mask_prob

    @classmethod
    def for_run(cls, meta, *, label_smoothing=0.0, mask_prob=0.15):
        return cls(meta, label_smoothing=label_smoothing, mask_prob=mask_prob)

    def batch(self, data, batch_size, block_size, generator):
        # the window is both the input (corrupted) and the targets (at the chosen positions)
        inputs, targets = mask_tokens(windows(data, batch_size, block_size, generator), self, generator)
        return (inputs,), targets

    def example_batch(self, batch_size, block_size):
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(self.data_vocab, (batch_size, block_size), generator=generator)
        chosen = torch.rand(ids.shape, generator=generator) < self.mask_prob  # the targets, as mask_tokens picks them
        return (ids,), torch.where(chosen, ids, IGNORE_INDEX)

    def evaluate(self, model, tokenizer, cfg, progress):
        ids, data = lm_tokens(cfg, self.meta, tokenizer)
        return evaluate_masked(model, self.meta, ids, data, cfg, progress)

    def sample(self, model, tokenizer, text, cfg, out):
        return show_fills(model, tokenizer, self.meta, text, cfg, out)


def mask_tokens(tokens, task, generator):
    """BERT's corruption of tokens (B, T): (inputs, targets), targets IGNORE_INDEX where nothing is to be predicted."""
    # (B, T) bool: the positions the model must predict
    chosen = torch.rand(tokens.shape, generator=generator) < task.mask_prob
    action = torch.rand(tokens.shape, generator=generator)  # < 0.8: [MASK], < 0.9: random token, else unchanged
    # drawn for every position, used only where action picks a random token; never [MASK] itself
    random_tokens = torch.randint(task.data_vocab, tokens.shape, generator=generator)
    inputs = torch.where(chosen & (action < 0.8), task.mask_id, tokens)
    inputs = torch.where(chosen & (action >= 0.8) & (action < 0.9), random_tokens, inputs)
    # targets at every chosen position, the unchanged ones included: the model cannot tell which they are
    return inputs, torch.where(chosen, tokens, IGNORE_INDEX)


# -----------------------------------------------------------------------------
# Evaluation: the loss at the masked positions


def evaluate_masked(model, meta, tokens, data, cfg, progress):
    """
    An encoder's cross-entropy at the masked positions of tokens, cut into windows of block_size, each masked as in
    training (mask_tokens) with its own generator, seeded by --seed and its index, so that the same seed masks the
    same positions whatever the batch size. A dict of results.
    """
    # train.py appends [MASK] after the dataset's ids: its random replacements are drawn from the ids below it
    task = MaskedLM(meta, mask_prob=cfg.mask_prob, data_vocab=meta["special_tokens"]["mask"])
    block, device = model.config.block_size, next(model.parameters()).device
    starts = range(0, len(tokens), block)[: cfg.limit]
    # a bidirectional model without a padding id would attend to padding: the shorter last window runs alone
    full = [k for k, start in enumerate(starts) if start + block <= len(tokens)]
    batches = [full[i : i + cfg.batch_size] for i in range(0, len(full), cfg.batch_size)]
    batches += [[k] for k in range(len(full), len(starts))]
    nats, count = 0.0, 0
    with progress_bar(total=len(starts), unit="window", shown=progress) as bar:
        for batch in batches:
            masked = []
            for k in batch:
                window = torch.from_numpy(tokens[starts[k] : starts[k] + block].astype(np.int64))
                masked.append(mask_tokens(window[None], task, torch.Generator().manual_seed(cfg.seed + k)))
            inputs, targets = (torch.cat(parts) for parts in zip(*masked))
            count += int((targets != IGNORE_INDEX).sum())
            _, loss = model(inputs.to(device), targets.to(device), reduction="sum", return_logits=False)
            nats += loss.item()
            bar.update(len(batch))
    if not count:
        raise ValueError(f"{data} is too short: no position was masked; raise --mask_prob or give more text")
    return {
        "data": data,
        "windows": len(starts),
        "masked_tokens": count,
        "mask_prob": cfg.mask_prob,
        "masked_loss": nats / count,
    }


# -----------------------------------------------------------------------------
# Sampling: fill in the [MASK]s


def show_fills(model, tokenizer, meta, text, cfg, out):
    """Encoder: print text with each [MASK] filled by its likeliest token, then the candidates per mask.
    Returns (the ids with the masks,) for the attention maps."""
    special = meta["special_tokens"]
    ids, positions = encode_masked(text, tokenizer, special["mask"])
    block = model.config.block_size
    if len(ids) > block:
        raise ValueError(f"the text has {len(ids)} tokens, more than the model's block_size={block}")
    # special tokens, and the ids that pad the embedding beyond the tokenizer's vocabulary, are no answer
    exclude = sorted({*special.values(), *range(tokenizer.vocab_size, model.config.vocab_size)})
    # never ask topk for more tokens than remain
    k = min(cfg.candidates, model.config.vocab_size - len(exclude))
    fills = fill_mask(model, ids, positions, k, exclude)
    best = list(ids)
    # candidates are likeliest first: the best fill is the first one's id
    for position, candidates in zip(positions, fills):
        best[position] = candidates[0][0]
    print(tokenizer.decode(best), file=out)
    for n, candidates in enumerate(fills, 1):
        print(f"{MASK} {n}: " + "  ".join(f"{tokenizer.decode([t])!r} {p:.3f}" for t, p in candidates), file=out)
    return (ids,)


def encode_masked(text, tokenizer, mask_id):
    """(ids, positions of the masks) for text holding [MASK]s; each piece between them is encoded on its own."""
    pieces = text.split(MASK)
    if len(pieces) == 1:
        raise ValueError(f'an encoder fills in masks: put {MASK} in --start, e.g. --start "To be or {MASK} to be"')
    # positions: where each mask id lands in ids
    ids, positions = tokenizer.encode(pieces[0]), []
    for piece in pieces[1:]:
        positions.append(len(ids))
        ids += [mask_id, *tokenizer.encode(piece)]
    return ids, positions


def fill_mask(model, ids, positions, k, exclude):
    """
    The k likeliest (token id, probability) pairs at each masked position of ids.
    exclude: token ids never proposed (special tokens, and ids the tokenizer cannot decode).
    """
    idx = torch.tensor([ids], dtype=torch.long, device=next(model.parameters()).device)
    # model(idx) is (logits, loss); .float(): probabilities in full precision under autocast
    logits = model(idx)[0][0, positions].float()  # (masks, V)
    # -inf: softmax gives them probability 0, so topk never proposes them
    logits[:, exclude] = float("-inf")
    probs, tokens = logits.softmax(dim=-1).topk(k, dim=-1)
    return [list(zip(t.tolist(), p.tolist())) for t, p in zip(tokens, probs)]
