"""Acceptance rules for draft–verify, as small pure functions.

Each rule takes the target's per-position distributions, the drafted tokens (a
chain or a flattened tree), the draft distributions q and explicit uniforms, and
returns the accepted path plus the target's next token. Randomness is always
passed in (``uniforms(...)`` draws them from a seeded generator), so a rule is a
deterministic function of its inputs and the Triton kernels in ``kernels/`` can be
checked against these token for token.

Row convention: ``probs[0]`` is the target's distribution after the last
committed (pending) token, ``probs[i + 1]`` the distribution after tree node i.

This module knows nothing about models, sessions, KV caches or gRPC.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from . import seeding, trees
from .engine.device import host_list, to_device, to_host
from .engine.rowops import argmax_rows, topk_rows
from .types import SIBLINGS_WOR, SamplingParams, TokenTree


@dataclass
class Acceptance:
    path: list[int]  # accepted tree nodes, root to leaf
    next_token: int  # correction at the first rejection, or the bonus token


# ---------------------------------------------------------------------------
# target distribution


def target_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """[n, V] logits -> [n, V] float32 probabilities after temperature, min-p, top-k, top-p
    (vLLM's order; top-k then top-p is Hugging Face's). min-p drops the tokens whose
    probability is below ``min_p`` times the row's largest. Greedy (temperature 0) gives
    one-hot argmax."""
    logits = logits.float()
    if sampling.greedy:
        out = torch.zeros_like(logits)
        out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        return out
    z = logits / sampling.temperature
    if sampling.min_p > 0.0:  # p >= min_p * max p  <=>  z >= max z + log(min_p)
        z = z.masked_fill(z < z.amax(-1, keepdim=True) + math.log(sampling.min_p), float("-inf"))
    if sampling.top_k and sampling.top_k < z.shape[-1]:
        kth = torch.topk(z, sampling.top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_z, idx = torch.sort(z, dim=-1, descending=True)
        cum = torch.softmax(sorted_z, -1).cumsum(-1)
        # drop a token when the mass strictly before it already reaches top_p
        drop_sorted = (cum - torch.softmax(sorted_z, -1)) >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return torch.softmax(z, -1)


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of each row of [n, V] probabilities."""
    p = probs.clamp_min(1e-30)
    return -(probs * p.log()).sum(-1)


def logit_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of softmax(``logits``) for one [V] row, in five passes over it
    and one temporary (log-sum-exp and an expectation of the logits: H = log Z + m - E_p[x]
    with Z = sum exp(x - m)); ``entropy(softmax(x))`` makes three temporaries in eight
    passes, which at 8 sessions a forward was 1.2 ms of a 20 ms step on 2 CPU cores."""
    x = logits.float()
    m = x.max()
    e = (x - m).exp_()
    z = e.sum()
    return z.log() + m - torch.dot(e, x) / z


def sample(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF sample of one token from unnormalised [V] weights with uniform u in [0, 1)."""
    cdf = probs.double().cumsum(0)
    target = u * float(cdf[-1])
    idx = int(torch.searchsorted(cdf, torch.tensor([target], dtype=cdf.dtype), right=True)[0])
    idx = min(idx, probs.shape[0] - 1)
    while probs[idx] <= 0 and idx > 0:  # never land on a zero-mass token at the edge
        idx -= 1
    return idx


