"""
Generate from a checkpoint of train.py, or from Hugging Face weights: what the model's task shows of a prompt
(Task.sample, in tasks/): a GPT continues it (or talks, with --chat), an encoder-decoder translates it, an encoder
fills in its [MASK]s. This file loads the model, reads the prompt, hands it to the task and draws the attention maps.

    python sample.py --out_dir=out-shakespeare --start "ROMEO:" --num_samples=3 --temperature=0.8
    python sample.py --init_from=gpt2 --start "The meaning of life is" --top_p=0.9
    python sample.py --init_from=/models/TinyLlama-1.1B --start "ROMEO:"   # a folder with its tokenizer.json
    python sample.py --out_dir=out-reverse --start "hello" --beam_size=4
    python sample.py --out_dir=out-chat --chat                          # talk to it: /reset, /quit
    python sample.py --out_dir=out-chat --chat --start "What is two plus three?"   # one answer, then exit
    python sample.py --help
"""

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from config import parse_config
from generate import check_sampling_args
from runtime import DTYPES, autocast, resolve_device, resolve_dtype
from start import load_configured
from tasks import TASKS, make_task

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
    """Refuse options that the model's task (a tasks.Task) does not use, rather than ignore them silently."""
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
    except KeyboardInterrupt:  # Ctrl-C while it generates: one line (a streamed sample's line ended first), no trace
        if sys.stdout.isatty():
            print()
        print("sample.py: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
