"""Devices on the CPU: ``resolve_device`` and its errors, ``cpu_bf16_is_fast``, ``--device`` through the
settings, CLI and Runtime, and ``GraphedEngine``'s static-shape forward (run without
capture) against the eager engine: chains, trees, several sessions of different
lengths, padded buckets, the fallback, and the KV it writes. Fast, tiny models;
``tests/e2e/test_device_real.py`` runs the real model through ``GraphedEngine``."""

from __future__ import annotations

import shutil

import pytest
import torch

from specmesh.engine import LlamaEngine
from specmesh.engine.cudagraph import GraphedEngine
from specmesh.engine.device import resolve_device
from specmesh.types import InvalidArgument
from tests.support import tiny_hf

NO_CUDA = not torch.cuda.is_available()


# ---------------------------------------------------------------- resolve_device
def test_resolve_device_auto_and_cpu():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    auto = resolve_device("auto")
    assert auto.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device(None) == auto and resolve_device("") == auto


@pytest.mark.parametrize("spec", ["gpu", "cuda:x", "tpu:0", "cuda:-1", "mps", "meta"])
def test_resolve_device_rejects_garbage(spec):
    with pytest.raises(InvalidArgument) as e:
        resolve_device(spec)
    assert e.value.field == "device" and "cpu" in str(e.value)


@pytest.mark.skipif(not NO_CUDA, reason="checks the message on a machine without CUDA")
@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:3"])
def test_resolve_device_without_cuda(spec):
    with pytest.raises(InvalidArgument, match=r"device: cuda(:\d)? requested but torch.cuda.is_available\(\) is False"):
        resolve_device(spec)


