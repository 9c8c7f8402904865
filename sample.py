"""
Generate from a checkpoint of train.py, or from GPT-2's weights, for every architecture:
a GPT continues the prompt, an encoder-decoder translates it, an encoder fills in its [MASK]s. The decoding itself
is generate.py's; this file reads the prompt, prints what comes out and draws the attention maps.

    python sample.py --out_dir=out-shakespeare --start "ROMEO:" --num_samples=3 --temperature=0.8
    python sample.py --init_from=gpt2 --start "The meaning of life is" --top_p=0.9
    python sample.py --init_from=/models/TinyLlama-1.1B --start "ROMEO:"   # a folder with its tokenizer.json
    python sample.py --out_dir=out-reverse --start "hello" --beam_size=4
    python sample.py --out_dir=out-chat --chat                          # talk to it: /reset, /quit
    python sample.py --out_dir=out-chat --chat --start "What is two plus three?"   # one answer, then exit
    python sample.py --help
"""

import itertools
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from chat import model_format
from config import parse_config
from data import TASKS, make_task
from generate import ChatSession, check_sampling_args, end_of_text, generate_stream, prompt_start, translate, until_stop
from runtime import DTYPES, autocast, resolve_device, resolve_dtype
from start import load_configured
from synthetic import solve

MASK = "[MASK]"  # what the encoder's prompt writes where a token is to be filled in
MAX_TICK_LABELS = 32  # token labels per axis of a heat map; more would overlap


@dataclass
class SampleConfig:
    init_from: str = "resume"  # "resume": out_dir's checkpoint; a checkpoint file (ours, nanoGPT's); a HF id or folder
    out_dir: str = "out-shakespeare"  # the folder train.py wrote its checkpoints to
    checkpoint: str = ""  # which file of out_dir: "" the best weights (best.pt, else ckpt.pt), "ckpt.pt" the latest
    dataset: str = ""  # nanoGPT character-level checkpoints only: the prepared dataset of their characters
    start: str = ""  # the prompt; "FILE:path" reads a file; "" starts from end-of-text (bos, or a newline)
    chat: bool = False  # GPT with a chat template: talk to it turn by turn (--start: answer that message, then exit)
    system: str = ""  # chat: the system prompt that opens the conversation
    num_samples: int = 1  # GPT: continuations drawn, all in one batch
    max_new_tokens: int = 500  # GPT: tokens added to each sample; encoder-decoder: the longest output (<= block_size)
    temperature: float = 0.8  # GPT: divides the logits; < 1 sharper, > 1 flatter, 0 picks the likeliest (greedy)
    top_k: int | None = 200  # GPT: sample among the k likeliest tokens only; None: all of them
    top_p: float | None = None  # GPT: sample among the fewest likeliest tokens holding p of the probability; None: all
    stream: bool | None = None  # GPT: print tokens as they come; None: when printing one sample to a terminal
    use_cache: bool = True  # GPT: keep earlier positions' keys and values (KV cache); False recomputes, same tokens
    beam_size: int = 1  # encoder-decoder: 1 decodes greedily, more runs beam search with that many hypotheses
    length_penalty: float = 0.6  # beam search: a hypothesis scores log p / ((5 + length) / 6) ** length_penalty
    candidates: int = 5  # encoder: the likeliest tokens listed for each [MASK]
    attention: str = ""  # write the prompt's attention maps (a heat map per layer and head) to this PNG (matplotlib)
    seed: int = 1337  # seeds the sampling: the same seed and options give the same text
    device: str = "auto"  # "cpu", "cuda", "cuda:1", "mps"; "auto": cuda, else mps, else cpu
    dtype: str = "auto"  # "float32", "bfloat16" or "float16" (autocast); "auto": as in train.py
    compile: bool = False  # torch.compile the layers: a slow first step, faster ones after it

    def __post_init__(self):
        # the model's own check, run at parse time: a bad value fails before the slow model load
        check_sampling_args(self.temperature, self.top_k, self.top_p)
        for name in ("num_samples", "beam_size", "candidates"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.chat and self.num_samples > 1:
            raise ValueError(f"chat replies one message at a time: drop --num_samples={self.num_samples}")
        if self.system and not self.chat:
            raise ValueError("--system is the system prompt of a chat: add --chat")
        if self.stream and self.num_samples > 1:
            raise ValueError(
                f"stream=True prints one sample as it grows; set num_samples=1 (got {self.num_samples}) or stream=False"
            )


def read_prompt(start):
    """The prompt text: start itself, or the contents of the file that "FILE:path" names."""
    if not start.startswith("FILE:"):
        return start
    # FILE: lets a long or multi-line prompt come from a file, not the shell
    path = Path(start.removeprefix("FILE:")).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"prompt file {path} not found") from None
    except UnicodeDecodeError:
        raise ValueError(f"prompt file {path} is not UTF-8 text") from None


