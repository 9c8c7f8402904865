"""
The data side of training. First the tasks, side by side: what differs between a GPT on text (CausalLM), an
encoder on text (MaskedLM, BERT's 80/10/10 corruption), an encoder-decoder on pairs (Seq2Seq) and a GPT on
conversations (Chat, the loss on the assistant's tokens): their splits, batches, counts, losses and exact answers,
and what eval.py and sample.py do with a model of each; TASKS names them all. Then what a batch is for each, the
seeds that make a micro-batch depend on its seed alone, the dataset a run reads (prepared first if missing, by one
rank while the others wait) and the stream of training batches, built one step ahead on a background thread.
train.py, eval.py, sample.py and plan.py hold a Task and call its methods.
"""

import difflib
import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

import tokens
from config import ConfigError
from log import log
from model import IGNORE_INDEX
from runtime import raise_if_any_failed

# how long the other ranks of a torchrun job wait while one prepares the dataset
PREPARE_TIMEOUT = timedelta(days=2)


# -----------------------------------------------------------------------------
# The tasks: what differs between the kinds of training, side by side


class Task:
    """
    A kind of training, the one place where the kinds differ: causal LM (a GPT on text), masked LM (an encoder on
    text), sequence to sequence (an encoder-decoder on pairs) and chat (a GPT on conversations). Each reads its
    prepared splits, draws a micro-batch, counts its tokens, makes the batch that compile and the planner trace, and
    computes its loss; it evaluates a model (eval.py) and shows what one makes of a prompt (sample.py). train.py,
    eval.py, sample.py and plan.py call these methods and never ask which task they train. A task with exact_answers
    also gives answer_rows(split), the val examples in order, and decoded(model, split, rows, batch_size,
    block_size), their greedy outputs beside the references. TASKS maps each task's name to its class; make_task
    picks the task a run names, or that of its architecture and dataset.
    """

    name = ""  # its name in TASKS: the `task` setting of train.py and eval.py
    arch = "gpt"  # the architecture it trains
    kind = "lm"  # the prepared data it reads (meta["kind"]; tokens.KIND_NEEDS lists the files of each kind)
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
        """A batch on device (model_inputs), its lengths marked dynamic for torch.compile where they vary."""
        return model_inputs(inputs, targets, device, self.varying)

    def loss(self, model, inputs, targets, smoothed=True):
        """The summed loss of a batch on its device; smoothed: with the training loss's label smoothing."""
        smoothing = self.label_smoothing if smoothed else 0.0
        return model(*inputs, targets, label_smoothing=smoothing, reduction="sum", return_logits=False)[1]

    def describe(self, split, batch_size):
        """A line on the training split's batches for the run's log, or None."""
        return None

    def evaluate(self, model, tokenizer, cfg, progress):
        """eval.py's results ({name: value}) for model; cfg: eval.py's EvalConfig; progress: show a progress bar."""
        raise NotImplementedError

    def sample(self, model, tokenizer, text, cfg, out):
        """Print to out what model makes of the prompt text (cfg: a SampleConfig); returns the attention maps' ids."""
        raise NotImplementedError


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

    # eval.py and sample.py are imported where they are used: only they call these
    def evaluate(self, model, tokenizer, cfg, progress):
        import eval as evaluation

        return evaluation.evaluate_lm(model, tokenizer, self.meta, cfg, progress)

    def sample(self, model, tokenizer, text, cfg, out):
        import sample

        return sample.show_samples(model, tokenizer, self.meta, text, cfg, out)