def test_resolve_device_counts_gpus(monkeypatch):
    """cuda:N beyond the visible GPUs names how many there are (faked: one GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(InvalidArgument, match=r"cuda:3 requested but only 1 GPU visible"):
        resolve_device("cuda:3")


# ---------------------------------------------------------------- settings, CLI, Runtime
def test_settings_device_field(monkeypatch):
    from pydantic import ValidationError

    from specmesh.serving.settings import load_settings

    assert load_settings(None).device == "auto" and load_settings(None).cuda_graphs is True
    assert load_settings(None, device="CUDA:1").device == "cuda:1"
    monkeypatch.setenv("SPECMESH_DEVICE", "cpu")
    s = load_settings(None)
    assert s.device == "cpu" and s.torch_device() == torch.device("cpu")
    with pytest.raises(ValidationError, match="expected auto | cpu | cuda | cuda:N"):
        load_settings(None, device="gpu0")


@pytest.mark.skipif(not NO_CUDA, reason="needs a machine without CUDA")
def test_serve_refuses_a_missing_gpu_at_start_up(capsys):
    """``specmesh serve verifier --device cuda`` on a machine without CUDA: one clear
    line and exit 2 before any model or port is touched; a garbage device too."""
    from specmesh.cli import main

    assert main(["serve", "verifier", "--port", "0", "--device", "cuda", "--metrics", "false"]) == 2
    err = capsys.readouterr().err
    assert "specmesh: error: device: cuda requested but torch.cuda.is_available() is False" in err
    assert main(["serve", "--device", "gpu7"]) == 2
    err = capsys.readouterr().err
    assert "specmesh: error: invalid settings" in err and "expected auto | cpu | cuda | cuda:N, got 'gpu7'" in err


def test_cli_device_flags_parse():
    from specmesh.cli import build_parser
    from specmesh.cli.serve import settings_from_args

    ap = build_parser()
    a = ap.parse_args(["demo", "--device", "cpu", "--no-cuda-graphs"])
    assert a.device == "cpu" and a.cuda_graphs is False
    assert ap.parse_args(["demo"]).device == "auto" and ap.parse_args(["demo"]).cuda_graphs is True
    b = ap.parse_args(["bench", "--device", "cuda:1", "--hf-dtype", "bf16"])
    from specmesh.cli.bench import config_from_args

    cfg = config_from_args(b)
    assert (cfg.device, cfg.cuda_graphs, cfg.hf_dtype) == ("cuda:1", True, "bf16")
    s = settings_from_args(ap.parse_args(["serve", "verifier", "--device", "cpu", "--cuda-graphs", "false"]))
    assert s.device == "cpu" and s.cuda_graphs is False
    s = settings_from_args(ap.parse_args(["serve", "verifier", "--cuda-graphs", "invariant"]))
    assert s.cuda_graphs == "invariant"
    assert ap.parse_args(["demo", "--invariant-graphs"]).cuda_graphs == "invariant"
    assert config_from_args(ap.parse_args(["bench", "--invariant-graphs"])).cuda_graphs == "invariant"
    assert ap.parse_args(["device-check", "--out", "x"]).out == "x"


@pytest.mark.skipif(not NO_CUDA, reason="needs a machine without CUDA")
def test_device_check_without_cuda_says_so(capsys, tmp_path):
    from specmesh.cli import main

    assert main(["device-check", "--out", str(tmp_path / "o")]) == 3
    assert "no CUDA device here" in capsys.readouterr().err


def test_source_checkout_maps_the_package_folders_without_an_install():
    """A bare GPU machine runs device-check from a copy of the repository, not installed:
    with no site-packages at all (``-S``: no installed mapping), the repository root on
    ``sys.path`` still finds ``specmesh.router`` ... in their package-dir folders."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    names = ("router", "drafter_service", "verifier_service", "kernels")
    code = ("import importlib.util, json, sys, specmesh\n"
            f"print(json.dumps([importlib.util.find_spec('specmesh.' + n).origin for n in {names!r}]))")
    r = subprocess.run([sys.executable, "-S", "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [str(root / n / "__init__.py") for n in names]


def test_gpu_scripts_parse():
    import subprocess
    from pathlib import Path

    scripts = Path(__file__).resolve().parents[2] / "scripts"
    for name in ("gpu-stage", "gpu-assemble", "device-check"):
        r = subprocess.run(["bash", "-n", str(scripts / name)], capture_output=True, text=True)
        assert r.returncode == 0, (name, r.stderr)


# what the device check imports (its phases, the CLI commands it runs, gpu-assemble's conversion)
DEVICE_PATH = ("specmesh.cli", "specmesh.cli.bench.device_check", "specmesh.runtime", "specmesh.cli.bench.harness",
               "specmesh.cli.bench.peers", "specmesh.cli.bench.systems", "specmesh.cli.bench.strategies",
               "specmesh.cli.bench.sweep", "specmesh.serving.server", "specmesh.cli.stack", "specmesh.router",
               "specmesh.drafter_service", "specmesh.verifier_service", "specmesh.models.gguf_state",
               "specmesh.uno.diffusion", "specmesh.observability.wiring", "specmesh.kernels", "pytest")
NAMESPACES = {"google.protobuf": "protobuf", "opentelemetry.sdk": "opentelemetry-sdk",
              "opentelemetry.semconv": "opentelemetry-semantic-conventions", "opentelemetry": "opentelemetry-api"}


def test_gpu_stage_wheels_and_the_image_cover_what_the_device_check_imports():
    """Every third-party package the project's own code imports on the device check's path
    (imported in a fresh interpreter through ``DEVICE_PATH``) is in the GPU machines' image
    (``scripts/gpu-image-packages``) or among the wheels ``scripts/gpu-stage`` stages; the
    staged grpcio and protobuf meet the committed stubs' floors. (gpu-stage checks the
    staged wheels' own requirements against the same image list when it downloads them.)"""
    import ast
    import json
    import re
    import subprocess
    import sys
    from importlib.metadata import packages_distributions
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()  # noqa: E731
    image = {norm(x.split("#")[0].strip()) for x in (root / "scripts" / "gpu-image-packages").read_text().splitlines()
             if x.split("#")[0].strip()}
    stage = (root / "scripts" / "gpu-stage").read_text()
    pins = dict(re.findall(r"([A-Za-z0-9_.-]+)==([0-9][A-Za-z0-9.]*)", stage.split("WHEELS=(", 1)[1].split(")", 1)[0]))
    staged = {norm(k) for k in pins}
    own = set()  # the import names the project's code uses
    for folder in ("specmesh", "router", "drafter_service", "verifier_service", "kernels"):
        for f in (root / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Import):
                    own |= {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    own.add(node.module)
    code = "import importlib, json, sys\n" + "".join(f"importlib.import_module({m!r})\n" for m in DEVICE_PATH) \
        + "print(json.dumps(sorted(sys.modules)))"
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    loaded = set(json.loads(r.stdout.strip().splitlines()[-1]))
    dists = packages_distributions()
    need = {}
    for name in sorted(own & loaded):
        top = name.split(".")[0]
        if top in sys.stdlib_module_names or top in ("specmesh", "tests", "router", "kernels"):
            continue
        ns = next((d for k, d in NAMESPACES.items() if name == k or name.startswith(k + ".")), None)
        for d in ([ns] if ns else dists.get(top, [top])):
            need.setdefault(norm(d), name)
    missing = {d: n for d, n in need.items() if d not in image and d not in staged}
    assert not missing, f"imported on the device path, neither in the image nor staged: {missing}"
    stub = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", (root / "specmesh/v1/common_pb2_grpc.py").read_text())
    pb = re.search(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version.Domain.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+)",
                   (root / "specmesh/v1/common_pb2.py").read_text())
    ver = lambda v: tuple(int(x) for x in re.findall(r"\d+", v)[:3])  # noqa: E731
    assert ver(pins["grpcio"]) >= ver(stub.group(1)) and ver(pins["protobuf"]) >= tuple(map(int, pb.groups()))


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama as a Hugging Face directory, with the real model's tokenizer files."""
    from specmesh.models.loading import resolve_model

    src = resolve_model("smollm2-135m-instruct", quiet=True)
    d = tmp_path_factory.mktemp("tiny-model")
    model, _ = tiny_hf()
    model.save_pretrained(d)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, d / f.name)
    return d


def test_runtime_device_plumbing(tiny_model_dir):
    from specmesh.runtime import Runtime

    rt = Runtime(str(tiny_model_dir), n_slots=2, max_seq_len=64, layerskip_exit=1, quiet=True, block_drafter=False,
                 device="cpu")
    assert rt.device == torch.device("cpu") and rt.cuda_graphs is False and type(rt.engine) is LlamaEngine
    assert rt.engine.k_cache.device.type == "cpu"
    g = Runtime(str(tiny_model_dir), n_slots=2, max_seq_len=64, layerskip_exit=1, quiet=True, block_drafter=False,
                device="cpu", cuda_graphs="always")
    assert isinstance(g.engine, GraphedEngine) and not g.engine.capture and g.engine.n_slots == 2
    if NO_CUDA:
        with pytest.raises(InvalidArgument, match="device"):
            Runtime(str(tiny_model_dir), device="cuda", quiet=True, block_drafter=False)


def _fake_capture(monkeypatch, eng):
    """Stand in for CUDA capture on the CPU: a bucket's "graph" replays its static forward."""
    class Graph:
        def __init__(self, st):
            self.st = st

        def replay(self):
            self.st.out = eng._forward(self.st)

    eng.capture = True
    monkeypatch.setattr(eng, "_capture", lambda st: setattr(st, "graph", Graph(st)))


def test_runtime_warm_up_covers_what_the_drafters_use(tiny_model_dir, monkeypatch):
    """``Runtime.warm_up`` (run at start-up when graphs are captured, before a service
    reports SERVING) prepares every bucket the configuration uses: greedy and sampled
    rounds of plain decoding, prompt lookup, layer-skip and contrastive acceptance then
    capture nothing more (``serving_captures``, the verifier's ``cuda_graph_captures``)."""
    from specmesh.loop import generate_tokens
    from specmesh.runtime import Runtime
    from specmesh.types import SamplingParams

    rt = Runtime(str(tiny_model_dir), n_slots=2, max_seq_len=64, layerskip_exit=1, quiet=True, block_drafter=False,
                 device="cpu", cuda_graphs="always")
    eng = rt.engine
    assert rt.warmup_s is None and not eng._steps  # no capture on the CPU: no warm-up at start-up
    assert rt.verifier.info()["cuda_graph_captures"] is None
    _fake_capture(monkeypatch, eng)
    n = rt.warm_up()
    assert n == len(eng._steps) == eng.calls["captures"] > 0 and eng.serving and rt.warmup_s >= 0
    ids = [(3 * i + 1) % 90 + 2 for i in range(9)] * 2
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.8)
    cd = SamplingParams(acceptance="contrastive")
    for sp in (greedy, sampled, cd):
        for d, kw in ((None, {}), (rt.drafter("prompt_lookup"), {"budget": 6}), (None, {"self_draft": "layerskip"})):
            generate_tokens(d, rt.verifier, ids, max_new_tokens=8, sampling=sp, **kw)
    assert eng.calls["serving_captures"] == 0 and eng.calls["replayed"] > 0 and eng.calls["uncaptured"] == 0
    assert rt.verifier.info()["cuda_graph_captures"] == 0


