"""Token trees: a tree pass gives every node bitwise the logits of a one-token decode of its path (both numerics, the
torch fallback, beside chains of other slots); the accepted path is compacted into place; greedy trees are
token-identical and sampled trees exact in distribution; the recycle drafter learns, persists and recovers."""
import pytest
import torch

from specdec import SpecDecoder, kernels
from specdec.costs import PassCosts, best_tree_size
from specdec.drafters.base import Draft
from specdec.drafters import recycle
from specdec.drafters.recycle import RecycleDrafter, RecycleTable
from specdec.drafters.tree import best_first, depths, merge, path, prune
from specdec.runtime.load import load_gguf
from specdec.sampling import PositionNoise, SamplingParams, warp
from specdec.verification import verify_tree
from test_runtime import PROMPT, gguf_pair  # noqa: F401 - the tiny quantized GGUF (a fixture)
from test_verification import chi2_pvalue

# duplicate tokens in siblings (10 under the root twice? no: merged by drafters; here 10 appears at several depths and
# as a child of different parents), depth 5 > width 3
TREE = [10, 11, 10, 12, 13, 14, 10, 15, 10, 16]
PARENTS = [-1, -1, 0, 0, 2, 2, 4, 1, 6, 8]


@pytest.fixture(scope="module", params=["exact", "q8", "torch"])
def rt(request, gguf_pair):  # noqa: F811
    if request.param == "torch":  # the model keeps the library it was built with: None here
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SPECDEC_CPU_KERNEL", "0")
            kernels.library.cache_clear()
            model = load_gguf(gguf_pair[0])
        kernels.library.cache_clear()
        assert model._lib is None
        return model
    if not kernels.available():
        pytest.skip("no CPU kernels")
    model = load_gguf(gguf_pair[0])
    model.set_numerics(request.param)
    return model


def decode_path(model, tokens: list[int]) -> torch.Tensor:
    """Logits after `tokens` by one-token steps in a fresh slot (the reference every tree row must equal)."""
    c = model.new_cache()
    out = None
    for i in range(1, len(tokens) + 1):
        out = c.forward(tokens[:i], 1)
    c.close()
    return out[0]


@pytest.mark.parametrize("extra", [0, 9, 27])  # the tree's keys inside a block, across 16- and 32-key blocks
def test_tree_node_logits_equal_one_token_decodes_of_their_paths(rt, extra):
    prompt = PROMPT + [(5 * i) % 90 + 3 for i in range(extra)]
    c = rt.new_cache()
    out = c.forward_tree(prompt, TREE, PARENTS)
    assert torch.equal(out[0], decode_path(rt, prompt))
    for i in range(len(TREE)):
        assert torch.equal(out[1 + i], decode_path(rt, prompt + [TREE[j] for j in path(PARENTS, i)])), i
    c.close()


def test_a_tree_beside_chains_of_other_slots_in_one_pass(rt):
    """Rows of a plain slot (a chain) and a tree slot in the same pass: each equals its own decode."""
    a, b = rt.acquire_slot(), rt.acquire_slot()
    chain = [7, 8, 9, 30]
    rt.forward(PROMPT[:-1], [a] * (len(PROMPT) - 1), list(range(len(PROMPT) - 1)))
    rt.forward(chain[:2], [b] * 2, [0, 1])
    base = len(PROMPT)
    paths = [None, None] + [[base + j for j in path(PARENTS, i)] for i in range(len(TREE))]
    positions = [2, 3] + [base - 1] + [base - 1 + d for d in depths(PARENTS)]
    paths = paths[:2] + [None] + paths[2:]
    out = rt.forward(chain[2:] + [PROMPT[-1]] + TREE, [b, b, a] + [a] * len(TREE), positions, paths=paths)
    assert torch.equal(out[1], decode_path(rt, chain))
    for i in range(len(TREE)):
        assert torch.equal(out[3 + i], decode_path(rt, PROMPT + [TREE[j] for j in path(PARENTS, i)]))
    rt.release_slot(a), rt.release_slot(b)


