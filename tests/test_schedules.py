"""Random schedules against the batch engine under a KV pool of one context (hypothesis): arrivals at random steps,
prompts sharing prefixes, choices of one prompt (twins), cancellations, and the preemptions and evictions a small
pool forces. Every finished request equals the request served alone, every running request holds what its state
says (a twin waiting or a preempted request nothing, the others blocks for their tokens), and at the end the pool
balances: no block held, every block free or cached. Requests may carry a prediction (their own output, or another
prompt's), drafted from their prompt's last chunk on. With a drafter that reads the target's hidden states (whose
cached prefixes carry them), each finished request's drafter holds exactly the hidden states of its tokens.
Requests may carry presence and frequency penalties, or a repetition penalty over a window of the last tokens (each
choice its own state), verified row by row."""
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec import SpecDecoder, models
from specdec.batch import BatchEngine, Sequence
from specdec.batch.requests import State
from specdec.drafters import ChainDrafter, NgramDrafter
from specdec.penalties import penalties
from specdec.sampling import SamplingParams

BASE = "The cat sat on the mat and looked at the door. "
PROMPTS = [BASE * 2 + "Then it slept.", BASE * 2 + "Then it ran.", BASE + "A dog came.", "Short one."]


@pytest.fixture(scope="module")
def rt(tiny_dirs):
    model, tok = models.load(tiny_dirs["target"], backend="runtime")
    model.set_kv_memory(model.kv_bytes_per_position * model.max_len)  # one whole context: pressure at once
    yield model, tok
    model.set_kv_memory(None)


_ALONE: dict = {}


# OpenAI's counted penalties, or a repetition penalty over llama.cpp's window of the last tokens
PENALTIES = {"counts": dict(presence_penalty=0.3, frequency_penalty=0.7),
             "window": dict(repetition_penalty=1.3, repetition_window=4)}


def alone(rt, prompt: str, params: SamplingParams, n: int, penalized: str | None = None) -> list[int]:
    key = (prompt, params.temperature, params.seed, n, penalized)
    if key not in _ALONE:
        model, tok = rt
        sd = SpecDecoder.from_models(model, tok, draft="none")
        _ALONE[key] = sd.generate(prompt, max_new_tokens=n, chat=False, temperature=params.temperature,
                                  seed=params.seed, **PENALTIES.get(penalized, {})).token_ids
    return _ALONE[key]


request = st.tuples(st.integers(0, 6),  # arrival step
                    st.integers(0, len(PROMPTS) - 1),  # prompt
                    st.integers(1, 3),  # choices (twins)
                    st.sampled_from([None, 3, 11]),  # greedy, or a seed
                    st.integers(2, 10),  # max new tokens
                    st.one_of(st.none(), st.integers(1, 8)),  # cancelled after this many steps, or never
                    st.sampled_from([None, "own", "other"]),  # a prediction: none, its own output, another's
                    st.sampled_from([None, "counts", "window"]))  # penalties (PENALTIES)


def feature_chain(model):
    """ngram + a random feature draft that always proposes (it reads the target's hidden states)."""
    from specdec.drafters.feature import FeatureDrafter
    from specdec.drafters.feature_net import FeatureDraftNet
    torch.manual_seed(0)
    c = model.config
    net = FeatureDraftNet(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, 32, 10000.0, 1e-5)
    return ChainDrafter([NgramDrafter(), FeatureDrafter(net, model.embed, model.head, torch.arange(c.vocab_size),
                                                        c.vocab_size, min_confidence=0.0, max_len=256)])


def hidden_alone(model, tokens: list[int]) -> torch.Tensor:
    """The target's final hidden states of `tokens` computed in a slot of their own."""
    slot = model.acquire_slot()
    try:
        model.reserve(slot, len(tokens))
        return model.forward(tokens, [slot] * len(tokens), list(range(len(tokens))), [], hidden=True)[1]
    finally:
        model.truncate(slot, 0)
        model.release_slot(slot)


@pytest.mark.parametrize("features", [False, True])
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(schedule=st.lists(request, min_size=1, max_size=6))
def test_random_schedules_equal_each_request_alone_and_the_pool_balances(rt, features, schedule):
    model, tok = rt
    eos = SpecDecoder.from_models(model, tok, draft="none").engine.eos_ids
    engine = BatchEngine(model, feature_chain(model) if features else NgramDrafter(), model.config.vocab_size, eos,
                         256, max_batch_rows=12, prefill_chunk=8)
    model.pool.clear_hashes()
    waiting, kinds = [], {}  # (arrival, sequence, cancel after, prompt); each sequence's penalties
    for arrival, p, n, seed, new, cancel, predicted, penalized in schedule:
        params = SamplingParams() if seed is None else SamplingParams(0.9, 1.0, 0, seed)
        ids = tok(PROMPTS[p]).input_ids
        for c in range(n):  # n choices of one prompt: one seed each, as the server gives them
            choice = params if seed is None else SamplingParams(0.9, 1.0, 0, seed + c)
            pred = None if predicted is None else alone(rt, PROMPTS[p if predicted == "own" else p - 1], choice, 12)
            kw = PENALTIES.get(penalized, {})
            adjust = None if penalized is None else penalties(
                None, kw.get("presence_penalty", 0.0), kw.get("frequency_penalty", 0.0), None,
                kw.get("repetition_penalty", 1.0), ids, kw.get("repetition_window"))
            if adjust is not None:
                choice = replace(choice, penalties=adjust)
            seq = Sequence(ids, new, choice, constraint=adjust, prediction=pred)
            kinds[id(seq)] = penalized
            waiting.append((arrival, seq, cancel, PROMPTS[p]))
    started, done, cancelled, held_features = {}, [], set(), []
    step = 0
    while waiting or engine.running:
        for item in [w for w in waiting if w[0] <= step]:  # in order, while the pool and the rows allow
            _, seq, cancel, prompt = item
            if len(engine.running) >= engine.max_batch_rows or not engine.can_start(seq.prompt):
                break
            engine.add(seq)
            waiting.remove(item)
            started[seq.id] = (step, cancel, prompt)
        for s in list(engine.running):  # cancellations (a client hanging up)
            at, cancel, _ = started[s.id]
            if cancel is not None and step - at >= cancel:
                engine.remove(s)
                cancelled.add(s.id)
        before = {s.id: s for s in engine.running}
        drafters = {s.id: engine._state[s.id][1] for s in engine.running}
        engine.step()
        assert not engine.failed
        for s in engine.running:  # what each state holds (requests.py's life cycle)
            held = len(model.blocks_of(engine._state[s.id][0]))
            if s.state in (State.WAITING_FOR_TWIN, State.PREEMPTED):
                assert held == 0, (s.state, held)
            else:
                assert s.state in (State.PREFILLING, State.DECODING) and held * 16 >= len(s.tokens) - 1
        left = [s for i, s in before.items() if s not in engine.running and i not in cancelled]
        done += left
        held_features += [(s, drafters[s.id].members[1].feats.clone()) for s in left if features]
        step += 1
        assert step < 500, "the schedule never finished"
    for s in done:
        want = alone(rt, started[s.id][2], s.params, s.max_new_tokens, kinds[id(s)])
        assert s.generated == want, (s.id, started[s.id])
    pool = model.pool
    assert all(r == 0 for r in pool.refs)  # nothing held once every request left
    assert len(pool.free) + len(pool.evictable) == pool.blocks
    engine.close()
    for s, feats in held_features:  # all but the newest token's: computed, restored or both, the same bits
        assert len(feats) >= len(s.tokens) - 1 and torch.equal(feats, hidden_alone(model, s.tokens[: len(feats)]))
