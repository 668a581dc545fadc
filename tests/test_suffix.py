"""The suffix drafter (drafters/suffix.py): the longest earlier match against a brute force over random contexts
(hypothesis), long drafts while the output copies its prompt, earlier requests' outputs drawn on (a bounded store),
and speculation with it equal to target-only: greedy token for token, seeded sampling text for text, alone and in
the batch engine."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import SpecDecoder, models
from specdec.batch import BatchEngine, Sequence
from specdec.drafters.suffix import (
    MIN_MATCH,
    OutputStore,
    SuffixDrafter,
    continuation_tree,
    load_stores,
    longest_match,
    matches,
)
from specdec.drafters.tenants import PerTenant
from specdec.sampling import SamplingParams


def brute(context: list[int], tail_len: int) -> int:
    """The length of the longest suffix (>= MIN_MATCH, <= tail_len) with an earlier occurrence followed by a token."""
    best = 0
    L = len(context)
    for n in range(MIN_MATCH, min(tail_len, L - 1) + 1):
        suffix = context[L - n:]
        if any(context[i:i + n] == suffix for i in range(0, L - n)):
            best = n
    return best


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=0, max_size=40), st.integers(2, 12))
def test_longest_match_is_the_longest_earlier_occurrence_and_matches_are_all_of_them(context, tail_len):
    a = np.asarray(context, np.int64)
    n, start = longest_match(a, a[-tail_len:], len(a))
    assert n == brute(context, tail_len)
    if n:  # what follows is what followed that occurrence, the latest one
        assert context[start - n:start] == context[-n:] and start < len(context)
        assert not any(context[i:i + n] == context[-n:] for i in range(start - n + 1, len(context) - n))
    m, starts = matches(a, a[-tail_len:], len(a))  # every occurrence, for trees
    assert m == n and starts.tolist() == [i + n for i in range(len(context) - n) if context[i:i + n] == context[-n:]]


def test_continuation_tree_weighs_each_branch_by_how_often_it_followed():
    """Three earlier occurrences of a match went on as 5 6 7, 5 6 8 and 9: one tree, each node worth p per level
    times the share of its parent's occurrences that took it, best first with parents before children."""
    p = 0.9
    source = np.asarray([1, 2, 5, 6, 7, 0, 1, 2, 5, 6, 8, 0, 1, 2, 9, -1], np.int64)
    tree = continuation_tree(source, np.asarray([2, 8, 14]), 3, p, 32)
    nodes = {(tree.parents[i], t): (i, v) for i, (t, v) in enumerate(zip(tree.tokens, tree.values))}
    five, v5 = nodes[(-1, 5)]
    six, v6 = nodes[(five, 6)]
    assert v5 == pytest.approx(p * 2 / 3) and nodes[(-1, 9)][1] == pytest.approx(p / 3)
    assert v6 == pytest.approx(p * p * 2 / 3)
    assert nodes[(six, 7)][1] == pytest.approx(p ** 3 / 3) == nodes[(six, 8)][1]
    assert len(tree.tokens) == 5 and tree.values == sorted(tree.values, reverse=True)
    assert all(up < i for i, up in enumerate(tree.parents))
    assert tree.tokens[0] == 5  # the likeliest continuation first
    small = continuation_tree(source, np.asarray([2, 8, 14]), 3, p, 2)  # cut to 2 nodes: still a tree of ancestors
    assert small.tokens == [5, 6] and small.parents == [-1, 0]


def test_a_greedy_request_drafts_every_continuation_its_match_had_as_a_tree():
    """The latest occurrence of `0 1 2` went on with 9, two earlier ones with 5 6: greedy requests get one tree with
    both (5 first: it followed twice); sampled requests a chain, the latest continuation."""
    context = [0, 1, 2, 5, 6, 0, 1, 2, 5, 6, 0, 1, 2, 9, 0, 1, 2]
    tree = SuffixDrafter().propose(context, 8, SamplingParams(), None)
    assert tree.is_tree and tree.tokens[0] == 5 and 9 in tree.tokens
    chain = SuffixDrafter().propose(context, 8, SamplingParams(0.8, 1.0, 0, 1), None)
    assert not chain.is_tree and chain.tokens[0] == 9


