"""
Evaluate a checkpoint of train.py, or Hugging Face weights: a language model's loss, perplexity and bits per byte
over a whole dataset split or any text file, a masked-LM encoder's masked loss, HellaSwag accuracy, an
encoder-decoder's exact match and token accuracy over a split's pairs, and a chat model's loss on the assistant's
tokens and exact match of its greedy replies.

    python eval.py --out_dir=out-shakespeare                          # the val split of the data it trained on
    python eval.py --out_dir=out-shakespeare --input=hamlet.txt       # any UTF-8 text, with the model's tokenizer
    python eval.py --init_from=gpt2 --task=hellaswag --input=hellaswag_val.jsonl
    python eval.py --out_dir=out-reverse --split=test --beam_size=4
    python eval.py --out_dir=out-chat-shakespeare                     # a chat model: its dataset's val split
    python eval.py --help
"""

import json
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import prepare_data
from chat import model_format
from checkpoint import run_checkpoint
from config import parse_config
from data import TASKS, MaskedLM, Seq2Seq, chat_batch, fitting_pairs, make_task, mask_tokens, seq2seq_batch
from generate import decoded_pairs, decoded_replies, start_ids
from model import IGNORE_INDEX
from runtime import DTYPES, autocast, resolve_device, resolve_dtype
from start import load_configured
from tokens import MIRROR_ENV, dataset_dir, load_conversations, load_meta, load_pairs, load_tokens, token_byte_lengths

SPLITS = ("train", "val", "test")
HELLASWAG_FILE = "hellaswag_val.jsonl"
HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"


