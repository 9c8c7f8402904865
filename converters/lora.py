"""
LoRA (Hu et al. 2021): fine-tune a GPT whose weights stay frozen by training, beside chosen Linears, a low-rank
update that is small enough to keep, save and merge; and the rows of the chat tokens a base model never learnt
trained with it (its vocabulary grown to them first: GPT.grow_vocabulary).

    add_adapters(model, LoRASettings(rank=8, alpha=16.0, targets=("attention", "mlp")), token_rows=[65, 66, 67, 68],
                 generator=torch.Generator().manual_seed(1337))
    ...                                                     # train: only the adapters have requires_grad
    adapters = adapter_state(model)                         # {name: tensor}: what a checkpoint keeps
    plain = merge(model)                                    # the adapters folded into the weights: a plain GPT again

An adapted Linear keeps the base's weight and bias Parameters under their names (a base checkpoint's names are
the adapted model's) and adds lora_a (r, in) and lora_b (out, r):

    y = x W^T + b + (alpha / r) * dropout(x) A^T B^T        merged: W + (alpha / r) B A

B starts at zero, so the adapted model starts as the base. Token rows: the rows of given ids in the token embedding
(and in the head, tied to it or not) gain a trained delta (n, C), zero at first: a frozen base never learnt tokens
its vocabulary did not have (the builtin chat template's markers), and with LoRA nothing else could teach it them.
Why not peft: docs/training.md (it renames the weights that checkpoints, FSDP, Muon and export name as model.py does).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from config import ConfigError
from converters.base import Converter
from model import Block

# which Linears of each block an adapter target names: (the block's submodule, its Linears); MLP's `up` is swiglu's
TARGETS = {"attention": ("attn", ("qkv", "proj")), "mlp": ("mlp", ("fc", "up", "proj"))}


@dataclass(frozen=True)
class LoRASettings:
    """What the adapters are: their rank, scale and place (train.py's lora_* settings)."""

    rank: int  # r: lora_a is (r, in), lora_b (out, r)
    alpha: float  # the update is scaled by alpha / r, so that a change of r needs no new learning rate
    targets: tuple  # names in TARGETS: "attention", "mlp"
    dropout: float = 0.0  # on the adapters' input, in training only

    @property
    def scale(self):
        return self.alpha / self.rank


class LoRALinear(nn.Linear):
    """A Linear of the base, frozen, plus its trained low-rank update (see the module's docstring)."""

    def __init__(self, linear, settings, generator):
        # nn.Linear's own weight is made on the meta device (no memory, no random draws), then replaced by the base's
        with torch.device("meta"):
            super().__init__(linear.in_features, linear.out_features, bias=False)
        self.weight, self.bias = linear.weight, linear.bias
        self.scale, self.dropout = settings.scale, nn.Dropout(settings.dropout)
        like = {"device": linear.weight.device, "dtype": linear.weight.dtype}
        # A as nn.Linear's (and peft's) default: uniform within +-1/sqrt(in), drawn on the CPU; B zero: no update yet
        bound = 1 / math.sqrt(self.in_features)
        lora_a = torch.empty(settings.rank, self.in_features).uniform_(-bound, bound, generator=generator)
        self.lora_a = nn.Parameter(lora_a.to(**like))
        self.lora_b = nn.Parameter(torch.zeros(self.out_features, settings.rank, **like))

    def forward(self, x):
        # (..., in) -> (..., r) -> (..., out): never the (out, in) product B A
        update = F.linear(F.linear(self.dropout(x), self.lora_a), self.lora_b)
        return F.linear(x, self.weight, self.bias) + update * self.scale


class RowsEmbedding(nn.Embedding):
    """The token embedding, frozen, with a trained delta added to the rows of some ids."""

    def __init__(self, embedding, rows, delta):
        with torch.device("meta"):
            super().__init__(embedding.num_embeddings, embedding.embedding_dim)
        self.weight, self.row_delta = embedding.weight, delta  # delta: (n, C), the rows' in order
        # slot[id]: 0 for an id without a delta, k + 1 for rows[k]: one lookup adds each id's delta (or zeros)
        slot = torch.zeros(self.num_embeddings, dtype=torch.long)
        slot[torch.tensor(rows)] = torch.arange(1, len(rows) + 1)
        self.register_buffer("slot", slot.to(embedding.weight.device), persistent=False)
        self.register_buffer("rows", torch.tensor(rows, device=embedding.weight.device), persistent=False)

    def forward(self, idx):
        deltas = torch.cat([self.row_delta.new_zeros(1, self.embedding_dim), self.row_delta])  # (1 + n, C)
        return F.embedding(idx, self.weight) + F.embedding(self.slot[idx], deltas)


class RowsHead(nn.Linear):
    """The output head, frozen, with a trained delta added to the rows of some ids: their logits gain x . delta."""

    def __init__(self, head, rows, delta):
        with torch.device("meta"):
            super().__init__(head.in_features, head.out_features, bias=False)
        self.weight, self.row_delta = head.weight, delta
        self.register_buffer("rows", torch.tensor(rows, device=head.weight.device), persistent=False)

    def forward(self, x):
        # (..., V) logits with (..., n) added at the rows' ids: W[rows] + delta, without a copy of W
        return F.linear(x, self.weight).index_add(-1, self.rows, F.linear(x, self.row_delta))


def add_adapters(model, settings, token_rows=(), *, generator):
    """
    Freeze every weight of model (a GPT) and give it trained adapters, in place: a LoRALinear for each Linear of
    every block that settings.targets names, and with token_rows (ids) a delta on those rows of the embedding and
    the head. generator draws the A matrices, so that every rank draws the same ones. Returns model.
    """
    model.requires_grad_(False)
    for block in [m for m in model.modules() if isinstance(m, Block)]:
        for target in settings.targets:
            part, names = TARGETS[target]
            parent = getattr(block, part)
            for name in names:
                if isinstance(getattr(parent, name), nn.Linear):  # MLP's up is None without swiglu
                    setattr(parent, name, LoRALinear(getattr(parent, name), settings, generator))
    if token_rows:
        wte, head = model.body.wte, model.lm_head
        rows, like = sorted(token_rows), {"device": wte.weight.device, "dtype": wte.weight.dtype}
        delta = nn.Parameter(torch.zeros(len(rows), wte.embedding_dim, **like))
        # a tied head shares the embedding's matrix, so it shares the delta too: merged, both get the same rows
        head_delta = delta if head.weight is wte.weight else nn.Parameter(torch.zeros_like(delta))
        model.body.wte, model.lm_head = RowsEmbedding(wte, rows, delta), RowsHead(head, rows, head_delta)
    return model


def adapter_state(model):
    """
    The trained tensors of an adapted model, whole, on the CPU: {name: tensor}, each shared one once. Under FSDP
    every rank gathers each of them (a collective: call it on every rank).
    """
    # imported here: a model in one process never needs torch.distributed.tensor (half a second of sample.py's start)
    from torch.distributed.tensor import DTensor

    trained = {name: p for name, p in model.named_parameters() if p.requires_grad}
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu() for name, p in trained.items()}