def test_ray_config_asks_for_gpus_when_the_device_is_cuda():
    from specmesh.deploy.ray.config import RayAppConfig

    cfg = RayAppConfig.model_validate({"settings": {"device": "cuda"}})
    assert cfg.verifier.options("Verifier")["ray_actor_options"]["num_gpus"] == 1
    assert cfg.drafter.options("Drafter")["ray_actor_options"]["num_gpus"] == 0  # drafters stay on the CPU
    assert cfg.serve_settings("verifier").device == "cuda" and cfg.serve_settings("drafter").device == "cpu"
    gpu_drafter = RayAppConfig.model_validate({"drafter": {"device": "cuda:0"}, "verifier": {"num_gpus": 0.5}})
    assert gpu_drafter.drafter.num_gpus == 1 and gpu_drafter.verifier.num_gpus == 0.5
    assert gpu_drafter.device("verifier") == "auto"
    plain = RayAppConfig.model_validate({})
    assert plain.verifier.num_gpus == 0 and plain.device("drafter") == "cpu"
    with pytest.raises(ValueError):
        RayAppConfig.model_validate({"verifier": {"device": "gpu"}})


# ---------------------------------------------------------------- GraphedEngine without capture
def _pair(**kw):
    model, cfg = tiny_hf()
    sd = model.state_dict()
    eager = LlamaEngine(cfg, sd, n_slots=3, max_seq_len=64)
    static = GraphedEngine(cfg, sd, n_slots=3, max_seq_len=64, capture=False, **kw)
    return eager, static


