"""
HellaSwag (Zellers et al. 2019), a benchmark: which of four endings a causal language model finds likeliest after a
context, scored as lm-evaluation-harness scores it (acc by the summed log-likelihood of each ending, acc_norm by it
per character). It evaluates a GPT and trains nothing: its file is read from --input or $NANOFORMER_DATA_MIRROR.
"""

import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from tasks.base import Task, read_text
from tokens import MIRROR_ENV

HELLASWAG_FILE = "hellaswag_val.jsonl"
HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"


class HellaSwag(Task):
    """The benchmark as a task of eval.py's: a GPT's choice among four endings. kind None: no run trains on it."""

    name, kind, scores = "hellaswag", None, "endings by a causal language model's likelihood"

    @classmethod
    def check_eval(cls, cfg):
        # the file is read and checked before the slow model load, so that a wrong one fails at once
        if cfg.split is not None:
            raise ValueError("HellaSwag reads its jsonl file (--input), not a --split")
        read_hellaswag(hellaswag_path(cfg.input))

    def evaluate(self, model, tokenizer, cfg, progress):
        path = hellaswag_path(cfg.input)
        return evaluate_hellaswag(model, tokenizer, read_hellaswag(path), cfg, path, progress)


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
    """The HellaSwag file: --input, else hellaswag_val.jsonl in $NANOFORMER_DATA_MIRROR; never downloaded."""
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
