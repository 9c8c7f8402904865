"""
The causal language model: a GPT predicting each next token of text. Its batches (windows of the token file), its
evaluation (loss, perplexity and bits per byte over a split or any text file, in strided windows) and its sampling
(continuations of a prompt, streamed or in one batch, and a conversation in the terminal with --chat).
"""

import functools
import itertools
import math
import sys

import numpy as np
import torch

import tokens
from generate import ChatSession, end_of_text, generate_stream, prompt_start, start_ids, until_stop
from log import progress_bar
from model import IGNORE_INDEX
from tasks.base import Task, lm_tokens, windows


class CausalLM(Task):
    """A GPT predicting each next token of text: a window's inputs and targets are one window shifted by one."""

    name, scores, bits_per_byte = "lm", "text with a GPT", True
    eval_options = ("stride",)
    sample_options = ("num_samples", "temperature", "top_k", "top_p", "stream", "use_cache", "chat", "system")
    sample_applies = "sampling (--temperature, --top_k, --top_p, --num_samples, --chat) applies to GPT checkpoints only"
    sample_does = "a GPT samples with --temperature, --top_k and --top_p (greedy: --temperature=0)"

    @functools.cached_property
    def byte_lengths(self):
        """The UTF-8 bytes each id stands for (tokens.token_byte_lengths), read at the first evaluation."""
        return tokens.token_byte_lengths(self.meta)

    def batch(self, data, batch_size, block_size, generator):
        window = windows(data, batch_size, block_size + 1, generator)
        return (window[:, :-1],), window[:, 1:]

    def text_bytes(self, targets):
        return int(self.byte_lengths[targets[targets != IGNORE_INDEX].numpy()].sum())

    def evaluate(self, model, tokenizer, cfg, progress):
        return evaluate_lm(model, tokenizer, self.meta, cfg, progress)

    def sample(self, model, tokenizer, text, cfg, out):
        if cfg.chat:
            return chat(model, tokenizer, self.meta, text, cfg, out)
        return show_samples(model, tokenizer, self.meta, text, cfg, out)


# -----------------------------------------------------------------------------
# Evaluation: loss, perplexity, bits per byte


def window_starts(n_tokens, block_size, stride):
    """
    Where the windows of a GPT's evaluation start: every stride tokens, until a window reaches the last token. A
    window holds block_size + 1 tokens (inputs, and the targets one further); the last may be shorter.
    """
    # the last window starts at the first multiple of stride from which block_size tokens reach the end
    last = max(n_tokens - 1 - block_size, 0)
    return range(0, last + stride, stride)


def lm_loss(model, tokens, byte_lengths, *, block_size, stride, batch_size, limit=None, progress=False):
    """
    A GPT's summed cross-entropy over every token of tokens (a 1-D id array) but the first, in windows of block_size
    (window_starts): the first window scores all its targets, each later one only its last stride. Returns
    {"windows", "tokens", "bytes", "nats"}: the windows run, the tokens scored, the UTF-8 bytes they stand for
    (byte_lengths: tokens.token_byte_lengths) and their loss in nats.
    """
    device = next(model.parameters()).device
    starts = window_starts(len(tokens), block_size, stride)[:limit]
    nats, count, n_bytes = 0.0, 0, 0
    with progress_bar(total=len(starts), unit="window", shown=progress) as bar:
        for i in range(0, len(starts), batch_size):
            batch = starts[i : i + batch_size]
            # IGNORE_INDEX past the end of a short last window: its targets are then left out of the loss
            windows = torch.full((len(batch), block_size + 1), IGNORE_INDEX)
            for row, start in enumerate(batch):
                piece = tokens[start : start + block_size + 1]
                windows[row, : len(piece)] = torch.from_numpy(piece.astype(np.int64))
            # the padding read as id 0 comes after the real tokens, which a causal model never lets them see
            inputs, targets = windows[:, :-1].clamp(min=0), windows[:, 1:].clone()
            # later windows: their first block_size - stride targets were scored by the window before
            targets[torch.tensor(batch) > 0, : block_size - stride] = IGNORE_INDEX
            scored = targets[targets != IGNORE_INDEX].numpy()
            count, n_bytes = count + len(scored), n_bytes + int(byte_lengths[scored].sum())
            _, loss = model(inputs.to(device), targets.to(device), reduction="sum", return_logits=False)
            nats += loss.item()
            bar.update(len(batch))
    return {"windows": len(starts), "tokens": count, "bytes": n_bytes, "nats": nats}