def _same(a, b, hidden=()):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.logits.shape == y.logits.shape
        torch.testing.assert_close(y.logits, x.logits, atol=1e-4, rtol=0)
        assert torch.equal(x.logits.argmax(-1), y.logits.argmax(-1))
        for li in hidden:
            torch.testing.assert_close(y.hidden[li], x.hidden[li], atol=1e-4, rtol=1e-5)


def _both(engines, fn):
    return [fn(e) for e in engines]


def test_graphed_engine_matches_eager_chains_trees_and_sessions():
    eager, static = _pair()
    assert static.n_slots == 3 and static.k_cache.shape[1] == 4  # + the padding's scratch slot
    for e in (eager, static):
        e.prefill(0, list(range(5, 17)))  # 12 tokens: bucket 16
        e.prefill(1, list(range(30, 33)))  # 3: bucket 4
        e.prefill(2, [7])  # 1
    assert static.calls["graphed"] == 3 and static.calls["eager"] == 0
    chain = (0, [40, 41, 42], [-1, 0, 1])
    tree = (2, [50, 51, 52, 53, 54, 55], [-1, 0, 0, 1, 1, 2])
    single = (1, [60], [-1])
    items = [chain, tree, single]
    rows = [None, [0, 3, 5], [0]]
    a, b = (e.score_batch(items, rows=rows, hidden_layers=[0, 2]) for e in (eager, static))
    _same(a, b, hidden=[0, 2])
    assert b[1].logits.shape[0] == 3 and b[0].hidden[2].shape == (3, eager.hidden)
    # the KV the static forward wrote makes later calls match: commit a tree path and go on
    for e in (eager, static):
        e.commit(0, [0, 1, 2])
        e.commit(2, [0, 1, 4])
        e.commit(1, [0])
    a, b = (e.score_batch([(2, [61, 62], [-1, -1]), (0, [63], [-1]), (1, [64, 65, 66, 67, 68], [-1, 0, 1, 2, 3])])
            for e in (eager, static))
    _same(a, b)
    assert [static.length(s) for s in range(3)] == [15, 4, 4]
    # single-slot score (what layer-skip drafting calls) with extra and fewer layers
    for e in (eager, static):
        e.score(1, [70], [-1], extra=0)
    a, b = (e.score(1, [71], [-1], rows=[0], n_layers=2, extra=1) for e in (eager, static))
    _same([a], [b])
    keys = list(static._steps)
    # (B, T, layers, hidden layers, keys, adapted): batch 3 -> 4, 6 tokens -> 8; layers 2
    assert (4, 8, 3, (0, 2), 64, False) in keys and any(k[2] == 2 for k in keys)