@pytest.mark.parametrize("leaf", [None, 0, 2, 4, 6, 8, 9, 7])  # acceptance at every depth, both branches
def test_compaction_leaves_the_slot_a_decode_of_the_path_would(rt, leaf):
    nodes = [] if leaf is None else path(PARENTS, leaf)
    seq = PROMPT + [TREE[i] for i in nodes]
    c = rt.new_cache()
    c.forward_tree(PROMPT, TREE, PARENTS)
    c.keep_path(nodes)
    assert c.tokens == seq
    ref = rt.new_cache()
    ref.forward(seq)
    (k, v), (rk, rv) = rt.slot_kv(c.slot, len(seq)), rt.slot_kv(ref.slot, len(seq))
    assert torch.equal(k, rk) and torch.equal(v, rv)
    nxt = seq + [42]
    assert torch.equal(c.forward(nxt, 1), ref.forward(nxt, 1))  # and decoding goes on from there
    c.close(), ref.close()


# ---- verification and sizing (pure functions) ---------------------------------------------------------------------
def test_verify_tree_follows_the_targets_choices():
    V = 20
    logits = torch.full((1 + len(TREE), V), -5.0)
    want = {0: 10, 1: 10, 3: 13, 5: 10, 7: 3}  # rows: root -> node 0 -> node 2 -> node 4 -> node 6 -> bonus 3
    for row, t in want.items():
        logits[row, t] = 5.0
    nodes, token = verify_tree(TREE, PARENTS, logits, SamplingParams(), None, 50)
    assert nodes == [0, 2, 4, 6] and token == 3
    logits[0] = -5.0
    logits[0, 11] = 5.0  # the root's choice is the second child, whose child 15 is not the target's (argmax 0)
    assert verify_tree(TREE, PARENTS, logits, SamplingParams(), None, 50) == ([1], 0)


def test_verify_tree_races_on_each_nodes_own_position():
    """Seeded sampling: the token accepted at a node is the race winner at position + depth, whatever the row."""
    V, noise, sp = 6, PositionNoise(7), SamplingParams(temperature=1.0)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, V, generator=g)
    p = warp(logits, sp)
    w0, w1 = noise.pick(p[:1], [40])[0], noise.pick(p[1:2], [41])[0]
    nodes, token = verify_tree([w0, (w0 + 1) % V], [-1, -1], logits, sp, noise, 40)
    assert nodes == [0] and token == w1


def test_best_tree_size_trades_tokens_for_rows():
    flat = lambda rows: 1.0  # noqa: E731 - rows cost nothing: every node with any value pays
    steep = lambda rows: 1.0 + 0.35 * (rows - 1)  # noqa: E731
    values = [0.9, 0.6, 0.3, 0.2, 0.05]
    assert best_tree_size(values, flat) == 5
    # steep: a node pays while its value beats the rate's marginal cost (0.9, 0.6 yes; 0.3 < 0.35 * rate no)
    assert best_tree_size(values, steep) == 2
    assert best_tree_size([0.1], steep) == 0
    costs = PassCosts()
    assert costs(3) == pytest.approx(1.7)  # the prior before anything is measured
    for _ in range(3):
        costs.observe(1, 6.0), costs.observe(4, 9.0)
    assert costs(1) == 6.0 and costs(4) == 9.0 and costs(2) == pytest.approx(7.0)


def test_a_size_timed_in_a_busy_moment_is_priced_afresh_once_it_runs_again():
    costs = PassCosts()
    for _ in range(3):
        costs.observe(1, 6.0), costs.observe(2, 300.0)  # two-row passes timed while another process ran
    assert costs(2) == 300.0 and best_tree_size([0.9], costs) == 0
    costs.observe(2, 7.0), costs.observe(1, 900.0)  # one slow pass of a size does not move its price
    assert costs(1) == 6.0
    for _ in range(2):
        costs.observe(2, 7.0)
    assert costs(2) == 7.0 and best_tree_size([0.9], costs) == 1  # three fresh passes outvote the busy ones


class PricedOut(PassCosts):
    """A curve frozen where every draft row costs a hundred one-row passes (as if timed while the machine was busy)."""

    def __call__(self, rows):
        return 1.0 if rows == 1 else 100.0 * rows

    def observe(self, rows, ms):
        pass