def test_an_output_copying_its_prompt_gets_long_drafts():
    code = list(range(100, 160))  # a function the request asks to edit: its output repeats most of it
    prompt = [1, 2] + code + [3]
    d = SuffixDrafter()
    out = code[:5]
    draft = d.propose(prompt + out, 32, None, None)
    assert draft.tokens == code[5:5 + len(draft.tokens)] and len(draft.tokens) >= 8
    assert d.propose([7, 8, 9], 32, None, None).tokens == []  # nothing matches: nothing proposed


def test_earlier_outputs_are_drawn_on_and_the_store_is_bounded():
    store = OutputStore(limit=100)
    first = SuffixDrafter(PerTenant(OutputStore, {"": store}))
    first.propose([1, 2, 3], 8, None, None)
    first._context = [1, 2, 3] + list(range(200, 240))  # what the request generated
    first.close()  # its output joins the store
    later = first.fork()  # another request: three tokens match, so up to MATCH_FACTOR x 3 are drafted
    assert later.propose([9, 9, 200, 201, 202], 8, None, None).tokens == list(range(203, 209))
    for i in range(5):  # older outputs leave, least recently used first
        store.add(list(range(1000 * (i + 1), 1000 * (i + 1) + 40)))
    assert store.tokens <= 100 and tuple(range(200, 240)) not in store.outputs


@pytest.fixture(scope="module")
def rt(tiny_dirs):
    model, tok = models.load(tiny_dirs["target"], backend="runtime")
    sd = SpecDecoder.from_models(model, tok, draft="suffix")
    sd.engine.eos_ids = set()  # long outputs: the tiny model repeats itself, which the drafter copies
    sd.engine.costs = CheapRows()  # drafts sized by a fixed curve: a busy machine's measured one varies run to run
    return sd


class CheapRows:
    """A pass curve where each added row costs 5% of a one-row pass (the 1.5B's rows 2-4 cost 5-14%)."""

    def __call__(self, rows: int) -> float:
        return 1.0 + 0.05 * (rows - 1)

    def observe(self, rows: int, ms: float) -> None:
        pass


PROMPT = "The cat sat on the mat. The cat sat on the mat. The cat"


def test_speculation_with_suffix_equals_target_only_and_repeats_draw_on_earlier_outputs(rt):
    """Alone (Engine): greedy and seeded outputs equal target-only's; asked again, a request finds its earlier
    output in the store and drafts it deep (far fewer passes), still equal."""
    plain = SpecDecoder.from_models(rt.model, rt.tokenizer, draft="none")
    plain.engine.eos_ids = set()
    for kw in (dict(), dict(temperature=0.8, seed=5)):
        want = plain.generate(PROMPT, max_new_tokens=60, chat=False, **kw)
        first = rt.generate(PROMPT, max_new_tokens=60, chat=False, **kw)
        again = rt.generate(PROMPT, max_new_tokens=60, chat=False, **kw)
        assert first.token_ids == want.token_ids == again.token_ids, kw
    assert again.stats["target_passes"] <= len(again.token_ids) // 3  # the earlier output, drafted and accepted
    assert max(len(r.proposed) for r in again.records) > 8  # deeper than any fixed τ


