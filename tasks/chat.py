"""
Chat: a GPT on conversations, with the loss on the assistant's tokens. Its batches (whole conversations of about one
length, right-padded), its evaluation (that loss, and the exact match of greedy final replies where they are exact
answers) and its sampling (the causal LM's: text, or a conversation with --chat).
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import tokens
from chat import ChatFormat, model_format
from generate import decoded_replies
from log import progress_bar
from model import IGNORE_INDEX
from recipes.chat import BadConversation, LeftOut, chat_records, encode_conversation
from tasks.base import dataset_split, long_block_note, usable_rows
from tasks.lm import CausalLM


class Chat(CausalLM):
    """
    The causal LM on conversations (see the module's docstring). pad_id stays None, so that the model builds no key
    mask: causal attention never lets a real position see the padding after it.
    """

    name = kind = "chat"
    scores, eval_options = "a GPT's replies", ("exact_match",)
    varying = saves_data_meta = True

    def __init__(self, meta, *, label_smoothing=0.0):
        super().__init__(meta, label_smoothing=label_smoothing)
        self.exact_answers = bool(meta.get("exact_answers"))

    def load_split(self, folder, split, block_size):
        """A ChatSplit: the conversations that fit block_size + 1 ids, shortest first."""
        conversations = tokens.load_conversations(folder, split)
        lengths = np.diff(conversations.index)
        # inputs and targets are a conversation's ids less one
        fits = np.flatnonzero(lengths <= block_size + 1)
        shortest = f" (the shortest has {lengths.min() - 1:,} inputs)"
        usable_rows(fits, len(conversations), f"{split} conversation", folder, block_size, shortest)
        # a fixed seed: the order is the same on every rank and at every resume
        tiebreak = np.random.default_rng(0).permutation(len(fits))
        return ChatSplit(conversations, fits[np.lexsort((tiebreak, lengths[fits]))])

    def batch(self, data, batch_size, block_size, generator):
        inputs, targets = chat_batch(data.conversations, chat_rows(data, batch_size, generator))
        return (inputs,), targets

    def example_batch(self, batch_size, block_size):
        # dense, as chat_batch makes them: a window's strides would give compile's graph guards real batches fail
        (inputs,), targets = super().example_batch(batch_size, block_size)
        return (inputs.contiguous(),), targets.contiguous()

    def count_tokens(self, inputs, targets):
        # a conversation's inputs end at its last loss target (the chat recipe cuts what follows), and its padding after
        real = targets != IGNORE_INDEX
        last = targets.size(1) - 1 - real.flip(1).int().argmax(1)
        return int((last + 1).sum())

    def answer_rows(self, split):
        return np.sort(split.order)  # the conversations in their file's order (the split keeps them by length)

    def decoded(self, model, split, rows, batch_size, block_size):
        stop = ChatFormat.from_meta(self.meta).end_of_turn
        return decoded_replies(model, (split.conversations[int(i)] for i in rows), stop)

    def evaluate(self, model, tokenizer, cfg, progress):
        return evaluate_chat(model, tokenizer, self.meta, cfg, progress)

    def describe(self, split, batch_size):
        padding = padding_fraction(split, batch_size)
        return f"chat batches: whole conversations of about one length, {padding:.1%} of their positions padding"

    def length_note(self, split, block_size):
        # inputs are a conversation's ids less one
        longest = int(np.diff(split.conversations.index)[split.order].max()) - 1
        return long_block_note(longest, "training conversation", block_size)


@dataclass(frozen=True)
class ChatSplit:
    """A chat split as Chat.batch reads it: its conversations, and those that fit block_size, shortest first."""

    conversations: tokens.Conversations
    # equal lengths in a fixed shuffled order, so that a file's runs of one kind of conversation do not fill batches
    order: np.ndarray


def chat_batch(conversations, rows):
    """
    Conversations `rows` as (inputs (B, T), targets (B, T)): inputs = ids[:-1], targets = ids[1:] where that id is
    a loss target, else IGNORE_INDEX; right-padded to the longest of the batch, with inputs 0 (any id would do: see
    Chat) and targets IGNORE_INDEX.
    """
    examples = [conversations[int(i)] for i in rows]
    T = max(len(ids) for ids, _ in examples) - 1
    inputs = torch.zeros((len(examples), T), dtype=torch.int64)
    targets = torch.full((len(examples), T), IGNORE_INDEX)
    for b, (ids, flags) in enumerate(examples):
        ids = torch.from_numpy(ids.astype(np.int64))
        inputs[b, : len(ids) - 1] = ids[:-1]
        targets[b, : len(ids) - 1] = torch.where(torch.from_numpy(flags[1:] == 1), ids[1:], IGNORE_INDEX)
    return inputs, targets


def chat_rows(split, batch_size, generator):
    """
    batch_size neighbours in split.order from a random start: conversations of about one length, so that little of
    the batch is padding. The order wraps around, so every conversation is drawn equally often.
    """
    start = int(torch.randint(len(split.order), (1,), generator=generator))
    return split.order[(start + np.arange(batch_size)) % len(split.order)]


def padding_fraction(split, batch_size):
    """
    The share of a chat split's micro-batch positions that are padding, over the starts chat_rows draws (at most
    4,096 of them, evenly spread): what per-conversation padding costs this dataset at this batch size.
    """
    # inputs per conversation (its ids less one), in split.order
    lengths = np.diff(split.conversations.index)[split.order] - 1
    n = len(lengths)
    starts = np.unique(np.linspace(0, n - 1, min(n, 4096)).astype(np.int64))
    rows = lengths[(starts[:, None] + np.arange(batch_size)) % n]  # (starts, B)
    return 1 - rows.sum() / (rows.max(1).sum() * batch_size)


# -----------------------------------------------------------------------------
# Evaluation: the assistant's tokens, and exact answers


def chat_conversations(cfg, meta, chat_format, block_size):
    """
    (conversations as (ids, targets) arrays, what they are, how many were left out) that fit block_size: a
    conversations file (--input, in the model's template) or a split of the chat data the model was trained on.
    """
    if cfg.input:
        left_out, conversations = LeftOut(), []
        for where, record in chat_records(Path(cfg.input).expanduser()):
            try:
                ids, targets = encode_conversation(record, chat_format, block_size)
            except BadConversation as err:
                left_out.add(str(err), where)
                continue
            conversations.append((np.asarray(ids), np.asarray(targets, dtype=np.uint8)))
        if not conversations:
            raise ValueError(f"{cfg.input} holds no conversation this model can score: {left_out.describe()}")
        return conversations, cfg.input, left_out.bad()
    folder, split = dataset_split(cfg, meta, "chat")
    stored = tokens.load_conversations(folder, split)
    fits = [i for i, n in enumerate(np.diff(stored.index)) if n <= block_size + 1]
    if not fits:
        raise ValueError(f"no {split} conversation of {folder.name} fits the model's block_size={block_size}")
    return [stored[i] for i in fits], f"{folder.name} {split}", len(stored) - len(fits)


def evaluate_chat(model, tokenizer, meta, cfg, progress):
    """
    A chat model's loss on the assistant's tokens (teacher-forced, per target) and, where the replies are exact
    answers (the dataset's meta says so, or --exact_match), the exact match of its greedy final replies.
    """
    chat_format = model_format(meta, cfg.init_from)
    conversations, data, left_out = chat_conversations(cfg, meta, chat_format, model.config.block_size)
    conversations = conversations[: cfg.limit]
    device = next(model.parameters()).device
    # batches of conversations of about one length, so that little of each is padding
    order = np.argsort([len(ids) for ids, _ in conversations], kind="stable")
    nats, count = 0.0, 0
    for i in range(0, len(order), cfg.batch_size):
        inputs, targets = chat_batch(conversations, order[i : i + cfg.batch_size])
        count += int((targets != IGNORE_INDEX).sum())
        _, loss = model(inputs.to(device), targets.to(device), reduction="sum", return_logits=False)
        nats += loss.item()
    results = {"data": data, "conversations": len(conversations), "left_out": left_out, "targets": count}
    results["loss"] = nats / count
    exact = meta.get("exact_answers", False) if cfg.exact_match is None else cfg.exact_match
    if exact:
        replies = decoded_replies(model, conversations, chat_format.end_of_turn, vocab_size=tokenizer.vocab_size)
        bar = progress_bar(replies, total=len(conversations), unit="reply", shown=progress)
        results["exact_match"] = sum(output == reference for output, reference in bar) / len(conversations)
    return results
