"""Acceptance rules on enumerable toy vocabularies: exact distributions, not just 'it runs'."""
import itertools

import pytest
import torch

from specdec.errors import InvalidRequest
from specdec.sampling import SamplingParams, warp
from specdec.verification import acceptance_prob, greedy_verify, residual, sample_verify


def rand_dist(v, g, sparse=False):
    x = torch.rand(v, generator=g, dtype=torch.float64) ** 3
    if sparse:
        x[torch.randperm(v, generator=g)[: v // 2]] = 0
    return x / x.sum()


def test_greedy_verify_accepts_longest_matching_prefix():
    logits = torch.full((4, 5), -1.0)
    for i, t in enumerate([3, 1, 4, 2]):
        logits[i, t] = 1.0
    assert greedy_verify(torch.tensor([3, 1, 4]), logits) == (3, 2)  # all accepted, bonus from last row
    assert greedy_verify(torch.tensor([3, 0, 4]), logits) == (1, 1)  # stop at the first rejection, correct it
    assert greedy_verify(torch.tensor([0, 1, 4]), logits) == (0, 3)  # later matches do not count
    assert greedy_verify(torch.tensor([], dtype=torch.long), logits[:1]) == (0, 3)


@pytest.mark.parametrize("sparse", [False, True])
def test_one_step_output_is_exactly_p(sparse):
    """P(x) = q(x) min(1, p/q) + P(reject) residual(x) must equal p(x) for every x."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        p, q = rand_dist(6, g, sparse), rand_dist(6, g)
        a = torch.where(q > 0, acceptance_prob(p, q.clamp(min=1e-300)), torch.zeros_like(q))
        out = q * a + (1 - (q * a).sum()) * residual(p, q)
        assert torch.allclose(out, p, atol=1e-12)


def joint_from_rule(p_fn, q_fn, V, tau):
    """Exact distribution of the first two emitted tokens of one speculative cycle, enumerating every draft,
    every acceptance outcome and every resample, using the library's own acceptance and residual functions."""
    out = torch.zeros(V, V, dtype=torch.float64)
    for drafts in itertools.product(range(V), repeat=tau):
        q_prob, qs, ps = 1.0, [], []
        for k in range(tau):
            qk, pk = q_fn(drafts[:k]), p_fn(drafts[:k])
            q_prob *= float(qk[drafts[k]])
            qs.append(qk)
            ps.append(pk)
        if q_prob == 0:
            continue
        reach = q_prob  # P(this draft block and all drafts so far accepted)
        emitted_prefix = []
        for k in range(tau + 1):
            if len(emitted_prefix) >= 2:
                break
            if k == tau:  # bonus token from p after the block
                bonus = p_fn(drafts)
                for x in range(V):
                    out[tuple((emitted_prefix + [x])[:2])] += reach * bonus[x] if len(emitted_prefix) == 1 else 0
                break
            a = float(acceptance_prob(ps[k][drafts[k]], qs[k][drafts[k]]))
            res = residual(ps[k], qs[k])
            for x in range(V):  # reject at k, resample x
                w = reach * (1 - a) * float(res[x])
                if not w:
                    continue
                seq = emitted_prefix + [x]
                if len(seq) == 2:
                    out[seq[0], seq[1]] += w
                else:  # the token after the correction comes from the next cycle: target alone, p(. | x)
                    out[x] += w * p_fn((x,))
            reach *= a
            emitted_prefix = emitted_prefix + [drafts[k]]
        if len(emitted_prefix) >= 2 and k < tau + 1:
            out[emitted_prefix[0], emitted_prefix[1]] += reach
    return out


@pytest.mark.parametrize("tau", [1, 2, 3])
def test_block_output_distribution_equals_target(tau):
    V = 3
    g = torch.Generator().manual_seed(tau)
    table_p, table_q = {}, {}

    def cond(table, ctx):
        if ctx not in table:
            table[ctx] = rand_dist(V, g)
        return table[ctx]

    p_fn = lambda ctx: cond(table_p, tuple(ctx))  # noqa: E731
    q_fn = lambda ctx: cond(table_q, tuple(ctx))  # noqa: E731
    got = joint_from_rule(p_fn, q_fn, V, tau)
    want = torch.stack([p_fn(()) [a] * p_fn((a,)) for a in range(V)])
    assert torch.allclose(got, want, atol=1e-12), (got, want)


def chi2_pvalue(counts, probs):
    n = counts.sum()
    mask = probs > 0
    assert counts[~mask].sum() == 0, "sampled a token with zero target probability"
    exp = n * probs[mask]
    stat = float(((counts[mask] - exp) ** 2 / exp).sum())
    dof = int(mask.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


@pytest.mark.parametrize("one_hot", [False, True])
def test_sample_verify_monte_carlo_matches_p(one_hot):
    """The random implementation itself: the first emitted token ~ p (chi-square, 20k seeded draws)."""
    V, g = 5, torch.Generator().manual_seed(7)
    p = torch.stack([rand_dist(V, g) for _ in range(3)])
    q = torch.stack([rand_dist(V, g) for _ in range(2)])
    counts = torch.zeros(V)
    rng = torch.Generator().manual_seed(11)
    for _ in range(20000):
        if one_hot:
            draft = torch.tensor([2, 4])
            n, tok = sample_verify(draft, None, p, rng)
        else:
            d0 = int(torch.multinomial(q[0], 1, generator=rng))
            d1 = int(torch.multinomial(q[1], 1, generator=rng))
            n, tok = sample_verify(torch.tensor([d0, d1]), q, p, rng)
            draft = torch.tensor([d0, d1])
        counts[int(draft[0]) if n >= 1 else tok] += 1
    assert chi2_pvalue(counts, p[0]) > 1e-3


def test_chi2_detects_a_wrong_distribution():
    """The statistical test has power: sampling from q instead of p is caught."""
    V, g = 5, torch.Generator().manual_seed(7)
    p, q = rand_dist(V, g), rand_dist(V, g)
    rng = torch.Generator().manual_seed(3)
    counts = torch.bincount(torch.multinomial(q, 20000, replacement=True, generator=rng), minlength=V).double()
    assert chi2_pvalue(counts, p) < 1e-6


def test_warp_temperature_topk_topp():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    assert torch.allclose(warp(logits, SamplingParams(temperature=1.0)), logits.double().softmax(-1))
    assert torch.allclose(warp(logits, SamplingParams(temperature=0.5)), (logits.double() / 0.5).softmax(-1))
    k2 = warp(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (k2[2:] == 0).all() and torch.allclose(k2[:2], logits[:2].double().softmax(-1))
    full = logits.double().softmax(-1)
    # top_p: smallest set whose mass reaches p
    p_cut = float(full[0] + full[1]) - 1e-9
    tp = warp(logits, SamplingParams(temperature=1.0, top_p=p_cut))
    assert (tp[2:] == 0).all() and torch.allclose(tp.sum(), torch.tensor(1.0, dtype=torch.float64))
    tp1 = warp(logits, SamplingParams(temperature=1.0, top_p=float(full[0]) / 2))
    assert tp1[0] == 1.0


def test_min_p_keeps_the_tokens_at_least_that_fraction_as_likely_as_the_likeliest():
    logits = torch.tensor([0.5, 0.2, 0.05, 0.25]).log()
    kept = warp(logits, SamplingParams(temperature=1.0, min_p=0.45))  # 0.2 / 0.5 and 0.05 / 0.5 fall below
    assert torch.allclose(kept, torch.tensor([0.5, 0.0, 0.0, 0.25], dtype=torch.float64) / 0.75)
    hot = warp(logits, SamplingParams(temperature=2.0, min_p=0.5))  # after temperature: sqrt of each ratio
    assert (hot > 0).tolist() == [True, True, False, True]
    assert torch.allclose(hot[[0, 1, 3]], (logits[[0, 1, 3]].double() / 2).softmax(-1))
    assert warp(logits, SamplingParams(temperature=1.0, min_p=1.0)).tolist() == [1.0, 0.0, 0.0, 0.0]
    with pytest.raises(InvalidRequest, match="min_p"):
        SamplingParams(temperature=1.0, min_p=1.5)


def test_warped_rule_keeps_exactness():
    """Warping p and q identically, then applying the rule, yields the warped p exactly."""
    g = torch.Generator().manual_seed(5)
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.8)
    for _ in range(100):
        p = warp(torch.randn(8, generator=g, dtype=torch.float64), params)
        q = warp(torch.randn(8, generator=g, dtype=torch.float64), params)
        a = torch.where(q > 0, acceptance_prob(p, q.clamp(min=1e-300)), torch.zeros_like(q))
        out = q * a + (1 - (q * a).sum()) * residual(p, q)
        assert torch.allclose(out, p, atol=1e-12)


def test_seeded_race_kernel_equals_the_full_race_and_samples_exactly():
    """PositionNoise.pick: the kernel's few-logarithm race (both builds) picks argmax p/E of the full race torch
    computes over every token, at every temperature; and over seeds, the winner is distributed exactly as p."""
    from specdec import kernels
    from specdec.kernels.reference.selection import uniforms
    from specdec.sampling import PositionNoise, SamplingParams, warp
    g = torch.Generator().manual_seed(1)
    noise = PositionNoise(11)
    keys = [noise.key(t) for t in range(24)]
    for temperature in (0.2, 0.7, 1.5):
        p = warp(torch.randn(24, 3001, generator=g) * 3, SamplingParams(temperature=temperature))
        p[3, :] = 0.0
        p[3, 17] = 1.0  # one token certain
        full = [int((row / -torch.log(uniforms(k, torch.arange(p.shape[1])))).argmax()) for row, k in zip(p, keys)]
        libs = [kernels.library(), kernels.library("avx2")] if kernels.available() else [None]
        for lib in libs:
            assert kernels.race(p, keys, lib) == full
        assert full[3] == 17
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0]], dtype=torch.float64)
    n = 40000
    counts = torch.bincount(torch.tensor([PositionNoise(s).pick(probs, [9])[0] for s in range(n)]), minlength=5)
    expected = probs[0] * n
    chi2 = float(((counts[:4] - expected[:4]) ** 2 / expected[:4]).sum())
    assert counts[4] == 0 and chi2 < 16.3  # 3 degrees of freedom: p-value 0.001