def test_a_curve_that_prices_every_draft_out_is_still_probed(gguf_pair, tok):  # noqa: F811
    """Only passes that run are timed: a curve that cut every tree to nothing would never see a multi-row pass
    again. One cycle in PROBE_EVERY verifies its best node anyway; the output stays the target's."""
    from specdec.engine import PROBE_EVERY
    sd, model = tree_spec(gguf_pair[0], tok, TopTree)
    sd.engine.costs = PricedOut()
    out = sd.generate("Hello there", max_new_tokens=40, chat=False)
    plain = SpecDecoder.from_models(load_gguf(gguf_pair[0]), tok, "none")
    assert out.token_ids == plain.generate("Hello there", max_new_tokens=40, chat=False).token_ids
    probed = [r.cycle for r in out.records if r.proposed]
    assert [len(out.records[c].proposed) for c in probed] == [1] * len(probed)  # its best node only
    assert len(probed) == (len(out.records) - 1) // PROBE_EVERY >= 1, probed
    assert all(out.records[c].accepted == 1 for c in probed)  # the target's own top choice


def test_tree_helpers():
    assert depths(PARENTS) == [1, 1, 2, 2, 3, 3, 4, 2, 5, 6]
    t = best_first(1, lambda tok, d: [(tok + 1, 0.9), (tok + 2, 0.5)], 5, 3)
    assert t.tokens == [2, 3, 4, 3, 4] and t.parents == [-1, 0, 1, -1, 0]  # 0.9, 0.81, 0.729, 0.5, 0.45
    assert t.values == sorted(t.values, reverse=True)
    assert prune(t, 2).tokens == [2, 3]
    m = merge(Draft([2, 3, 9]), t, 6)  # the chain first; the tree's nodes it lacks after
    assert m.tokens[:3] == [2, 3, 9] and m.parents[:3] == [-1, 0, 1] and len(m.tokens) == 6


# ---- the engine with trees ------------------------------------------------------------------------------------------
class TopTree:
    """Proposes the target's own top-3 at depth 1 and each one's top-3 at depth 2 (12 nodes): every outcome of
    top_k=3 sampling lies in the tree, so acceptance leans entirely on the rule."""
    name, free, makes_trees = "toptree", True, True

    def __init__(self, model):
        self.model = model

    def _top(self, tokens):
        c = self.model.new_cache()
        out = c.forward(tokens, 1)[0].topk(3).indices.tolist()
        c.close()
        return out

    def propose(self, context, k, params, generator):
        tokens, parents = [], []
        for a in self._top(context):
            tokens.append(a), parents.append(-1)
            at = len(tokens) - 1
            for b in self._top(context + [a]):
                tokens.append(b), parents.append(at)
        return Draft(tokens, parents=parents, values=[1.0] * len(tokens))

    def reset(self):
        pass


def exact_joint(model, ids, sp, n=3):
    joint = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for prefix, pr in joint.items():
            p = warp(decode_path(model, ids + list(prefix)), sp)
            for t in p.nonzero().flatten().tolist():
                nxt[prefix + (t,)] = pr * float(p[t])
        joint = nxt
    return joint


def sampled_joint(sd, prompt, sp, runs, seeded):
    counts = {}
    for i in range(runs):
        torch.manual_seed(i)
        out = sd.generate(prompt, max_new_tokens=3, chat=False, temperature=sp.temperature, top_k=sp.top_k,
                          seed=i if seeded else None)
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
    return counts


class FreeRows(PassCosts):
    """Rows cost nothing: the cost model verifies every node offered."""

    def __call__(self, rows):
        return 1.0


def tree_spec(gguf_path, tok, drafter):
    model = load_gguf(gguf_path)
    sd = SpecDecoder.from_models(model, tok, "none", tau=2)
    sd.engine.drafter = drafter(model)
    sd.engine.costs = FreeRows()
    return sd, model


def _planted(tokens, parents, logits, params, generator, position):
    """The planted bug: accept the first child the target could sample at all (p > 0), not the race winner."""
    p = warp(logits, params)
    accepted, node = [], -1
    while True:
        kids = [i for i, q in enumerate(parents) if q == node and p[node + 1, tokens[i]] > 0]
        if not kids:
            return accepted, verify_tree(tokens, parents, logits, params, generator, position)[1] if not accepted \
                else generator.pick(p[node + 1:node + 2], [position + len(accepted)])[0]
        accepted.append(kids[0])
        node = kids[0]