def test_greedy_suffix_trees_are_verified_and_lossless(rt):
    """Earlier outputs went on three ways after the context's last tokens: the first proposal is one tree of them,
    verified as one, and the output equals target-only's, alone and in the batch engine."""
    plain = SpecDecoder.from_models(rt.model, rt.tokenizer, draft="none")
    plain.engine.eos_ids = set()
    want = plain.generate(PROMPT, max_new_tokens=40, chat=False).token_ids
    ids = rt.tokenizer(PROMPT, add_special_tokens=False).input_ids
    store = OutputStore()
    z = (want[1] + 1) % rt.model.config.vocab_size  # a wrong continuation
    for out in ([*ids[-2:], *want[:6]], [*ids[-2:], want[0], z, z], [*ids[-2:], *want[:2], z]):
        store.add(list(out))
    sd = SpecDecoder.from_models(rt.model, rt.tokenizer, draft=SuffixDrafter(PerTenant(OutputStore, {"": store})))
    sd.engine.eos_ids, sd.engine.costs = set(), CheapRows()
    out = sd.generate(PROMPT, max_new_tokens=40, chat=False)
    assert out.token_ids == want
    tree = out.records[1]  # (cycle 0 is the prefill's)
    assert tree.parents is not None and len(set(tree.parents)) < len(tree.parents) and tree.accepted >= 2
    engine = BatchEngine(rt.model, SuffixDrafter(PerTenant(OutputStore, {"": store})), rt.model.config.vocab_size, set(), 256, max_batch_rows=24)
    seq = engine.add(Sequence(ids, 40, SamplingParams()))
    trees = 0
    while engine.running:
        trees += sum(rec.parents is not None for _, rec in engine.step())
    assert seq.generated == want and trees and not engine.failed
    engine.close()


def test_batched_requests_with_suffix_equal_each_alone(rt):
    """The batch engine: every request equals target-only; repeats of an earlier request (greedy, and seeded with
    the same seed) draft its output from the store and have most of it accepted."""
    plain = SpecDecoder.from_models(rt.model, rt.tokenizer, draft="none")
    plain.engine.eos_ids = set()
    template = SuffixDrafter()
    params = [SamplingParams(), SamplingParams(0.8, 1.0, 0, 9), SamplingParams(0.8, 1.0, 0, 10)]
    ids = rt.tokenizer(PROMPT, add_special_tokens=False).input_ids
    for round_ in range(2):  # the first round fills the store, the second repeats it
        engine = BatchEngine(rt.model, template, rt.model.config.vocab_size, set(), 256, max_batch_rows=24)
        seqs = [engine.add(Sequence(ids, 40, q)) for q in params]
        accepted = 0
        while engine.running:
            accepted += sum(rec.accepted for _, rec in engine.step())
            assert not engine.failed
        for s, q in zip(seqs, params):
            want = plain.generate(PROMPT, max_new_tokens=40, chat=False, temperature=q.temperature, seed=q.seed)
            assert s.generated == want.token_ids, (round_, q)
        engine.close()
    assert accepted >= 60  # of the second round's 120 tokens


def test_suffix_file_keeps_the_outputs_between_runs_and_refuses_a_bad_file_in_one_line(rt, tmp_path):
    """`suffix:FILE`: what earlier runs generated is drafted from after a restart (the shutdown save writes it); a
    file made for another target, or one that is not a store, is an empty store and one stderr line, never a crash."""
    from specdec.api import build_drafter
    from specdec.drafters.base import save
    f = tmp_path / "store.npz"
    first = build_drafter(f"suffix:{f}", rt.model, rt.tokenizer)
    first.propose([5, 6, 7], 4, None, None)
    first._context = [5, 6, 7] + list(range(40, 70))
    save(first)  # what the server does at shutdown
    again = build_drafter(f"suffix:{f}", rt.model, rt.tokenizer)
    assert again.propose([9, 40, 41, 42], 4, None, None).tokens == list(range(43, 47))
    said = []
    meta = {"fingerprint": "another", "vocab": rt.model.config.vocab_size}
    assert not load_stores(f, meta, rt.model.config.vocab_size, log=said.append).default.outputs
    f.write_bytes(b"\x00not a store" * 5)
    assert not load_stores(f, again.meta, rt.model.config.vocab_size, log=said.append).default.outputs
    assert len(said) == 2 and "another target" in said[0] and "unreadable" in said[1]
    assert all("\n" not in s for s in said)
    from specdec.errors import InvalidRequest
    for bad in ("suffix:", f"suffix:{tmp_path}"):  # no file name, or a directory
        with pytest.raises(InvalidRequest, match="needs a file name"):
            build_drafter(bad, rt.model, rt.tokenizer)
