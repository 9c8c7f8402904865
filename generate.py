"""
Generating from the models of model.py: picking the next token (greedy, temperature, top-k, top-p), a GPT's
continuation streamed a token at a time with the KV cache, an encoder-decoder's translation (greedy, sampled or by
beam search), and the decoded pairs that exact match scores (train.py's validation accuracy, eval.py's seq2seq).
Functions taking the model first, like nanochat's engine beside its gpt.py: the model computes one forward pass,
these decide what it reads next, and they work on any model of model.py without being part of it. Last, a GPT's
replies in a conversation: one greedy reply (what exact match scores), and a ChatSession that keeps its KV cache
from turn to turn.

    out = generate(model, idx, 100, temperature=0.8, top_k=200)        # GPT: (B, T + 100)
    for token in generate_stream(model, idx, 100, stop_token=eot): ...   # GPT: (B, 1) a step, as it comes
    out = translate(model, src, 64, bos_id, eos_id, beam_size=4)        # encoder-decoder: (B, L)
    session = ChatSession(model, chat_format, system="Be brief.")      # GPT with a chat template (chat.py)
    for token in session.reply("Who speaks first?"): ...                 # ids of the reply, as they come

Shape letters as in model.py (B batch, T length, V vocabulary, K beams...).
"""

import torch
from torch.nn.utils.rnn import pad_sequence

from model import IGNORE_INDEX
from tokens import final_reply

# -----------------------------------------------------------------------------
# The next token