@pytest.mark.parametrize("seeded", [True, False])
def test_sampling_with_trees_matches_the_target_alone(gguf_pair, tok, seeded, monkeypatch):  # noqa: F811
    sd, model = tree_spec(gguf_pair[0], tok, TopTree)
    sp = SamplingParams(temperature=1.0, top_k=3)
    ids = tok("ab").input_ids
    joint = exact_joint(model, ids, sp)
    counts = sampled_joint(sd, "ab", sp, 600, seeded)
    keys = sorted(set(joint) | set(counts))
    vec = lambda d, default: torch.tensor([d.get(k, default) for k in keys], dtype=torch.float64)  # noqa: E731
    assert chi2_pvalue(vec(counts, 0), vec(joint, 0.0)) > 1e-3, counts
    if not seeded:
        return
    import specdec.engine
    monkeypatch.setattr(specdec.engine, "verify_tree", _planted)
    bad = sampled_joint(sd, "ab", sp, 600, seeded)
    assert chi2_pvalue(vec(bad, 0), vec(joint, 0.0)) < 1e-6  # the test catches a rule that skips the race


def test_seeded_tree_text_equals_target_only(gguf_pair, tok):  # noqa: F811
    sd, _ = tree_spec(gguf_pair[0], tok, TopTree)
    plain = SpecDecoder.from_models(load_gguf(gguf_pair[0]), tok, "none")
    accepted = 0
    for seed in range(4):
        kw = dict(max_new_tokens=24, chat=False, temperature=0.9, seed=seed)
        out = sd.generate("Hello there", **kw)
        assert out.token_ids == plain.generate("Hello there", **kw).token_ids
        accepted += sum(r.accepted for r in out.records if r.parents)
    assert accepted >= 4  # tree nodes were accepted, not only verified


def test_greedy_recycle_is_token_identical_and_learns(gguf_pair, tok, tmp_path):  # noqa: F811
    model = load_gguf(gguf_pair[0])
    plain = SpecDecoder.from_models(model, tok, "none")
    sd = SpecDecoder.from_models(model, tok, f"recycle:{tmp_path / 'table.safetensors'}", tau=4)
    sd.engine.costs = FreeRows()
    prompts = ["Hello there, general", "Once upon a time", "Hello there, general"]
    trees, accepted = 0, []
    for p in prompts:
        out = sd.generate(p, max_new_tokens=40, chat=False)
        assert out.token_ids == plain.generate(p, max_new_tokens=40, chat=False).token_ids
        trees += sum(bool(r.parents) for r in out.records)
        accepted.append(out.stats["accepted"])
    assert trees and accepted[2] > accepted[0]  # the repeated prompt: its successors are in the table now


# ---- recycle persistence --------------------------------------------------------------------------------------------
def test_recycle_table_round_trip_corrupt_and_foreign_files(tmp_path):
    f = tmp_path / "t.safetensors"
    t = RecycleTable(50, fingerprint="abc")
    t.update([3, 4], torch.randn(2, 50))
    t.offered[0, 2] += 5
    t.save(f)
    back = RecycleTable.load_or_new(f, 50, "abc")
    assert torch.equal(back.succ, t.succ) and torch.equal(back.prob, t.prob) and torch.equal(back.offered, t.offered)
    said = []
    other = RecycleTable.load_or_new(f, 50, "xyz", log=said.append)  # another target's vocabulary
    assert (other.succ < 0).all() and "another target" in said[-1]
    f.write_bytes(b"\x00garbage" * 10)
    fresh = RecycleTable.load_or_new(f, 50, "abc", log=said.append)
    assert (fresh.succ < 0).all() and "unreadable" in said[-1]
    RecycleTable.load_or_new(tmp_path / "none.safetensors", 50, "abc", log=said.append)  # absent: fresh, silent
    assert len(said) == 2