def evaluate_lm(model, tokenizer, meta, cfg, progress):
    """GPT: loss, perplexity and bits per byte of the text. A dict of results."""
    ids, data = lm_tokens(cfg, meta, tokenizer)
    if cfg.input:  # after where a document starts, so that the file's first token is scored too
        ids = np.concatenate([np.asarray(start_ids(tokenizer, meta), dtype=np.int64), ids])
    # a GPT needs one token to predict from and one to predict
    if len(ids) < 2:
        raise ValueError(f"{data} has {len(ids)} token(s): at least 2 are needed, to predict one from the other")
    block = model.config.block_size
    stride = cfg.stride or block
    if stride > block:
        raise ValueError(f"stride must be at most the model's block_size={block}, got {stride}")
    windows = {"block_size": block, "stride": stride, "batch_size": cfg.batch_size, "limit": cfg.limit}
    counts = lm_loss(model, ids, tokens.token_byte_lengths(meta), progress=progress, **windows)
    loss = counts["nats"] / counts["tokens"]
    return {
        "data": data,
        "windows": counts["windows"],
        "stride": stride,
        "tokens": counts["tokens"],
        "bytes": counts["bytes"],
        "loss": loss,
        "perplexity": math.exp(loss),
        # nats to bits, per byte of the text the scored tokens stand for (special tokens stand for none)
        "bits_per_byte": counts["nats"] / (math.log(2) * counts["bytes"]) if counts["bytes"] else math.nan,
    }


# -----------------------------------------------------------------------------
# Sampling: continue the prompt


def show_samples(model, tokenizer, meta, text, cfg, out):
    """GPT: print cfg.num_samples continuations of text, streamed or all at the end. Returns (prompt ids,)."""
    stop = end_of_text(meta)
    head = prompt_start(tokenizer, meta, text)
    # only the prompt the user gave is printed, never the start tokens before it
    shown = crop_prompt(tokenizer.encode(text), model.config.block_size, len(head)) if text else []
    prompt = head + shown
    # a seeded generator of our own, on the model's device: the same seed gives the same text, and the
    # global RNG is left alone
    generator = torch.Generator(next(model.parameters()).device).manual_seed(cfg.seed)
    steps = sample_gpt(model, prompt, cfg, stop, generator, tokenizer.vocab_size)
    # by default only one sample to a terminal streams: piped output gets whole samples
    stream = cfg.stream if cfg.stream is not None else cfg.num_samples == 1 and out.isatty()
    if stream:
        new = [print_stream(steps, shown, tokenizer, stop, out)]
    else:
        # each step is (num_samples, 1): column 0 holds every row's next token
        rows = [[] for _ in range(cfg.num_samples)]
        for step in steps:
            for row, token in zip(rows, step[:, 0].tolist()):
                row.append(token)
        # rows that stopped early repeat the stop token; cut it off
        new = [until_stop(row, stop) for row in rows]
        for i, ids in enumerate(new):
            if i:
                print("-" * 15, file=out)
            print(tokenizer.decode(shown + ids), file=out)
    # a blank line alone would look like a failure: say what happened
    empty = [str(i + 1) for i, ids in enumerate(new) if not ids]
    if empty and cfg.max_new_tokens:
        print(
            f"note: sample {', '.join(empty)} ended at once: the model's first new token was its end of text "
            f"(id {stop}); another --seed or a higher --temperature may go further",
            file=sys.stderr,
        )
    return (prompt,)


def crop_prompt(ids, block_size, reserved=0):
    """
    The last block_size - reserved ids of the prompt (reserved: ids that go before it, such as bos), with a notice
    on stderr when that drops some.
    """
    room = block_size - reserved
    if len(ids) <= room:
        return ids
    beside = f" beside {reserved} start token(s)" if reserved else ""
    print(
        f"note: the prompt has {len(ids)} tokens, more than the model's block_size={block_size} holds{beside}; "
        f"keeping its last {room}",
        file=sys.stderr,
    )
    # the end, since a GPT continues from the last tokens of its context
    return ids[-room:]


def sample_gpt(model, prompt, cfg, stop_token, generator, vocab_size):
    """
    Continue prompt (a list of ids) cfg.num_samples times in one batch with cfg's sampling options, drawing only
    ids below vocab_size (the tokenizer's, not the padded embedding's): an iterator over each step's (num_samples, 1)
    new tokens, rows that reached stop_token repeating it.
    """
    device = next(model.parameters()).device
    # (num_samples, T): the same prompt in every row; the rows diverge as they sample
    idx = torch.tensor([prompt] * cfg.num_samples, dtype=torch.long, device=device)
    options = {"stop_token": stop_token, "generator": generator, "use_cache": cfg.use_cache, "vocab_size": vocab_size}
    # a generator: nothing runs until the caller iterates, then one forward pass per step
    return generate_stream(model, idx, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p, **options)