def load_adapters(model, tensors):
    """Copy adapter tensors (adapter_state's dict) into an adapted model; ValueError if they do not fit it."""
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    shapes, saved = {n: tuple(p.shape) for n, p in params.items()}, {n: tuple(t.shape) for n, t in tensors.items()}
    if shapes != saved:
        differ = sorted(n for n in shapes.keys() | saved.keys() if shapes.get(n) != saved.get(n))
        raise ValueError(f"the adapters do not fit the model built for them: {', '.join(differ[:4])} differ")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(tensors[name])


@torch.no_grad()
def merge(model):
    """
    An adapted model made plain again, in place: every update folded into the weight it adapts and the plain modules
    back, every weight trainable. Its forward equals the adapted one's up to rounding; its state dict the base's.
    """
    merged = set()  # the deltas already added: a tied head's is the embedding's
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LoRALinear):
                child.weight += child.scale * (child.lora_b @ child.lora_a)
            elif isinstance(child, (RowsEmbedding, RowsHead)) and id(child.row_delta) not in merged:
                child.weight[child.rows] += child.row_delta
                merged.add(id(child.row_delta))
            # the plain module back, holding the same weight (and bias) Parameters
            if isinstance(child, (LoRALinear, RowsHead)):
                with torch.device("meta"):
                    plain = nn.Linear(child.in_features, child.out_features, bias=False)
                plain.weight, plain.bias = child.weight, child.bias
                setattr(parent, name, plain)
            elif isinstance(child, RowsEmbedding):
                with torch.device("meta"):
                    plain = nn.Embedding(child.num_embeddings, child.embedding_dim)
                plain.weight = child.weight
                setattr(parent, name, plain)
    return model.requires_grad_(True)


# -----------------------------------------------------------------------------
# LoRA as a converter: what start.py applies between building the model and spreading it over the ranks, and what
# train.py and the checkpoints save, without asking whether it is LoRA