@pytest.mark.parametrize("spoil", ["nan", "negative", "dtype", "successor"])
def test_a_recycle_table_with_unusable_numbers_starts_fresh_in_one_line(tmp_path, spoil):
    """A table whose file is whole but whose numbers a proposal cannot use (NaN, negative counts, another dtype,
    successors past the vocabulary) is a fresh table and one line at load, not a failure of every request."""
    from safetensors.torch import save_file
    f = tmp_path / "t.safetensors"
    t = RecycleTable(50, fingerprint="abc")
    t.update([3, 4], torch.randn(2, 50))
    tensors = {"succ": t.succ, "prob": t.prob, "offered": t.offered, "accepted": t.accepted}
    if spoil == "nan":
        tensors["prob"] = tensors["prob"].clone().fill_(float("nan"))
    elif spoil == "negative":
        tensors["offered"] = -tensors["offered"]
    elif spoil == "dtype":
        tensors["succ"] = tensors["succ"].to(torch.float16)
    else:
        tensors["succ"] = tensors["succ"].clone().fill_(50)
    meta = {"format": str(recycle.FORMAT), "vocab": "50", "k": str(t.k), "fingerprint": "abc"}
    save_file(tensors, str(f), metadata=meta)
    said = []
    table = RecycleTable.load_or_new(f, 50, "abc", log=said.append)
    assert len(said) == 1 and "unreadable" in said[0] and "\n" not in said[0]
    assert (table.succ < 0).all() and torch.isfinite(table.prob).all()
    drafter = RecycleDrafter(table)
    drafter.propose([3, 4, 3], 3, SamplingParams(), torch.Generator())  # proposes (nothing yet), never raises


def test_saving_a_chain_persists_recycle_beside_a_datastore(tmp_path):
    """The server's shutdown save walks the chain: the datastore (which learns nothing) is passed over, the recycle
    table is written (a datastore's `save` is its builder, which once made every shutdown fail)."""
    from specdec.drafters.base import save
    from specdec.drafters.chain import ChainDrafter
    from specdec.drafters.datastore import DatastoreDrafter
    DatastoreDrafter.save([[1, 2, 3, 4]], tmp_path)
    table = tmp_path / "table.safetensors"
    chain = ChainDrafter([DatastoreDrafter.load(tmp_path, 50), RecycleDrafter(RecycleTable(50), table)])
    save(chain)
    assert table.exists()


def test_recycle_drafts_from_the_successors_it_saw():
    t = RecycleTable(30)
    logits = torch.full((2, 30), -9.0)
    logits[0, 7], logits[1, 8] = 9.0, 9.0  # after 5 comes 7, after 7 comes 8
    d = RecycleDrafter(t)
    d.observe_verify([1, 5], Draft([7]), logits, [0])
    draft = d.propose([1, 5], 3, SamplingParams(), None)
    assert draft.is_tree and draft.tokens[:2] == [7, 8] and draft.parents[:2] == [-1, 0]
    assert draft.values[0] > 0.7 and draft.values == sorted(draft.values, reverse=True)
    assert d.propose([1, 2], 3, SamplingParams(), None).tokens == []  # never saw 2


def test_server_keeps_the_recycle_table_between_runs(tiny_dirs, tmp_path):
    """`specdec serve` with recycle: trees verified in the batch over real HTTP, the table saved at shutdown and
    loaded at the next start."""
    from specdec import models
    from specdec.server import create_app
    from test_server import LiveServer, two_completions
    model, tok = models.load(tiny_dirs["target"], backend="runtime")
    table = tmp_path / "table.safetensors"
    sd = SpecDecoder.from_models(model, tok, f"recycle:{table}", tau=3)
    srv = LiveServer(create_app(sd, model_name="tiny"))
    try:
        two_completions(srv.url)
    finally:
        srv.stop()
    assert table.exists()
    again = SpecDecoder.from_models(model, tok, f"recycle:{table}", tau=3)
    assert torch.equal(again.engine.drafter.table.succ, sd.engine.drafter.table.succ)
    assert (again.engine.drafter.table.succ >= 0).any()


@pytest.mark.skipif(not kernels.available(), reason="no CPU kernels")
def test_topk_kernel_equals_torch_on_both_builds():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 1000 + 37, generator=g) * 4  # a tail past the 64-wide blocks
    logits[1, 500] = 80.0
    ref = logits.topk(8, -1)
    for isa in {kernels.library().isa, "avx2"}:
        lib = kernels.library(isa)
        idx, val, lse = torch.empty(5, 8, dtype=torch.int32), torch.empty(5, 8), torch.empty(5)
        lib.rows_topk(logits.data_ptr(), 5, logits.shape[1], 8, idx.data_ptr(), val.data_ptr(), lse.data_ptr(), 2)
        assert torch.equal(idx.long(), ref.indices) and torch.equal(val, ref.values)
        assert torch.allclose(lse, torch.logsumexp(logits, -1), rtol=1e-6)
    idx, prob = kernels.topk(logits, 8)
    assert torch.allclose(prob, torch.softmax(logits, -1).topk(8, -1).values, rtol=1e-5)


