"""Tests for ``specmesh.kernels`` (``kernels/``): the batched torch references against
``specmesh.acceptance`` (single session, same ``uniforms``), and the Triton kernels
against the references, token for token. Without CUDA the Triton code runs under
TRITON_INTERPRET=1, which is set here before ``specmesh.kernels.triton_kernels`` (and
so triton's jit) is first imported.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from specmesh import kernels  # noqa: E402
from specmesh import acceptance as A  # noqa: E402
from specmesh.types import SamplingParams, TokenTree  # noqa: E402
from tests.support import ROOT as REPO_ROOT  # noqa: E402

# selected by ``pytest -m cuda`` (``specmesh device-check`` runs them on the GPU); here they run
# under the interpreter like every other test
pytestmark = pytest.mark.cuda
HAVE_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAVE_TRITON or (not CUDA and os.environ.get("TRITON_INTERPRET") != "1"),
                                  reason="needs triton (CUDA, or TRITON_INTERPRET=1)")
DEV = "cuda" if CUDA else "cpu"
ROOT = str(REPO_ROOT)
BLOCK_V = 32  # small, so every V below spans several blocks and none is a multiple of it

SAMPLINGS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=8),
             SamplingParams(temperature=1.3, top_p=0.8)]


# ---------------------------------------------------------------------------
# random sessions


def _parents(kind: str, size: int, g: torch.Generator) -> list[int]:
    if kind == "chain" or size == 0:
        return list(range(-1, size - 1))
    if kind == "deep":  # a long spine; every third node is a later (leaf) sibling of the tip
        par, tip = [], -1
        for i in range(size):
            if i % 3 == 2:
                par.append(par[tip])
            else:
                par.append(tip)
                tip = i
        return par
    return [int(torch.randint(-1, i, (1,), generator=g)) if i else -1 for i in range(size)]


def _session(g, seed: int, size: int, vocab: int, shape: str, qform: str, edge: str) -> dict:
    """One session: a tree (or chain) of ``size`` nodes with tokens drawn from its q.
    edge: "" random | "all" (argmax drafts, one-hot q, u_accept = 0) | "reject0"
    (first drafted token has zero target mass)."""
    parents = _parents(shape, size, g)
    sampling = SAMPLINGS[1] if edge == "reject0" else SAMPLINGS[int(torch.randint(0, 3, (1,), generator=g))]
    logits = torch.randn(size + 1, vocab, generator=g) * 4.0
    probs = A.target_probs(logits, sampling)
    tokens, q_ids, q_probs = [], [], []
    for i, par in enumerate(parents):
        row = par + 1
        if edge == "all":
            tokens.append(int(probs[row].argmax()))
            q_ids.append([])
            q_probs.append([])
            continue
        qrow = probs[row] * torch.exp(0.7 * torch.randn(vocab, generator=g)) + 0.02 / vocab
        qrow = qrow / qrow.sum()  # close to p, with a little mass where p has none
        if qform == "sparse":
            kq = int(torch.randint(1, 9, (1,), generator=g))
            top = qrow.topk(kq)
            ids, ps = top.indices.tolist(), (top.values / top.values.sum()).tolist()
        else:
            ids, ps = list(range(vocab)), qrow.tolist()
        tok = ids[int(torch.multinomial(torch.tensor(ps), 1, generator=g))]
        if edge == "reject0" and i == 0:
            tok = int(probs[0].argmin())  # outside the top-k: p(x) = 0
            ids, ps = ([tok], [1.0]) if qform == "sparse" else (ids, ps)
        tokens.append(tok)
        q_ids.append(ids)
        q_probs.append(ps)
    if qform == "none":
        q_ids = q_probs = None
    tree = TokenTree(tokens, parents, q_ids, q_probs)
    depth = max(tree.depths()) + 1 if size else 0
    ua, us = A.uniforms(seed, size, depth)
    if edge == "all":
        ua = torch.zeros_like(ua)
    if edge == "reject0":
        ua = ua * 0 + 0.999
    return dict(tree=tree, logits=logits, probs=probs, ua=ua, us=us, depth=depth)


def _batch(seed: int, sizes: list[int], vocab: int, shape: str, qform: str, edges: dict | None = None) -> dict:
    """Pack sessions into padded batch tensors; padding is random garbage the ops must ignore."""
    g = torch.Generator().manual_seed(seed)
    edges = edges or {}
    ss = [_session(g, seed * 100 + i, s, vocab, shape, qform, edges.get(i, "")) for i, s in enumerate(sizes)]
    n, t = len(ss), max(max(sizes), 1) if sizes else 1
    d = max([s["depth"] for s in ss] + [1])
    probs = torch.softmax(torch.randn(n, t + 1, vocab, generator=g), -1)
    logits = torch.randn(n, t + 1, vocab, generator=g)
    tokens = torch.randint(0, vocab, (n, t), generator=g)
    parents = torch.randint(-1, t, (n, t), generator=g)
    ua = torch.rand(n, t, generator=g, dtype=torch.float64)
    us = torch.rand(n, d + 1, generator=g, dtype=torch.float64)
    kq = vocab if qform == "dense" else 8
    q_ids = torch.full((n, t, kq), -1, dtype=torch.long)
    q_probs = torch.rand(n, t, kq, generator=g)
    dense = torch.softmax(torch.randn(n, t, vocab, generator=g), -1)
    for i, s in enumerate(ss):
        tr, k = s["tree"], len(s["tree"])
        probs[i, : k + 1] = s["probs"]
        logits[i, : k + 1] = s["logits"]
        tokens[i, :k] = torch.tensor(tr.tokens, dtype=torch.long)
        parents[i, :k] = torch.tensor(tr.parents, dtype=torch.long)
        ua[i, :k] = s["ua"]
        us[i, : s["depth"] + 1] = s["us"]
        if k:
            dense[i, :k] = A.dense_q(tr, vocab)
        for j in range(k):
            if tr.q_ids is not None and tr.q_ids[j]:
                m = len(tr.q_ids[j])
                q_ids[i, j, :m] = torch.tensor(tr.q_ids[j])
                q_probs[i, j, :m] = torch.tensor(tr.q_probs[j])
    q = {"none": None, "sparse": (q_ids, q_probs), "dense": dense}[qform]
    return dict(sessions=ss, probs=probs, logits=logits, tokens=tokens, parents=parents, ua=ua, us=us,
                q=q, sizes=torch.tensor(sizes, dtype=torch.long), depth=d)


def _to(x, dev):
    if x is None:
        return None
    if isinstance(x, tuple):
        return tuple(_to(y, dev) for y in x)
    return x.to(dev)


def _chain(b, greedy: bool, backend: str, dev="cpu"):
    src = b["logits"] if greedy else b["probs"]
    out = kernels.chain_accept(src.to(dev), b["tokens"].to(dev), _to(b["q"], dev), b["ua"].to(dev),
                               b["us"].to(dev), b["sizes"].to(dev), greedy, backend=backend, block_v=BLOCK_V)
    return tuple(o.cpu() for o in out)


def _tree(b, greedy: bool, backend: str, dev="cpu"):
    src = b["logits"] if greedy else b["probs"]
    out = kernels.tree_accept(src.to(dev), b["tokens"].to(dev), b["parents"].to(dev), b["sizes"].to(dev),
                              _to(b["q"], dev), b["ua"].to(dev), b["us"].to(dev), greedy,
                              max_depth=b["probs"].shape[1] - 1, backend=backend, block_v=BLOCK_V)
    return tuple(o.cpu() for o in out)


def _expected(b, greedy: bool, tree: bool):
    """Per-session specmesh.acceptance results: (paths, next tokens)."""
    paths, nexts = [], []
    for s in b["sessions"]:
        tr, vocab = s["tree"], s["probs"].shape[-1]
        if greedy:
            am = s["logits"].argmax(-1).tolist()
            r = A.greedy_tree(am, tr) if tree else A.greedy_chain(am, tr.tokens)
        elif tree:
            r = A.rejection_tree(s["probs"], tr, A.dense_q(tr, vocab), s["ua"], s["us"])
        else:
            r = A.rejection_chain(s["probs"], tr.tokens, A.dense_q(tr, vocab), s["ua"], s["us"])
        paths.append(r.path)
        nexts.append(r.next_token)
    return paths, nexts


CHAIN_CASES = [  # seed, sizes, vocab, qform, edges
    (1, [4, 0, 2, 5, 1, 3], 53, "none", {1: "", 3: "all"}),
    (2, [5, 5, 3, 0, 4], 77, "sparse", {0: "reject0", 1: "all"}),
    (3, [3, 5, 1, 2], 130, "dense", {2: "reject0", 1: "all"}),
]
TREE_CASES = [  # seed, sizes, vocab, shape, qform, edges
    (4, [7, 1, 0, 9, 4], 61, "random", "none", {1: "", 4: "all"}),
    (5, [10, 6, 1, 8], 97, "random", "sparse", {2: "reject0", 3: "all"}),
    (6, [12, 9, 3], 50, "deep", "dense", {1: "all"}),
    (7, [12, 1, 5], 75, "deep", "sparse", {2: "reject0"}),
]


# ---------------------------------------------------------------------------
# torch references against specmesh.acceptance


@pytest.mark.parametrize("case", CHAIN_CASES)
@pytest.mark.parametrize("greedy", [False, True])
def test_chain_reference_matches_acceptance(case, greedy):
    seed, sizes, vocab, qform, edges = case
    b = _batch(seed, sizes, vocab, "chain", qform, edges)
    acc, nxt = _chain(b, greedy, "torch")
    paths, nexts = _expected(b, greedy, tree=False)
    assert acc.tolist() == [len(p) for p in paths]
    assert nxt.tolist() == nexts
    for i, e in edges.items():  # the edge cases really are what they claim
        if e == "all":
            assert acc[i] == sizes[i]
        if e == "reject0" and not greedy:
            assert acc[i] == 0


@pytest.mark.parametrize("case", TREE_CASES)
@pytest.mark.parametrize("greedy", [False, True])
def test_tree_reference_matches_acceptance(case, greedy):
    seed, sizes, vocab, shape, qform, edges = case
    b = _batch(seed, sizes, vocab, shape, qform, edges)
    path, plen, nxt = _tree(b, greedy, "torch")
    paths, nexts = _expected(b, greedy, tree=True)
    assert plen.tolist() == [len(p) for p in paths]
    assert [path[i, : len(p)].tolist() for i, p in enumerate(paths)] == paths
    assert bool((path[torch.arange(path.shape[1]) >= plen.unsqueeze(1)] == -1).all())
    assert nxt.tolist() == nexts


def test_chain_reference_many_seeds():
    """Wider random sweep of the reference alone (cheap, no Triton)."""
    for seed in range(10, 40):
        qform = ("none", "sparse", "dense")[seed % 3]
        b = _batch(seed, [seed % 6, 5, 2, 4], 40 + seed, "chain", qform)
        acc, nxt = _chain(b, False, "torch")
        paths, nexts = _expected(b, False, tree=False)
        assert acc.tolist() == [len(p) for p in paths] and nxt.tolist() == nexts


def test_tree_reference_many_seeds():
    for seed in range(40, 60):
        qform = ("none", "sparse", "dense")[seed % 3]
        b = _batch(seed, [seed % 9, 8, 3], 30 + seed, "random", qform)
        path, plen, nxt = _tree(b, False, "torch")
        paths, nexts = _expected(b, False, tree=True)
        assert plen.tolist() == [len(p) for p in paths] and nxt.tolist() == nexts


def _residual_inputs(seed: int, n: int, vocab: int):
    g = torch.Generator().manual_seed(seed)
    p = A.target_probs(torch.randn(n, vocab, generator=g) * 2, SamplingParams(temperature=0.9, top_k=12))
    q = torch.softmax(torch.randn(n, vocab, generator=g) * 2, -1)
    q[0] = p[0]  # residual without mass -> sample p
    q[1] = 0.0
    q[1, int(p[1].argmax())] = 1.0  # one-hot q
    u = torch.rand(n, generator=g, dtype=torch.float64)
    u[2] = 0.0
    u[3] = 1.0 - 1e-16
    return p, q, u


def test_residual_reference_matches_acceptance():
    p, q, u = _residual_inputs(0, 6, 83)
    got = kernels.residual_sample(p, q, u, backend="torch")
    for i in range(p.shape[0]):
        resid = (p[i].double() - q[i].double()).clamp_min(0.0)
        dist = resid if float(resid.sum()) > 0 else p[i].double()
        assert int(got[i]) == A.sample(dist, float(u[i]))
    plain = kernels.residual_sample(p, None, u, backend="torch")
    assert plain.tolist() == [A.sample(p[i].double(), float(u[i])) for i in range(p.shape[0])]


def _mask_expected(parents: list[int], t: int):
    tr = TokenTree([0] * len(parents), parents)
    mask = torch.eye(t, dtype=torch.bool)
    for i, par in enumerate(parents):
        while par >= 0:
            mask[i, par] = True
            par = parents[par]
    depths = tr.depths() + [0] * (t - len(parents))
    return mask, torch.tensor(depths)


def _mask_batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    sizes, t = [6, 1, 0, 9, 4], 9
    parents = torch.randint(-1, t, (len(sizes), t), generator=g)  # garbage padding
    trees = [_parents(("random", "deep", "chain")[i % 3], s, g) for i, s in enumerate(sizes)]
    for i, p in enumerate(trees):
        parents[i, : len(p)] = torch.tensor(p, dtype=torch.long)
    return parents, torch.tensor(sizes), torch.tensor([3, 0, 7, 11, 2]), trees, t


def test_tree_mask_reference():
    parents, sizes, prefix, trees, t = _mask_batch(0)
    mask, pos = kernels.tree_mask_and_positions(parents, sizes, prefix, backend="torch")
    assert mask.dtype == torch.bool and mask.shape == (5, t, t) and pos.shape == (5, t)
    for i, p in enumerate(trees):
        em, ed = _mask_expected(p, t)
        assert torch.equal(mask[i], em)
        assert torch.equal(pos[i], prefix[i] + ed)


# ---------------------------------------------------------------------------
# Triton kernels against the references


@needs_triton
@pytest.mark.parametrize("case", CHAIN_CASES)
@pytest.mark.parametrize("greedy", [False, True])
def test_chain_triton_matches_reference(case, greedy):
    seed, sizes, vocab, qform, edges = case
    b = _batch(seed, sizes, vocab, "chain", qform, edges)
    ref = _chain(b, greedy, "torch")
    got = _chain(b, greedy, "triton", DEV)
    assert [r.tolist() for r in ref] == [x.tolist() for x in got]


@needs_triton
@pytest.mark.parametrize("case", TREE_CASES)
@pytest.mark.parametrize("greedy", [False, True])
def test_tree_triton_matches_reference(case, greedy):
    seed, sizes, vocab, shape, qform, edges = case
    b = _batch(seed, sizes, vocab, shape, qform, edges)
    ref = _tree(b, greedy, "torch")
    got = _tree(b, greedy, "triton", DEV)
    assert [r.tolist() for r in ref] == [x.tolist() for x in got]


@needs_triton
def test_greedy_triton_argmax_ties_take_first():
    """Integer logits tie often, also across vocabulary blocks; torch.argmax takes the first."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 3, (5, 4, 70), generator=g).float()
    tokens = logits[:, :3].argmax(-1)
    tokens[1, 1] = int((logits[1, 1] == logits[1, 1].max()).nonzero()[-1])  # a later tied id: rejected
    parents = torch.tensor([-1, 0, 1]).expand(5, 3)
    ref = kernels.chain_accept(logits, tokens, greedy=True, backend="torch")
    got = kernels.chain_accept(logits.to(DEV), tokens.to(DEV), greedy=True, backend="triton", block_v=32)
    assert ref[0].tolist() == [3, 1, 3, 3, 3] and [r.tolist() for r in ref] == [x.cpu().tolist() for x in got]
    ref = kernels.tree_accept(logits, tokens, parents, greedy=True, backend="torch")
    got = kernels.tree_accept(logits.to(DEV), tokens.to(DEV), parents.to(DEV), greedy=True, backend="triton",
                              block_v=32)
    assert [r.tolist() for r in ref] == [x.cpu().tolist() for x in got]