@dataclass
class EvalConfig:
    init_from: str = "resume"  # "resume": out_dir's checkpoint; a checkpoint file (ours, nanoGPT's); a HF id or folder
    out_dir: str = "out-shakespeare"  # the folder train.py wrote its checkpoints to
    checkpoint: str = ""  # which file of out_dir: "" the best weights (best.pt, else ckpt.pt), "ckpt.pt" the latest
    dataset: str = ""  # nanoGPT character-level checkpoints only: the prepared dataset of their characters
    task: str = "auto"  # "auto": the model's own; a TASKS name (lm: loss, perplexity, bits per byte; masked_lm;
    # seq2seq, chat: exact match too), or "hellaswag"
    split: str | None = None  # "train", "val" or (seq2seq) "test" of the data the model was trained on; None: val
    input: str = ""  # lm: a UTF-8 text file instead of a split; chat: a conversations file; hellaswag: its jsonl
    exact_match: bool | None = None  # chat: greedily decode each final reply, compare; None: if the data's are exact
    data_dir: str | None = None  # where the datasets are; None: the run's (out_dir/config.json), else as in train.py
    stride: int | None = None  # GPT: a window every stride tokens, scoring only its last stride; None: block_size
    mask_prob: float = 0.15  # encoder: the fraction of positions masked and predicted, as in training
    seed: int = 1337  # encoder: which positions are masked; the same seed masks the same positions
    beam_size: int = 1  # seq2seq: 1 decodes greedily; more runs beam search with that many hypotheses
    length_penalty: float = 0.6  # beam search: a hypothesis scores log p / ((5 + length) / 6) ** length_penalty
    limit: int | None = None  # only the first N windows, pairs or HellaSwag items, for a quick look; None: all
    batch_size: int = 16  # windows, pairs or HellaSwag items (4 sequences each) per forward pass
    json: bool = False  # print one JSON object instead of `key  value` lines
    progress: bool | None = None  # a progress bar on stderr; None: when stderr is a terminal
    device: str = "auto"  # "cpu", "cuda", "cuda:1", "mps"; "auto": cuda, else mps, else cpu
    dtype: str = "auto"  # "float32", "bfloat16" or "float16" (autocast); "auto": as in train.py
    compile: bool = False  # torch.compile the layers: a slow start, faster batches after it

    def __post_init__(self):
        if self.task not in ("auto", *TASKS, "hellaswag"):
            raise ValueError(f"task must be one of auto, {', '.join(TASKS)}, hellaswag; got {self.task!r}")
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
# Language models: loss, perplexity, bits per byte


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
    (window_starts): the first window scores all its targets, each later one only its last stride, those the one
    before did not reach. Returns {"windows", "tokens", "bytes", "nats"}: the windows run, the tokens scored, the
    UTF-8 bytes they stand for (byte_lengths: token_byte_lengths of the tokenizer) and their loss in nats.
    """
    device = next(model.parameters()).device
    starts = window_starts(len(tokens), block_size, stride)[:limit]
    nats, count, n_bytes = 0.0, 0, 0
    with tqdm(total=len(starts), unit="window", file=sys.stderr, disable=not progress) as bar:
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
    (folder, split): the prepared dataset the model was trained on (meta's name) under --data_dir, the run's data_dir
    or the default root, and --split (default val); refused if its data was prepared with another tokenizer since,
    or if a `kind` ("language-modelling", "chat" or "seq2seq") without a test split is asked for its test split.
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
    folder = dataset_dir(meta["name"], data_dir)
    if load_meta(folder)["tokenizer"] != meta["tokenizer"]:
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
    return load_tokens(folder / f"{split}.bin"), f"{folder.name} {split}"


def evaluate_lm(model, tokenizer, meta, cfg, progress):
    """GPT: loss, perplexity and bits per byte of the text. A dict of results."""
    tokens, data = lm_tokens(cfg, meta, tokenizer)
    if cfg.input:  # after where a document starts, so that the file's first token is scored too
        tokens = np.concatenate([np.asarray(start_ids(tokenizer, meta), dtype=np.int64), tokens])
    # a GPT needs one token to predict from and one to predict
    if len(tokens) < 2:
        raise ValueError(f"{data} has {len(tokens)} token(s): at least 2 are needed, to predict one from the other")
    block = model.config.block_size
    stride = cfg.stride or block
    if stride > block:
        raise ValueError(f"stride must be at most the model's block_size={block}, got {stride}")
    windows = {"block_size": block, "stride": stride, "batch_size": cfg.batch_size, "limit": cfg.limit}
    counts = lm_loss(model, tokens, token_byte_lengths(meta), progress=progress, **windows)
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


def evaluate_masked(model, meta, tokens, data, cfg, progress):
    """
    An encoder's cross-entropy at the masked positions of tokens, cut into windows of block_size, each masked as in
    training (mask_tokens: mask_prob of the positions, 80% shown as [MASK], 10% a random token, 10% unchanged) with
    its own generator, seeded by --seed and its index, so that the same seed masks the same positions whatever the
    batch size. A dict of results.
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
    with tqdm(total=len(starts), unit="window", file=sys.stderr, disable=not progress) as bar:
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
# Sequence to sequence: exact match and token accuracy


def evaluate_seq2seq(model, meta, cfg, progress):
    """
    Exact match, token accuracy and teacher-forced loss over a split's pairs that fit block_size. Their sources are
    decoded (greedily, or by beam search) and compared with the references, target + eos: exact match counts the
    outputs equal to their reference up to its eos, token accuracy the reference positions whose token the output
    has at the same position; the loss is the cross-entropy per target + eos position.
    """
    if cfg.input:
        raise ValueError("an encoder-decoder is evaluated on its dataset's pairs: give --split, not --input")
    folder, split = dataset_split(cfg, meta, "seq2seq")
    pairs = load_pairs(folder, split)
    block = model.config.block_size
    fits = fitting_pairs(pairs, block)  # as in training
    if not len(fits):
        raise ValueError(f"no {split} pair of {folder.name} fits the model's block_size={block}")
    rows, task, device = fits[: cfg.limit], Seq2Seq(meta), next(model.parameters()).device
    batches = [seq2seq_batch(pairs, rows[i : i + cfg.batch_size], task) for i in range(0, len(rows), cfg.batch_size)]
    nats, n_targets = 0.0, 0
    for src, tgt_in, targets in batches:
        _, loss = model(src.to(device), tgt_in.to(device), targets.to(device), reduction="sum", return_logits=False)
        nats += loss.item()
        n_targets += int((targets != IGNORE_INDEX).sum())
    beams = {"beam_size": cfg.beam_size, "length_penalty": cfg.length_penalty}
    outputs = decoded_pairs(model, batches, task.bos_id, task.eos_id, max_len=block, **beams)
    exact, correct, n_reference = 0, 0, 0
    for output, reference in tqdm(outputs, total=len(rows), unit="pair", file=sys.stderr, disable=not progress):
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
# Chat: the assistant's tokens, and exact answers