# -----------------------------------------------------------------------------
# GPT: continue the prompt


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
    ids below vocab_size (the tokenizer's; BPE models pad their embedding to 50304). Returns an iterator over the
    (num_samples, 1) new tokens of each step; rows that reached stop_token repeat it.
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
    Print text as its ids (an iterator of ints) arrive; returns them. shown: the prompt ids to print first.
    The whole sequence is decoded each step and only the new text printed, and text ending in an
    incomplete UTF-8 character (which BPE splits over several tokens) waits for the next token.
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
# GPT: chat


CHAT_HELP = "type a message and press Enter; /reset starts a new conversation, /quit (or Ctrl-D) ends"


def chat(model, tokenizer, meta, cfg, out):
    """
    GPT: a conversation in the terminal, each reply streamed as it comes and the KV cache kept from turn to turn;
    with --start, the reply to that one message.
    """
    # seeded, on the model's device: the same seed and messages give the same replies
    generator = torch.Generator(next(model.parameters()).device).manual_seed(cfg.seed)
    sampling = {"temperature": cfg.temperature, "top_k": cfg.top_k, "top_p": cfg.top_p, "generator": generator}
    limits = {"max_new_tokens": cfg.max_new_tokens, "vocab_size": tokenizer.vocab_size}
    session = ChatSession(model, model_format(meta, cfg.init_from), system=cfg.system, **limits, **sampling)
    if cfg.start:
        return answer(session, read_prompt(cfg.start), tokenizer, out)
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


# -----------------------------------------------------------------------------
# Encoder-decoder: translate the prompt


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


# -----------------------------------------------------------------------------
# Encoder: fill in the [MASK]s


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


# -----------------------------------------------------------------------------
# Attention maps


def attention_panels(model, tokenizer, src, tgt=None):
    """The panels plot_attention draws: every layer's self-attention over src, and for an encoder-decoder
    the decoder's self-attention over tgt and its cross-attention from tgt to src."""
    device = next(model.parameters()).device
    src_t = torch.tensor([src], dtype=torch.long, device=device)
    src_labels = token_labels(src, tokenizer)
    if tgt is None:
        # GPT or encoder: one {"self": (1, H, T, T)} per layer; [0] drops the batch of one
        maps = model.attention_maps(src_t)
        return [(f"layer {i}", m["self"][0], src_labels, src_labels) for i, m in enumerate(maps)]
    # encoder-decoder: the decoder layers add cross-attention, (1, H, T_tgt, T_src)
    maps = model.attention_maps(src_t, torch.tensor([tgt], dtype=torch.long, device=device))
    tgt_labels = token_labels(tgt, tokenizer)
    panels = [(f"encoder {i}", m["self"][0], src_labels, src_labels) for i, m in enumerate(maps["encoder"])]
    for i, m in enumerate(maps["decoder"]):
        panels += [
            (f"decoder {i} self", m["self"][0], tgt_labels, tgt_labels),
            (f"decoder {i} cross", m["cross"][0], tgt_labels, src_labels),
        ]
    return panels


def token_labels(ids, tokenizer):
    """One tick label per id: the token's text escaped (repr without its quotes), so newlines show."""
    return [repr(tokenizer.decode([i]))[1:-1] for i in ids]


def plot_attention(panels, path):
    """
    Save a grid of attention heat maps, each with its colour bar, to path: one row per panel, one column per head.
    panels: (title, weights (H, Tq, Tk), query labels, key labels) each.
    """
    try:
        from matplotlib.figure import Figure  # no pyplot: no window, no global figure state
    except ImportError:
        raise ImportError("--attention needs matplotlib: pip install matplotlib") from None
    # axes: (len(panels), heads), one heat map of (Tq, Tk) each, large enough for its tick labels at 5 points
    heads = panels[0][1].size(0)
    longest = max(min(len(labels), MAX_TICK_LABELS) for _, _, queries, keys in panels for labels in (queries, keys))
    side = max(2.4, 1.2 + 0.12 * longest)  # inches: the colour bar and the labels' own width, then ~9 pt a label
    fig = Figure(figsize=(side * heads, side * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), heads, squeeze=False)
    for row, (title, weights, queries, keys) in zip(axes, panels):
        for h, ax in enumerate(row):
            # each map on its own scale: over many keys even a clear pattern is far from probability 1
            image = ax.imshow(weights[h].float().cpu().numpy(), cmap="viridis", vmin=0.0)
            fig.colorbar(image, ax=ax).ax.tick_params(labelsize=5)
            ax.set_title(f"{title}, head {h}", fontsize=8)
            ax.set_xticks(*token_ticks(keys), fontsize=5, rotation=90)
            ax.set_yticks(*token_ticks(queries), fontsize=5)
    fig.savefig(path, dpi=100)


def token_ticks(labels):
    """
    (positions, texts) of an axis's tick labels: every token, or on an axis of more than MAX_TICK_LABELS tokens
    every k-th token with its position in front, so that at most MAX_TICK_LABELS show.
    """
    # step 1 (every token) whenever the axis is short enough
    step = math.ceil(len(labels) / MAX_TICK_LABELS)
    positions = range(0, len(labels), step)
    return positions, [labels[i] if step == 1 else f"{i}: {labels[i]}" for i in positions]


# -----------------------------------------------------------------------------
# The command line


def check_options(cfg, task):
    """Refuse options that the model's task (a data.Task) does not use, rather than ignore them silently."""
    for other in TASKS.values():
        # options have defaults, so only a changed value is a request
        given = [
            f"--{n}={getattr(cfg, n)}"
            for n in other.sample_options
            if n not in task.sample_options and getattr(cfg, n) != getattr(SampleConfig, n)
        ]
        if given:
            raise ValueError(f"{' and '.join(given)}: {other.sample_applies}; {task.sample_does}")


def main(cfg, out=None):
    """Load the model, generate as cfg says and print to out (None: stdout); write the attention maps if asked."""
    out = sys.stdout if out is None else out  # looked up now, not at import: tests and callers may replace it
    # local rank 0: one process, so plain 'cuda' means the first GPU
    device = resolve_device(cfg.device, 0)
    dtype = resolve_dtype(cfg.dtype, device)
    # read before the slow model load, so a wrong prompt file fails at once
    text = read_prompt(cfg.start)
    if cfg.chat and cfg.attention:
        raise ValueError("--attention draws one prompt's maps: drop it with --chat")
    model, tokenizer, meta, task = load_configured(cfg, device)
    # needs the model's task, known only once it is loaded
    task = make_task(task, model.config.arch, meta)
    check_options(cfg, task)
    # no_grad: no graph kept while generating; autocast: matmuls in cfg's dtype
    if cfg.chat:
        with autocast(device, dtype):
            return chat(model, tokenizer, meta, cfg, out)
    with torch.no_grad(), autocast(device, dtype):
        inputs = task.sample(model, tokenizer, text, cfg, out)
        if cfg.attention:
            plot_attention(attention_panels(model, tokenizer, *inputs), cfg.attention)
            print(f"attention maps written to {cfg.attention}", file=sys.stderr)


def cli(argv):
    """The command line; returns the exit status: 2 with a one-line message for bad input."""
    try:
        # config files and --key=value options into a SampleConfig, whose __post_init__ checks them
        main(parse_config(SampleConfig, argv))
    except (ValueError, OSError, ImportError) as err:
        print(f"sample.py: error: {' '.join(str(err).splitlines())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
