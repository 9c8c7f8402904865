"""
Typed `key = value` configuration for every script: config files read with `ast` (never executed) and
--key=value command-line overrides, each value checked against its dataclass field's type.

    cfg = parse_config(TrainConfig, ["configs/shakespeare.py", "--max_iters=500"])

A config file holds only `key = value` lines whose values are literals; later files and options win, and a dict
option on the command line adds its keys to the files' dict. A mistake (an unknown key, a wrong type, a file that is
not a config) raises ConfigError with a one-line message that names the file line or option and how to fix it.
"""

import ast
import difflib
import importlib
import inspect
import io
import pkgutil
import sys
import textwrap
import tokenize
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path

# how every script's usage line spells its options; both spellings are accepted
OPTIONS_USAGE = "[--key=value | --key value ...]"
# the words a bool option may take, matched after lowercasing: --compile=False, --eval_only 1
BOOL_WORDS = types.MappingProxyType({"true": True, "false": False, "1": True, "0": False})  # read-only


class ConfigError(ValueError):
    """A bad setting, config file, command line or input file; the message says what is wrong and how to fix it."""


class Plugins(Mapping):
    """
    {name: class} of a plug-in folder (tasks/, converters/, recipes/): the plug-in `name` is the subclass of base
    that the folder's file `name`.py defines. Looking one up imports that file alone; its names are the file names,
    read without importing anything. This is the one place plug-ins are found: a registry that imported every file
    up front would load the chat templates, LoRA and the hub's data sets into a run that names none of them.
    Iterating the values (a listing for --help, the choices an error names) imports them all.
    """

    def __init__(self, package, path, base):
        self.package, self.base = package, base
        # base.py holds the contract, not a plug-in
        self.names = tuple(sorted(info.name for info in pkgutil.iter_modules(path) if info.name != "base"))

    def __contains__(self, name):
        return name in self.names

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)

    def __getitem__(self, name):
        if name not in self.names:
            raise KeyError(name)
        module = importlib.import_module(f"{self.package}.{name}")
        for value in vars(module).values():
            # the classes the file defines, not those it imports
            if isinstance(value, type) and value.__module__ == module.__name__ and issubclass(value, self.base):
                if value.name == name:
                    return value
        raise ConfigError(f"{self.package}/{name}.py defines no {self.base.__name__} named {name!r}: set its `name`")


def field_docs(cls):
    """
    The comment after each field of dataclass cls, by field name: what --help prints. Fields it inherits from
    dataclass bases (TrainConfig's model settings) have the comments written in their base.
    """
    docs = {}
    for base in reversed(cls.__mro__):
        if is_dataclass(base):
            docs.update(own_field_docs(base))
    return docs


def own_field_docs(cls):
    """The comments of the fields defined in the body of dataclass cls itself."""
    # dedented: a class defined inside a function or a test comes back indented, which ast cannot parse
    source = textwrap.dedent(inspect.getsource(cls))
    # comments are not in the ast, so they are read from the token stream: {line number: text without the '#'}
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    comments = {t.start[0]: t.string.lstrip("#").strip() for t in tokens if t.type == tokenize.COMMENT}
    # body[0] is the class; its body holds the fields (AnnAssign nodes) among methods and its docstring
    body = ast.parse(source).body[0].body
    # a field's comment may sit on any of its lines (a formatter may wrap a long default in parentheses)
    return {
        n.target.id: " ".join(comments[line] for line in range(n.lineno, n.end_lineno + 1) if line in comments)
        for n in body
        if isinstance(n, ast.AnnAssign)
    }


