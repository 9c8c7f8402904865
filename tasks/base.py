"""
What every task is: the Task contract, and the helpers several tasks share (reading a split, the dataset a model
was trained on, a text file, the rows that fit block_size). Each task is one file beside this one.
"""

import json
from pathlib import Path

import numpy as np
import torch

import tokens
from checkpoint import run_checkpoint
from config import ConfigError
from data import model_inputs
from log import log

# block_size this many times the longest example of a task whose batches are only as long as their longest: said
DWARFS = 4


class Task:
    """
    A kind of training and what goes with it: its splits, batches, counts and loss (train.py), its evaluation
    (eval.py) and what it shows of a prompt (sample.py); the scripts call these methods, never asking which task it
    is. A task with exact_answers also gives answer_rows(split), the val examples in order, and decoded(model, split,
    rows, batch_size, block_size), their greedy outputs beside the references.
    """

    name = ""  # its name in TASKS: the `task` setting of train.py and eval.py
    arch = "gpt"  # the architecture it trains (or scores)
    kind = "lm"  # the prepared data it reads (meta["kind"]; tokens.KIND_NEEDS)
    examples = "shakespeare_char, shakespeare"  # datasets of that kind, for a message
    scores = ""  # what eval.py scores, for a message
    eval_options = ()  # the eval.py options that apply to this task alone
    sample_options = ()  # the sample.py options that apply to this task (and others that list them) alone
    sample_applies = ""  # said when another task's model is given one of them
    sample_does = ""  # what sample.py does with its model, said when it is given another task's option
    varying = False  # batch lengths vary from batch to batch: one dynamic compiled graph, no CUDA graphs
    exact_answers = False  # its val data has answers to decode and compare: exact match then chooses best.pt
    bits_per_byte = False  # its targets spell text: evaluation reports the val loss in bits per byte too
    pad_id = None  # the padding id whose keys the model masks (ModelConfig.pad_token_id)
    saves_data_meta = False  # a fine-tune saves its data's meta (chat: tokens, template), not its checkpoint's

    def __init__(self, meta, *, label_smoothing=0.0):
        self.meta = meta  # the dataset's (an encoder's with its [MASK] id)
        self.label_smoothing = label_smoothing  # of the training loss; evaluation's is plain cross-entropy

    @classmethod
    def for_run(cls, meta, *, label_smoothing=0.0, mask_prob=0.15):
        """The task of a run on data with this meta, with the run's settings that apply to it."""
        return cls(meta, label_smoothing=label_smoothing)

    @property
    def model_vocab(self):
        """The model's vocabulary: the data's ids, for tiktoken's rounded up to a multiple of 64 (faster matmuls)."""
        vocab = self.meta["vocab_size"]
        return -(-vocab // 64) * 64 if self.meta["tokenizer"]["type"] == "tiktoken" else vocab

    def load_split(self, folder, split, block_size):
        """A split as batch() reads it: a memmap of token ids, its file staying on disk."""
        ids = tokens.load_tokens(folder / f"{split}.bin")
        if len(ids) <= block_size:  # a GPT's window is block_size + 1 tokens (inputs and targets)
            raise ConfigError(
                f"{folder.name}'s {split} split has {len(ids):,} tokens, too few for block_size={block_size}: "
                f"use block_size <= {len(ids) - 1}, or a dataset with a longer {split} split"
            )
        return ids

    def batch(self, data, batch_size, block_size, generator):
        """One micro-batch of a split drawn with generator: (model inputs tuple, targets), int64 CPU tensors."""
        raise NotImplementedError

    def example_batch(self, batch_size, block_size):
        """
        The longest micro-batch the run can draw (Seq2Seq's source one shorter), of fixed random ids (the random
        generators are left as they were), every position a target: what compile tries and the planner traces.
        """
        ids = random_ids(self.meta["vocab_size"], (batch_size, block_size + 1))
        return (ids[:, :-1],), ids[:, 1:]

    def count_tokens(self, inputs, targets):
        """Input tokens of a batch, padding left out: what tokens/s counts."""
        return sum(x.numel() for x in inputs)

    def text_bytes(self, targets):
        """The UTF-8 bytes of text that a batch's targets spell (for bits_per_byte); 0 where they spell none."""
        return 0

    def to_device(self, inputs, targets, device):
        """A batch on device (data.model_inputs), its lengths marked dynamic for torch.compile where they vary."""
        return model_inputs(inputs, targets, device, self.varying)

    def loss(self, model, inputs, targets, smoothed=True):
        """The summed loss of a batch on its device; smoothed: with the training loss's label smoothing."""
        smoothing = self.label_smoothing if smoothed else 0.0
        return model(*inputs, targets, label_smoothing=smoothing, reduction="sum", return_logits=False)[1]

    def describe(self, split, batch_size):
        """A line on the training split's batches for the run's log, or None."""
        return None

    def length_note(self, split, block_size):
        """A note for the run's log where block_size dwarfs the training split's longest example (long_block_note)."""
        return None

    def evaluate(self, model, tokenizer, cfg, progress):
        """eval.py's results ({name: value}) for model; cfg: eval.py's EvalConfig; progress: show a progress bar."""
        raise NotImplementedError

    def sample(self, model, tokenizer, text, cfg, out):
        """Print to out what model makes of the prompt text (cfg: a SampleConfig); returns the attention maps' ids."""
        raise NotImplementedError


# -----------------------------------------------------------------------------
# What several tasks share


def usable_rows(fits, total, what, folder, block_size, why=""):
    """
    fits, the rows of the `total` examples of a split that fit block_size, with a note saying how many do not;
    ConfigError if none does (why: what the message adds).
    """
    if not len(fits):
        raise ConfigError(f"no {what} of {folder.name} fits block_size={block_size}{why}; raise block_size")
    if len(fits) < total:
        log(f"note: {total - len(fits):,} of {total:,} {what}s do not fit block_size={block_size}; they are left out")
    return fits


def long_block_note(longest, what, block_size):
    """
    A note where block_size is DWARFS times the positions of the longest example (`what`) or more: batches are only
    as long as their longest example, so the positions past it are never trained on (a learned position's embedding
    stays random) while a plan, the slow-step note and serving's cache budget count them all. None otherwise.
    """
    if block_size < DWARFS * longest:
        return None
    return (
        f"note: block_size={block_size:,} is {block_size // longest}x the longest {what} ({longest:,} positions): "
        f"the positions past it are never trained on; --block_size={longest} fits every one"
    )


def random_ids(vocab_size, shape):
    """Ids from a generator of a fixed seed: an example batch, the same at every call, moving no other generator."""
    return torch.randint(vocab_size, shape, generator=torch.Generator().manual_seed(0))


def windows(tokens, batch_size, length, generator):
    """batch_size windows of `length` consecutive tokens at random offsets: (B, length) int64."""
    # + 1: a window may end at the very last token
    starts = torch.randint(len(tokens) - length + 1, (batch_size,), generator=generator).tolist()
    # the file's uint16 or uint32 ids widened to int64, which embeddings and cross_entropy take
    return torch.from_numpy(np.stack([tokens[s : s + length] for s in starts]).astype(np.int64))


def read_text(path):
    """The contents of a UTF-8 text file, refusing a missing, empty or binary one with one line."""
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text") from None
    if not text:
        raise ValueError(f"{path} is empty: there is no text to evaluate")
    return text


def dataset_split(cfg, meta, kind):
    """
    (folder, split) to evaluate (cfg: eval.py's EvalConfig): the prepared dataset the model was trained on (meta's
    name) under --data_dir, else the run's data_dir, and --split (default val); refused if its data was prepared with
    another tokenizer since, or for a test split that a `kind` of data other than seq2seq has not.
    """
    if "name" not in meta:
        raise ValueError("these weights come without a dataset: evaluate a text file with --input=FILE")
    checkpoint = Path(cfg.init_from).expanduser()
    if cfg.init_from == "resume":
        checkpoint = run_checkpoint(cfg.out_dir, cfg.checkpoint)
    data_dir, run = cfg.data_dir, checkpoint.parent / "config.json"
    if data_dir is None and run.is_file():
        # train.py writes its settings beside the checkpoints: the run's data_dir is where its data is
        try:
            data_dir = json.loads(run.read_text(encoding="utf-8"))["train_config"]["data_dir"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(
                f"{run} is not train.py's config.json; name the datasets' folder with --data_dir"
            ) from None
    folder = tokens.dataset_dir(meta["name"], data_dir)
    if tokens.load_meta(folder)["tokenizer"] != meta["tokenizer"]:
        raise ValueError(
            f"{folder} holds data of another tokenizer than the model's (prepared again since?); evaluate a text "
            "file with --input, or point --data_dir at the data it was trained on"
        )
    split = cfg.split or "val"
    # seq2seq data alone keeps a test split apart (tokens.SEQ2SEQ_SPLITS)
    if split == "test" and kind != "seq2seq":
        raise ValueError(f"{folder.name} is a {kind} dataset: its splits are train and val, not test")
    return folder, split


def lm_tokens(cfg, meta, tokenizer):
    """(the token ids to evaluate, what they are): the --input file encoded, or the split of the training data."""
    if cfg.input:
        text = read_text(cfg.input)
        try:
            ids = tokenizer.encode(text)
        except ValueError as err:  # characters outside a char-level vocabulary, named
            raise ValueError(f"{cfg.input}: {err}") from None
        return np.asarray(ids, dtype=np.int64), cfg.input
    folder, split = dataset_split(cfg, meta, "language-modelling")
    return tokens.load_tokens(folder / f"{split}.bin"), f"{folder.name} {split}"
