"""
Sequence to sequence: an encoder-decoder translating a source into a target. Its batches (padded pairs of varying
lengths), its evaluation (exact match, token accuracy and teacher-forced loss over a split's pairs, decoded greedily
or by beam search) and its sampling (the prompt translated, and for a synthetic task whether that is right).
"""

from dataclasses import dataclass

import numpy as np
import torch

import tokens
from generate import decoded_pairs, translate, until_stop
from log import progress_bar
from model import IGNORE_INDEX
from synthetic import solve
from tasks.base import Task, dataset_split, long_block_note, random_ids, usable_rows


class Seq2Seq(Task):
    """An encoder-decoder translating a source into a target: padded (source, target) pairs of varying lengths."""

    name = kind = "seq2seq"
    arch, examples, scores = "encoder_decoder", "reverse, sort, num2words, translation", "pairs with an encoder-decoder"
    varying = exact_answers = True
    eval_options = sample_options = ("beam_size", "length_penalty")
    sample_applies = "beam search applies to encoder-decoder checkpoints only"
    sample_does = "an encoder-decoder decodes greedily, or with --beam_size and --length_penalty"

    def __init__(self, meta, *, label_smoothing=0.0):
        super().__init__(meta, label_smoothing=label_smoothing)
        special = meta["special_tokens"]
        self.pad_id, self.bos_id, self.eos_id = special["pad"], special["bos"], special["eos"]

    def load_split(self, folder, split, block_size):
        """A PairSplit: the pairs, and those that fit block_size."""
        pairs = tokens.load_pairs(folder, split)
        usable = usable_rows(fitting_pairs(pairs, block_size), len(pairs), f"{split} pair", folder, block_size)
        return PairSplit(pairs, usable)

    def length_note(self, split, block_size):
        # a source, or a target with bos (or eos)
        lengths = np.diff(split.pairs.index, axis=0)[split.usable]
        longest = int(max(lengths[:, 0].max(), lengths[:, 1].max() + 1))
        return long_block_note(longest, "training pair", block_size)

    def batch(self, data, batch_size, block_size, generator):
        # random pairs among those that fit block_size (with replacement, like the windows)
        rows = data.usable[torch.randint(len(data.usable), (batch_size,), generator=generator).numpy()]
        src, tgt_in, targets = seq2seq_batch(data.pairs, rows, self)
        return (src, tgt_in), targets

    def example_batch(self, batch_size, block_size):
        ids = random_ids(self.meta["vocab_size"], (batch_size, block_size + 1))
        # the source one shorter, each tensor dense: equal sizes (or strides) would share a symbol in compile's
        # dynamic graph, and the first batch of unequal lengths would compile again
        return (ids[:, 1:-1].contiguous(), ids[:, :-1].contiguous()), ids[:, 1:].contiguous()

    def count_tokens(self, inputs, targets):
        return sum(int((x != self.pad_id).sum()) for x in inputs)

    def answer_rows(self, split):
        return split.usable

    def decoded(self, model, split, rows, batch_size, block_size):
        starts = range(0, len(rows), batch_size)
        batches = (seq2seq_batch(split.pairs, rows[i : i + batch_size], self) for i in starts)
        return decoded_pairs(model, batches, self.bos_id, self.eos_id, max_len=block_size)

    def evaluate(self, model, tokenizer, cfg, progress):
        return evaluate_seq2seq(model, self, cfg, progress)

    def sample(self, model, tokenizer, text, cfg, out):
        return show_translation(model, tokenizer, self.meta, text, cfg, out)


@dataclass(frozen=True)
class PairSplit:
    """A split of pairs as Seq2Seq.batch reads it: its pairs, and the indices of those that fit block_size."""

    pairs: tokens.Pairs
    usable: np.ndarray


def fitting_pairs(pairs, block_size):
    """The indices of pairs whose source fits block_size, and whose target with bos (or eos) does."""
    lengths = np.diff(pairs.index, axis=0)  # (n, 2): source and target length of each pair
    return np.flatnonzero((lengths[:, 0] <= block_size) & (lengths[:, 1] + 1 <= block_size))