def test_trace_and_analyze_report_trees():
    """Tree records: acceptance by depth and by sibling rank, and the counterfactual of smaller trees, exact on a
    hand-made trace."""
    from specdec.analyze import analyze
    from specdec.trace import CycleRecord, tree_stats
    parents = [-1, -1, 0, 0, 2]  # ranks: 0, 1 | 0, 1 | 0
    recs = [CycleRecord(0, 3, [5, 6, 7, 8, 9], 0, [1], 1, 10, 11, parents=parents, path=[]),  # prefill cycle
            CycleRecord(1, 3, [5, 6, 7, 8, 9], 3, [5, 7, 9, 4], 0.1, 10.0, 10.2, parents=parents, path=[0, 2, 4]),
            CycleRecord(2, 3, [5, 6, 7, 8, 9], 1, [6, 4], 0.1, 10.0, 10.2, parents=parents, path=[1]),
            CycleRecord(3, 3, [5, 6, 7, 8, 9], 0, [4], 0.1, 10.0, 10.2, parents=parents, path=[])]
    t = tree_stats(recs[1:], {1: 5.0, 6: 10.0})
    assert t["tree_passes"] == 3 and t["nodes_per_pass"] == 5 and t["accepted_depth"] == round(4 / 3, 3)
    assert t["acceptance_by_depth"] == [round(2 / 3, 4), 0.5, 1.0]
    # rank 0: reached 3 (root) + 1 (under node 0) + 1 (under node 2) = 5, accepted 0, 2, 4 -> 3/5
    assert t["acceptance_by_rank"] == {"0": 0.6, "1": round(1 / 4, 4)}
    # cut to 1 node: tokens 2 + 1 + 1, time 3 passes of 2 rows (linear 5 -> 10 over 1..6 rows: 6 ms)
    assert t["speedup_with_nodes"]["1"] == round(4 * 5.0 / 18.0, 3)
    assert t["speedup_with_nodes"]["5"] == round(7 * 5.0 / 30.0, 3)
    rep = analyze(recs)
    assert rep["trees"]["tree_passes"] == 3 and rep["acceptance_by_position"][:2] == [round(2 / 3, 4), 0.5]


def test_datastore_branches_and_chains_merge_into_one_tree():
    """The datastore's runner-up continuation becomes a branch valued by its share of the matches; a chain with
    recycle merges the branches with recycle's tree, shared prefixes once."""
    from specdec.drafters.chain import ChainDrafter
    from specdec.drafters.datastore import DatastoreDrafter
    seqs = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7], [9, 2, 3, 4, 8, 8, 8], [0, 2, 3, 4, 5, 6, 9],
            [7, 2, 3, 4, 8, 1, 1]]
    store = DatastoreDrafter(torch.tensor([t for s in seqs for t in (*s, -1)]), 20)
    assert store.propose([2, 3, 4], 3, None, None).tokens == [5, 6, 7]
    t = store.propose_tree([2, 3, 4], 3, None, None)
    assert (t.tokens, t.parents) == ([5, 6, 8, 7], [-1, 0, -1, 1])
    assert t.values == pytest.approx([0.6, 0.6, 0.4, 0.4])  # 3 of 5 matches go on with 5, all 3 of those with 6, ...
    table = RecycleTable(20)
    logits = torch.full((2, 20), -9.0)
    logits[0, 5], logits[1, 11] = 9.0, 9.0  # recycle: after 4 comes 5, after 5 comes 11
    table.update([4, 5], logits)
    chain = ChainDrafter([store, RecycleDrafter(table)])
    m = chain.propose([2, 3, 4], 3, SamplingParams(), None)
    assert m.tokens[:4] == [5, 6, 8, 7] and 11 in m.tokens
    assert m.parents[m.tokens.index(11)] == 0  # under the shared first node 5, not a second copy of it