class MaskedLM(Task):
    """
    An encoder predicting the tokens hidden in a window (BERT's corruption, mask_tokens). A dataset without a [MASK]
    id gets one after its vocabulary, recorded in the meta the checkpoints store. data_vocab: the ids random
    replacements are drawn from (default: the dataset's).
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
        import eval as evaluation

        ids, data = evaluation.lm_tokens(cfg, self.meta, tokenizer)
        return evaluation.evaluate_masked(model, self.meta, ids, data, cfg, progress)

    def sample(self, model, tokenizer, text, cfg, out):
        import sample

        return sample.show_fills(model, tokenizer, self.meta, text, cfg, out)


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
        from generate import decoded_pairs  # imported here, as generation is needed for exact match only

        return decoded_pairs(model, batches, self.bos_id, self.eos_id, max_len=block_size)

    def evaluate(self, model, tokenizer, cfg, progress):
        import eval as evaluation

        return evaluation.evaluate_seq2seq(model, self.meta, cfg, progress)

    def sample(self, model, tokenizer, text, cfg, out):
        import sample

        return sample.show_translation(model, tokenizer, self.meta, text, cfg, out)


class Chat(CausalLM):
    """
    A GPT on conversations, with the loss on the assistant's tokens: batches of whole conversations of about one
    length, right-padded. pad_id stays None, so that the model builds no key mask: causal attention never lets a
    real position see the padding after it. Data whose replies are exact (a quiz) is scored by exact match too.
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
        # a conversation's inputs end at its last loss target (prepare_data cuts what follows), and its padding after
        real = targets != IGNORE_INDEX
        last = targets.size(1) - 1 - real.flip(1).int().argmax(1)
        return int((last + 1).sum())

    def answer_rows(self, split):
        return np.sort(split.order)  # the conversations in their file's order (the split keeps them by length)

    def decoded(self, model, split, rows, batch_size, block_size):
        from chat import ChatFormat  # imported here, as generation is needed for exact match only
        from generate import decoded_replies

        # a reply ends at an end-of-turn
        stop = ChatFormat.from_meta(self.meta).end_of_turn
        return decoded_replies(model, (split.conversations[int(i)] for i in rows), stop)

    def evaluate(self, model, tokenizer, cfg, progress):
        import eval as evaluation

        return evaluation.evaluate_chat(model, tokenizer, self.meta, cfg, progress)

    def describe(self, split, batch_size):
        padding = padding_fraction(split, batch_size)
        return f"chat batches: whole conversations of about one length, {padding:.1%} of their positions padding"


# every task by its name; "auto" picks the first of its architecture and data kind (make_task)
TASKS = {task.name: task for task in (CausalLM, MaskedLM, Seq2Seq, Chat)}


def make_task(name, arch, meta, mask_prob=0.15, label_smoothing=0.0):
    """
    Task `name` ("auto": the first in TASKS of arch and of the data's kind, meta["kind"]) of a model of arch trained on
    a dataset with this meta; ConfigError where they do not go together.
    """
    kind, dataset = meta.get("kind", "lm"), meta.get("name", "this dataset")
    if name == "auto":
        if kind == "chat" and arch != "gpt":
            raise ConfigError(
                f"{dataset} is chat data, which only arch=gpt trains on (a reply is the next tokens of the "
                f"conversation); arch={arch} needs another dataset"
            )
        # each architecture's task; a GPT's depends on its data
        mine = [task for task in TASKS.values() if task.arch == arch]
        name = next((task.name for task in mine if task.kind == kind), mine[0].name)
    if name not in TASKS:  # a checkpoint of a task registered elsewhere, say
        raise ConfigError(f"task={name!r} is not one of data.TASKS ({', '.join(TASKS)}): register it first")
    task = TASKS[name]
    if arch != task.arch:
        raise ConfigError(f"task={name} trains arch={task.arch!r}, not arch={arch!r}")
    if kind != task.kind:
        raise ConfigError(f"arch={arch} needs a {task.kind} dataset ({task.examples}); {dataset} is {kind}")
    if task is MaskedLM:
        return MaskedLM(meta, label_smoothing=label_smoothing, mask_prob=mask_prob)
    return task(meta, label_smoothing=label_smoothing)


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


def random_ids(vocab_size, shape):
    """Ids from a generator of a fixed seed: an example batch, the same at every call, moving no other generator."""
    return torch.randint(vocab_size, shape, generator=torch.Generator().manual_seed(0))


def fitting_pairs(pairs, block_size):
    """The indices of pairs whose source fits block_size, and whose target with bos (or eos) does."""
    lengths = np.diff(pairs.index, axis=0)  # (n, 2): source and target length of each pair
    return np.flatnonzero((lengths[:, 0] <= block_size) & (lengths[:, 1] + 1 <= block_size))


# -----------------------------------------------------------------------------
# What a batch is, for each task


def windows(tokens, batch_size, length, generator):
    """batch_size windows of `length` consecutive tokens at random offsets: (B, length) int64."""
    # + 1: a window may end at the very last token
    starts = torch.randint(len(tokens) - length + 1, (batch_size,), generator=generator).tolist()
    # the file's uint16 or uint32 ids widened to int64, which embeddings and cross_entropy take
    return torch.from_numpy(np.stack([tokens[s : s + length] for s in starts]).astype(np.int64))


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


