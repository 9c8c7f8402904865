"""Chat formats: a conversation of system, user and assistant messages as token ids, and which ids are learned.

A chat dataset (prepare_data.py chat) and a chat model (sample.py --chat) read one format, named by the meta's "chat"
entry. ChatFormat.from_meta(meta).render(messages) gives the ids of a conversation and, per id, whether training
learns it (a loss target).

The built-in template, for our own tokenizers (GPT-2's BPE, a character vocabulary, a tokenizer.json trained
here). Four special tokens mark the roles and the end of each turn:

    [<system> text <end_of_turn>] <user> text <end_of_turn> <assistant> text <end_of_turn> <user> ...

No newlines are added and no start token; each text is the message's content encoded on its own, which never
yields a special id, so no message can forge a marker. A model is asked for a reply with the conversation so far
followed by <assistant> (the generation prompt), and its reply ends with <end_of_turn>. The four ids are the meta's
special_tokens "system", "user", "assistant" and "end_of_turn", which with_chat_tokens adds right after the base
vocabulary: 50257, 50258, 50259 and 50260 for GPT-2's BPE (free ids within the 50,304 embedding rows of a padded
GPT-2), n to n + 3 for n characters. With GPT-2's BPE, [user "Hello", assistant "Hi"] is

    <user> Hello <end_of_turn> <assistant> Hi <end_of_turn>
    50258  15496 50260         50259       17250 50260

A Hugging Face template, for a model folder whose chat_template.jinja or tokenizer_config.json holds one (Llama 3's,
Qwen's ChatML): the Jinja source is rendered as transformers' apply_chat_template renders it (a sandbox with
trim_blocks and lstrip_blocks, loop controls, raise_exception, a tojson that keeps non-ASCII text, strftime_now,
the folder's bos_token, eos_token, ...) and the text is tokenized with the special tokens it writes recognised, so
the ids equal tokenizer.apply_chat_template(messages). As there, a message whose text spells a special token
('<|eot_id|>') gets that token. The meta keeps the template's source, the special token strings it reads and the
end-of-turn ids, so a dataset or checkpoint needs no folder.

Loss targets: the tokens of every assistant message's text and the end-of-turn token closing it; nothing else
(system and user text, role markers, the generation prompt). A Hugging Face template's assistant text is found by
rendering: the conversation before assistant message i with the generation prompt, and the conversation up to and
including message i, must both be prefixes of the whole rendering (a template that renders earlier turns
differently, as one dropping past reasoning does, is refused as not incremental); the characters between the two
are the reply. Its tokens (by their character offsets) are targets up to and including the first end-of-turn
token, so ChatML's newline after <|im_end|> is not one.

A model fine-tuned on chat data whose tokens lie beyond its vocabulary gets rows for them: GPT.grow_vocabulary.
"""

import json
from bisect import bisect_right
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

import tokens
from log import one_line

ROLES = ("system", "user", "assistant")
# the built-in template's special tokens: their names in meta["special_tokens"], in the order with_chat_tokens adds them
BUILTIN_TOKENS = ("system", "user", "assistant", "end_of_turn")
# the special token strings transformers hands a template (its special_tokens_map), by their tokenizer_config.json keys
TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# a Hugging Face folder's template file, read before tokenizer_config.json's chat_template, as transformers does
TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
# older folders keep their special token strings here instead of (or as well as) in tokenizer_config.json
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
# a conversation whose rendering shows which token closes an assistant turn in a Hugging Face template
PROBE = ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"})


# ----------------------------------------------------------------------------- conversations


def messages_problem(messages):
    """Why the first bad message of a list (counted from 1) is not one with a known role and a text; None if none is."""
    for i, message in enumerate(messages, 1):
        if not isinstance(message, dict) or not all(isinstance(message.get(key), str) for key in ("role", "content")):
            return f"message {i} is not an object with 'role' and 'content' strings"
        if message["role"] not in ROLES:
            return f"message {i} has role {message['role']!r}; the roles are {', '.join(ROLES)}"
    return None