@needs_triton
def test_tree_triton_random_sweep():
    """More seeds for the most involved kernel (sibling rejections, re-normalised residuals)."""
    for seed in range(70, 76):
        qform = ("none", "sparse", "dense")[seed % 3]
        b = _batch(seed, [seed % 7, 8, 4], 40 + 7 * seed % 50, ("random", "deep")[seed % 2], qform)
        assert [r.tolist() for r in _tree(b, False, "torch")] == [x.tolist() for x in _tree(b, False, "triton", DEV)]


@needs_triton
@pytest.mark.parametrize("seed,vocab,block", [(0, 83, 32), (1, 257, 64), (2, 16, 16)])
def test_residual_triton_matches_reference(seed, vocab, block):
    p, q, u = _residual_inputs(seed, 6, vocab)
    for qq in (q, None):
        ref = kernels.residual_sample(p, qq, u, backend="torch")
        got = kernels.residual_sample(p.to(DEV), _to(qq, DEV), u.to(DEV), backend="triton", block_v=block)
        assert ref.tolist() == got.cpu().tolist()


@needs_triton
def test_tree_mask_triton_matches_reference():
    parents, sizes, prefix, _, _ = _mask_batch(1)
    ref = kernels.tree_mask_and_positions(parents, sizes, prefix, backend="torch")
    got = kernels.tree_mask_and_positions(parents.to(DEV), sizes.to(DEV), prefix.to(DEV), backend="triton")
    assert torch.equal(ref[0], got[0].cpu()) and torch.equal(ref[1], got[1].cpu())


