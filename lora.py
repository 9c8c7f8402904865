"""
LoRA (Hu et al. 2021): fine-tune a GPT whose weights stay frozen by training, beside chosen Linears, a low-rank
update that is small enough to keep, save and merge; and the rows of the chat tokens a base model never learnt
trained with it (its vocabulary grown to them first: chat.grow_vocabulary).

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

Written here rather than taken from peft: peft wraps each Linear in a module of its own (the base weight under
`base_layer.weight`, another state-dict name), wraps the model in a PeftModel and needs transformers, while
checkpoints, FSDP's per-Block sharding, Muon's block_matrices and export all name our weights as model.py does;
what this needs is the hundred lines below.
"""

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

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

    @classmethod
    def from_record(cls, record, dropout=0.0):
        """The settings of a checkpoint's "lora" record (start.fit_to_data writes it)."""
        return cls(record["rank"], record["alpha"], tuple(record["targets"]), dropout)

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
    the head (one shared delta where the head is tied to the embedding). generator draws the A matrices, so that
    every rank draws the same ones. Returns model.
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

    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
        for name, p in model.named_parameters()
        if p.requires_grad
    }


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
    An adapted model made plain again, in place: every update folded into the weight it adapts (W += (alpha / r)
    B A, the token rows' deltas added to their rows) and the plain modules back, every weight trainable as in a
    model just built. Its forward equals the adapted one's up to rounding; its state dict has the base's names only.
    """
    merged = set()  # the deltas already added: a tied head's is the embedding's
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LoRALinear):
                child.weight += child.scale * (child.lora_b @ child.lora_a)
            elif isinstance(child, (RowsEmbedding, RowsHead)) and id(child.row_delta) not in merged:
                child.weight[child.rows] += child.row_delta
                merged.add(id(child.row_delta))
            if isinstance(child, (LoRALinear, RowsHead)):
                setattr(parent, name, plain_linear(child))
            elif isinstance(child, RowsEmbedding):
                with torch.device("meta"):
                    embedding = nn.Embedding(child.num_embeddings, child.embedding_dim)
                embedding.weight = child.weight
                setattr(parent, name, embedding)
    return model.requires_grad_(True)


def plain_linear(linear):
    """An nn.Linear holding linear's weight and bias Parameters themselves."""
    with torch.device("meta"):
        plain = nn.Linear(linear.in_features, linear.out_features, bias=False)
    plain.weight, plain.bias = linear.weight, linear.bias
    return plain


def fingerprint(model):
    """
    A cheap fingerprint of a model's weights (16 hex digits): names, shapes and 4,096 evenly spaced values of each
    tensor. An adapter checkpoint keeps its base's, to refuse a base that changed since (a run that trained on).
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().flatten()
        sample = flat[:: max(1, flat.numel() // 4096)][:4096].float().cpu().contiguous()
        digest.update(f"{name}{tuple(tensor.shape)}".encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]


def describe(model, settings, token_rows):
    """The line a run logs about its adapters: what is trained, how much of the model that is."""
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    rows = f"; the rows of token ids {', '.join(map(str, token_rows))} trained too" if token_rows else ""
    return (
        f"LoRA: rank {settings.rank}, alpha {settings.alpha:g} on {' and '.join(settings.targets)}: "
        f"{trained:,} trained parameters ({trained / total:.2%} of {total:,}), the base frozen{rows}"
    )
