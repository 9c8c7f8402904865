"""
The data recipes, one file per dataset or family of datasets, and prepare(), which runs one: recipes/base.py holds
what a recipe is made of (Recipe, Option) and what the recipes share. A dataset lands in <data_dir>/<folder>/ as
meta.json plus token files, in the format that tokens.py defines and reads, built in a hidden folder and renamed
into place only when complete (staged_folder). A run imports the recipe file of the dataset it names, no other: to
add a dataset, add a file (docs/data.md, "Adding a dataset").
"""

import contextlib
import difflib
import hashlib
import importlib
import json
import pkgutil
import secrets
import shutil
from collections.abc import Mapping

from log import one_line
from recipes.base import resolve_options
from tokens import FORMAT_VERSION, TOKENIZER_JSON, atomic_output, data_root, dataset_dir, is_prepared, load_meta

# Dataset NAME is made by recipes/NAME.py, or by the family file this table names for it. The table's order is the
# order --help lists the datasets in; those it does not name (a file of their own) come after, by name.
FILES = {
    "shakespeare_char": "shakespeare_char",
    "shakespeare": "shakespeare",
    "openwebtext": "hub",
    "fineweb_edu": "hub",
    "text": "text",
    "translation": "translation",
    "chat": "chat",
    "shakespeare_chat": "chat",
    "reverse": "synthetic",
    "sort": "synthetic",
    "num2words": "synthetic",
}


class Recipes(Mapping):
    """
    {dataset name: Recipe} of the files in recipes/, by the rule above FILES. The names are known without importing
    anything, and looking one up imports its file alone: a registry that imported every recipe up front would load
    the chat templates, the hub's readers and the synthetic tasks into a run that names none of them. Iterating the
    values (--help) imports them all.
    """

    def __init__(self):
        # base.py holds the contract, not a recipe
        own = sorted(info.name for info in pkgutil.iter_modules(__path__) if info.name != "base")
        self.files = FILES | {name: name for name in own if name not in FILES.values()}

    def __contains__(self, name):
        return name in self.files

    def __iter__(self):
        return iter(self.files)

    def __len__(self):
        return len(self.files)

    def __getitem__(self, name):
        # an unknown name raises KeyError here, as a Mapping's should
        module = importlib.import_module(f"{__name__}.{self.files[name]}")
        if name not in module.RECIPES:
            raise KeyError(f"recipes/{self.files[name]}.py has no recipe {name!r} in its RECIPES")
        return module.RECIPES[name]


RECIPES = Recipes()


def recipe_of(name):
    """RECIPES[name]; an unknown name raises ValueError naming the closest one and every one."""
    if name not in RECIPES:
        close = difflib.get_close_matches(name, RECIPES, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"unknown dataset {name!r}; {hint}choose one of: {', '.join(RECIPES)}")
    return RECIPES[name]


def describe_tokenizer(spec):
    """A tokenizer spec as a person reads it, for messages: 'char-level, 65 symbols', 'tiktoken gpt2', ..."""
    if spec.get("type") == "char":
        return f"char-level, {len(spec['chars'])} symbols"
    if spec.get("type") == "huggingface":
        # the content, not the path the file came from, tells two tokenizers apart
        digest = hashlib.sha256(spec["json"].encode("utf-8")).hexdigest()
        return f"Hugging Face {TOKENIZER_JSON} with sha256 {digest[:12]}"
    return f"tiktoken {spec.get('encoding')}"


def existing_meta(folder):
    """The meta of the dataset already in `folder`, None if there is none; a foreign folder raises ValueError."""
    # an absent or empty folder is simply a new dataset
    if not folder.is_dir() or not any(folder.iterdir()):
        return None
    try:
        # a folder this script did not write (someone's files) is never replaced without --force
        return load_meta(folder)
    except (FileNotFoundError, ValueError) as err:
        raise ValueError(
            f"{folder} exists but is not a dataset this script can update ({one_line(err)}); "
            "pass --force to replace it, or choose another --data_dir"
        ) from None


@contextlib.contextmanager
def staged_folder(folder):
    """Yield a hidden folder beside `folder` that replaces it only if the block succeeds."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    # hidden (dataset_dir refuses dot names, so no dataset is called this) and random, so concurrent runs never
    # share a stage
    stage = folder.with_name(f".{folder.name}.partial-{secrets.token_hex(4)}")
    stage.mkdir()
    try:
        yield stage
        # two renames: a folder cannot replace a non-empty folder in one step, so the old one moves aside first
        old = folder.with_name(f".{folder.name}.old-{secrets.token_hex(4)}")
        if folder.exists():
            folder.rename(old)
        stage.rename(folder)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        # after a success the stage was renamed away and this does nothing; after a failure it drops the partial outputs
        shutil.rmtree(stage, ignore_errors=True)


def prepare(name, /, data_dir=None, force=False, **options):
    """Prepare dataset `name` (a key of RECIPES) and return its folder.

    Options are those of `python prepare_data.py NAME --help`, as keyword arguments (`name` is positional-only, so
    the option `name=`, the output folder, can be passed too). Outputs that are up to date (same inputs and options)
    are kept, and an existing dataset from a different tokenizer is refused, unless force=True. Raises ValueError,
    FileNotFoundError or DownloadError (an OSError) with a one-line message; nothing half-written is left behind.
    """
    recipe = recipe_of(name)
    # every option of the recipe, converted and checked, defaults filled in
    opts = resolve_options(name, recipe.options, options)
    root = data_root(data_dir)
    # <root>/<name>, or the --name folder for text, chat and translation
    folder = dataset_dir(recipe.folder(opts) if recipe.folder else opts.get("name", name), root)
    # local input files (None: the hub, or generated) and what identifies them; a download happens here
    files, fingerprint = recipe.inputs(name, opts, root) if recipe.inputs else (None, None)
    # everything the outputs depend on; JSON round trip so it compares equal to what meta.json holds
    record = {
        "dataset": name,
        "inputs": fingerprint,
        **{
            o.name: o.recorded(opts[o.name])
            for o in recipe.options
            if o.affects_output and (o.recorded_unset or opts[o.name] is not None)
        },
    }
    record = json.loads(json.dumps(record))
    # --force ignores the existing folder: nothing is kept, nothing refused
    old = None if force else existing_meta(folder)
    # same inputs and options, and the files intact: nothing to do
    if old is not None and old.get("source") == record and is_prepared(folder):
        return folder

    # replacing data of another tokenizer would leave checkpoints trained on it reading wrong ids
    def check_tokenizer(spec):
        if old is not None and old["tokenizer"] != spec:
            raise ValueError(
                f"{folder} holds data from a different tokenizer ({describe_tokenizer(old['tokenizer'])}, now "
                f"{describe_tokenizer(spec)}); pass --force to replace it, or choose another --name/--data_dir"
            )

    # the builder writes into the stage; meta.json comes last, listing what was written
    with staged_folder(folder) as stage:
        meta = {
            "format_version": FORMAT_VERSION,
            "name": folder.name,
            **recipe.build(stage, name, opts, files, check_tokenizer),
            "source": record,
        }
        # ensure_ascii=False: a char vocabulary stays readable in meta.json
        with atomic_output(stage / "meta.json") as f:
            f.write(json.dumps(meta, indent=1, ensure_ascii=False).encode("utf-8"))
    return folder
