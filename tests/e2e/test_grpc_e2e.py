"""End to end over loopback with the real SmolLM2-135M: greedy output through the
router equals in-process plain greedy; 8 concurrent streams; a drafter process
killed mid-stream; cancel frees the KV slot; health and reflection; a raw client
built only from the .proto files; bearer-token auth; TLS and mutual TLS.

One Runtime and one set of in-process servers (``RuntimeStack`` of
tests/support.py) are shared by the module; the kill test runs its drafter as a
real subprocess.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import grpc
import pytest

from tests.support import REAL_N, REAL_SETTINGS, ROOT, RuntimeStack, free_port, settings, wait_for

pytestmark = pytest.mark.slow

N = REAL_N  # new tokens per generation (keeps the file within ~3 minutes on 2 cores)
PROMPTS = [
    "Write a Python function that checks whether a number is prime, then call it on 7.",
    "List the planets of the solar system in order from the sun.",
    "Repeat exactly: the cat sat on the mat. the cat sat on the mat. the cat sat on the mat.",
    "Explain in two sentences what a hash map is.",
]


@pytest.fixture(scope="module")
def stack():
    st = RuntimeStack()
    yield st
    st.close()


def test_greedy_through_router_equals_plain_greedy(stack):
    from specmesh import Client

    with Client(stack.address, timeout=120) as c:
        for prompt in PROMPTS[:3]:
            ref = stack.ref(prompt)
            r = c.generate(prompt, strategy="external", drafter="prompt_lookup", max_new_tokens=N)
            assert r.token_ids == ref, prompt
            assert r.text == stack.rt.decode(ref)
            assert r.stats.new_tokens == len(ref) and r.stats.rounds > 0 and r.stats.network_s >= 0
        prompt = PROMPTS[2]
        for strategy, drafter in (("autoregressive", ""), ("external", "suffix"), ("self", "")):
            r = c.generate(prompt, strategy=strategy, drafter=drafter, max_new_tokens=16, draft_budget=3)
            assert r.token_ids == stack.ref(prompt, 16), strategy
        # self without a drafter: the trained block drafter's tree when the verifier has it loaded
        assert r.stats.drafter == ("block_tree" if "block_tree" in stack.rt.verifier.self_drafters else "layerskip")
        s = c.stream(PROMPTS[2], strategy="external", max_new_tokens=N)
        pieces = list(s)
        assert "".join(pieces) == s.result.text == stack.rt.decode(stack.ref(PROMPTS[2]))
        assert len(pieces) > 1 and s.stats.tau > 1.0  # a repetitive prompt pays
        assert s.stats.accept_hist and s.stats.finish_reason in ("length", "stop")


def test_eight_concurrent_streams(stack):
    from specmesh import Client

    jobs = [(p, st) for p in PROMPTS for st in ("external", "autoregressive")]
    refs = {p: stack.ref(p) for p in PROMPTS}
    before = stack.verifier_info()
    out: dict = {}
    with Client(stack.address, timeout=180) as c:
        def run(i, prompt, strategy):
            out[i] = c.generate(prompt, strategy=strategy, max_new_tokens=N).token_ids

        threads = [threading.Thread(target=run, args=(i, p, st)) for i, (p, st) in enumerate(jobs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
    assert len(out) == 8
    for i, (p, _) in enumerate(jobs):
        assert out[i] == refs[p], jobs[i]
    after = stack.verifier_info()
    assert after.max_batch_seen > 1  # concurrent sessions shared forwards
    assert after.batches - before.batches < after.batched_requests - before.batched_requests
    assert wait_for(lambda: len(stack.verifier_info().sessions) == 0, 20)


def test_killing_the_drafter_process_mid_stream(stack):
    from specmesh.router.servicer import router_service
    from specmesh import Client
    from specmesh.serving.server import build_server

    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "specmesh.cli", "serve", "drafter", "--port", str(port)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        assert "listening on" in line, line
        rs = settings(REAL_SETTINGS, drafter_address=f"127.0.0.1:{port}",
                      verifier_addresses=[stack.vserver.address],
                      context_drafters="drafter")  # prompt lookup on that drafter process, not in the verifier
        svc, router = router_service(rs, codec=stack.rt)
        server = build_server(rs, [svc], 0)
        try:
            prompt = PROMPTS[2]
            ref = stack.ref(prompt, 48)
            with Client(server.address, timeout=120) as c:
                s = c.stream(prompt, strategy="external", drafter="prompt_lookup", max_new_tokens=48)
                it = iter(s)
                next(it)
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
                rest = list(it)
                assert s.token_ids == ref and rest, "the stream completes with plain decoding"
                assert s.stats.fallbacks >= 1
                assert not router.drafter.health.healthy  # marked unhealthy, retried after a backoff
                r = c.generate(prompt, strategy="external", max_new_tokens=16)  # still served, same output
                assert r.token_ids == stack.ref(prompt, 16)
        finally:
            server.server.stop(0)
            router.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_cancel_frees_the_slot(stack):
    from specmesh import Client

    with Client(stack.address, timeout=120) as c:
        s = c.stream(PROMPTS[1], strategy="external", max_new_tokens=200)
        it = iter(s)
        next(it)
        assert len(stack.verifier_info().sessions) == 1
        s.cancel()
        assert wait_for(lambda: len(stack.verifier_info().sessions) == 0, 10), "cancel must free the KV slot"
        f1 = stack.verifier_info().forwards
        time.sleep(0.5)
        assert stack.verifier_info().forwards == f1  # nothing keeps decoding for the cancelled call
        with pytest.raises(Exception) as e:
            c.generate(PROMPTS[1], max_new_tokens=200, timeout=0.5)
        assert type(e.value).__name__ == "DeadlineExceededError"
        assert wait_for(lambda: len(stack.verifier_info().sessions) == 0, 10), "an expired call frees its slot"


def test_health_and_reflection(stack):
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    for srv, name in ((stack.rserver, "Router"), (stack.dserver, "Drafter"), (stack.vserver, "Verifier")):
        with grpc.insecure_channel(srv.address) as ch:
            hs = health_pb2_grpc.HealthStub(ch)
            for service in ("", f"specmesh.v1.{name}"):
                r = hs.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert r.status == health_pb2.HealthCheckResponse.SERVING
            db = ProtoReflectionDescriptorDatabase(ch)
            assert f"specmesh.v1.{name}" in db.get_services()
            desc = DescriptorPool(db).FindServiceByName(f"specmesh.v1.{name}")
            assert len(desc.methods) >= 3
    with grpc.insecure_channel(stack.address) as ch:
        pool = DescriptorPool(ProtoReflectionDescriptorDatabase(ch))
        fields = pool.FindMessageTypeByName("specmesh.v1.GenerateRequest").fields_by_name
        assert {"prompt", "strategy", "max_new_tokens", "sampling"} <= set(fields)


def test_list_strategies_names_the_defaults(stack):
    from specmesh import Client

    with Client(stack.address, timeout=30) as c:
        resp = c.list_strategies()
    info = {s.name: s for s in resp.strategies}
    assert set(info) == {"autoregressive", "external", "self", "proactive", "ssr", "auto"}
    block = "block_tree" in stack.rt.verifier.self_drafters  # the bundled checkpoint is attached by Runtime
    assert info["self"].default_drafter == ("block_tree" if block else "layerskip")
    assert ("block_tree" in info["self"].drafters) == block and "layerskip" in info["self"].drafters
    assert info["external"].default_drafter == resp.default_drafter == stack.rs.default_drafter
    assert info["proactive"].default_drafter == info["ssr"].default_drafter == "cache"
    assert info["autoregressive"].default_drafter == "" and info["auto"].default_drafter == ""
    assert all(s.description for s in resp.strategies) and "block_tree" in info["self"].description


def test_raw_client_built_only_from_the_protos(stack, tmp_path):
    from grpc_tools import protoc

    protos = sorted((ROOT / "protos" / "specmesh" / "v1").glob("*.proto"))
    assert protoc.main(["protoc", f"-I{ROOT / 'protos'}", f"--python_out={tmp_path}",
                        f"--grpc_python_out={tmp_path}", *map(str, protos)]) == 0
    for d in (tmp_path / "specmesh", tmp_path / "specmesh" / "v1"):
        (d / "__init__.py").touch()
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(tmp_path)!r})
        import grpc
        from specmesh.v1 import router_pb2, router_pb2_grpc
        assert router_pb2.__file__.startswith({str(tmp_path)!r}), router_pb2.__file__
        stub = router_pb2_grpc.RouterStub(grpc.insecure_channel({stack.address!r}))
        req = router_pb2.GenerateRequest(prompt={PROMPTS[2]!r}, strategy="external", max_new_tokens=16)
        text, final = "", None
        for resp in stub.Generate(req, timeout=120):
            if resp.WhichOneof("event") == "delta":
                text += resp.delta.text
            else:
                final = resp.final
        print(json.dumps({{"text": text, "final": final.text, "ids": list(final.token_ids),
                          "rounds": final.stats.rounds}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    ref = stack.ref(PROMPTS[2], 16)
    assert got["ids"] == ref and got["text"] == got["final"] == stack.rt.decode(ref) and got["rounds"] > 0


def test_token_auth(stack):
    from specmesh import Client
    from specmesh.errors import UnauthenticatedError
    from specmesh.serving.server import build_server

    srv = build_server(stack.rs, [stack.rsvc], 0, token="e2e-secret")
    try:
        with Client(srv.address, timeout=60) as c:
            with pytest.raises(UnauthenticatedError):
                c.generate(PROMPTS[2], max_new_tokens=4)
        with Client(srv.address, token="wrong", timeout=60) as c:
            with pytest.raises(UnauthenticatedError):
                c.generate(PROMPTS[2], max_new_tokens=4)
        with Client(srv.address, token="e2e-secret", timeout=60) as c:
            assert c.generate(PROMPTS[2], max_new_tokens=8).token_ids == stack.ref(PROMPTS[2], 8)
    finally:
        srv.server.stop(0)


def _pki(tmp: Path) -> dict:
    pytest.importorskip("cryptography")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def key():
        return ec.generate_private_key(ec.SECP256R1())

    def cert(subject, issuer, pub, signer, ca=False, sans=()):
        b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
             .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)])).public_key(pub)
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
        return b.sign(signer, hashes.SHA256())

    def pem_key(k):
        return k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                               serialization.NoEncryption())

    ca_key, srv_key, cli_key = key(), key(), key()
    ca = cert("specmesh-test-ca", "specmesh-test-ca", ca_key.public_key(), ca_key, ca=True)
    srv = cert("localhost", "specmesh-test-ca", srv_key.public_key(), ca_key,
               sans=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    cli = cert("client", "specmesh-test-ca", cli_key.public_key(), ca_key)
    pem = serialization.Encoding.PEM
    files = {"ca": ca.public_bytes(pem), "srv_cert": srv.public_bytes(pem), "srv_key": pem_key(srv_key),
             "cli_cert": cli.public_bytes(pem), "cli_key": pem_key(cli_key)}
    for name, data in files.items():
        (tmp / name).write_bytes(data)
    return {name: tmp / name for name in files}


def test_tls_and_mutual_tls(stack, tmp_path):
    from specmesh import Client
    from specmesh.errors import UnavailableError
    from specmesh.serving.server import build_server

    pki = _pki(tmp_path)
    ref = stack.ref(PROMPTS[2], 8)
    tls = settings(REAL_SETTINGS, tls_cert=str(pki["srv_cert"]), tls_key=str(pki["srv_key"]))
    srv = build_server(tls, [stack.rsvc], 0)
    try:
        with Client(srv.address, root_certificates=pki["ca"].read_bytes(), timeout=60) as c:
            assert c.generate(PROMPTS[2], max_new_tokens=8).token_ids == ref
        with Client(srv.address, tls=True, timeout=10) as c:  # system roots do not trust the test CA
            with pytest.raises(UnavailableError):
                c.generate(PROMPTS[2], max_new_tokens=4)
        with Client(srv.address, timeout=10) as c:  # plaintext to a TLS port
            with pytest.raises(UnavailableError):
                c.generate(PROMPTS[2], max_new_tokens=4)
    finally:
        srv.server.stop(0)
    mtls = settings(REAL_SETTINGS, tls_cert=str(pki["srv_cert"]), tls_key=str(pki["srv_key"]),
                    tls_client_ca=str(pki["ca"]))
    srv = build_server(mtls, [stack.rsvc], 0)
    try:
        with Client(srv.address, root_certificates=pki["ca"], private_key=pki["cli_key"],
                    certificate_chain=pki["cli_cert"], timeout=60) as c:
            assert c.generate(PROMPTS[2], max_new_tokens=8).token_ids == ref
        with Client(srv.address, root_certificates=pki["ca"], timeout=10) as c:  # no client certificate
            with pytest.raises(UnavailableError):
                c.generate(PROMPTS[2], max_new_tokens=4)
    finally:
        srv.server.stop(0)
