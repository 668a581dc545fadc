"""Incremental detokenization and stop strings: the same text and the same cut as decoding everything, at a cost
per token that does not grow with the output."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import models
from specdec.text import IncrementalText, StopText


class Counting:
    """A tokenizer wrapper that counts decode calls and the ids they decode."""

    def __init__(self, tok):
        self.tok, self.calls, self.ids = tok, 0, 0

    def decode(self, ids, skip_special_tokens=True):
        self.calls += 1
        self.ids += len(ids)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def brute_force_keep(tok, ids, stops):
    """The old rule: the shortest prefix whose full decode contains a stop string."""
    for m in range(1, len(ids) + 1):
        if any(s in tok.decode(ids[:m], skip_special_tokens=True) for s in stops):
            return m
    return None


def test_cost_per_token_does_not_grow_with_the_output(tok):
    ids = tok("abcdefghij " * 80, add_special_tokens=False).input_ids  # 880 tokens
    counting = Counting(tok)
    text = StopText(counting, ["NEVER", "xyz"])
    for n in range(1, len(ids) + 1):  # one cycle per token, as the engine calls it
        assert text.stop_check(ids[:n]) is None
        text.visible(ids[:n], final=False)
    assert counting.calls == 2 * len(ids)  # two small decodes per token, never the whole output
    assert counting.ids <= 4 * len(ids)
    assert text.visible(ids, final=True) == tok.decode(ids, skip_special_tokens=True)


def test_stop_cut_equals_decoding_everything(tok):
    ids = tok("the quick brown fox jumps over the lazy dog", add_special_tokens=False).input_ids
    for stops in (["fox"], ["zzz", "n f"], ["lazy dog"], ["the"], ["o"]):
        text = StopText(tok, stops)
        keep = None
        for n in range(1, len(ids) + 1):
            keep = text.stop_check(ids[:n])
            if keep is not None:
                break
        assert keep == brute_force_keep(tok, ids, stops), stops
        full = tok.decode(ids[:keep], skip_special_tokens=True)
        assert text.visible(ids[:keep], final=True) == full[: min(full.find(s) for s in stops if s in full)]


def test_held_back_text_and_a_budget_cut(tok):
    ids = tok("hello wor", add_special_tokens=False).input_ids
    text = StopText(tok, ["world"])
    assert text.stop_check(ids) is None
    assert text.visible(ids, final=False) == "hello "  # "wor" could be the start of "world"
    assert text.visible(ids, final=True) == "hello wor"
    assert text.visible(ids[:3], final=True) == "hel"  # tokens seen by stop_check were cut by the token budget


@pytest.mark.real
def test_real_tokenizer_multibyte_and_spaces():
    """SmolLM2's byte-level BPE: characters split across tokens (emoji, accents) and leading spaces decode exactly."""
    _, tok = models.load("default")
    sample = "Caf\u00e9 cr\u00e8me \U0001F600 costs 3\u20ac \u2014 na\u00efve r\u00e9sum\u00e9s!\n\tdef f(x): return x**2  # \u00df"
    ids = tok(sample, add_special_tokens=False).input_ids
    inc = IncrementalText(lambda w: tok.decode(w, skip_special_tokens=True))
    for k, t in enumerate(ids):
        inc.push(t)
        assert tok.decode(ids[: k + 1], skip_special_tokens=True).startswith(inc.text)
    assert inc.text + inc.pending() == tok.decode(ids, skip_special_tokens=True)
    for stops in (["\U0001F600"], ["na\u00ef"], [" return"], ["\u00df"]):
        text = StopText(tok, stops)
        keep = next(k for k in range(1, len(ids) + 1) if text.stop_check(ids[:k]) is not None)
        assert keep == brute_force_keep(tok, ids, stops), stops


@pytest.mark.real
def test_runtime_tokenizer_copies_after_its_chat_template_was_used():
    """A second decoder on the same tokenizer (bench and tune build one per draft) deep-copies it after chat prompts
    were rendered: the compiled template is not copied but rebuilt, and the copy renders the same text."""
    import copy
    from specdec import SpecDecoder
    model, tok = models.load("default")
    messages = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert copy.deepcopy(tok).apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == text
    sd = SpecDecoder.from_models(model, tok, "ngram", tau=2)
    assert sd.generate("hi", max_new_tokens=3).token_ids