def chat_conversations(cfg, meta, chat_format, block_size):
    """
    (conversations as (ids, targets) arrays, what they are, how many were left out): a conversations file (--input,
    rendered with the model's template, those it cannot use counted) or a split of the chat data the model was
    trained on, in both cases those that fit block_size.
    """
    if cfg.input:
        left_out, conversations = prepare_data.LeftOut(), []
        for where, record in prepare_data.chat_records(Path(cfg.input).expanduser()):
            try:
                ids, targets = prepare_data.encode_conversation(record, chat_format, block_size)
            except prepare_data.BadConversation as err:
                left_out.add(str(err), where)
                continue
            conversations.append((np.asarray(ids), np.asarray(targets, dtype=np.uint8)))
        if not conversations:
            raise ValueError(f"{cfg.input} holds no conversation this model can score: {left_out.describe()}")
        return conversations, cfg.input, left_out.bad()
    folder, split = dataset_split(cfg, meta, "chat")
    stored = load_conversations(folder, split)
    # a conversation of n ids is n - 1 inputs and targets
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
        bar = tqdm(replies, total=len(conversations), unit="reply", file=sys.stderr, disable=not progress)
        results["exact_match"] = sum(output == reference for output, reference in bar) / len(conversations)
    return results


# -----------------------------------------------------------------------------
# HellaSwag


@dataclass
class HellaSwagItem:
    """One HellaSwag question, its texts cleaned as lm-evaluation-harness cleans them."""

    line: int  # where it is in its file, for error messages
    context: str
    endings: list[str]  # four, one of them right
    label: int  # the right ending's index