def conversation_problem(obj):
    """
    Why obj, one parsed line of a JSONL file, is not a conversation to train on; None when it is one. A conversation
    is {"messages": [...]} of messages with "role" (system, user or assistant) and "content" strings, a system message
    first if any, at least one assistant turn, the last message the assistant's. Its length is the caller's to check.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list):
        return 'not an object with a "messages" list'
    messages = obj["messages"]
    if not messages:
        return "an empty conversation"
    if problem := messages_problem(messages):
        return problem
    roles = [message["role"] for message in messages]
    if "system" in roles[1:]:
        return f"message {roles.index('system', 1) + 1} is a system message, which only the first may be"
    if "assistant" not in roles:
        return "no assistant message"
    if roles[-1] != "assistant":
        return f"the last message is the {roles[-1]}'s, not the assistant's"
    return None


def check_messages(messages):
    """ValueError naming the first message of `messages` (a list) that render cannot read."""
    if not isinstance(messages, list):
        raise ValueError(f"a conversation is a list of messages, got {type(messages).__name__}")
    if problem := messages_problem(messages):
        raise ValueError(f"cannot render the conversation: {problem}")


# ----------------------------------------------------------------------------- meta


def with_chat_tokens(meta):
    """
    meta (a dataset's or a checkpoint's) with the built-in template's special tokens added after its vocabulary
    (50257-50260 for GPT-2's BPE, whose 50,257 ids end with end-of-text), vocab_size grown to cover them, kind "chat"
    and meta["chat"] = {"template": "builtin"}. Tokens the meta holds already keep their ids, so a chat model's
    meta comes back unchanged. The meta passed in is not modified.
    """
    special, vocab = dict(meta["special_tokens"]), meta["vocab_size"]
    for name in BUILTIN_TOKENS:
        if name not in special:
            special[name] = vocab
            vocab += 1
    return {**meta, "kind": "chat", "vocab_size": vocab, "special_tokens": special, "chat": {"template": "builtin"}}


def folder_chat(folder):
    """
    The meta's "chat" entry for a Hugging Face model folder: {"template": its Jinja source, "tokens": the special
    token strings the template may read, "end_of_turn": the ids that end an assistant reply}; None when the folder
    has no template. The template is chat_template.jinja, else tokenizer_config.json's chat_template (a string, or
    a list of {"name", "template"} whose "default" is taken). end_of_turn holds the special token that closes an
    assistant turn in the template (found by rendering a probe conversation: Llama 3's <|eot_id|>, ChatML's
    <|im_end|>), then the eos token and config.json's eos_token_id. A template that does not render, or a folder
    without a tokenizer.json, raises one line.
    """
    folder = Path(folder).expanduser()
    config = folder_json(folder / TOKENIZER_CONFIG)
    source = template_source(folder, config)
    if source is None:
        return None
    # tokenizer_config.json's strings win, as its keys are the ones transformers' newer saves write
    strings = {**folder_json(folder / SPECIAL_TOKENS_MAP), **config}
    names = {key: token_string(strings[key], folder, key) for key in TEMPLATE_TOKENS if strings.get(key) is not None}
    file = tokens.tokenizer_json_file(folder)
    tokenizer = template_tokenizer(file.read_text(encoding="utf-8"), file)
    closer = closing_token(TemplateChat(source, names, tokenizer, end_of_turn=()))
    eos = [tokenizer.token_to_id(names["eos_token"])] if "eos_token" in names else []
    # Llama 3.1's instruct config lists several: end of text, end of message (tool calls), end of turn
    model_eos = folder_json(folder / "config.json").get("eos_token_id")
    model_eos = model_eos if isinstance(model_eos, list) else [model_eos]
    # in order of preference, each once; None is an eos string the tokenizer lacks, or no eos_token_id
    end_of_turn = list(dict.fromkeys(i for i in [closer, *eos, *model_eos] if isinstance(i, int)))
    if not end_of_turn:
        raise ValueError(
            f"{folder}: its chat template closes an assistant turn with no special token and the folder names no eos "
            f"token, so a reply could not end; set eos_token in {TOKENIZER_CONFIG}"
        )
    return {"template": source, "tokens": names, "end_of_turn": end_of_turn}


def closing_token(chat):
    """The first special token after the assistant's text in a TemplateChat's rendering of PROBE; None if none."""
    messages = list(PROBE)
    text = chat.text(messages)
    ((start, end),) = chat.replies(messages, text)
    reply = text[start:end]
    # what follows the text closes the turn; all of the reply is searched should the template change the text
    closing = reply.partition(PROBE[1]["content"])[2] or reply
    added = chat.tokenizer.get_added_tokens_decoder()
    return next((i for i in chat.tokenizer.encode(closing, add_special_tokens=False).ids if i in added), None)


def folder_json(path):
    """The JSON object in file path, {} when there is no such file; one line when it is not a JSON object."""
    if not path.is_file():
        return {}
    obj = tokens.read_json(path, missing="")
    if not isinstance(obj, dict):
        raise ValueError(f"{path} is not a JSON object")
    return obj


def template_source(folder, config):
    """A folder's chat template (chat_template.jinja, else tokenizer_config.json's chat_template), or None."""
    if (folder / TEMPLATE_FILE).is_file():
        return (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    # several named templates (Cohere's default, tool_use and rag): the default is the one for plain conversations
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ValueError(
        f"{folder / TOKENIZER_CONFIG}: chat_template is neither a string nor a list of {{name, template}} with a "
        "'default'; put the template in chat_template.jinja"
    )


def token_string(value, folder, key):
    """A special token's string as a tokenizer config stores it: the string itself, or {"content": string, ...}."""
    string = value.get("content") if isinstance(value, dict) else value
    if isinstance(string, str):
        return string
    raise ValueError(f"{folder}: {key} is {value!r:.100}, neither a string nor an object with a 'content' string")