def format_help(cls):
    """The --help text of dataclass cls: usage, then every field with its default and comment."""
    docs = field_docs(cls)
    lines = [
        f"usage: {Path(sys.argv[0]).name} [CONFIG.py ...] {OPTIONS_USAGE}",
        "",
        "Config files hold `key = value` lines of literals; later files and options override earlier ones, except",
        "that a dict option on the command line is merged into the config files' dict: its keys replace theirs.",
        "",
    ]
    for f in fields(cls):
        # a field with a default_factory (data_options' dict) shows the value the factory makes
        default = f.default if f.default_factory is MISSING else f.default_factory()
        # strings bare, as they are typed (--device=auto); anything else as Python writes it (--data_dir=None)
        shown = f"--{f.name}={default if isinstance(default, str) else repr(default)}"
        lines.append(help_line(shown, docs.get(f.name, "")))
    return "\n".join(lines)


def help_line(option, doc):
    """One option's line of --help, laid out as every script prints it: the option as typed, then what it does."""
    return f"  {option:<34} {doc}"


def allowed_types(hint):
    """The types a field's hint allows: (int, NoneType) for `int | None`, (float,) for `float`."""
    return typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)


def coerce(value, hint, where):
    """value as the field's type: an int is fine where a float is expected, a whole float where an int is."""
    # the hint's types in order: the first that accepts value, as is or converted, decides
    for kind in allowed_types(hint):
        if kind is type(None) and value is None or kind in (bool, str, dict) and isinstance(value, kind):
            return value
        if isinstance(value, bool):  # True is an int to Python, never to a config
            continue
        if kind is float and isinstance(value, (int, float)):
            return float(value)
        if kind is int and (isinstance(value, int) or isinstance(value, float) and value.is_integer()):
            return int(value)
    # no allowed type took value: name them as a config writes them ('int or None')
    expected = " or ".join("None" if k is type(None) else k.__name__ for k in allowed_types(hint))
    raise ConfigError(f"{where} must be {expected}, got {value!r}")


def parse_text(text, hint, key):
    """A command-line value: text for str fields, true/false/1/0 for bools, else a Python literal."""
    kinds = allowed_types(hint)
    # `None` means None only where the field allows it; a str field takes any other text as it is, unparsed
    if text == "None" and type(None) in kinds:
        return None
    if str in kinds:
        return text
    if bool in kinds and text.lower() in BOOL_WORDS:
        return BOOL_WORDS[text.lower()]
    if kinds in ((bool,), (bool, type(None))):  # --overwrite=yes: say which words a switch takes
        words = "true or false (or 1, 0" + (", None)" if type(None) in kinds else ")")
        raise ConfigError(f"--{key} takes {words}, got {text!r}")
    try:
        # numbers, lists, dicts: the literals a config file may hold
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = text  # reported as the wrong type below
    return coerce(value, hint, f"--{key}")


def check_key(key, names, where):
    """key, if it names a field; else ConfigError from `where` with the closest name."""
    if key not in names:
        if key == "config" and where == "command line":
            raise ConfigError(
                "a config file is named on its own, not with --config: e.g. train.py configs/shakespeare.py "
                "--max_iters=100 (the file first, then the options that override it)"
            )
        # a typo such as --learning_rte is answered with the key it most resembles
        close = difflib.get_close_matches(key, names, n=1)
        hint = f"did you mean '{close[0]}'?" if close else "--help lists every key"
        raise ConfigError(f"{where}: unknown key '{key}'; {hint}")
    return key


def closest_path(arg):
    """For a config file that does not exist: the config files it most resembles, or how options are written."""
    here = Path(__file__).resolve().parent
    # the configs shipped beside this file and the .py files of the folder arg names, as arg would spell them
    folder = Path(arg).parent
    candidates = {str(folder / p.name) for p in [*folder.glob("*.py"), *(here / folder).glob("*.py")]}
    close = difflib.get_close_matches(arg, sorted(candidates), n=1, cutoff=0.75)
    return f"did you mean {close[0]}?" if close else "options are written --key=value"