def harness_text(text):
    """lm-evaluation-harness's clean-up of HellaSwag's WikiHow texts: '[title]' marks to '. ', other [marks] gone."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def hellaswag_item(item, line, where):
    """The HellaSwagItem of one parsed jsonl line; ValueError naming `where` and the field for a malformed one."""

    def text(name):
        value = item[name]
        if not isinstance(value, str):
            raise ValueError(f"{where}: '{name}' must be a string, got {value!r:.60}")
        return value

    # the public file holds ctx_a, ctx_b and activity_label: the harness builds its context from them
    if "ctx_a" in item and "ctx_b" in item:
        context = f"{text('ctx_a')} {text('ctx_b').capitalize()}"
    elif "ctx" in item:
        context = text("ctx")
    else:
        raise ValueError(f"{where}: no 'ctx' field (nor 'ctx_a' and 'ctx_b'); is this HellaSwag's jsonl?")
    if "activity_label" in item:
        context = f"{text('activity_label')}: {context}"
    endings = item.get("endings")
    if not (isinstance(endings, list) and len(endings) == 4 and all(isinstance(e, str) for e in endings)):
        raise ValueError(f"{where}: 'endings' must be a list of 4 strings, got {endings!r:.80}")
    label = item.get("label")
    # an int in the public file, a string in the Hugging Face copy; the test split has none
    if isinstance(label, str) and label in ("0", "1", "2", "3"):
        label = int(label)
    if label not in (0, 1, 2, 3) or isinstance(label, bool):
        raise ValueError(f"{where}: 'label' must be 0, 1, 2 or 3, got {label!r:.40}")
    context, endings = harness_text(context), [harness_text(e) for e in endings]
    if not context or not all(endings):
        raise ValueError(f"{where}: {'the context' if not context else 'an ending'} is empty")
    return HellaSwagItem(line, context, endings, label)


def hellaswag_path(name):
    """
    The HellaSwag file: --input, else hellaswag_val.jsonl in $NANOFORMER_DATA_MIRROR, the folder of offline copies
    that prepare_data.py reads too; never downloaded.
    """
    if name:
        return Path(name).expanduser()
    mirror = os.environ.get(MIRROR_ENV)
    if mirror and (Path(mirror) / HELLASWAG_FILE).is_file():
        return Path(mirror) / HELLASWAG_FILE
    raise FileNotFoundError(
        f"no HellaSwag file: download {HELLASWAG_URL} and pass it as --input=PATH, or put it in the folder "
        f"${MIRROR_ENV} names"
    )


def read_hellaswag(path):
    """The items of a HellaSwag jsonl file (one JSON object a line, blank lines skipped): HellaSwagItems."""
    items = []
    for n, line in enumerate(read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path} line {n}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not JSON ({err.msg}); HellaSwag's file holds one object a line") from None
        if not isinstance(item, dict):
            raise ValueError(f"{where}: not a JSON object; HellaSwag's file holds one object a line")
        items.append(hellaswag_item(item, n, where))
    if not items:
        raise ValueError(f"{path} holds no HellaSwag items, only blank lines")
    return items


def hellaswag_sequences(items, tokenizer, block_size, path):
    """
    Per item, per ending: (ids, n): the context's ids then the ending's, at most block_size + 1 of them (the context
    cut from the left), the ending's n ids last. Also the number of items whose context was cut.
    """
    sequences, cut = [], set()
    for item in items:
        try:
            context = tokenizer.encode(item.context)
            for ending in item.endings:
                # as the harness: the whole text encoded, the ids after the context's being the ending's, which
                # starts with a space
                ids = tokenizer.encode(f"{item.context} {ending}")
                n = len(ids) - len(context)
                if not 1 <= n <= block_size:
                    raise ValueError(f"an ending is {n} tokens long; the model scores 1 to block_size={block_size}")
                if len(ids) > block_size + 1:
                    cut.add(item.line)
                sequences.append((ids[-(block_size + 1) :], n))
        except ValueError as err:
            raise ValueError(f"{path} line {item.line}: {err}") from None
    return sequences, len(cut)


def ending_logprobs(model, sequences, *, batch_size, progress=False):
    """
    The log-likelihood of each sequence's ending given what comes before it: (ids, n) each, ids at most block_size + 1
    long, scoring its last n ids. float64 (len(sequences),); batch_size sequences per forward pass.
    """
    device = next(model.parameters()).device
    scores = torch.zeros(len(sequences), dtype=torch.float64)
    with tqdm(total=len(sequences), unit="ending", file=sys.stderr, disable=not progress) as bar:
        for i in range(0, len(sequences), batch_size):
            batch = sequences[i : i + batch_size]
            # right-padded inputs: a causal model's real positions never see the padding after them
            inputs = torch.zeros((len(batch), max(len(ids) for ids, _ in batch) - 1), dtype=torch.long)
            rows, positions, targets = [], [], []
            for row, (ids, n) in enumerate(batch):
                inputs[row, : len(ids) - 1] = torch.tensor(ids[:-1])
                # position p predicts id p + 1: the ending's n ids are predicted at the last n positions
                rows += [row] * n
                positions += range(len(ids) - 1 - n, len(ids) - 1)
                targets += ids[-n:]
            x, _ = model.body(inputs.to(device))  # (B, T, C)
            rows_t = torch.tensor(rows, device=device)
            # the head only where an ending is scored: the (B, T, V) logits of a 50k vocabulary would be gigabytes
            logits = model.head(x[rows_t, torch.tensor(positions, device=device)]).float()
            logp = logits.log_softmax(dim=-1).gather(1, torch.tensor(targets, device=device)[:, None])[:, 0]
            sums = torch.zeros(len(batch), dtype=torch.float64, device=device).index_add_(0, rows_t, logp.double())
            scores[i : i + len(batch)] = sums.cpu()
            bar.update(len(batch))
    return scores


def evaluate_hellaswag(model, tokenizer, items, cfg, path, progress):
    """HellaSwag accuracy: acc by each ending's summed log-likelihood, acc_norm by it per character of the ending."""
    items = items[: cfg.limit]
    sequences, cut = hellaswag_sequences(items, tokenizer, model.config.block_size, path)
    logprobs = ending_logprobs(model, sequences, batch_size=4 * cfg.batch_size, progress=progress).view(-1, 4)
    # the harness's acc_norm: divided by the ending's length in characters, without the space before it
    chars = torch.tensor([[len(e) for e in item.endings] for item in items], dtype=torch.float64)
    labels = torch.tensor([item.label for item in items])
    return {
        "data": str(path),
        "items": len(items),
        "context_cut": cut,
        "acc": (logprobs.argmax(dim=1) == labels).double().mean().item(),
        "acc_norm": (logprobs.div(chars).argmax(dim=1) == labels).double().mean().item(),
    }