@dataclass(frozen=True)
class PairSplit:
    """A split of pairs as Seq2Seq.batch reads it: its pairs, and the indices of those that fit block_size."""

    pairs: tokens.Pairs
    usable: np.ndarray


@dataclass(frozen=True)
class ChatSplit:
    """A chat split as Chat.batch reads it: its conversations, and those that fit block_size, shortest first."""

    conversations: tokens.Conversations
    # indices of the conversations that fit, by length; equal lengths in a fixed shuffled order, so that a file's
    # runs of one kind of conversation do not fill whole batches
    order: np.ndarray


def chat_batch(conversations, rows):
    """
    Conversations `rows` as (inputs (B, T), targets (B, T)): inputs = ids[:-1], targets = ids[1:] where that id is
    a loss target, else IGNORE_INDEX; right-padded to the longest of the batch. The padding's inputs are id 0 (any id
    would do: causal attention keeps real positions from seeing it) and its targets IGNORE_INDEX.
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
    the batch is padding. The order wraps around, so every conversation is drawn equally often; the few starts near
    the end pair the longest conversations with the shortest.
    """
    start = int(torch.randint(len(split.order), (1,), generator=generator))
    return split.order[(start + np.arange(batch_size)) % len(split.order)]


def micro_seeds(generator, n):
    """Seeds for the next n micro-batches: a micro-batch depends only on its seed, whichever rank draws it."""
    return torch.randint(2**62, (n,), generator=generator).tolist()


def count_targets(targets):
    """How many positions of targets hold a real target: what a step's mean loss divides by."""
    return int((targets != IGNORE_INDEX).sum())


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
# The dataset of a run, and its stream of training batches


def prepared_dataset(name, data_dir, options):
    """The folder of dataset `name`, prepared first if missing or out of date; ConfigError says why it cannot be."""
    try:
        folder = tokens.dataset_dir(name, data_dir)
        # prepare() keeps outputs that are up to date for these options: with none, an intact folder is enough
        if not options and tokens.is_prepared(folder):
            return folder
        import prepare_data  # imported here: only data to prepare, or to explain, needs it

        if name not in prepare_data.DATASETS:  # a folder of the user's own: say what is wrong with it, if anything
            if options:
                raise ValueError(f"data_options need one of the datasets {', '.join(prepare_data.DATASETS)}")
            if not folder.is_dir():
                # a typo (shakespear_char) is answered with the dataset or prepared folder it most resembles
                there = [p.name for p in folder.parent.iterdir() if p.is_dir()] if folder.parent.is_dir() else []
                close = difflib.get_close_matches(name, [*prepare_data.DATASETS, *there], n=1)
                hint = f"; did you mean {close[0]}?" if close else ""
                raise ValueError(
                    f"not one of {', '.join(prepare_data.DATASETS)}, nor a folder in {folder.parent}{hint}"
                )
            tokens.check_prepared(folder)
        else:
            log(f"dataset {name}: preparing it in {folder.parent} unless up to date")
            folder = prepare_data.prepare(name, data_dir, **options)
    # bad options, a missing input, a failed download, a full disk: all reported as one line
    except (ValueError, OSError) as e:
        raise ConfigError(f"dataset {name}: {e}") from None
    return folder


def find_dataset(cfg, rt):
    """The dataset's folder, prepared first if missing: by rank 0, then by each node's first rank, then by the rest."""
    # the others wait over a gloo group of its own, whose timeout outlasts a preparation of hours (OpenWebText):
    # waiting in the default group would end at dist_timeout, and on GPUs in NCCL's watchdog
    group = dist.new_group(backend="gloo", timeout=PREPARE_TIMEOUT) if rt.world_size > 1 else None
    folder = None
    # three turns, so that one process downloads and tokenizes while the others wait: rank 0 first, then the first
    # rank of every other machine (its data_dir may be a local disk), then everyone else, who find it done
    for my_turn in (rt.rank == 0, rt.rank != 0 and rt.local_rank == 0, rt.local_rank != 0):
        error = None
        if my_turn:
            try:
                folder = prepared_dataset(cfg.dataset, cfg.data_dir, cfg.data_options)
            except ConfigError as e:
                error = str(e)
        raise_if_any_failed(error, rt.world_size, group)  # also makes the others wait until the files exist
    if group is not None:
        dist.destroy_process_group(group)
    return folder