@needs_triton
def test_triton_empty_batch_and_zero_drafts():
    probs = torch.softmax(torch.randn(3, 1, 45), -1)
    tokens = torch.zeros(3, 0, dtype=torch.long)
    us = torch.rand(3, 1, dtype=torch.float64)
    ua = torch.zeros(3, 0, dtype=torch.float64)
    for greedy in (False, True):
        ref = kernels.chain_accept(probs, tokens, None, ua, us, greedy=greedy, backend="torch")
        got = kernels.chain_accept(probs.to(DEV), tokens.to(DEV), None, ua.to(DEV), us.to(DEV), greedy=greedy,
                                   backend="triton", block_v=16)
        assert [r.tolist() for r in ref] == [g.cpu().tolist() for g in got]
        assert ref[0].tolist() == [0, 0, 0]
        ref = kernels.tree_accept(probs, tokens, tokens, None, None, ua, us, greedy, backend="torch")
        got = kernels.tree_accept(probs.to(DEV), tokens.to(DEV), tokens.to(DEV), None, None, ua.to(DEV),
                                  us.to(DEV), greedy, backend="triton", block_v=16)
        assert [r.tolist() for r in ref] == [g.cpu().tolist() for g in got]
    empty = kernels.chain_accept(probs[:0].to(DEV), tokens[:0].to(DEV), None, ua[:0].to(DEV), us[:0].to(DEV),
                                 backend="triton")
    assert empty[0].shape == (0,)


def test_imports_without_triton():
    """The package and its references work where triton is missing."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch\nfrom specmesh import kernels\n"
            "p = torch.softmax(torch.randn(2, 3, 20), -1)\n"
            "a, n = kernels.chain_accept(p, torch.zeros(2, 2, dtype=torch.long), None,"
            " torch.rand(2, 2), torch.rand(2, 3))\n"
            "assert a.shape == (2,)\n")
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT)


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
def test_kernels_compile_for_cuda(tmp_path):
    """Lower every kernel variant to a sm_90 cubin (no GPU needed): catches what the
    interpreter cannot, e.g. type mismatches across control flow."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=ROOT, TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    r = subprocess.run([sys.executable, "-m", "specmesh.kernels.compile_check", "--arch", "90"], env=env,
                       cwd=ROOT, capture_output=True, text=True)
    if r.returncode == 77:
        pytest.skip(r.stdout.strip())
    assert r.returncode == 0, r.stdout + r.stderr