def print_stream(steps, shown, tokenizer, stop_token, out):
    """Print one sample as its (1, 1) steps arrive, up to stop_token; returns its new ids. See print_tokens."""
    tokens = itertools.takewhile(lambda t: t != stop_token, (s[0, 0].item() for s in steps))
    return print_tokens(tokens, shown, tokenizer, out)


def print_tokens(tokens, shown, tokenizer, out):
    """
    Print text as its ids (an iterator of ints) arrive, after those of shown (the prompt); returns them. The whole
    sequence is decoded each step and only the new text printed, one ending in an incomplete UTF-8 character (which
    BPE splits over several tokens) once the next token completes it.
    """
    ids = list(shown)
    printed = tokenizer.decode(ids)
    print(printed, end="", file=out, flush=True)
    for token in tokens:
        ids.append(token)
        text = tokenizer.decode(ids)
        # U+FFFD: tiktoken's (and a byte-level tokenizer.json's) stand-in for an incomplete character; wait for the rest
        if not text.endswith("\ufffd"):
            print(text[len(printed) :], end="", file=out, flush=True)
            printed = text
    # whatever was held back, then the final newline
    print(tokenizer.decode(ids)[len(printed) :], file=out)
    return ids[len(shown) :]


# -----------------------------------------------------------------------------
# Sampling: a conversation (--chat)


CHAT_HELP = "type a message and press Enter; /reset starts a new conversation, /quit (or Ctrl-D) ends"


def chat(model, tokenizer, meta, text, cfg, out):
    """
    GPT: a conversation in the terminal, each reply streamed as it comes and the KV cache kept from turn to turn;
    with --start (text), the reply to that one message.
    """
    # the chat wing (chat templates, jinja2), loaded only by sample.py --chat
    from chat import model_format

    # seeded, on the model's device: the same seed and messages give the same replies
    generator = torch.Generator(next(model.parameters()).device).manual_seed(cfg.seed)
    sampling = {"temperature": cfg.temperature, "top_k": cfg.top_k, "top_p": cfg.top_p, "generator": generator}
    limits = {"max_new_tokens": cfg.max_new_tokens, "vocab_size": tokenizer.vocab_size}
    session = ChatSession(model, model_format(meta, cfg.init_from), system=cfg.system, **limits, **sampling)
    if cfg.start:
        return answer(session, text, tokenizer, out)
    print(CHAT_HELP, file=sys.stderr)
    while True:
        try:
            text = input("> ")
        except (EOFError, KeyboardInterrupt):  # Ctrl-D or Ctrl-C at the prompt: the end, not an error
            print(file=out)
            return
        command = text.strip().lower()
        if command in ("/quit", "/exit"):
            return
        if command == "/reset":
            session.reset()
            print("(a new conversation)", file=sys.stderr)
        elif command.startswith("/"):
            print(f"unknown command {command}: {CHAT_HELP}", file=sys.stderr)
        elif command:
            dropped = session.dropped
            try:
                answer(session, text, tokenizer, out)
            except ValueError as err:  # the message alone outgrew block_size: say so, and keep the prompt
                print(f"note: {err}", file=sys.stderr)
            if session.dropped and not dropped:  # said the first time only: from then on it happens as needed
                kept = " (the system prompt stays)" if cfg.system else ""
                print(
                    f"note: the conversation outgrew the {model.config.block_size} tokens the model reads "
                    f"(block_size): its oldest turns are left out from now on{kept}",
                    file=sys.stderr,
                )


def answer(session, text, tokenizer, out):
    """Stream the session's reply to text; a reply cut short says why on stderr."""
    print_tokens(session.reply(text, tokenizer.decode), [], tokenizer, out)
    if session.ended == "block_size":
        block = session.model.config.block_size
        print(
            f"note: the reply was cut where the conversation reached the model's block_size={block} tokens; "
            "the next message goes on without the oldest turns",
            file=sys.stderr,
        )
    elif session.ended == "max_new_tokens":
        print(f"note: the reply was cut at --max_new_tokens={session.max_new_tokens}", file=sys.stderr)