def test_graphed_engine_buckets_padding_and_fallback():
    eager, static = _pair(batch_buckets=(1, 2, 4), token_buckets=(2, 4))
    assert static.batch_buckets == (1, 2, 4)
    for e in (eager, static):
        e.prefill(0, [3, 4, 5])  # bucket (1, 4)
        e.prefill(1, [6])  # bucket (1, 2): one padding token
        e.prefill(2, list(range(10, 20)))  # 10 tokens > 4: eager
    assert static.calls == {"graphed": 2, "replayed": 0, "uncaptured": 2, "eager": 1, "captures": 0,
                            "capture_errors": 0, "serving_captures": 0}
    a, b = (e.score_batch([(1, [7, 8, 9], [-1, 0, 0]), (2, [11], [-1])]) for e in (eager, static))
    _same(a, b)  # 2 sessions x 3 tokens -> bucket (2, 4)
    assert static.calls["graphed"] == 3
    # invalid input and oversized calls go to the eager engine, which raises the same errors
    for bad in ([(0, [1, 2, 3, 4, 5], [-1, 0, 1, 2, 3])], [(0, [1], [-1]), (0, [2], [-1])]):
        _same(eager.score_batch(bad), static.score_batch(bad))
    with pytest.raises(InvalidArgument, match="parents"):
        static.score_batch([(0, [1, 2], [-1, 5])])
    with pytest.raises(InvalidArgument, match="tokens"):
        static.score_batch([(0, [10**6], [-1])])
    assert static.calls["eager"] == 5
    # padding writes go to the scratch slot: slot 1 (1 committed token) scores one token at
    # position 1; its padding token (position 2) leaves the slot untouched
    assert static.length(1) == 1
    before = static.k_cache[:, 1, :, :3].clone()
    static.score_batch([(0, [1], [-1]), (1, [2], [-1])])  # bucket (2, 2): a padding token each
    after = static.k_cache[:, 1, :, :3]
    assert torch.equal(after[..., 0, :], before[..., 0, :]) and torch.equal(after[..., 2, :], before[..., 2, :])
    assert not torch.equal(after[..., 1, :], before[..., 1, :])


def test_graphed_engine_bf16_and_the_verifier():
    """bf16 (refined top logits) through ``EngineVerifier``: greedy rounds with a drafted
    tree give the same tokens on both engines."""
    from specmesh.types import SamplingParams, TokenTree, VerifyRequest
    from specmesh.verifier import EngineVerifier

    model, cfg = tiny_hf()
    sd = model.state_dict()
    # against the ragged eager forward (the padded static forward is not the batch-invariant one)
    vs = [EngineVerifier(LlamaEngine(cfg, sd, dtype="bf16", n_slots=2, max_seq_len=64, batch_invariant=False)),
          EngineVerifier(GraphedEngine(cfg, sd, dtype="bf16", n_slots=2, max_seq_len=64, capture=False))]
    outs = []
    for v in vs:
        v.enable_features([1])
        toks, got = [5, 6, 7, 8], []
        keep = 0
        for r in range(6):
            tree = TokenTree(tokens=[(t * 7 + r) % 96 for t in toks[-3:]], parents=[-1, 0, 0])
            res = v.verify(VerifyRequest("s", keep, toks[keep:], tree, SamplingParams()))
            keep = len(toks)
            new = res.accepted + [res.next_token]
            got += new
            toks = toks + new
        outs.append((got, v.features[v.slot_of("s"), :len(toks) - 1].clone()))
    assert outs[0][0] == outs[1][0]
    torch.testing.assert_close(outs[1][1].float(), outs[0][1].float(), atol=0.15, rtol=0.02)  # ~1 bf16 ulp
    assert vs[1].engine.calls["graphed"] > 0