def read_config_file(arg, names):
    """The (key, value, line) assignments of a config file; found relative to the working directory or this file."""
    # a relative path is tried in the working directory first, then beside this file (the repository)
    path = Path(arg)
    if not path.is_file() and not path.is_absolute() and (Path(__file__).resolve().parent / path).is_file():
        path = Path(__file__).resolve().parent / path  # so configs/x.py works from any working directory
    if path.is_dir():  # a run's folder where a config file goes: python sample.py out-shakespeare
        raise ConfigError(f"{arg} is a folder, not a config file: name a run's folder with --out_dir={arg}")
    if not path.is_file():
        raise ConfigError(f"config file {arg} not found; {closest_path(arg)}")
    try:
        # parsed, never executed: a config file runs no code, and a syntax error names its line
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except SyntaxError as e:
        raise ConfigError(f"{path} line {e.lineno}: not a `key = value` config file ({e.msg})") from None
    assignments = []
    # each top-level statement must be one `name = literal`: no imports, `a = b = 1`, `x += 1` or expressions
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            continue  # a docstring
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            raise ConfigError(f"{path} line {node.lineno}: only `key = value` assignments are allowed")
        key = check_key(node.targets[0].id, names, f"{path} line {node.lineno}")
        try:
            # literal_eval refuses names, calls and arithmetic: `lr = 6e-4 / 10` or `dataset = name` is an error
            value = ast.literal_eval(node.value)
        except ValueError:
            raise ConfigError(
                f"{path} line {node.lineno}: the value of {key} must be a literal "
                "(number, string, True/False, None, or a list/tuple/dict of those)"
            ) from None
        # the third item says where the value came from, for a type error raised by coerce later
        assignments.append((key, value, f"{path} line {node.lineno}: {key}"))
    return assignments


def parse_config(cls, argv, config_files=True):
    """
    Build dataclass cls from argv's config files and --key=value (or --key value) options, applied in order as the
    module's docstring says, each value typed by its field. --help prints every key with its default and doc and
    exits. Raises ConfigError naming the bad file line, key or value; config_files=False refuses files.
    """
    return make_config(cls, given_values(cls, argv, config_files))


def make_config(cls, values):
    """cls(**values), its checks' failures (in __post_init__) raised as ConfigError."""
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None


def given_values(cls, argv, config_files=True):
    """The {name: value} that argv's config files and options give, as parse_config reads them (defaults left out)."""
    # {field name: type}, string annotations resolved to real types (`int | None`) for coerce
    hints = typing.get_type_hints(cls)
    # arguments are consumed from the front, since `--key value` takes the next word too; later values win
    values, args = {}, list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("-h", "--help"):
            print(format_help(cls))
            raise SystemExit(0)
        # a word without -- is a config file, applied now so that later options override it
        if not arg.startswith("--"):
            if not config_files:  # a script that takes only options after its own words (prepare_data.py NAME)
                raise ConfigError(f"unexpected argument {arg!r}; options are written --key=value")
            for key, value, where in read_config_file(arg, list(hints)):
                values[key] = coerce(value, hints[key], where)
            continue
        key, has_value, text = arg[2:].partition("=")  # only the first '=' splits, values may hold more
        check_key(key, list(hints), "command line")
        is_bool = bool in allowed_types(hints[key])
        if not has_value:
            # a bool flag takes the next word only if it is a bool word: `--eval_only config.py` stays a flag
            takes_next = args and not args[0].startswith("--") and (not is_bool or args[0].lower() in BOOL_WORDS)
            if takes_next:
                text = args.pop(0)
            elif is_bool:
                text = "true"  # a bare --flag
            else:
                raise ConfigError(f"--{key} needs a value: --{key}=VALUE")
        value = parse_text(text, hints[key], key)
        # a dict adds its keys to the config files' dict rather than replacing it: --data_options="{'input': 'x'}"
        # keeps the file's other data options
        if isinstance(value, dict) and isinstance(values.get(key), dict):
            value = {**values[key], **value}
        values[key] = value
    return values