def gpt_window(inputs, targets):
    """
    The (B, T + 1) window a GPT batch's inputs (B, T) and targets (B, T) are two views of, as CausalLM.batch and
    pinned make them (inputs its first T columns, targets its last T); None for any other batch.
    """
    window = inputs[0]._base if len(inputs) == 1 else None  # _base: the tensor a view looks into
    if window is None or targets._base is not window or not window.is_contiguous():
        return None
    one_column_on = window.data_ptr() + window.element_size()
    fits = window.shape == (targets.size(0), targets.size(1) + 1) and inputs[0].data_ptr() == window.data_ptr()
    return window if fits and targets.data_ptr() == one_column_on else None


def pinned(inputs, targets):
    """
    A batch in page-locked host memory, whose copy to the GPU can then run while the GPU works. A GPT's window is
    pinned whole, dense, and sliced again: its views would be copied through a pageable temporary, and it is half the
    bytes of inputs and targets apart.
    """
    window = gpt_window(inputs, targets)
    if window is not None:
        window = window.pin_memory()
        return (window[:, :-1],), window[:, 1:]
    return tuple(x.pin_memory() for x in inputs), targets.pin_memory()


def model_inputs(inputs, targets, device, varying=False):
    """
    A batch on device: (inputs tuple, targets). Pinned host memory (see pinned) lets the copy overlap with GPU
    work; a GPT's window is copied once and sliced on the device. varying (Task.varying: pairs, conversations):
    dimension 1, the length, varies from batch to batch and is marked dynamic, so that torch.compile builds one
    graph for all of them instead of recompiling for each new length.
    """
    window = None if varying else gpt_window(inputs, targets)
    if window is not None:
        window = window.to(device, non_blocking=window.is_pinned())
        return (window[:, :-1],), window[:, 1:]
    moved = [x.to(device, non_blocking=x.is_pinned()) for x in (*inputs, targets)]
    if varying:
        for x in moved:
            torch._dynamo.maybe_mark_dynamic(x, 1)
    return tuple(moved[:-1]), moved[-1]


class TrainBatches:
    """
    The training micro-batches of this rank, one step ahead: while the device runs a step, a background thread
    builds the next step's batches (pinned in memory on CUDA) and counts their targets and tokens, so a small
    model's step does not wait for Python. Each micro-batch depends only on its seed, drawn in order from
    `generator` for the micro-batches of all ranks: the stream is the same on any number of ranks.
    """

    def __init__(self, data, task, cfg, generator, rt, per_rank):
        self.data, self.task, self.cfg, self.pin = data, task, cfg, rt.device.type == "cuda"
        self.generator, self.rank, self.per_rank, self.world_size = generator, rt.rank, per_rank, rt.world_size
        # one worker: the next step's batches are built in order while this step runs, never further ahead
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.advance()

    def advance(self):
        """Start building the next step's batches."""
        self.resume_state = self.generator.get_state()  # what a checkpoint stores: the pending step is not taken
        # every rank draws all ranks' seeds, so the generator moves alike everywhere; each keeps its own slice
        seeds = micro_seeds(self.generator, self.per_rank * self.world_size)
        mine = seeds[self.rank * self.per_rank : (self.rank + 1) * self.per_rank]
        self.pending = self.pool.submit(self.build, mine)

    def build(self, seeds):
        """(micro-batches, real targets, input tokens) for these seeds; runs on the background thread."""
        cfg, task = self.cfg, self.task
        batches = [
            # a fresh generator per micro-batch: its contents depend on its seed alone
            task.batch(self.data, cfg.batch_size, cfg.block_size, torch.Generator().manual_seed(s))
            for s in seeds
        ]
        # pinned (page-locked) memory lets the copy to the GPU run asynchronously (non_blocking)
        if self.pin:
            batches = [pinned(inputs, targets) for inputs, targets in batches]
        # counted here on the CPU, so the training loop never waits for a count on the GPU
        n_targets = sum(count_targets(targets) for _, targets in batches)
        return batches, n_targets, sum(task.count_tokens(inputs, targets) for inputs, targets in batches)

    def peek(self):
        """(micro-batches, real targets, input tokens) of the next step, without taking it."""
        return self.pending.result()

    def close(self):
        self.pool.shutdown(cancel_futures=True)