# ----------------------------------------------------------------------------- Jinja


def compile_template(source):
    """A Jinja template as transformers compiles a chat template; ValueError (one line) when it is not valid Jinja."""
    # sandboxed and immutable: a template from a model folder is untrusted code, and may not change its inputs
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, GenerationBlock]
    )
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as err:
        raise ValueError(
            f"the chat template is not valid Jinja (line {getattr(err, 'lineno', '?')}: {one_line(err)}); fix the "
            f"template ({TEMPLATE_FILE} or {TOKENIZER_CONFIG}'s chat_template)"
        ) from None


class GenerationBlock(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}, which transformers' templates wrap assistant text in: the body as is."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)  # the tag's name
        # the body's nodes in place of the block: it renders exactly as if the tags were not there
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def raise_exception(message):
    """What a template calls to refuse its input (Mistral's: roles must alternate)."""
    raise jinja2.TemplateError(message)


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' tojson: plain JSON, where Jinja's own filter would escape '<', '>', '&' and "'" for HTML."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(pattern):
    """Today's date or time written by strftime's `pattern` (Llama 3.1's template dates its system message)."""
    return datetime.now().strftime(pattern)


def template_tokenizer(text, source):
    """The tokenizers.Tokenizer of a tokenizer.json's text that encodes a rendered template as transformers does."""
    tokenizer = tokens.parse_tokenizer_json(text, source)
    # the special tokens the template writes ('<|eot_id|>') must become their ids, as apply_chat_template encodes
    # them; parse_tokenizer_json turns that off, for plain text
    tokenizer.encode_special_tokens = False
    return tokenizer


# ----------------------------------------------------------------------------- formats


class ChatFormat:
    """
    How a conversation becomes ids: the built-in template (BuiltinChat) or a Hugging Face one (TemplateChat); see the
    module docstring. from_meta picks the one a dataset's or checkpoint's meta names.
    """

    end_of_turn: tuple[int, ...]  # the ids that end an assistant reply: generation stops at any of them

    @classmethod
    def from_meta(cls, meta):
        """The chat format meta["chat"] names; ValueError when the meta has none (data that is not chat data)."""
        chat = meta.get("chat")
        if not isinstance(chat, dict) or not isinstance(chat.get("template"), str):
            raise ValueError(
                "this model or dataset has no chat template (its meta has no 'chat' entry): fine-tune it on a chat "
                "dataset (prepare_data.py chat) or start from a Hugging Face folder with a chat_template"
            )
        if chat["template"] == "builtin":
            return BuiltinChat(tokens.Tokenizer.from_meta(meta))
        spec = meta["tokenizer"]
        if spec.get("type") != "huggingface":
            raise ValueError(
                f"the meta's chat template is a Hugging Face one but its tokenizer is {spec.get('type')!r}, not a "
                "tokenizer.json; prepare the chat data again"
            )
        source = "the tokenizer.json stored in this dataset or checkpoint"
        tokenizer = template_tokenizer(spec["json"], source)
        return TemplateChat(chat["template"], chat.get("tokens", {}), tokenizer, chat["end_of_turn"])

    def render(self, messages, add_generation_prompt=False):
        """
        (ids, targets) of a conversation: the ids of all its messages, followed by the generation prompt when
        add_generation_prompt; targets[k] is True where ids[k] is a loss target (assistant text, and the end-of-turn
        token closing it). `messages` is a list of {"role", "content"} dicts; a bad one raises ValueError.
        """
        raise NotImplementedError

    def prompt_ids(self, messages):
        """The ids a model reads before writing its reply to `messages`: render with the generation prompt."""
        return self.render(messages, add_generation_prompt=True)[0]

    def reply_ends(self):
        """The ids that end a reply: end-of-turn, and any other marker (a model that writes one began another turn)."""
        return self.end_of_turn


# The built-in template as a Hugging Face chat template (Jinja), which export.py writes: rendered by transformers'
# apply_chat_template and tokenized with the markers as special tokens, it gives BuiltinChat.render's ids. Unlike
# render, it gives a marker its id where a message's text spells one ('<user>'), as every Hugging Face template does
BUILTIN_JINJA = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('the roles are system, user and assistant, not ' + message['role']) }}"
    "{% endif %}"
    "{{ '<' + message['role'] + '>' + message['content'] + '<end_of_turn>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}"
)