def test_graphed_engine_serves_gated_rows_like_the_eager_engine():
    """The mask-gated adapter (specmesh.uno) in the static forward: mask rows read the MASK
    vector, gated rows get the low-rank terms through a 0/1 gate, normal rows are the
    target's; the same numbers as the eager engine, in a bucket (no eager fallback)."""
    from specmesh.uno.adapter import new_adapter

    eager, static = _pair()
    cfg = eager.config
    ad = new_adapter(cfg, rank=4, readout=8, block=3)
    g = torch.Generator().manual_seed(3)
    for d in ad.B:
        for p in d:
            d[p] = torch.randn(d[p].shape, generator=g) * 0.2
    ad.mask = torch.randn(ad.mask.shape, generator=g)
    for e in (eager, static):
        e.attach_adapter(ad)
        e.prefill(0, list(range(5, 12)))
    m = eager.mask_id
    # pending + 2 drafts + a block of 3 masks after the pending token and after each draft
    toks = [20, 21, 22] + [m] * 9
    par = [-1, 0, 1, 0, 3, 4, 1, 6, 7, 2, 9, 10]
    before = static.calls["graphed"]
    a, b = (e.score(0, toks, par, hidden_layers=[e.n_layers - 1]) for e in (eager, static))
    _same([a], [b], hidden=[eager.n_layers - 1])
    assert static.calls["graphed"] == before + 1  # 12 tokens: bucket 16, not the eager engine
    # gated rows holding real tokens (the diffusion mode) too
    a, b = (e.score(0, [20, m, 23, m], [-1, 0, 1, 2], gated=[1, 2, 3]) for e in (eager, static))
    _same([a], [b])
    static.attach_adapter(None)
    assert static._steps and not any(st.adapted for st in static._steps.values())  # only the adapted ones dropped


def _adapter(cfg):
    from specmesh.uno.adapter import new_adapter

    ad = new_adapter(cfg, rank=4, readout=8, block=3)
    g = torch.Generator().manual_seed(3)
    for d in ad.B:
        for p in d:
            d[p] = torch.randn(d[p].shape, generator=g) * 0.2
    ad.mask = torch.randn(ad.mask.shape, generator=g)
    return ad


def test_graphed_engine_plain_steps_run_no_adapter_terms():
    """With the mask-gated adapter attached, a step with no gated row and no mask row runs
    the bucket without the adapter's terms (no low-rank call at all, the same bits as an
    engine without the adapter); a step with gated rows runs its own bucket with them.
    Attaching or detaching the adapter keeps the plain buckets."""
    eager, static = _pair()
    _, bare = _pair()
    ad = _adapter(eager.config)
    calls = []
    real = ad.delta
    ad.delta = lambda *a, **k: (calls.append(a[:2]), real(*a, **k))[1]
    static.attach_adapter(ad)
    for e in (static, bare):
        e.prefill(0, list(range(5, 12)))
    assert calls == []  # the prompt: a plain step
    a, b = (e.score_batch([(0, [20, 21, 22], [-1, 0, 0])], hidden_layers=[1])[0] for e in (static, bare))
    assert calls == [] and torch.equal(a.logits, b.logits) and torch.equal(a.hidden[1], b.hidden[1])
    plain = set(static._steps)
    assert not any(k[5] for k in plain)
    m = static.mask_id
    eager.attach_adapter(ad)
    eager.prefill(0, list(range(5, 12)))
    _same([eager.score(0, [20, m, m], [-1, 0, 1])], [static.score(0, [20, m, m], [-1, 0, 1])])
    assert len(calls) > 0 and any(k[5] for k in static._steps)
    static.attach_adapter(None)
    assert set(static._steps) == plain  # the adapted bucket dropped, the plain ones kept


def test_graphed_engine_key_buckets_attend_over_the_smallest_that_holds_the_keys():
    """A forward attends over the smallest key bucket holding base + T for every row (not
    all max_seq_len keys), a KV head's query heads folded into its rows: the same numbers
    as the eager engine across bucket boundaries, chains and trees, several sessions."""
    model, cfg = tiny_hf()
    sd = model.state_dict()
    eager = LlamaEngine(cfg, sd, n_slots=2, max_seq_len=64)
    static = GraphedEngine(cfg, sd, n_slots=2, max_seq_len=64, capture=False, key_buckets=(8, 16, 32))
    assert static.key_buckets == (8, 16, 32, 64)
    assert cfg["num_attention_heads"] != cfg.get("num_key_value_heads", cfg["num_attention_heads"])  # GQA
    for e in (eager, static):
        e.prefill(0, list(range(3, 9)))  # 6 + 8 padded tokens: keys 16
        e.prefill(1, [4, 5])
    seen = []
    for r in range(10):
        items = [(0, [10 + r, 11, 12, 13], [-1, 0, 0, 1]), (1, [20 + r, 21, 22], [-1, 0, 1])]
        a, b = (e.score_batch(items) for e in (eager, static))
        _same(a, b)
        for e in (eager, static):
            e.commit(0, [0, 1, 3])
            e.commit(1, [0, 1, 2])
        seen.append(max(k[4] for k in static._steps))
    assert static.calls["eager"] == 0 and {8, 16, 32, 64} <= {k[4] for k in static._steps}
    assert seen == sorted(seen) and seen[-1] == 64  # 36 + 3 keys -> the 64 bucket


