"""
Evaluate a checkpoint of train.py, or Hugging Face weights, as its task (tasks/) scores it: a language model's loss,
perplexity and bits per byte over a dataset split or any text file, a masked loss, exact match. Benchmarks such as
HellaSwag: lm-evaluation-harness against serve.py (docs/eval.md).

    python eval.py --out_dir=out-shakespeare                          # the val split of the data it trained on
    python eval.py --out_dir=out-shakespeare --input=hamlet.txt       # any UTF-8 text, with the model's tokenizer
    python eval.py --out_dir=out-reverse --split=test --beam_size=4
    python eval.py --out_dir=out-chat-shakespeare                     # a chat model: its dataset's val split
    python eval.py --help
"""

import json
import sys
from dataclasses import dataclass

import torch

from checkpoint import run_checkpoint
from config import parse_config
from runtime import DTYPES, autocast, resolve_device, resolve_dtype
from start import load_configured
from tasks import TASKS, make_task

SPLITS = ("train", "val", "test")


@dataclass
class EvalConfig:
    init_from: str = "resume"  # "resume": out_dir's checkpoint; a checkpoint file (ours, nanoGPT's); a HF id or folder
    out_dir: str = "out-shakespeare"  # the folder train.py wrote its checkpoints to
    checkpoint: str = ""  # which file of out_dir: "" the best weights (best.pt, else ckpt.pt), "ckpt.pt" the latest
    dataset: str = ""  # nanoGPT character-level checkpoints only: the prepared dataset of their characters
    task: str = "auto"  # "auto": the model's own; a name in tasks/ (lm: loss, perplexity, bits per byte; masked_lm;
    # seq2seq, chat: exact match too)
    split: str | None = None  # "train", "val" or (seq2seq) "test" of the data the model was trained on; None: val
    input: str = ""  # lm: a UTF-8 text file instead of a split; chat: a conversations file
    exact_match: bool | None = None  # chat: greedily decode each final reply, compare; None: if the data's are exact
    data_dir: str | None = None  # where the datasets are; None: the run's (out_dir/config.json), else as in train.py
    stride: int | None = None  # GPT: a window every stride tokens, scoring only its last stride; None: block_size
    mask_prob: float = 0.15  # encoder: the fraction of positions masked and predicted, as in training
    seed: int = 1337  # encoder: which positions are masked; the same seed masks the same positions
    beam_size: int = 1  # seq2seq: 1 decodes greedily; more runs beam search with that many hypotheses
    length_penalty: float = 0.6  # beam search: a hypothesis scores log p / ((5 + length) / 6) ** length_penalty
    limit: int | None = None  # only the first N windows, pairs or conversations, for a quick look; None: all
    batch_size: int = 16  # windows or pairs per forward pass
    json: bool = False  # print one JSON object instead of `key  value` lines
    progress: bool = True  # progress on stderr: a bar on a terminal, else a line every 30 s (log.PROGRESS_SECONDS)
    device: str = "auto"  # "cpu", "cuda", "cuda:1", "mps"; "auto": cuda, else mps, else cpu
    dtype: str = "auto"  # "float32", "bfloat16" or "float16" (autocast); "auto": as in train.py
    compile: bool = False  # torch.compile the layers: a slow start, faster batches after it

    def __post_init__(self):
        if self.task not in ("auto", *TASKS):
            raise ValueError(f"task must be one of auto, {', '.join(TASKS)}; got {self.task!r}")
        if self.split is not None and self.split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}; got {self.split!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        for name in ("batch_size", "beam_size", "stride", "limit"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0 < self.mask_prob < 1:
            raise ValueError(f"mask_prob must be in (0, 1), got {self.mask_prob}")
        if self.split is not None and self.input:
            raise ValueError("give --split or --input, not both: --input evaluates a file instead of a split")


# -----------------------------------------------------------------------------
# The command line


def eval_task(cfg, trained):
    """The Task that cfg asks of a model whose own is `trained` (load_model's); ValueError for one it cannot do."""
    task = type(trained) if cfg.task == "auto" else TASKS[cfg.task]
    if trained.arch != task.arch:
        arch = trained.arch
        raise ValueError(
            f"task={task.name} scores {task.scores}; this checkpoint's arch is {arch}: use --task={trained.name}"
        )
    for owner in TASKS.values():
        for option in owner.eval_options:
            if getattr(cfg, option) != getattr(EvalConfig, option) and option not in task.eval_options:
                raise ValueError(f"--{option} applies to task={owner.name}, not to task={task.name}")
    return trained if task is type(trained) else task(trained.meta)


def format_results(results):
    """`key  value` lines: floats to 4 decimals, counts with thousands separators."""
    width = max(map(len, results))
    shown = {
        k: f"{v:.4f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else v for k, v in results.items()
    }
    return "\n".join(f"{key:<{width}}  {value}" for key, value in shown.items())


def main(cfg, out=None):
    """Evaluate as cfg says, print the results to out (None: stdout) and return them as a dict."""
    out = sys.stdout if out is None else out  # looked up now, not at import: tests and callers may replace it
    device = resolve_device(cfg.device, 0)
    dtype = resolve_dtype(cfg.dtype, device)
    model, tokenizer, meta, trained = load_configured(cfg, device)
    task = eval_task(cfg, make_task(trained, model.config.arch, meta))
    source = cfg.init_from if cfg.init_from != "resume" else str(run_checkpoint(cfg.out_dir, cfg.checkpoint))
    results = {"model": source, "arch": model.config.arch, "task": task.name}
    # no_grad: nothing is trained; autocast: matmuls in cfg's dtype (every loss is summed in float32 or more)
    with torch.no_grad(), autocast(device, dtype):
        results |= task.evaluate(model, tokenizer, cfg, cfg.progress)
    print(json.dumps(results) if cfg.json else format_results(results), file=out)
    return results


def cli(argv):
    """The command line; returns the exit status: 2 with a one-line message for bad input, 1 out of memory."""
    try:
        cfg = parse_config(EvalConfig, argv)
        main(cfg)
    except (ValueError, OSError, ImportError) as err:
        print(f"eval.py: error: {' '.join(str(err).splitlines())}", file=sys.stderr)
        return 2
    except torch.OutOfMemoryError:
        print(f"eval.py: error: out of memory with batch_size={cfg.batch_size}: lower --batch_size", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback; eval.py writes nothing
        print("eval.py: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
