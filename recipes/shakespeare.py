"""
Tiny Shakespeare with GPT-2's BPE or a model's tokenizer.json: the text and the 90/10 cut of shakespeare_char,
encoded as the text recipe encodes a file (in pieces, in parallel).
"""

import re

from recipes.base import Recipe, tokenizer_option
from recipes.shakespeare_char import SHAKESPEARE_INPUT, shakespeare_inputs
from recipes.text import build_lm_text
from tokens import TOKENIZER_JSON, tokenizer_json_file


def build_shakespeare(stage, name, opts, files, check_tokenizer):
    """tiny Shakespeare with GPT-2 BPE or a tokenizer.json, split 90/10 as shakespeare_char is."""
    # the option's 'gpt2' is the text recipe's 'bpe'; any other value is a tokenizer.json or its folder
    tokenizer = "bpe" if opts["tokenizer"] == "gpt2" else opts["tokenizer"]
    # 90/10 fixed, as in nanoGPT's data/shakespeare, so losses compare; one document, so no end-of-text in it
    opts = opts | {"val_fraction": 0.1}
    return build_lm_text(stage, name, opts, files, check_tokenizer, tokenizer=tokenizer, eot_after_files=False)


def shakespeare_folder(opts):
    """'shakespeare' for GPT-2 BPE, else shakespeare_<the tokenizer's model folder or file name>."""
    # another tokenizer's ids get a folder of their own, named after it: 'shakespeare' stays GPT-2's
    if opts["tokenizer"] == "gpt2":
        return "shakespeare"
    file = tokenizer_json_file(opts["tokenizer"]).resolve()
    # a model folder's name (shakespeare_TinyLlama-1.1B), or a lone file's own; two tokenizers that come out with the
    # same name are still told apart, by prepare's check of the tokenizer in the folder
    label = file.parent.name if file.name == TOKENIZER_JSON else file.stem
    return "shakespeare_" + re.sub(r"[^\w.-]", "_", label or "tokenizer")


RECIPES = {
    "shakespeare": Recipe(
        "tiny Shakespeare, GPT-2 BPE (tiktoken) or a tokenizer.json, 90/10 split as in nanoGPT",
        options=(
            SHAKESPEARE_INPUT,
            tokenizer_option(
                ("gpt2",),
                "gpt2",
                "gpt2: GPT-2 BPE; else a tokenizer.json or a folder holding one (a Llama or Mistral model folder), "
                "written to shakespeare_<its folder name>",
            ),
        ),
        inputs=shakespeare_inputs,
        build=build_shakespeare,
        folder=shakespeare_folder,
    ),
}