class LoRA(Converter):
    """
    The converter of a LoRA run (lora_rank > 0). Its record, what the checkpoints keep: the adapters' rank, alpha
    and targets, the token rows they train and their base (start.base_record). Its checkpoints hold the adapters
    alone, as "weights" (state), one file also under FSDP; restore puts them on the base again, plain merges them.
    """

    name, partial = "lora", True

    def __init__(self, record, cfg=None):
        super().__init__(record, cfg)
        dropout = 0.0 if cfg is None else cfg.lora_dropout
        self.settings = LoRASettings(record["rank"], record["alpha"], tuple(record["targets"]), dropout)

    @classmethod
    def check(cls, cfg):
        """The lora_* settings' one-line errors: their values, and what LoRA does not combine with."""
        targets = cfg.lora_targets.split(",")
        if not set(targets) <= set(TARGETS) or len(set(targets)) < len(targets):
            raise ConfigError(f"lora_targets={cfg.lora_targets!r} must be 'attention', 'mlp' or 'attention,mlp'")
        if cfg.lora_alpha <= 0 or not 0 <= cfg.lora_dropout < 1:
            raise ConfigError(
                f"lora_alpha must be positive and lora_dropout in [0, 1), got {cfg.lora_alpha}, {cfg.lora_dropout}"
            )
        if cfg.converter == cls.name and not cfg.lora_rank:
            raise ConfigError("converter='lora' needs lora_rank > 0 (the adapters' rank, e.g. --lora_rank=8)")
        if not cfg.lora_rank:
            return
        if cfg.converter not in ("", cls.name):
            raise ConfigError(f"lora_rank asks for LoRA, and converter={cfg.converter!r} for another: choose one")
        if cfg.arch != "gpt":
            raise ConfigError(
                f"lora_rank is for fine-tuning decoder-only models (arch='gpt'), not arch={cfg.arch!r}: train an "
                "encoder or an encoder-decoder whole (lora_rank=0)"
            )
        if cfg.init_from == "scratch":
            raise ConfigError(
                "lora_rank adapts trained weights, which init_from='scratch' has none of: give --init_from a "
                "checkpoint, a nanoGPT checkpoint or a Hugging Face folder (or 'resume')"
            )
        if cfg.optimizer == "muon" or cfg.ema_decay:
            raise ConfigError(
                "lora_rank trains small adapters with AdamW: optimizer='muon' (whole matrices) and ema_decay (an "
                "average of every weight) do not apply; use optimizer='adamw' and ema_decay=0"
            )

    @classmethod
    def for_new_run(cls, cfg, base, meta, base_record):
        record = {
            "rank": cfg.lora_rank,
            "alpha": cfg.lora_alpha,
            "targets": cfg.lora_targets.split(","),
            "token_rows": trained_rows(meta, base.config.vocab_size),
            "base": base_record,
        }
        return cls(record, cfg)

    def convert(self, model, generator):
        """model (grown to the data's vocabulary) frozen, with the adapters; generator draws their A matrices."""
        return add_adapters(model, self.settings, self.record["token_rows"], generator=generator)

    def describe(self, model):
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total, settings, rows = sum(p.numel() for p in model.parameters()), self.settings, self.record["token_rows"]
        rows = f"; the rows of token ids {', '.join(map(str, rows))} trained too" if rows else ""
        return (
            f"LoRA: rank {settings.rank}, alpha {settings.alpha:g} on {' and '.join(settings.targets)}: "
            f"{trained:,} trained parameters ({trained / total:.2%} of {total:,}), the base frozen{rows}"
        )

    def state(self, model):
        return adapter_state(model)  # the adapters alone (under FSDP a collective)

    def restore(self, base, ckpt):
        """The checkpoint's model, unmerged: base grown to its vocabulary where the run grew it, with its adapters."""
        if ckpt["model_config"]["vocab_size"] > base.config.vocab_size:
            base.grow_vocabulary(ckpt["model_config"]["vocab_size"])
        # the A matrices drawn here are overwritten: a generator of their own leaves the run's generators alone
        self.convert(base, torch.Generator())
        load_adapters(base, ckpt["weights"])
        return base

    def plain(self, model):
        return merge(model).eval()

    def run_settings(self):
        return {
            "converter": "",
            "lora_rank": self.record["rank"],
            "lora_alpha": self.record["alpha"],
            "lora_targets": ",".join(self.record["targets"]),
        }


def trained_rows(meta, base_vocab):
    """
    The token ids whose rows a LoRA fine-tune trains: the builtin chat template's markers, which no base model
    learnt (GPT-2 BPE's lie in its padding, never seen), and any id beyond the base's vocabulary. A Hugging Face
    folder's own template uses tokens its model was trained with: none.
    """
    rows = set(range(base_vocab, meta["vocab_size"]))
    if meta.get("chat", {}).get("template") == "builtin":
        rows |= {meta["special_tokens"][name] for name in ("system", "user", "assistant", "end_of_turn")}
    return sorted(rows)