class BuiltinChat(ChatFormat):
    """The built-in template: role markers and end-of-turn special tokens around each message's text."""

    def __init__(self, tokenizer):
        missing = [name for name in BUILTIN_TOKENS if name not in tokenizer.special_tokens]
        if missing:
            raise ValueError(
                f"the meta names the built-in chat template but its special_tokens lack {', '.join(missing)}; "
                "prepare the chat data again"
            )
        self.tokenizer = tokenizer
        self.ids = {name: tokenizer.special_tokens[name] for name in BUILTIN_TOKENS}
        self.end_of_turn = (self.ids["end_of_turn"],)

    def reply_ends(self):
        return tuple(self.ids.values())  # the role markers and end-of-turn

    def render(self, messages, add_generation_prompt=False):
        check_messages(messages)
        ids, targets = [], []
        for message in messages:
            text = self.tokenizer.encode(message["content"])
            reply = message["role"] == "assistant"
            ids += [self.ids[message["role"]], *text, self.ids["end_of_turn"]]
            # the role marker is given to the model; an assistant's text and the end of its turn it must write
            targets += [False] + [reply] * (len(text) + 1)
        if add_generation_prompt:
            ids.append(self.ids["assistant"])
            targets.append(False)
        return ids, targets


class TemplateChat(ChatFormat):
    """
    A Hugging Face chat template: `source` (Jinja) rendered with the special token strings `names` (bos_token, ...)
    and tokenized by `tokenizer` (a tokenizers.Tokenizer from template_tokenizer); `end_of_turn` ids as in the meta.
    """

    def __init__(self, source, names, tokenizer, end_of_turn):
        self.template, self.names, self.tokenizer = compile_template(source), dict(names), tokenizer
        self.end_of_turn = tuple(end_of_turn)

    def reply_ends(self):
        # end-of-turn first, then the tokenizer's special tokens (role headers such as <|start_header_id|>)
        added = self.tokenizer.get_added_tokens_decoder()
        return tuple(dict.fromkeys([*self.end_of_turn, *(i for i, token in added.items() if token.special)]))

    def text(self, messages, add_generation_prompt=False):
        """The template's rendering of `messages`, as apply_chat_template(..., tokenize=False) gives it."""
        try:
            return self.template.render(
                # as transformers: a key whose value is None is left out, which templates test with 'is defined'
                messages=[{key: value for key, value in m.items() if value is not None} for m in messages],
                # templates test these with 'is not none', which an undefined name would pass
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.names,
            )
        # a template is code: besides Jinja's errors and its own raise_exception, it fails as Python does (a
        # TypeError adding a string to a number, an IndexError), each a template that cannot render these messages
        except Exception as err:
            raise ValueError(
                f"the chat template does not render this conversation ({type(err).__name__}: {one_line(err)})"
            ) from None

    def replies(self, messages, text):
        """The (start, end) characters of each assistant message in `text`, the rendering of `messages`."""
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.text(messages[:i], add_generation_prompt=True)
            upto = self.text(messages[: i + 1])
            if not (upto.startswith(before) and text.startswith(upto)):
                raise ValueError(
                    f"the chat template is not incremental: the conversation up to message {i + 1} does not render "
                    "as the start of the whole, so the assistant's tokens cannot be told apart; use a template that "
                    "renders earlier turns as it renders them when they are last"
                )
            spans.append((len(before), len(upto)))
        return spans

    def prompt_ids(self, messages):
        # without targets, so without the incremental check: a template that renders past turns otherwise (gpt-oss
        # ends the last reply with <|return|>, earlier ones with <|end|>) still prompts as transformers does
        check_messages(messages)
        return self.tokenizer.encode(self.text(messages, add_generation_prompt=True), add_special_tokens=False).ids

    def render(self, messages, add_generation_prompt=False):
        check_messages(messages)
        text = self.text(messages, add_generation_prompt)
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        ids, offsets = encoding.ids, encoding.offsets
        # tokens come in the order of the text, so their end offsets do not decrease
        ends = [end for _, end in offsets]
        targets = [False] * len(ids)
        for start, end in self.replies(messages, text):
            # from the first token that ends inside the reply to the last that starts inside it, cut after the
            # end-of-turn token (ChatML's '\n' after <|im_end|> is the template's, not the model's to write)
            k = bisect_right(ends, start)
            while k < len(ids) and offsets[k][0] < end:
                targets[k] = True
                if ids[k] in self.end_of_turn:
                    break
                k += 1
        return ids, targets


def model_format(meta, source):
    """
    The ChatFormat of a model that sample.py or eval.py loaded from `source` (their init_from) with this meta: the
    meta's own template (a model fine-tuned on chat data), else the template of the Hugging Face folder `source`
    names (an instruct model as it was published). ValueError saying how to get one when neither has a template.
    """
    folder = Path(source).expanduser()
    if "chat" not in meta and folder.is_dir():
        found = folder_chat(folder)
        meta = meta if found is None else {**meta, "chat": found}
    return ChatFormat.from_meta(meta)