def uniforms(seed: int, n_nodes: int, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(u_accept [n_nodes], u_sample [depth + 1]) from the round seed's acceptance
    stream (``seeding.ACCEPT``: independent of the drafter's draws)."""
    g = seeding.generator(seed, seeding.ACCEPT)
    u = torch.rand(n_nodes + depth + 1, generator=g, dtype=torch.float64)
    return u[:n_nodes], u[n_nodes:]


def dense_q(tree: TokenTree, vocab: int) -> torch.Tensor:
    """[n, V] draft distributions; a one-hot row where the node carries no q."""
    q = torch.zeros(len(tree), vocab, dtype=torch.float32)
    for i, tok in enumerate(tree.tokens):
        ids = tree.q_ids[i] if tree.q_ids is not None else None
        if ids:
            q[i, torch.tensor(ids, dtype=torch.long)] = torch.tensor(tree.q_probs[i], dtype=torch.float32)
        else:
            q[i, tok] = 1.0
    return q


def _children(tree: TokenTree) -> dict[int, list[int]]:
    """node (-1 = root) -> its children in sibling order."""
    return trees.children_index(tree.parents)


def _row(node: int) -> int:
    return node + 1  # probs row holding the distribution *after* ``node`` (-1 = pending)


# ---------------------------------------------------------------------------
# greedy


def greedy_chain(argmax: list[int], draft: list[int]) -> Acceptance:
    """Accept the longest prefix where draft[i] == argmax[i]; emit argmax at the first
    mismatch, or the bonus argmax[k] when all k drafts match. argmax has k + 1 entries."""
    n = 0
    while n < len(draft) and draft[n] == argmax[n]:
        n += 1
    return Acceptance(list(range(n)), int(argmax[n]))


def greedy_tree(argmax: list[int], tree: TokenTree) -> Acceptance:
    """Descend from the root into the child whose token equals the target's argmax;
    stop when none does and emit the argmax there. argmax has len(tree) + 1 entries."""
    kids = _children(tree)
    path, cur = [], -1
    while True:
        want = argmax[_row(cur)]
        nxt = next((c for c in kids.get(cur, []) if tree.tokens[c] == want), None)
        if nxt is None:
            return Acceptance(path, int(want))
        path.append(nxt)
        cur = nxt


# ---------------------------------------------------------------------------
# lossless rejection sampling


def rejection_tree(probs: torch.Tensor, tree: TokenTree, q: torch.Tensor,
                   u_accept: torch.Tensor, u_sample: torch.Tensor, lenience: float = 1.0) -> Acceptance:
    """Multi-candidate rejection sampling (a chain is the one-child case: Leviathan/Chen).

    At node ``cur`` with target distribution p, try the children c in order, each
    drawn from proposal q_c:
      accept c w.p. min(1, p(x_c) / q_c(x_c))   (test: u_accept[c] * q_c(x_c) < p(x_c));
      on rejection p <- norm(max(0, p - q_c)) and try the next sibling.
    Descend into an accepted child; when every child fails (or there is none),
    sample the next token from the current p with u_sample[depth].
    Exact for any proposals as long as q_c is the distribution x_c was really drawn
    from given the siblings before it (each step is an exact sampler of its p):
      - one-hot (deterministic drafts): q_c = onehot(x_c);
      - siblings drawn i.i.d. (SpecInfer): q_c = q, the shared distribution;
      - drawn without replacement (``tree.siblings == SIBLINGS_WOR``; recursive
        rejection sampling): q_c = q with the earlier siblings' tokens removed,
        renormalised.
    probs: [len(tree)+1, V]; q: [len(tree), V] (each node's shared sibling q).
    ``lenience`` l (LOSSY unless 1; ``lenient_*`` rules): q is scaled by l in the test and
    the residual, accept w.p. min(1, p(x) / (l q_c(x))) and p <- norm(max(0, p - l q_c)).
    l = 1 multiplies by 1.0: bit for bit the exact rule."""
    kids = _children(tree)
    wor = tree.siblings == SIBLINGS_WOR
    path, cur, depth = [], -1, 0
    while True:
        p = probs[_row(cur)].double()
        accepted = None
        drawn: list[int] = []
        for c in kids.get(cur, []):
            x = tree.tokens[c]
            qc = q[c].double()
            if wor and drawn:
                qc = qc.clone()
                qc[drawn] = 0.0
                qc = qc / qc.sum()
            if float(u_accept[c]) * (lenience * float(qc[x])) < float(p[x]):
                accepted = c
                break
            drawn.append(x)
            resid = (p - lenience * qc).clamp_min(0.0)
            if float(resid.sum()) > 0:
                p = resid / resid.sum()
        if accepted is None:
            return Acceptance(path, sample(p, float(u_sample[depth])))
        path.append(accepted)
        cur = accepted
        depth += 1


def rejection_chain(probs: torch.Tensor, draft: list[int], q: torch.Tensor,
                    u_accept: torch.Tensor, u_sample: torch.Tensor, lenience: float = 1.0) -> Acceptance:
    """Leviathan/Chen speculative sampling over a chain of k drafts.
    accept x_i~q_i w.p. min(1, p_i(x_i)/q_i(x_i)); at the first rejection i sample
    from norm(max(0, p_i - q_i)) with u_sample[i]; if all pass sample the bonus from
    p_k with u_sample[k]. probs: [k+1, V], q: [k, V].
    ``lenience`` l (LOSSY unless 1): q_i is replaced by l q_i in the test and the
    residual (Leviathan et al., appendix: accept w.p. min(1, p/(l q)), residual
    norm(max(0, p - l q))); l = 1 is the exact rule bit for bit."""
    k = len(draft)
    if k:
        idx = torch.arange(k)
        x = torch.tensor(draft, dtype=torch.long)
        px = probs[idx, x].double()
        qx = q[idx, x].double() * lenience
        ok = u_accept[:k].double() * qx < px
        n = int(ok.long().cumprod(0).sum())
    else:
        n = 0
    if n < k:
        resid = (probs[n].double() - lenience * q[n].double()).clamp_min(0.0)
        dist = resid if float(resid.sum()) > 0 else probs[n].double()
        return Acceptance(list(range(n)), sample(dist, float(u_sample[n])))
    return Acceptance(list(range(k)), sample(probs[k].double(), float(u_sample[k])))


def one_hot(tree: TokenTree) -> bool:
    """No node carries a draft distribution beyond its own token: a deterministic draft
    (lookups, suffix trees, caches, a prediction, fixed candidate trees, a model's argmax)."""
    if tree.q_ids is None:
        return True
    return all(not ids or (len(ids) == 1 and int(ids[0]) == int(t)) for ids, t in zip(tree.q_ids, tree.tokens))


def match_tree(row_probs, tree: TokenTree, u_at) -> Acceptance:
    """Exact sampled verification of a one-hot draft, by matching the target's own draw.

    At depth d (from the pending token) draw the target's token y = sample(p, u_at(d)),
    p the row after the path accepted so far (``row_probs(row)``); descend into the first
    child whose token is y; where none is, emit y. Every emitted token is the one plain
    sampling draws at its position with the same uniform, so the output does not depend
    on what was drafted or how the positions were split into rounds (seeded output is
    reproducible under any draft schedule). A one-hot child x is accepted w.p. p(x) and a
    node's children together w.p. sum p(x_i): what rejection sampling accepts one-hot
    drafts with (for a tree, the recursive rule), so nothing is lost against it."""
    kids = _children(tree)
    path, cur, depth = [], -1, 0
    while True:
        y = sample(row_probs(_row(cur)), u_at(depth))
        nxt = next((c for c in kids.get(cur, []) if tree.tokens[c] == y), None)
        if nxt is None:
            return Acceptance(path, y)
        path.append(nxt)
        cur = nxt
        depth += 1


def position_draws(seed: int, sampling: SamplingParams, committed: Optional[int]):
    """d -> the uniform of the target's draw at depth d of a round with ``committed`` committed
    tokens (``seeding.position_uniform``: keyed by the absolute position). Without the length
    (a caller holding only the round seed ``seed``) depth 0 is still that round's draw and
    deeper ones are keyed by (round seed, depth)."""
    if committed is not None:
        return lambda d: seeding.position_uniform(sampling.seed, committed + d)
    return lambda d: seeding.first_uniform(seed if d == 0 else seeding.mix(seed, d))


def _matched(rule: str, tree: TokenTree, sampling: SamplingParams) -> bool:
    """Sampled, exact (or the exact rules on a contrastive target, or lenience 1, which is the
    exact rule), a one-hot draft: matched."""
    exact = rule in ("exact", "contrastive") or (rule == "lenient" and sampling.lenience == 1.0)
    return not sampling.greedy and exact and one_hot(tree)


# ---------------------------------------------------------------------------
# relaxed (lossy, opt-in)


def typical_tree(probs: torch.Tensor, tree: TokenTree, u_sample: torch.Tensor,
                 epsilon: float, delta: float) -> Acceptance:
    """LOSSY typical acceptance (Medusa): accept child x of the current node when
    p(x) > min(epsilon, delta * exp(-H(p))); take the first passing child in sibling
    order; when none passes sample from p. Output no longer follows the target
    distribution exactly; callers must label it."""
    kids = _children(tree)
    path, cur, depth = [], -1, 0
    while True:
        p = probs[_row(cur)].double()
        h = float(entropy(p.unsqueeze(0))[0])
        thresh = min(epsilon, delta * math.exp(-h))
        nxt = next((c for c in kids.get(cur, []) if float(p[tree.tokens[c]]) > thresh), None)
        if nxt is None:
            return Acceptance(path, sample(p, float(u_sample[depth])))
        path.append(nxt)
        cur = nxt
        depth += 1


def _first_passing(tree: TokenTree, passes, correction, u_sample: Optional[torch.Tensor] = None) -> Acceptance:
    """Descend from the root into the first child (sibling order) for which
    ``passes(row, token)`` holds; at a node where none does, emit ``correction(row, depth)``."""
    kids = _children(tree)
    path, cur, depth = [], -1, 0
    while True:
        row = _row(cur)
        nxt = next((c for c in kids.get(cur, []) if passes(row, tree.tokens[c])), None)
        if nxt is None:
            return Acceptance(path, int(correction(row, depth)))
        path.append(nxt)
        cur = nxt
        depth += 1


def lenient_greedy(logits: torch.Tensor, tree: TokenTree, lenience: float) -> Acceptance:
    """LOSSY lenience under greedy decoding, the deterministic form of min(1, p(x) / (l q(x))):
    the greedy target puts its mass on the argmax, so a draft x passes when
    p(x) >= l * max p (p the temperature-1 softmax of the row, i.e. logit(x) >= max logit
    + log l) or x is the argmax. Descend into the first passing child; emit the argmax
    where none passes. l = 1 admits only the argmax (ties included only as the argmax
    itself): exactly ``greedy_tree``."""
    lg = logits.float()
    am = argmax_rows(lg).tolist()
    top = lg.amax(-1).tolist()
    slack = math.log(lenience) if lenience < 1.0 else 0.0

    def passes(row: int, x: int) -> bool:
        return x == am[row] or (lenience < 1.0 and float(lg[row, x]) >= top[row] + slack)

    return _first_passing(tree, passes, lambda row, depth: am[row])


def topk_tree(logits: torch.Tensor, tree: TokenTree, k: int, probs: Optional[torch.Tensor] = None,
              u_sample: Optional[torch.Tensor] = None) -> Acceptance:
    """LOSSY top-k acceptance: a draft passes when it is among the target's k most likely
    tokens at its position (its logit reaches the k-th largest, or it is the argmax);
    descend into the first passing child. Greedy (``probs`` None): emit the argmax where
    none passes, so k = 1 is exactly ``greedy_tree``. Sampled: the ranking is that of
    ``probs`` (the target distribution after temperature / top-k / top-p; a token of
    probability 0 never passes) and the correction is sampled from p with u_sample[depth]."""
    score = logits.float() if probs is None else probs.double()
    am = argmax_rows(score).tolist()
    kth = topk_rows(score, min(k, score.shape[-1]))[0][:, -1].tolist()

    def passes(row: int, x: int) -> bool:
        v = float(score[row, x])
        if probs is not None and v <= 0.0:
            return False
        return x == am[row] or (k > 1 and v >= kth[row])

    if probs is None:
        return _first_passing(tree, passes, lambda row, depth: am[row])
    return _first_passing(tree, passes, lambda row, depth: sample(probs[row].double(), float(u_sample[depth])))


# ---------------------------------------------------------------------------
# contrastive decoding: the rules above applied to a contrastive target


def contrastive_logits(expert: torch.Tensor, amateur: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    """[n, V] expert and amateur logits -> [n, V] float32 contrastive-decoding scores (computed in float64)
    (Li et al. 2023; O'Brien & Lewis 2023):
        s(x) = (1 + beta) log p_e(x) - beta log p_a(x)   where p_e(x) >= alpha * max p_e,
        s(x) = -inf                                        elsewhere (the plausibility set).
    p_cd = softmax(s) is the contrastive target; ``target_probs(s, sampling)`` applies the
    request's temperature / top-k / top-p to it and greedy CD is argmax s. Row-wise: a
    row's scores do not depend on the other rows (speculative CD sees what vanilla CD sees)."""
    le = torch.log_softmax(expert.double(), -1)
    la = torch.log_softmax(amateur.double(), -1)
    s = (1.0 + beta) * le - beta * la
    if alpha > 0.0:
        keep = le >= le.amax(-1, keepdim=True) + math.log(alpha)
        s = s.masked_fill(~keep, float("-inf"))
    return s.float()  # float32 like the engine's logits: every path (host, kernels) ranks the same values


# ---------------------------------------------------------------------------
# divergence decoding: a specialist drafts, the target (the generalist) verifies


def jsd_bits(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence, in bits (so in [0, 1]), of each row pair of [n, V]
    probabilities (float64): 1/2 KL(p || m) + 1/2 KL(q || m), m = (p + q) / 2, with
    0 log 0 = 0. Symmetric; 0 exactly when the rows are equal."""
    p, q = p.double(), q.double()
    m = 0.5 * (p + q)

    def kl(a: torch.Tensor) -> torch.Tensor:
        return torch.where(a > 0, a * (a.clamp_min(1e-300).log() - m.clamp_min(1e-300).log()),
                           torch.zeros_like(a)).sum(-1)

    return ((0.5 * kl(p) + 0.5 * kl(q)) / math.log(2.0)).clamp(0.0, 1.0)


def divergence_jsd(logits: torch.Tensor, specialist: torch.Tensor) -> torch.Tensor:
    """[k] JSD (bits) between the specialist's and the target's distributions at each
    drafted position: softmax of the raw logits (temperature 1: the models' own
    distributions, whatever the request samples with). ``logits``: the target's
    [>= k, V] rows (row i: the position draft i fills), ``specialist``: [k, V]."""
    k = specialist.shape[0]
    return jsd_bits(torch.softmax(specialist.double(), -1), torch.softmax(logits[:k].double(), -1))


def divergence_chain(logits: torch.Tensor, specialist: torch.Tensor, draft: Sequence[int], threshold: float,
                     probs: Optional[torch.Tensor] = None, u_sample: Optional[torch.Tensor] = None) -> Acceptance:
    """LOSSY Divergence Decoding over a chain the specialist drafted: accept drafts
    0..n-1 where n is the first position with JSD(p_specialist, p_target) > ``threshold``
    (``divergence_jsd``: both full distributions), whatever the drafted tokens are;
    at n (or after the last draft: the bonus) emit the target's token: its argmax
    (greedy, ``probs`` None) or a sample of ``probs[n]`` (the target distribution after
    the request's temperature / top-k / top-p) with ``u_sample[n]``. ``logits``: the
    target's [k + 1, V] rows, ``specialist``: the specialist's [k, V] logits at the
    drafted positions. Threshold 0 accepts only where the two distributions are equal,
    where the specialist's draft is a draw of the target's own distribution: exact."""
    k = len(draft)
    if specialist.shape[0] != k:
        raise ValueError(f"{specialist.shape[0]} specialist rows for {k} drafted tokens")
    n = k
    if k:
        over = (divergence_jsd(logits, specialist) > threshold).tolist()
        n = over.index(True) if True in over else k
    if probs is None:
        return Acceptance(list(range(n)), int(logits[n].float().argmax()))
    return Acceptance(list(range(n)), sample(probs[n].double(), float(u_sample[n])))


# ---------------------------------------------------------------------------
# dispatch


def _batchable(tree: TokenTree, sampling: SamplingParams) -> bool:
    """The batched kernels implement the exact rules for chains and trees of i.i.d. or
    one-hot siblings — also for a contrastive target (the exact rules on its scores) and,
    sampled, for lenience (the exact rules with q scaled by l); the without-replacement
    rule and the other relaxed rules run on the host."""
    rule_ok = sampling.acceptance in ("exact", "contrastive") or (
        sampling.acceptance == "lenient" and not sampling.greedy)
    # sampled one-hot drafts are matched against the target's own draws on the host (``match_tree``),
    # the same computation as plain decoding's, so the two agree to the bit
    return rule_ok and len(tree) > 0 and tree.siblings != SIBLINGS_WOR and not _matched(sampling.acceptance, tree,
                                                                                         sampling)


def _contrastive_inputs(logits: Sequence[torch.Tensor], samplings: Sequence[SamplingParams],
                        amateurs: Optional[Sequence[Optional[torch.Tensor]]]) -> list[torch.Tensor]:
    """Each contrastive request's logits replaced by its contrastive scores."""
    out = list(logits)
    for i, sp in enumerate(samplings):
        if sp.acceptance == "contrastive":
            am = amateurs[i] if amateurs is not None else None
            if am is None:
                raise ValueError("contrastive acceptance needs the amateur's logits for the same rows")
            out[i] = contrastive_logits(logits[i], am, sp.cd_alpha, sp.cd_beta).to(logits[i].device)
    return out


def _sparse_q(trees: Sequence[TokenTree], samplings: Sequence[SamplingParams], t: int,
              V: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The nonzero entries of the dense [N, T, V] draft distributions ``dense_q`` would
    build (times the lenience of lenient requests): (flat indices int64, values
    float32), on the host; the caller scatters them on the device."""
    idx: list[int] = []
    val: list[float] = []
    lens: list[float] = []
    for j, (tr, sp) in enumerate(zip(trees, samplings)):
        lenience = sp.lenience if sp.acceptance == "lenient" else 1.0
        for i, tok in enumerate(tr.tokens):
            ids = tr.q_ids[i] if tr.q_ids is not None else None
            base = (j * t + i) * V
            if ids:
                idx += [base + int(x) for x in ids]
                val += [float(p) for p in tr.q_probs[i]]
                lens += [lenience] * len(ids)
            else:
                idx.append(base + int(tok))
                val.append(1.0)
                lens.append(lenience)
    # float32 values times the lenience in float32, as dense_q(...) * lenience computes them
    v = torch.tensor(val, dtype=torch.float32) * torch.tensor(lens, dtype=torch.float32)
    return torch.tensor(idx, dtype=torch.long), v


def _accept_group(logits: Sequence[torch.Tensor], trees: Sequence[TokenTree], samplings: Sequence[SamplingParams],
                  seeds: Sequence[int], greedy: bool, backend: str,
                  also: Optional[torch.Tensor] = None) -> tuple[list[Acceptance], list[float]]:
    """Requests of one verify forward, all greedy or all sampled, as ONE call of
    ``kernels.tree_accept`` (Triton on CUDA, its torch reference elsewhere): trees
    padded to the largest (sizes mask the padding), the same uniforms as ``accept``.
    Inputs go to the device in two non-blocking copies (int64 and float64; the draft
    distributions as their nonzero entries, scattered into a dense q on the device);
    the results come back in one host read, together with ``also`` (a 1-D tensor on the
    logits' device the caller wants read in the same go), returned as floats."""
    from specmesh import kernels

    dev = logits[0].device
    n, t = len(trees), max(len(tr) for tr in trees)
    V = logits[0].shape[-1]
    probs = torch.zeros(n, t + 1, V, dtype=torch.float32, device=dev)  # [N, T+1, V]
    depths = [max(tr.depths()) + 1 for tr in trees]
    D = max(depths) + 1
    ints = torch.zeros(2 * n * t + n, dtype=torch.long)  # tokens [N, T], parents [N, T], sizes [N]
    toks, pars, sizes = ints[: n * t].view(n, t), ints[n * t: 2 * n * t].view(n, t), ints[2 * n * t:]
    pars.fill_(-1)
    floats = torch.zeros(n * t + n * D, dtype=torch.float64)  # u_accept [N, T], u_sample [N, D]
    ua, us = floats[: n * t].view(n, t), floats[n * t:].view(n, D)
    for j, (lg, tr, sp, sd) in enumerate(zip(logits, trees, samplings, seeds)):
        k = len(tr)
        probs[j, : k + 1] = lg.float() if greedy else target_probs(lg, sp)
        toks[j, :k] = torch.tensor(tr.tokens)
        pars[j, :k] = torch.tensor(tr.parents)
        sizes[j] = k
        if not greedy:
            a, b = uniforms(sd, k, depths[j])
            ua[j, :k], us[j, : depths[j] + 1] = a, b
    ints = to_device(ints, dev)
    toks, pars, sizes = ints[: n * t].view(n, t), ints[n * t: 2 * n * t].view(n, t), ints[2 * n * t:]
    q = None
    if not greedy:
        floats = to_device(floats, dev)
        ua, us = floats[: n * t].view(n, t), floats[n * t:].view(n, D)
        qi, qv = _sparse_q(trees, samplings, t, V)
        q = torch.zeros(n * t * V, dtype=torch.float32, device=dev)  # [N, T, V], built on the device
        q.index_put_((to_device(qi, dev),), to_device(qv, dev))
        q = q.view(n, t, V)
    path, plen, nxt = kernels.tree_accept(
        probs, toks, pars, sizes, draft_q=q, u_accept=None if greedy else ua, u_sample=None if greedy else us,
        greedy=greedy, max_depth=max(depths), backend=backend)
    parts = [path.reshape(-1).double(), plen.reshape(-1).double(), nxt.reshape(-1).double()]
    if also is not None:
        parts.append(also.reshape(-1).double())
    flat = host_list(torch.cat(parts), "acceptance")  # the round's one readback (ints exact in float64)
    w = path.shape[1] if path.dim() == 2 else 0
    pl, nx = flat[n * w: n * w + n], flat[n * w + n: n * w + 2 * n]
    out = [Acceptance([int(x) for x in flat[j * w: j * w + int(pl[j])]], int(nx[j])) for j in range(n)]
    return out, flat[n * w + 2 * n:]


def accept_batch(logits: Sequence[torch.Tensor], trees: Sequence[TokenTree], samplings: Sequence[SamplingParams],
                 seeds: Sequence[int], batched: Optional[bool] = None, backend: str = "auto",
                 amateurs: Optional[Sequence[Optional[torch.Tensor]]] = None,
                 specialists: Optional[Sequence[Optional[torch.Tensor]]] = None,
                 committed: Optional[Sequence[Optional[int]]] = None) -> list[Acceptance]:
    """``accept`` for every request of one verify forward. ``batched`` (default: on
    when the logits are CUDA tensors): the exact rules of all greedy requests run as
    one kernel call and those of all sampled requests as another; the rest (empty
    drafts, relaxed rules, siblings drawn without replacement) one by one on the host.
    Same tokens as calling ``accept`` per request (same rules, same uniforms).
    ``amateurs[i]``: the amateur's logits for request i's rows (contrastive requests);
    ``specialists[i]``: the specialist's logits at request i's drafted positions
    (divergence requests); ``committed[i]``: request i's committed tokens, the pending one
    included (keys its target draws by position: ``position_draws``)."""
    return accept_batch_reading(logits, trees, samplings, seeds, batched, backend, amateurs, specialists,
                                committed=committed)[0]


def accept_batch_reading(logits: Sequence[torch.Tensor], trees: Sequence[TokenTree],
                         samplings: Sequence[SamplingParams], seeds: Sequence[int], batched: Optional[bool] = None,
                         backend: str = "auto", amateurs: Optional[Sequence[Optional[torch.Tensor]]] = None,
                         specialists: Optional[Sequence[Optional[torch.Tensor]]] = None,
                         also: Optional[torch.Tensor] = None,
                         committed: Optional[Sequence[Optional[int]]] = None) -> tuple[list[Acceptance], list[float]]:
    """``accept_batch``, plus the values of ``also`` (a 1-D tensor on the logits' device,
    e.g. entropies the caller reports) read in the same host read as the batched
    decisions (one read for both; a read of its own when no request was batched)."""
    n = len(trees)
    if batched is None:
        batched = n > 0 and logits[0].is_cuda
    logits = _contrastive_inputs(logits, samplings, amateurs)
    out: list[Optional[Acceptance]] = [None] * n
    groups: dict[bool, list[int]] = {True: [], False: []}
    for i in range(n):
        if batched and _batchable(trees[i], samplings[i]):
            groups[samplings[i].greedy].append(i)
        else:
            out[i] = _accept_scores(logits[i], trees[i], samplings[i], seeds[i],
                                    specialist=specialists[i] if specialists is not None else None,
                                    committed=committed[i] if committed is not None else None)
    vals: Optional[list[float]] = None
    for greedy, idx in groups.items():
        if idx:
            res, got = _accept_group([logits[i] for i in idx], [trees[i] for i in idx], [samplings[i] for i in idx],
                                     [seeds[i] for i in idx], greedy, backend, also if vals is None else None)
            if vals is None:
                vals = got
            for i, r in zip(idx, res):
                out[i] = r
    if vals is None:
        vals = [] if also is None or also.numel() == 0 else [float(x) for x in host_list(also.double(), "also")]
    return out, vals


def warm_up_kernels(device, vocab: int, max_nodes: int = 64, batch_sizes: Sequence[int] = (1, 2)) -> int:
    """Run the batched acceptance (``_accept_group``) for every tree size the verifier can
    send: greedy and sampled, a chain and a one-level tree of each of 1 ... ``max_nodes``
    nodes (every node count and every depth), for each of ``batch_sizes`` requests, so
    that on CUDA the Triton kernels are compiled here (start-up: ``Runtime.warm_up``), not
    inside the first verify rounds (a kernel specialises on its block sizes and on which
    integer arguments are 1 or multiples of 16). Returns the calls made."""
    calls = 0
    sizes = range(1, max_nodes + 1)
    logits = torch.zeros(max_nodes + 1, vocab, device=device)
    for greedy in (True, False):
        sp = SamplingParams() if greedy else SamplingParams(temperature=1.0)
        for k in sizes:
            for tree in (TokenTree.chain([0] * k), TokenTree([0] * k, [-1] + [0] * (k - 1))):
                for b in batch_sizes:
                    _accept_group([logits[: k + 1]] * b, [tree] * b, [sp] * b, list(range(b)), greedy, "auto")
                    calls += 1
    return calls


def accept(logits: torch.Tensor, tree: TokenTree, sampling: SamplingParams, seed: int,
           probs: Optional[torch.Tensor] = None, amateur: Optional[torch.Tensor] = None,
           specialist: Optional[torch.Tensor] = None, committed: Optional[int] = None) -> Acceptance:
    """Apply the rule ``sampling`` asks for to [len(tree)+1, V] target logits.
    CUDA tensors go through the batched kernels (``accept_batch``: same uniforms, same
    tokens). ``contrastive`` needs ``amateur``, the amateur's logits for the same rows:
    the target becomes ``contrastive_logits(logits, amateur)`` and the exact rules apply
    to it (``probs``, if given, must then be the contrastive target's). ``divergence``
    needs ``specialist``, the specialist's [len(tree), V] logits at the drafted positions
    of its chain (``divergence_chain``). Sampled exact (and contrastive) verification of a
    one-hot draft emits the target's own draws (``match_tree``), keyed by position where
    ``committed`` (the session's committed tokens, the pending one included) is given."""
    if sampling.acceptance == "contrastive":
        logits = _contrastive_inputs([logits], [sampling], [amateur])[0]
    return _accept_scores(logits, tree, sampling, seed, probs, specialist, committed)


def _accept_scores(logits: torch.Tensor, tree: TokenTree, sampling: SamplingParams, seed: int,
                   probs: Optional[torch.Tensor] = None, specialist: Optional[torch.Tensor] = None,
                   committed: Optional[int] = None) -> Acceptance:
    """``accept`` after a contrastive target has replaced the logits by its scores."""
    rule = sampling.acceptance
    if rule == "divergence":
        return _accept_divergence(logits, tree, sampling, seed, probs, specialist)
    if logits.is_cuda and _batchable(tree, sampling):
        return _accept_group([logits], [tree], [sampling], [seed], sampling.greedy, "auto")[0][0]
    if logits.is_cuda:  # the rules below are host code: one readback of the scored rows
        logits = to_host(logits.float(), "acceptance rows")
    if sampling.greedy:
        if rule == "lenient":
            return lenient_greedy(logits, tree, sampling.lenience)
        if rule == "topk":
            return topk_tree(logits, tree, sampling.accept_top_k)
        am = argmax_rows(logits).tolist()  # exact, contrastive, typical (greedy typical is greedy)
        return greedy_chain(am, tree.tokens) if tree.is_chain else greedy_tree(am, tree)
    if _matched(rule, tree, sampling):  # each row's distribution as plain decoding computes it: one row alone
        def row_probs(r: int) -> torch.Tensor:
            return (probs[r] if probs is not None else target_probs(logits[r: r + 1], sampling)[0]).double()

        return match_tree(row_probs, tree, position_draws(seed, sampling, committed))
    if probs is None:
        probs = target_probs(logits, sampling)
    depth = (max(tree.depths()) + 1) if len(tree) else 0
    u_acc, u_smp = uniforms(seed, len(tree), depth)
    if rule == "typical":
        return typical_tree(probs, tree, u_smp, sampling.typical_epsilon, sampling.typical_delta)
    if rule == "topk":
        return topk_tree(logits, tree, sampling.accept_top_k, probs=probs, u_sample=u_smp)
    lenience = sampling.lenience if rule == "lenient" else 1.0
    q = dense_q(tree, probs.shape[-1])
    if tree.is_chain:
        return rejection_chain(probs, tree.tokens, q, u_acc, u_smp, lenience)
    return rejection_tree(probs, tree, q, u_acc, u_smp, lenience)


def _accept_divergence(logits: torch.Tensor, tree: TokenTree, sampling: SamplingParams, seed: int,
                       probs: Optional[torch.Tensor], specialist: Optional[torch.Tensor]) -> Acceptance:
    if len(tree) and not tree.is_chain:
        raise ValueError("divergence acceptance verifies the specialist's chain, not a tree")
    if specialist is None:
        if len(tree):
            raise ValueError("divergence acceptance needs the specialist's logits at the drafted positions")
        specialist = logits[:0]
    logits, specialist = logits.float().cpu(), specialist.float().cpu()
    if sampling.greedy:
        return divergence_chain(logits, specialist, tree.tokens, sampling.jsd_threshold)
    if probs is None:
        probs = target_probs(logits, sampling)
    # no accept uniforms (the test is deterministic): u_sample[n] is then the uniform plain
    # decoding draws with the same round seed, so a round that accepts nothing emits its token
    _, u_smp = uniforms(seed, 0, len(tree))
    return divergence_chain(logits, specialist, tree.tokens, sampling.jsd_threshold, probs.cpu(), u_smp)