def seq2seq_batch(pairs, rows, task):
    """
    Pairs `rows` as (src (B, S), tgt_in (B, T), targets (B, T)): tgt_in = [bos] + target, targets = target + [eos],
    right-padded with pad_id (IGNORE_INDEX in targets) to the longest of the batch.
    """
    examples = [pairs[int(i)] for i in rows]
    # + 1: tgt_in has bos before the target, targets has eos after it
    S, T = max(len(s) for s, _ in examples), max(len(t) for _, t in examples) + 1
    # all padding at first; each row's real tokens then overwrite its start
    src = torch.full((len(examples), S), task.pad_id)
    tgt_in = torch.full((len(examples), T), task.pad_id)
    targets = torch.full((len(examples), T), IGNORE_INDEX)
    for b, (s, t) in enumerate(examples):
        s, t = torch.from_numpy(s.astype(np.int64)), torch.from_numpy(t.astype(np.int64))
        src[b, : len(s)] = s
        tgt_in[b, 0], tgt_in[b, 1 : len(t) + 1] = task.bos_id, t
        targets[b, : len(t)], targets[b, len(t)] = t, task.eos_id
    return src, tgt_in, targets


# -----------------------------------------------------------------------------
# Evaluation: exact match and token accuracy


def evaluate_seq2seq(model, task, cfg, progress):
    """
    Exact match, token accuracy and teacher-forced loss (per target + eos position) over a split's pairs that fit
    block_size, their sources decoded greedily or by beam search and compared with the references, target + eos:
    token accuracy counts the reference positions whose token the output has at the same position.
    """
    if cfg.input:
        raise ValueError("an encoder-decoder is evaluated on its dataset's pairs: give --split, not --input")
    folder, split = dataset_split(cfg, task.meta, "seq2seq")
    pairs = tokens.load_pairs(folder, split)
    block = model.config.block_size
    fits = fitting_pairs(pairs, block)  # as in training
    if not len(fits):
        raise ValueError(f"no {split} pair of {folder.name} fits the model's block_size={block}")
    rows, device = fits[: cfg.limit], next(model.parameters()).device
    batches = [seq2seq_batch(pairs, rows[i : i + cfg.batch_size], task) for i in range(0, len(rows), cfg.batch_size)]
    nats, n_targets = 0.0, 0
    for src, tgt_in, targets in batches:
        _, loss = model(src.to(device), tgt_in.to(device), targets.to(device), reduction="sum", return_logits=False)
        nats += loss.item()
        n_targets += int((targets != IGNORE_INDEX).sum())
    beams = {"beam_size": cfg.beam_size, "length_penalty": cfg.length_penalty}
    outputs = decoded_pairs(model, batches, task.bos_id, task.eos_id, max_len=block, **beams)
    exact, correct, n_reference = 0, 0, 0
    for output, reference in progress_bar(outputs, total=len(rows), unit="pair", shown=progress):
        exact += output == reference
        correct += sum(o == r for o, r in zip(output, reference))
        n_reference += len(reference)
    return {
        "data": f"{folder.name} {split}",
        "pairs": len(rows),
        "left_out": len(pairs) - len(fits),
        "decoding": "greedy" if cfg.beam_size == 1 else f"beam search, {cfg.beam_size} beams",
        "exact_match": exact / len(rows),
        "token_accuracy": correct / n_reference,
        "loss": nats / n_targets,
    }


# -----------------------------------------------------------------------------
# Sampling: translate the prompt


def show_translation(model, tokenizer, meta, text, cfg, out):
    """Encoder-decoder: print the output for the source text, and for a synthetic task whether it is right.
    Returns (source ids, decoder input ids) for the attention maps."""
    src = tokenizer.encode(text)
    block = model.config.block_size
    if not src:
        raise ValueError('an encoder-decoder translates --start: give it a source, e.g. --start "hello42"')
    if len(src) > block:  # cropping would change the question, so refuse
        raise ValueError(f"the source has {len(src)} tokens, more than the model's block_size={block}")
    expected = solve(meta["task"], text) if meta.get("task") else None  # first: it rejects sources the task cannot take
    special = meta["special_tokens"]
    source = torch.tensor([src], dtype=torch.long, device=next(model.parameters()).device)
    beams = {"beam_size": cfg.beam_size, "length_penalty": cfg.length_penalty}
    ids = translate(model, source, min(cfg.max_new_tokens, block), special["bos"], special["eos"], **beams)
    # (1, L) for the one source, without bos; eos and the padding after it are cut off
    output = until_stop(ids[0].tolist(), special["eos"])
    answer = tokenizer.decode(output)
    print(answer, file=out)
    if expected is not None:
        print("correct" if answer == expected else f"wrong: expected {expected!r}", file=out)
    # the decoder's input as it was during generation: bos, then the output, within block_size
    return src, [special["bos"], *output][:block]
