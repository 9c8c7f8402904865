"""
The Hugging Face corpora, OpenWebText and FineWeb-Edu: documents streamed through `datasets` (from the hub, or
local parquet/json/arrow files read the same way), GPT-2 BPE with end-of-text after each. The readers through
`datasets` serve the translation and chat recipes too.
"""

import os

from tqdm import tqdm

from log import one_line
from recipes.base import (
    INPUT_OPTION,
    NUM_PROC,
    Option,
    Recipe,
    count_option,
    expand_input,
    fraction_option,
    gpt2_spec,
    gpt2_vocab,
    input_fingerprint,
    input_option,
    mirror_entry,
    write_lm,
)
from tokens import MIRROR_ENV, DownloadError, Tokenizer

BATCH_DOCS = 1024  # documents (or pairs) per batch for the Hugging Face streams


def hf_lm_recipe(description, hf_dataset, hf_config):
    """The recipe of a Hugging Face corpus, whose options default to dataset `hf_dataset`, config `hf_config`."""
    options = (
        input_option(
            "local parquet/json/jsonl/arrow file, directory or glob, read through datasets.load_dataset (offline)"
        ),
        Option("hf_dataset", str, hf_dataset, "Hugging Face dataset id"),
        Option("hf_config", str, hf_config, "dataset config, e.g. sample-10BT"),
        count_option("max_docs", None, "stop after this many documents (quick runs)"),
        count_option("max_tokens", None, "stop once this many tokens are written (the last document is kept whole)"),
        fraction_option("val_fraction", 0.0005, "held-out fraction of documents (every round(1/f)-th one)"),
        NUM_PROC,
    )
    return Recipe(description, options=options, build=build_hf_lm, inputs=hf_lm_inputs)


def hf_lm_inputs(name, opts, root):
    """--input's files, else those of a mirror folder named after the dataset; (None, None) for the hub."""
    mirror = mirror_entry(name)
    if not opts["input"] and (mirror is None or not mirror.is_dir()):
        return None, None  # the hub; its identity is hf_dataset/hf_config
    files = expand_input(opts["input"] or str(mirror))
    return files, input_fingerprint(files)


def build_hf_lm(stage, name, opts, files, check_tokenizer):
    """Documents streamed through `datasets` (hub or local files), GPT-2 BPE."""
    # checked before the encoding is loaded, as that may download it
    check_tokenizer(gpt2_spec())
    vocab = gpt2_vocab()
    tokenizer = Tokenizer.from_meta(vocab)
    if files is not None:
        dataset = load_local_dataset(files)
    else:
        hint = f"pass local parquet/json files as {INPUT_OPTION}, or set {MIRROR_ENV} to a folder holding {name}/"
        dataset = load_hub_dataset(opts["hf_dataset"], opts["hf_config"], hint)
    if opts["max_docs"]:
        # lazy: a streamed dataset reads only the documents taken
        dataset = dataset.take(opts["max_docs"])
    # val_fraction 0.0005 -> every 2000th document is val
    period = max(1, round(1 / opts["val_fraction"]))
    # total None (no --max_docs): the bar counts without an end, as the stream's length is unknown
    with tqdm(desc=f"tokenizing {name}", total=opts["max_docs"], unit="doc", unit_scale=True, disable=None) as bar:
        items = encode_documents(
            dataset, tokenizer, period, opts["max_tokens"], opts["num_proc"] or os.cpu_count(), bar
        )
        files_meta = write_lm(stage, items, tokenizer.vocab_size)
    return {"kind": "lm", **vocab, "files": files_meta}


def encode_documents(dataset, tokenizer, period, max_tokens, num_threads, bar):
    """(split, ids) per batch of documents, each followed by end-of-text. Every period-th document, the first
    included, is val: deterministic, streaming, and never empty. Stops after the document that reaches max_tokens."""
    eot = tokenizer.special_tokens["eot"]
    # seen: documents so far, which decides each one's split; written: tokens so far, eot included
    seen = written = 0
    for batch in dataset.iter(batch_size=BATCH_DOCS):
        if "text" not in batch:
            raise ValueError(f"the input has no 'text' column (its columns: {', '.join(batch)})")
        # one batch of documents becomes two items, the ids of each split concatenated (one may be empty)
        out, before = {"train": [], "val": []}, seen
        for ids in tokenizer.encode_batch(batch["text"], num_threads):
            split = "val" if seen % period == 0 else "train"
            out[split].extend(ids)
            out[split].append(eot)
            seen, written = seen + 1, written + len(ids) + 1
            if max_tokens and written >= max_tokens:
                break
        bar.update(seen - before)
        # an empty list is fine: TokenWriter.write skips it
        yield from out.items()
        if max_tokens and written >= max_tokens:
            return


def load_local_dataset(files):
    """A streaming `datasets` view of local parquet/json/jsonl/arrow files: the hub's code path, offline."""
    import datasets  # imported on use: it is slow to import and only these datasets need it

    builders = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".arrow": "arrow"}
    # one format for all files: load_dataset reads a single format per call
    kinds = {builders.get(p.suffix.lower()) for p in files}
    if None in kinds or len(kinds) != 1:
        found = ", ".join(sorted({p.suffix or p.name for p in files}))
        raise ValueError(
            f"local dataset files must all be one of {', '.join(builders)}, got {found} "
            "(for plain text use the 'text' dataset)"
        )
    # streaming, as from the hub, so a large local corpus is never loaded whole; local files always land in a
    # 'train' split, and our own val split is drawn later
    return datasets.load_dataset(kinds.pop(), data_files=[str(p) for p in files], split="train", streaming=True)


def load_hub_dataset(hf_dataset, hf_config, hint):
    """The train split of a Hugging Face hub dataset, streamed; a failure raises DownloadError ending with `hint`."""
    import datasets

    # for the message only
    url = f"https://huggingface.co/datasets/{hf_dataset}"
    try:
        # streamed: OpenWebText and FineWeb-Edu are tens of GB, and only the rows read are downloaded
        return datasets.load_dataset(hf_dataset, name=hf_config, split="train", streaming=True)
    except Exception as err:  # connection, missing config or auth errors all mean: not loadable from here
        raise DownloadError(
            f"could not load {hf_dataset} ({hf_config or 'default config'}) from {url} ({one_line(err)}); {hint}"
        ) from None


RECIPES = {
    "openwebtext": hf_lm_recipe(
        "OpenWebText through Hugging Face datasets, GPT-2 BPE, streamed (--max_docs for a quick run)",
        "Skylion007/openwebtext",
        None,
    ),
    "fineweb_edu": hf_lm_recipe(
        "FineWeb-Edu sample-10BT through Hugging Face datasets, GPT-2 BPE, streamed",
        "HuggingFaceFW/fineweb-edu",
        "sample-10BT",
    ),
}