def check_sampling_args(temperature, top_k, top_p, min_p=None):
    """Raise a ValueError naming the first of temperature, top_k, top_p, min_p that is out of range."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k <= 0:
        raise ValueError(f"top_k must be a positive integer or None, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if min_p is not None and not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")


def sample_next(logits, temperature=1.0, top_k=None, top_p=None, generator=None, min_p=None):
    """
    Pick one token per row of logits (B, V): argmax at temperature 0, else sample the filtered softmax. (B, 1).
    min_p keeps the tokens at least min_p times as likely as the likeliest (after temperature, top_k and top_p).
    """
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    probs = next_probs(logits, temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    return draw(probs, generator)


def draw(probs, generator=None):
    """
    One id for each row of probs (B, V): (B, 1), by the inverse of the row's cumulative distribution at one uniform
    number a row. The sums are in float64 (float32 on Apple's MPS, which has no float64), so that even an id of
    probability 1e-12 keeps its share. The same distribution as torch.multinomial's, which on a CPU takes 0.8 ms a
    row over GPT-2's vocabulary against 0.05. A row that is not a distribution (NaN, all zero) is a ValueError.
    """
    dtype = torch.float32 if probs.device.type == "mps" else torch.float64
    cumulative = probs.to(dtype).cumsum(dim=-1)  # (B, V)
    total = cumulative[:, -1:]
    if not bool((total > 0).all()):  # NaN compares False too
        raise ValueError("cannot draw from a row of probabilities that is NaN or all zero (did the model overflow?)")
    # u < 1 with a mantissa's bits, so u x total rounds below the total: some id's sum passes it
    u = torch.rand(probs.size(0), 1, dtype=dtype, device=probs.device, generator=generator)
    # the first id whose sum passes u x total: an id of probability 0 adds nothing and is never drawn
    return torch.searchsorted(cumulative, u * total, right=True)


def next_probs(logits, temperature, top_k=None, top_p=None, min_p=None):
    """The distribution sample_next draws each row of logits (B, V) from: (B, V) float32, filtered tokens at 0."""
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (B, 1): the k-th largest logit of each row
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the likelier ones before it already hold top_p; the first one always stays
        drop = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))  # back in vocabulary order
    probs = logits.softmax(dim=-1)  # filtered tokens get probability 0
    if min_p:
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs


# -----------------------------------------------------------------------------
# GPT: continuing a prompt


@torch.no_grad()
def generate_stream(
    model,
    idx,
    max_new_tokens,
    temperature=1.0,
    top_k=None,
    top_p=None,
    *,
    stop_token=None,
    generator=None,
    use_cache=True,
    context_keep=None,
    vocab_size=None,
):
    """
    Yield a GPT's next (B, 1) tokens one step at a time after the prompt idx (B, T).
    Once the sequence outgrows block_size, the context window restarts from its last `context_keep`
    tokens (default block_size // 2) and fills up again. Position embeddings depend on where a token
    sits in the window, so the cache is rebuilt at each restart: one prefill every block_size - context_keep
    tokens instead of one per token. context_keep=block_size is nanoGPT's crop-every-step, exact but as slow
    as no cache. Without the cache the same windows are recomputed from scratch, giving the same tokens.
    Rows that produced stop_token keep producing it; the stream ends when all rows have.
    vocab_size: draw only ids below it, for a tokenizer smaller than the (padded) embedding, e.g. 50257 of 50304.
    """
    check_sampling_args(temperature, top_k, top_p)
    if idx.size(1) == 0:
        raise ValueError("the prompt is empty: start from at least one token, e.g. the end-of-text id")
    block = model.config.block_size
    keep = block // 2 if context_keep is None else context_keep
    if not 1 <= keep <= block:
        raise ValueError(f"context_keep must be in [1, block_size={block}], got {keep}")
    start = max(0, idx.size(1) - block)  # first token of the context window
    cache, done = None, torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)  # done: (B,)
    for _ in range(max_new_tokens):
        if idx.size(1) - start > block:  # window full: slide it, the cached positions are stale
            start, cache = idx.size(1) - keep, None
        if use_cache and cache is not None:  # the cache holds the window up to the last token: feed just that
            x, _ = model.body(idx[:, -1:], cache=cache)
        else:  # a new window: prefill the cache with all of it (or, uncached, recompute it every step)
            cache = model.new_cache() if use_cache else None
            x, _ = model.body(idx[:, start:], cache=cache)
        # only the last position predicts the next token; ids past vocab_size are cut off before sampling
        logits = model.head(x[:, -1])[:, :vocab_size]  # (B, V)
        token = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        if stop_token is not None:  # a stopped row repeats stop_token while the others go on
            token = token.masked_fill(done[:, None], stop_token)
            done = done | (token[:, 0] == stop_token)
        idx = torch.cat([idx, token], dim=1)  # (B, T + 1)
        yield token  # (B, 1)
        if done.all():
            return


def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, **options):
    """
    Continue a GPT's prompts idx (B, T) by up to max_new_tokens tokens; returns (B, T + new).
    temperature 0 is greedy; top_k keeps the k likeliest tokens, top_p the smallest set holding p of the
    probability. Further options (stop_token, generator, use_cache, context_keep, vocab_size): see generate_stream.
    """
    new = generate_stream(model, idx, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, **options)
    return torch.cat([idx, *new], dim=1)


def until_stop(ids, stop_token, keep_stop=False):
    """ids up to the first stop_token, without it (keep_stop: with it); all of them if there is none."""
    if stop_token not in ids:
        return ids
    return ids[: ids.index(stop_token) + (1 if keep_stop else 0)]


def start_ids(tokenizer, meta):
    """
    The ids a document starts after: those a tokenizer.json's template puts before every text (Llama's bos), else
    end-of-text (GPT-2), else bos; none for a character vocabulary. eval.py puts them before a text file, so that
    its first token is scored too, as lm-evaluation-harness scores a document; sample.py starts from them when it
    has no prompt.
    """
    if prefix := tokenizer.template_prefix():
        return prefix
    special = meta["special_tokens"]
    return [special["eot"]] if "eot" in special else [special["bos"]] if "bos" in special else []


def prompt_start(tokenizer, meta, text):
    """
    The ids that go before the prompt's own and are never printed: those a tokenizer.json's template puts before
    every text (Llama's bos); with no prompt, where a document starts (start_ids), or a newline for char data.
    """
    if text:
        return tokenizer.template_prefix()
    if head := start_ids(tokenizer, meta):
        return head
    if meta["tokenizer"]["type"] == "char":
        return tokenizer.encode("\n")
    raise ValueError(
        "this model's tokenizer has no bos token to start from (its config.json has no bos_token_id); "
        'give a prompt with --start, e.g. --start "Once upon a time"'
    )


def end_of_text(meta):
    """The id that ends a GPT's text: GPT-2's end-of-text, or a tokenizer.json's eos; None for character-level data."""
    special = meta["special_tokens"]
    return special.get("eot", special.get("eos"))


# -----------------------------------------------------------------------------
# Encoder-decoder: translating a source


def padding_id(model, eos_id):
    """What follows eos in a translated row: the model's pad_token_id, or eos again in a model without one."""
    return eos_id if model.config.pad_token_id is None else model.config.pad_token_id


@torch.no_grad()
def translate(
    model,
    src,
    max_new_tokens,
    bos_id,
    eos_id,
    *,
    beam_size=1,
    length_penalty=0.6,
    temperature=0.0,
    top_k=None,
    top_p=None,
    generator=None,
):
    """
    An encoder-decoder's translation of src (B, S): (B, L) target ids, each row ending with eos_id (unless it ran
    out of steps) and padded after it with padding_id. BOS is not included.
    beam_size 1 decodes greedily (temperature 0) or samples; beam_size > 1 runs beam_search.
    The encoder runs once; each layer projects its cross-attention keys and values once.
    """
    if beam_size > 1:
        return beam_search(
            model, src, max_new_tokens, bos_id, eos_id, beam_size=beam_size, length_penalty=length_penalty
        )
    check_sampling_args(temperature, top_k, top_p)
    memory, src_mask = model.encode(src)
    cache = model.new_cache()
    token = torch.full((src.size(0), 1), bos_id, dtype=torch.long, device=src.device)  # (B, 1)
    done = torch.zeros(src.size(0), dtype=torch.bool, device=src.device)  # (B,)
    out = []
    for _ in range(max_new_tokens):
        # the cache holds the earlier target positions: only the newest token goes through the decoder
        logits = model.decode(token, memory, src_mask, cache=cache)[:, -1]  # (B, V)
        token = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        token = token.masked_fill(done[:, None], padding_id(model, eos_id))  # rows past their eos get padding
        out.append(token)
        done = done | (token[:, 0] == eos_id)
        if done.all():
            break
    return torch.cat(out, dim=1)


@torch.no_grad()
def beam_search(model, src, max_new_tokens, bos_id, eos_id, beam_size=4, length_penalty=0.6):
    """
    Keep the beam_size best partial translations per source. Each step ranks the 2 * beam_size best extensions:
    those ending at eos_id finish if ranked among the first beam_size, the best beam_size others stay live
    (as in fairseq and Hugging Face). Hypotheses are compared by log-probability / ((5 + length) / 6) **
    length_penalty (Wu et al. 2016; 0.6 in the 2017 paper). A source is done once no live beam can beat its best
    finished hypothesis; if the steps run out first, its live beams compete with the finished ones.
    Returns (B, L) as translate does.
    """
    B, K = src.size(0), beam_size
    memory, src_mask = model.encode(src)
    memory = memory.repeat_interleave(K, dim=0)  # (B*K, S, C): row b*K + j is beam j of source b
    src_mask = None if src_mask is None else src_mask.repeat_interleave(K, dim=0)
    cache = model.new_cache()
    seqs = torch.full((B * K, 1), bos_id, dtype=torch.long, device=src.device)  # (B*K, 1 + step): BOS, tokens
    scores = torch.full((B, K), float("-inf"), device=src.device)  # summed log-probabilities of the live beams
    scores[:, 0] = 0.0  # all beams start identical: expand only the first
    finished = [[] for _ in range(B)]  # (normalised score, token list) per source
    done = [False] * B

    def penalty(length):
        return ((5 + length) / 6) ** length_penalty

    for step in range(max_new_tokens):
        # log-probabilities in float32 whatever the model's dtype, so that long sums do not lose precision
        logits = model.decode(seqs[:, -1:], memory, src_mask, cache=cache)[:, -1]  # (B*K, V)
        logprobs = logits.float().log_softmax(dim=-1)
        V = logprobs.size(-1)
        # every extension of every beam of a source in one row: index beam * V + token
        candidates = (scores.view(B * K, 1) + logprobs).view(B, K * V)
        top_scores, top_index = candidates.topk(2 * K, dim=1)  # at most K of them end at eos: K are left to go on
        # choose on the host: the rules below (finish or go on, done or not) differ per source
        beams = []  # (score, row of the parent beam in seqs, next token) of the K beams of each source that go on
        for b in range(B):
            chosen = []  # this source's beams that go on, as in beams
            for rank, (score, index) in enumerate(zip(top_scores[b].tolist(), top_index[b].tolist())):
                beam, token = divmod(index, V)
                if done[b] or len(chosen) == K or score == float("-inf"):
                    break
                if token != eos_id:
                    chosen.append((score, b * K + beam, token))
                elif rank < K:  # an ending ranked below the beam is not among the K best hypotheses
                    finished[b].append((score / penalty(step + 1), seqs[b * K + beam, 1:].tolist() + [eos_id]))
            chosen += [(float("-inf"), b * K, eos_id)] * (K - len(chosen))  # a finished source: dead beams
            # Log-probabilities only fall as a hypothesis grows, so a live beam's best possible ending is its score
            # now over the largest penalty of the lengths it can still end at, step + 2 to max_new_tokens.
            best_live = max(score for score, _, _ in chosen) / max(penalty(step + 2), penalty(max_new_tokens))
            done[b] = any(hyp[0] >= best_live for hyp in finished[b])
            beams += chosen
        if all(done):
            break
        # the K chosen beams of every source take over their parents' histories and caches
        new_scores, rows, tokens = zip(*beams)
        rows = torch.tensor(rows, device=src.device)  # (B*K,)
        for self_cache, _ in cache:
            self_cache.reorder(rows)  # cross-attention keys are the same for every beam of a source
        seqs = torch.cat([seqs[rows], torch.tensor(tokens, device=src.device)[:, None]], dim=1)
        scores = torch.tensor(new_scores, device=src.device).view(B, K)

    results = []
    for b in range(B):
        if not done[b]:  # ran out of steps: the live beams compete with the finished ones
            length = seqs.size(1) - 1
            live = [(s / penalty(length), seqs[b * K + j, 1:].tolist()) for j, s in enumerate(scores[b].tolist())]
            finished[b] += [hyp for hyp in live if hyp[0] > float("-inf")]
        results.append(torch.tensor(max(finished[b], key=lambda hyp: hyp[0])[1], dtype=torch.long))
    # right-pad the shorter translations, as translate does
    return pad_sequence(results, batch_first=True, padding_value=padding_id(model, eos_id)).to(src.device)


def decoded_pairs(model, batches, bos_id, eos_id, *, max_len, beam_size=1, length_penalty=0.6):
    """
    Translate the sources of batches, each (src (B, S), tgt_in, targets (B, T)) as data.seq2seq_batch gives them,
    at most max_len tokens each, greedily or by beam search; yield (output, reference) lists of ids for each pair:
    the output through its first eos, the reference target + eos. Exact match is output == reference (an output
    without eos never matches); token accuracy compares them position by position. A generator: the caller's
    torch.autocast, if any, must hold while it is iterated.
    """
    device = next(model.parameters()).device
    for src, _, targets in batches:
        # (B, L) ids without bos, each row ending at its eos, padded after it
        outputs = translate(
            model, src.to(device), max_len, bos_id, eos_id, beam_size=beam_size, length_penalty=length_penalty
        )
        for output, reference in zip(outputs.tolist(), targets.tolist()):
            reference = [t for t in reference if t != IGNORE_INDEX]  # the target, then eos
            yield until_stop(output, eos_id, keep_stop=True), reference


# -----------------------------------------------------------------------------
# GPT: replies in a conversation


@torch.no_grad()
def reply_tokens(
    model,
    cache,
    new_ids,
    max_new_tokens,
    stop_tokens,
    *,
    temperature=0.0,
    top_k=None,
    top_p=None,
    generator=None,
    vocab_size=None,
):
    """
    Yield a GPT's reply one id at a time: new_ids (a list) are fed after the positions the KV cache already holds
    (a conversation's earlier turns are not computed again), then each sampled id is fed in turn. Ends after a
    stop token (which is yielded, not fed), after max_new_tokens, or when the cache holds block_size positions:
    a reply whose last id is not a stop token was cut short.
    """
    device = next(model.parameters()).device
    x, _ = model.body(torch.tensor([new_ids], device=device), cache=cache)
    for i in range(max_new_tokens):
        logits = model.head(x[:, -1])[:, :vocab_size]  # (1, V): ids past the tokenizer's are never drawn
        token = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        yield token.item()
        if token.item() in stop_tokens or i + 1 == max_new_tokens or cache[0][0].length == model.config.block_size:
            return
        x, _ = model.body(token, cache=cache)


def decoded_replies(model, conversations, stop_tokens, *, vocab_size=None):
    """
    Greedily decode the final reply of each (ids, is_target) conversation (arrays, as tokens.Conversations holds
    them) from the turns before it (tokens.final_reply); yield (output, reference) lists of ids, each through its
    end-of-turn: exact match is output == reference. A reply may run to block_size. A generator: the caller's
    torch.autocast, if any, must hold while it is iterated.
    """
    for ids, is_target in conversations:
        prompt, reference = final_reply(ids.tolist(), is_target)
        room = model.config.block_size - len(prompt) + 1  # the last id is sampled, never fed
        output = list(reply_tokens(model, model.new_cache(), prompt, room, set(stop_tokens), vocab_size=vocab_size))
        yield output, reference


class ChatSession:
    """
    A conversation with a GPT that goes on turn after turn. The KV cache keeps every earlier turn: a new turn feeds
    the model only what it has not read (the end of its last reply, the user's message, the assistant's header).
    chat_format (chat.ChatFormat) renders the messages; when the rendered history does not begin with the ids the
    cache holds (a reply whose ids are not those its text encodes to, or a template that rewrites earlier turns),
    the whole conversation is fed again and `recomputed` counts it. A conversation that outgrows block_size goes on
    without its oldest exchanges (the system prompt kept): `dropped` counts the messages left out so far.
    Sampling options as in generate_stream.
    """

    def __init__(self, model, chat_format, *, system="", max_new_tokens=500, vocab_size=None, **sampling):
        self.model, self.format, self.system = model, chat_format, system
        self.max_new_tokens, self.vocab_size, self.sampling = max_new_tokens, vocab_size, sampling
        self.recomputed = self.dropped = 0
        self.reset()

    def reset(self):
        """Forget every turn (the system prompt stays)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.cache, self.fed = self.model.new_cache(), []  # fed: the ids the cache holds
        self.ended = ""  # how the last reply ended: "end_of_turn", "max_new_tokens" or "block_size"

    def reply(self, text, decode):
        """
        Yield the ids of the reply to the user's message `text`, as they come, without its end-of-turn. decode
        (ids -> text) gives the reply's text, which joins the history. A conversation that would not fit block_size
        loses its oldest exchanges first (fit_conversation); ValueError when the message does not fit even alone
        (with the system prompt), and then it is not added. The reply ends at any of the format's reply_ends.
        """
        block = self.model.config.block_size
        messages, prompt = fit_conversation(self.format, [*self.messages, {"role": "user", "content": text}], block)
        self.dropped += len(self.messages) + 1 - len(messages)
        self.messages = messages
        if prompt[: len(self.fed)] != self.fed:
            self.cache, self.fed = self.model.new_cache(), []
            self.recomputed += 1
        new, reply, stopped = prompt[len(self.fed) :], [], False
        stop = set(self.format.reply_ends())
        steps = reply_tokens(
            self.model, self.cache, new, self.max_new_tokens, stop, vocab_size=self.vocab_size, **self.sampling
        )
        for token in steps:
            if token in stop:
                stopped = True
                break
            reply.append(token)
            yield token
        # every id but the last one sampled went through the model; an end-of-turn then starts the next turn's ids
        self.fed = (prompt + reply)[: self.cache[0][0].length]
        full = self.cache[0][0].length == self.model.config.block_size
        self.ended = "end_of_turn" if stopped else "block_size" if full else "max_new_tokens"
        self.messages.append({"role": "assistant", "content": decode(reply)})


def fit_conversation(chat_format, messages, block_size, room=1):
    """
    (messages, their prompt ids) for a conversation whose last message is the user's new one, fitted to block_size
    with `room` positions left for the reply: all of it while that fits; else without the oldest exchanges (each user
    message and the replies after it), the system prompt kept, until the prompt takes at most half of block_size
    (and leaves room): room for this reply and the next few turns, rather than a reply cut short and the whole
    conversation fed again at every turn. ValueError when even the new message alone does not fit.
    """
    prompt = chat_format.prompt_ids(messages)
    if len(prompt) + room <= block_size:
        return messages, prompt
    head = messages[:1] if messages[0]["role"] == "system" else []
    turns = messages[len(head) :]
    while len(turns) > 1 and len(prompt) > min(block_size // 2, block_size - room):
        # the oldest exchange: the first message and every one up to the next user message
        end = next((i for i, m in enumerate(turns[1:], 1) if m["role"] == "user"), len(turns) - 1)
        turns = turns[end:]
        prompt = chat_format.prompt_ids([*head, *turns])
    if len(prompt) + room > block_size:
        template = "the chat template and the system prompt" if head else "the chat template"
        raise ValueError(
            f"the message takes {len(prompt)} tokens with {template}, and the model reads {block_size} (block_size)"
            + (f" with {room} left for the reply" if room > 1 else "")
            + ": send a shorter one"
        )
    return [*head, *turns], prompt