def test_graphed_engine_attention_is_a_plain_multi_head_call_over_the_key_bucket(monkeypatch):
    """What the fused kernels need from the static forward's attention: q, k and v with the
    same head count (a KV head's query heads folded into its rows: no ``enable_gqa``), one
    additive mask broadcast over heads, over the key bucket's S keys (not max_seq_len).
    (tests/deploy/test_cuda.py asks torch on the GPU whether the memory-efficient kernel
    takes these calls.)"""
    import specmesh.engine.cudagraph as cg

    seen = []
    real = cg.F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        seen.append((q.shape, k.shape, v.shape, None if attn_mask is None else attn_mask.shape, dict(kw)))
        return real(q, k, v, attn_mask=attn_mask, **kw)

    model, cfg = tiny_hf()
    eng = GraphedEngine(cfg, model.state_dict(), n_slots=2, max_seq_len=64, capture=False, key_buckets=(16, 32))
    eng.prefill(0, list(range(3, 13)))
    monkeypatch.setattr(cg.F, "scaled_dot_product_attention", spy)
    eng.score_batch([(0, [5, 6, 7], [-1, 0, 0]), (1, [8], [-1])])
    nk = cfg["num_key_value_heads"]
    g = cfg["num_attention_heads"] // nk
    assert len(seen) == cfg["num_hidden_layers"]
    for qs, ks, vs, ms, kw in seen:  # batch 2, 4 tokens; keys: 10 + 4 -> the 16 bucket
        assert qs == (2, nk, g * 4, eng.head_dim) and ks == vs == (2, nk, 16, eng.head_dim)
        assert ms == (2, 1, g * 4, 16) and not kw.get("enable_gqa") and not kw.get("is_causal")


def test_graphed_engine_counts_replays_failed_captures_and_serving_captures(monkeypatch):
    """The counters tell a replayed graph from a bucket's static forward run without one:
    a failed capture shows in ``capture_errors``, ``uncaptured`` and
    ``uncaptured_buckets()`` (what the CUDA tests assert empty); a capture after the
    warm-up (``serving``) is counted in ``serving_captures``. The capture itself is
    replaced by a stand-in graph that runs the static forward (no CUDA here)."""
    eager, static = _pair()
    _fake_capture(monkeypatch, static)
    fake, fail = static._capture, {"on": False}

    def capture(st):
        if fail["on"]:
            raise RuntimeError("capture failed")
        fake(st)

    monkeypatch.setattr(static, "_capture", capture)
    n = static.warm_up(batch_sizes=[1], tokens=[1, 2, 4, 8, 16], hidden_layers=[1])
    assert n == 5 and static.calls["captures"] == 5 and static.hidden_keep == (1,)
    static.serving = True
    for e in (eager, static):
        e.prefill(0, list(range(5, 17)))  # 12 tokens: the warmed (1, 16) bucket
    a, b = (e.score(0, [3, 4, 5], [-1, 0, 1]) for e in (eager, static))
    _same([a], [b])
    assert static.calls["replayed"] == 2 and static.calls["uncaptured"] == 0
    assert static.calls["serving_captures"] == 0 and static.uncaptured_buckets() == []
    static.score_batch([(0, [3], [-1]), (1, [4], [-1])])  # batch 2: not warmed up
    assert static.calls["serving_captures"] == 1 and static.calls["captures"] == 6
    fail["on"] = True
    _same([eager.score(0, [3, 4], [-1, 0], hidden_layers=[0])], [static.score(0, [3, 4], [-1, 0], hidden_layers=[0])])
    assert static.calls["capture_errors"] == 1 and static.calls["uncaptured"] == 1
    assert static.uncaptured_buckets() == [(1, 2, 3, (0, 1), 64, False)]