@pytest.mark.real
def test_runtime_tokenizer_lookups_build_no_vocabulary_dict_and_agree_with_it():
    """eos_ids and the longest-token bound read the runtime tokenizer token by token (a 152k vocabulary's dict is
    about 40 MB the allocator keeps): the same answers as from get_vocab(), and get_vocab is never called."""
    from unittest import mock

    from specdec.api import longest_token_chars
    from specdec.runtime.tokenizer import Tokenizer
    model, tok = models.load("default")
    assert isinstance(tok, Tokenizer)
    vocab = tok.get_vocab()
    want_eos = {i for i in [tok.eos_token_id, *[vocab[t] for t in models.END_TOKENS if t in vocab]] if i is not None}
    with mock.patch.object(Tokenizer, "get_vocab", side_effect=AssertionError("built the vocabulary dict")):
        assert longest_token_chars(tok) >= max(map(len, vocab))  # a bound: the longest token, or its decoded text
        assert want_eos <= models.eos_ids(model, tok)
        assert tok.token_to_id("<|no such token|>") is None


@pytest.mark.real
def test_the_longest_token_bound_is_remembered_by_the_tokenizer_files_identity(tmp_path, monkeypatch):
    """Measuring it walks the whole vocabulary (0.15 s for 152k tokens at every start); a later start reads it back,
    and a changed tokenizer.json is measured again."""
    import shutil

    from specdec.runtime.tokenizer import Tokenizer
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    tok = models.load("default")[1]
    copy = tmp_path / "tok"
    shutil.copytree(tok.path, copy)
    first = Tokenizer(copy).longest_token_chars()
    walked = []
    real = Tokenizer.__len__
    monkeypatch.setattr(Tokenizer, "__len__", lambda self: walked.append(1) or real(self))
    assert Tokenizer(copy).longest_token_chars() == first and not walked  # read back: no walk
    (copy / "tokenizer.json").write_text((copy / "tokenizer.json").read_text() + " ")  # another identity
    assert Tokenizer(copy).longest_token_chars() == first and walked


# ---- llama-server's editor stops: n_indent (min_indent) and t_max_predict_ms (time_limit_s) ----------------------
class Chars:
    """Each token one character (ids index into the text's alphabet): cuts land on exact characters."""
    ALPHABET = "\n \tab(){}:x=1"

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.ALPHABET[i] for i in ids)

    def ids(self, text):
        return [self.ALPHABET.index(c) for c in text]


def short_line_cut(text: str, least: int) -> str:
    """The rule, written plainly: the text before the first line after the first whose indentation (spaces and tabs)
    is shorter than `least` and which has anything else on it; that line's newline is kept."""
    lines = text.split("\n")
    for k in range(1, len(lines)):
        body = lines[k].lstrip(" \t")
        if body and len(lines[k]) - len(body) < least:
            return "\n".join(lines[:k]) + "\n"
    return text


@settings(max_examples=400, deadline=None)
@given(text=st.text(alphabet="\n \tab:", max_size=40), least=st.integers(1, 4))
def test_a_short_line_ends_the_text_however_it_streams(text, least):
    """Streamed one token at a time, the visible text only grows, never shows what is cut, and ends as the plain
    rule says; the tokens kept are the fewest whose text reaches the short line's first character."""
    tok = Chars()
    ids, stop, seen = tok.ids(text), StopText(Chars(), [], min_indent=least), ""
    kept = None
    for n in range(1, len(ids) + 1):
        kept = stop.stop_check(ids[:n])
        shown = stop.visible(ids[:n], final=False)
        assert shown.startswith(seen)
        seen = shown
        if kept is not None:
            break
    final = stop.visible(ids[:kept] if kept else ids, final=True)
    want = short_line_cut(text, least)
    assert final == want and seen == final[:len(seen)]
    assert (kept is None) == (want == text)
    if kept is not None:  # the fewest tokens: up to the short line's first character
        assert short_line_cut(text[:kept - 1], least) == text[:kept - 1] and short_line_cut(text[:kept], least) == want


def test_past_the_time_limit_the_text_ends_at_a_line_end():
    tok = Chars()
    now = [0.0]
    stop = StopText(Chars(), [], time_limit_s=0.5, clock=lambda: now[0])
    ids = tok.ids("a(1)\nb(x)\nab")
    assert stop.stop_check(ids[:3]) is None  # the first call starts the clock
    now[0] = 0.4
    assert stop.stop_check(ids[:8]) is None  # within the limit
    now[0] = 0.6
    assert stop.stop_check(ids[:12]) == 10 and stop.visible(ids[:12], final=True) == "a(1)\nb(x)\n"
    later = StopText(Chars(), [], time_limit_s=0.5, clock=lambda: now[0])
    now[0] = 0.0
    ids = tok.ids("ab(x)=1\nxx")
    assert later.stop_check(ids[:2]) is None
    now[0] = 1.0
    assert later.stop_check(ids[:4]) is None  # overdue, but no line has ended: the next newline ends it
    assert later.stop_check(ids[:10]) == 8 and later.visible(ids[:10], final=True) == "ab(x)=1\n"
