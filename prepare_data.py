"""Datasets to token files: the command line of the recipes in recipes/.

    python prepare_data.py NAME [--data_dir=DIR] [--input=PATH] [--force] [options]   # or --key value
    python prepare_data.py --help          # every dataset, one line each
    python prepare_data.py NAME --help     # that dataset's options

A dataset lands in <data_dir>/<name>/ as meta.json plus token files (recipes.prepare, which train.py calls too).
"""

import sys
from dataclasses import asdict, make_dataclass

from config import OPTIONS_USAGE, ConfigError, help_line, parse_config
from recipes import RECIPES, describe_tokenizer, prepare, recipe_of
from recipes.base import Option, boolean
from tokens import DATA_DIR_ENV, MIRROR_ENV, load_meta

# what every dataset takes besides its own options; prepare() takes them as keywords too
COMMON_OPTIONS = (
    Option("data_dir", str, None, f"the datasets' root folder (default: ${DATA_DIR_ENV} or data/ beside this script)"),
    Option("force", boolean, False, "rebuild even if up to date, and replace data from another tokenizer"),
)
OFFLINE = (
    f"Offline: --input=PATH, ${MIRROR_ENV} (a local mirror folder), $TIKTOKEN_CACHE_DIR. "
    f"Output root: --data_dir, else ${DATA_DIR_ENV}, else data/ beside this script."
)


def help_text(name=None):
    """--help: every dataset with its description; NAME --help: that dataset's options as typed, with defaults."""
    if name is None:
        usage, about = "NAME", "Prepare a dataset as token files under <data_dir>/<name>/ (NAME --help: its options)."
        lines = [help_line(dataset, recipe.description) for dataset, recipe in RECIPES.items()]
    else:
        usage, about = name, RECIPES[name].description
        # an option without a default shows its name as the value to give: --input=INPUT
        options = (*RECIPES[name].options, *COMMON_OPTIONS)
        lines = [help_line(f"--{o.name}={o.name.upper() if o.default is None else o.default}", o.help) for o in options]
    return "\n".join([f"usage: prepare_data.py {usage} {OPTIONS_USAGE}", "", about, "", *lines, "", OFFLINE])


def parse_args(argv):
    """(dataset name, prepare()'s keywords) from `NAME --key=value ...`, the options read by config.parse_config."""
    name = argv[0] if argv and not argv[0].startswith("-") else None
    recipe = recipe_of(name) if name else None  # an unknown name is refused, --help or not
    if "-h" in argv or "--help" in argv:
        print(help_text(name))
        raise SystemExit(0)
    if name is None:
        raise ConfigError(f"name a dataset first, one of: {', '.join(RECIPES)} (--help says what each is)")
    # a dataclass of the dataset's options; the words after NAME are options only, never config files
    fields = [(o.name, field_type(o), o.default) for o in (*recipe.options, *COMMON_OPTIONS)]
    return name, asdict(parse_config(make_dataclass(name, fields), argv[1:], config_files=False))


def field_type(option):
    """The type config.parse_config reads an option's value as: bool for a yes/no option, `| None` if unset."""
    kind = bool if option.type is boolean else option.type
    return kind | None if option.default is None else kind


def summary_line(folder):
    """The line printed after a build: what was written, the vocab size and the tokenizer."""
    meta = load_meta(folder)
    if meta["kind"] == "seq2seq":
        counts = ", ".join(f"{split} {n:,} pairs" for split, n in meta["pairs"].items())
    elif meta["kind"] == "chat":
        counts = ", ".join(
            f"{split} {n:,} conversations ({meta['files'][f'{split}.bin']:,} tokens)"
            for split, n in meta["conversations"].items()
        )
    else:
        counts = ", ".join(f"{fname} {n:,} tokens" for fname, n in meta["files"].items())
    return f"{folder}: {counts}; vocab_size {meta['vocab_size']:,} ({describe_tokenizer(meta['tokenizer'])})"


def cli(argv):
    """The command line; returns the exit status: errors print one line and give 2."""
    try:
        name, settings = parse_args(argv)
        print(summary_line(prepare(name, **settings)))
    except (ValueError, OSError) as err:  # OSError: a missing or unwritable file, a failed download
        print(f"prepare_data.py: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("prepare_data.py: error: interrupted; partial outputs were removed", file=sys.stderr)
        # 128 + SIGINT, as a shell reports Ctrl-C
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