def test_ngram_branches_follow_every_earlier_occurrence():
    """`ngram` as a tree member: each distinct continuation of the matching n-gram is a branch, valued by the share
    of occurrences agreeing with it; its majority path is the chain propose() gives when the most recent agrees."""
    from specdec.drafters.ngram import NgramDrafter
    ctx = [1, 2, 3, 9, 1, 2, 3, 8, 8, 1, 2, 3, 9, 7, 5, 1, 2, 3]
    t = NgramDrafter().propose_tree(ctx, 3, None, None)
    assert (t.tokens, t.parents) == ([9, 8, 7, 8, 5, 1], [-1, -1, 0, 1, 2, 3])
    assert t.values == pytest.approx([2 / 3, 1 / 3, 1 / 3, 1 / 3, 1 / 3, 1 / 3])
    assert NgramDrafter().propose(ctx, 3, None, None).tokens == [9, 7, 5]
    assert NgramDrafter().propose_tree([1, 2, 3, 4], 3, None, None).tokens == []


def test_an_ngram_copy_reports_how_long_its_source_matched():
    """The copy's match runs back past the n-gram as far as the context agrees with its source (what the batch
    engine's copy estimates are bucketed by), up to MAX_MATCH."""
    from specdec.drafters.ngram import MAX_MATCH, NgramDrafter
    d = NgramDrafter()
    assert d.propose([5, 6, 7, 8, 1, 2, 3, 9, 9, 5, 6, 7, 8, 1, 2], 4, None, None).match == 6  # 5 6 7 8 1 2
    assert d.propose([1, 2, 3, 4, 7, 7, 1, 2], 4, None, None).match == 2  # only the bigram
    assert d.propose([0, 1, 2, 3, 0, 1, 2], 2, None, None).match == 3  # back to the context's start
    long = list(range(100))
    assert d.propose(long + [7] + long[:-1], 2, None, None).match == MAX_MATCH


@pytest.mark.parametrize("new", [[60], [60, 61]])
def test_an_ngram_copy_writes_a_rename_the_context_made_before_its_match(new, monkeypatch):
    """The context copies a source with one token renamed (50 written as `new`, the tokens before both agreeing):
    the copy writes `new` at the source's later occurrences; a context that differs from its source by more than a
    rename, or MAX_RENAMED = 0, copies the source as it is."""
    from specdec.drafters import ngram
    source = [1, 2, 50, 3, 4, 5, 6, 50, 7, 8, 50, 9]
    context = source + [0, 1, 2] + new + [3, 4, 5, 6]
    assert ngram.NgramDrafter().propose(context, 6, None, None).tokens == (new + [7, 8] + new + [9, 0])[:6]
    unrelated = source + [0, 11, 12] + new + [3, 4, 5, 6]  # no agreement before the differing span
    assert ngram.NgramDrafter().propose(unrelated, 6, None, None).tokens == [50, 7, 8, 50, 9, 0]
    monkeypatch.setattr(ngram, "MAX_RENAMED", 0)
    assert ngram.NgramDrafter().propose(context, 6, None, None).tokens == [50, 7, 8, 50, 9, 0]


def test_an_ngram_copy_follows_the_occurrence_whose_context_matches_longest(monkeypatch):
    """The trigram (8, 3, 4) occurs twice; the context before the earlier one goes on matching the context's own
    (1, 2, 9), before the latest not at all: the copy follows the earlier (suffix decoding's rule), the latest only
    on a tie or with LONGEST_OF = 1."""
    from specdec.drafters import ngram
    context = [1, 2, 9, 8, 3, 4, 5, 6, 0, 7, 8, 3, 4, 10, 11, 0, 1, 2, 9, 8, 3, 4]
    assert ngram.NgramDrafter().propose(context, 2, None, None).tokens == [5, 6]
    tie = [1, 3, 4, 5, 0, 2, 3, 4, 6, 0, 9, 3, 4]
    assert ngram.NgramDrafter().propose(tie, 1, None, None).tokens == [6]
    monkeypatch.setattr(ngram, "LONGEST_OF", 1)
    assert ngram.NgramDrafter().propose(context, 2, None, None).tokens == [10, 11]