def test_graphed_engine_invariant_mode_rows_do_not_depend_on_the_call():
    """``GraphedEngine(invariant=True)``: one bucket shape for every forward and prompts in
    chunks of it, so a row's logits, hidden states and KV are bitwise the same scored
    alone, in a chain, in a prompt chunk or beside another session (bf16, the static
    forward run without capture on the CPU); greedy speculation then equals plain
    decoding through the verifier."""
    from specmesh.drafters.prompt_lookup import PromptLookupDrafter
    from specmesh.loop import generate_tokens
    from specmesh.verifier import EngineVerifier

    model, cfg = tiny_hf()
    sd = model.state_dict()
    mk = lambda: GraphedEngine(cfg, sd, dtype="bf16", n_slots=2, max_seq_len=96, capture=False,  # noqa: E731
                               invariant=True, invariant_tokens=8)
    a, b = mk(), mk()
    assert a.batch_buckets == (2,) and a.token_buckets == (8,)
    prompt = [(7 * i + 3) % 96 for i in range(21)]  # 21 tokens: chunks of 8, 8, 5
    a.prefill(0, prompt)
    for t in prompt:  # one token a forward
        b.score(0, [t], [-1])
        b.commit(0, [0])
    assert torch.equal(a.k_cache[:, 0, :, :21], b.k_cache[:, 0, :, :21])
    assert torch.equal(a.v_cache[:, 0, :, :21], b.v_cache[:, 0, :, :21])
    chain = [40, 41, 42, 43, 44]
    whole = a.score(0, chain, list(range(-1, 4)), hidden_layers=[1])
    b.prefill(1, [9, 9, 9])
    for j, t in enumerate(chain):  # alone, beside another session
        r = b.score_batch([(0, [t], [-1]), (1, [5], [-1])], hidden_layers=[1])[0]
        assert torch.equal(r.logits[0], whole.logits[j]) and torch.equal(r.hidden[1][0], whole.hidden[1][j])
        b.commit(0, [0])
    assert a.calls["eager"] == 0 and b.calls["eager"] == 0
    ver = EngineVerifier(mk())
    rep = [3, 9, 11, 20, 4, 8] * 3
    plain, _ = generate_tokens(None, ver, rep, max_new_tokens=24)
    spec, st = generate_tokens(PromptLookupDrafter(), ver, rep, max_new_tokens=24, budget=6)
    assert spec == plain and st.drafted_tokens > 0


def test_graphed_engine_full_64_token_bucket_packs_and_equals_eager():
    """A chain filling a 64-token bucket (the invariant mode's default, and a prompt chunk
    in it) sets ancestry bit 63; packing it overflowed a signed 64-bit tensor on the H200
    (device-check, 2026-12-04). The static forward of the full bucket, a tree in it and a
    64-token prompt in invariant chunks equal the eager engine."""
    from specmesh.engine import LlamaEngine

    model, cfg = tiny_hf()
    sd = model.state_dict()
    eager = LlamaEngine(cfg, sd, n_slots=1, max_seq_len=256)
    static = GraphedEngine(cfg, sd, n_slots=1, max_seq_len=256, capture=False)
    inv = GraphedEngine(cfg, sd, n_slots=1, max_seq_len=256, capture=False, invariant=True)
    assert inv.token_buckets == (64,)
    prompt = [(5 * i + 2) % 96 for i in range(70)]  # 70: a full 64-token chunk, then 6
    for e in (eager, static, inv):
        e.prefill(0, prompt[:6])
    chain = prompt[6:70]
    par = list(range(-1, 63))
    tree_par = [-1] + [(i - 1) // 2 for i in range(1, 64)]  # a binary tree of 64 nodes: deep ancestry bits
    for pp in (par, tree_par):
        _same([eager.score(0, chain, pp)], [static.score(0, chain, pp)])
        _same([eager.score(0, chain, pp)], [inv.score(0, chain, pp)])
    assert static.calls["eager"] == 0 and inv.calls["eager"] == 0
    e2 = LlamaEngine(cfg, sd, n_slots=1, max_seq_len=256)
    i2 = GraphedEngine(cfg, sd, n_slots=1, max_seq_len=256, capture=False, invariant=True)
    for e in (e2, i2):
        e.prefill(0, prompt)
    _same([e2.score(0, [7], [-1])], [i2.score(0, [7], [-1])])


def test_cpu_bf16_is_fast_follows_the_cpu_instructions(monkeypatch):
    """bf16 autocast is the training default only where the CPU multiplies bf16 natively."""
    import torch

    from specmesh.engine.device import cpu_bf16_is_fast

    for amx, avx512_bf16, fast in ((False, False, False), (True, False, True), (False, True, True)):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v, raising=False)
        assert cpu_bf16_is_fast() is fast