# -----------------------------------------------------------------------------
# The command line


def eval_task(cfg, trained):
    """
    The Task that cfg asks of a model whose own is `trained` (load_model's), None for HellaSwag; ValueError for one
    it cannot do.
    """
    task = type(trained) if cfg.task == "auto" else TASKS.get(cfg.task)  # None: HellaSwag
    name, arch = cfg.task if task is None else task.name, trained.arch
    scores, needs = (
        ("endings by a causal language model's likelihood", "gpt") if task is None else (task.scores, task.arch)
    )
    if arch != needs:
        raise ValueError(f"task={name} scores {scores}; this checkpoint's arch is {arch}: use --task={trained.name}")
    for owner in TASKS.values():
        for option in owner.eval_options:
            if getattr(cfg, option) != getattr(EvalConfig, option) and option not in getattr(task, "eval_options", ()):
                raise ValueError(f"--{option} applies to task={owner.name}, not to task={name}")
    if task is None and cfg.split is not None:
        raise ValueError("HellaSwag reads its jsonl file (--input), not a --split")
    return None if task is None else trained if task is type(trained) else task(trained.meta)


def format_results(results):
    """`key  value` lines: floats to 4 decimals, counts with thousands separators."""
    width = max(map(len, results))
    lines = []
    for key, value in results.items():
        if isinstance(value, float):
            value = f"{value:.4f}"
        elif isinstance(value, int):
            value = f"{value:,}"
        lines.append(f"{key:<{width}}  {value}")
    return "\n".join(lines)


def main(cfg, out=None):
    """Evaluate as cfg says, print the results to out (None: stdout) and return them as a dict."""
    out = sys.stdout if out is None else out  # looked up now, not at import: tests and callers may replace it
    device = resolve_device(cfg.device, 0)
    dtype = resolve_dtype(cfg.dtype, device)
    # the HellaSwag file is read and checked before the slow model load, so that a wrong one fails at once
    path = hellaswag_path(cfg.input) if cfg.task == "hellaswag" else None
    items = read_hellaswag(path) if path else None
    model, tokenizer, meta, trained = load_configured(cfg, device)
    task = eval_task(cfg, make_task(trained, model.config.arch, meta))
    progress = sys.stderr.isatty() if cfg.progress is None else cfg.progress
    source = cfg.init_from if cfg.init_from != "resume" else str(run_checkpoint(cfg.out_dir, cfg.checkpoint))
    # the kind of data scored: lm (text), seq2seq (pairs), chat, or hellaswag
    results = {"model": source, "arch": model.config.arch, "task": "hellaswag" if task is None else task.kind}
    # no_grad: nothing is trained; autocast: matmuls in cfg's dtype (every loss is summed in float32 or more)
    with torch.no_grad(), autocast(device, dtype):
        if task is None:
            results |= evaluate_hellaswag(model, tokenizer, items, cfg, path, progress)
        else:
            results |= task.evaluate(model, tokenizer, cfg, progress)
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
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
