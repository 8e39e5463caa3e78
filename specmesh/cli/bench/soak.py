"""``specmesh bench-serving --soak-serve N``: N honest two-turn conversations through a real
``specmesh serve`` (its OpenAI front), a fuzzing client beside them, for issue 68's soak.

- honest: ``--soak-concurrency`` workers send the conversations (a system prompt and a
  question cut from the bundled workloads, two turns, ``--soak-tokens`` a reply), greedy
  and ``auto``; each error is counted (there must be none);
- seeded: the first ``--soak-seeded`` conversations are sampled (temperature 0.8, a seed
  each); they run once alone before the soak (the quiet run) and again inside it, spread
  through it: their outputs must be the same (cache cold then warm, under load);
- the fuzzing client (``--soak-fuzz``, on by default): schemathesis cases over the front's
  ``/openapi.json`` and Hypothesis ``GenerateRequest`` cases on the router, back to back
  until the conversations end (``specmesh.cli.bench.fuzz``), every case judged;
- memory: the resident set of ``specmesh serve``'s process tree (the supervisor, router,
  drafter, verifier and front), by process, sampled every 25 conversations; flat means the
  last sample within 5% of the one after the warm-up. The warm-up: first the server's
  capacity is touched once (``warm_capacity``: a prompt of the longest length allowed in
  every KV slot, plain and through the model drafters: their KV buffers are mapped lazily,
  resident as positions are first written, so the first long prompts raise the RSS by up to
  slots x positions x a position's KV), then the first 10% of the conversations (the prefix
  cache, ``--soak-mib``, full and evicting by then).

Knows nothing about models beyond the texts it cuts; speaks HTTP and gRPC.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Optional

FLAT = 0.05  # RSS growth after the warm-up that still counts as flat
WARM_TOKENS = 8  # tokens a warm-up request generates (``warm_capacity``)


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (Linux /proc)."""
    return sum(tree_parts(pid).values())


def tree_parts(pid: int) -> dict:
    """Resident bytes of a process and each descendant, by name (``serve``, ``serve verifier``, ...)."""
    out, todo, seen = {}, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
            args = [a.decode(errors="replace") for a in cmd]
            name = " ".join(args[args.index("serve"):args.index("serve") + 2]) if "serve" in args else str(p)
            name = name if name.split()[-1] in ("serve", "drafter", "verifier", "router", "openai") else "serve"
            for ln in Path(f"/proc/{p}/status").read_text().splitlines():
                if ln.startswith("VmRSS:"):
                    out[name] = out.get(name, 0) + int(ln.split()[1]) * 1024
            for t in Path(f"/proc/{p}/task").iterdir():
                todo += [int(k) for k in (t / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return out


def warm_capacity(client, model: str, texts, slots: int, prompt_tokens: int) -> None:
    """Touch the server's lazily mapped capacity once: ``slots`` concurrent requests of a
    ``prompt_tokens``-token prompt, plainly and through each model drafter (the draft LM, the
    block drafter on the drafter service and in the verifier), ``WARM_TOKENS`` tokens each:
    enough for a drafted round, the one that feeds a drafter the prompt (with fewer no round
    has room for a draft, and the draft LM's KV pages are first written mid-soak)."""
    def one(k: int, extra: dict) -> None:
        try:
            client.completions.create(model=model, prompt=texts.piece(prompt_tokens), max_tokens=WARM_TOKENS,
                                      temperature=0, extra_body=extra)
        except Exception as e:  # noqa: BLE001 - a drafter this server lacks: that capacity is not there
            print(f"  warm-up {extra}: {type(e).__name__}", file=sys.stderr, flush=True)

    for extra in ({"strategy": "autoregressive"}, {"strategy": "external", "drafter": "draft_lm"},
                  {"strategy": "external", "drafter": "block_tree"}, {"strategy": "self"}):
        threads = [threading.Thread(target=one, args=(k, extra)) for k in range(slots)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def conversation(texts, k: int) -> list[dict]:
    return [{"role": "system", "content": f"Conversation {k}. You are a concise assistant. " + texts.piece(60)},
            {"role": "user", "content": texts.piece(50) + "\nWhat is this about?"}]


def talk(client, model: str, msgs: list[dict], tokens: int, seed: Optional[int]) -> list[str]:
    """Two turns; the replies."""
    msgs, out = list(msgs), []
    for turn in range(2):
        kw = dict(temperature=0.8, seed=seed) if seed is not None else dict(temperature=0)
        r = client.chat.completions.create(model=model, messages=msgs, max_tokens=tokens, **kw)
        text = r.choices[0].message.content or ""
        out.append(text)
        msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "Say more about that."}]
    return out


def run_soak_served(args, texts, start, out: Path) -> dict:
    """The soak described in the module docstring (``start``: bench-serving's server starter)."""
    import openai

    from . import fuzz

    n, seeded = args.soak_serve, min(args.soak_seeded, args.soak_serve)
    convs = [conversation(texts, k) for k in range(n)]
    # a small cache that fills early and evicts all along (a slot of 2,048 positions: the budget's floor);
    # generation capped so that the fuzzing client's cases (n up to 8, any max_tokens) cost what an honest
    # turn does, not minutes
    srv, url, model = start("ours", args, out, extra=["--prefix-cache-mib", str(args.soak_mib), "--max-seq-len", "2048",
                                                      "--max-new-tokens-limit", str(2 * args.soak_tokens)],
                            env={"SPECMESH_DEFAULT_MAX_NEW_TOKENS": str(args.soak_tokens)})
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=900)
    base = url.removesuffix("/v1")
    res: dict = {"conversations": n, "seeded": seeded, "tokens": args.soak_tokens, "budget_mib": args.soak_mib,
                 "concurrency": args.soak_concurrency}
    t0 = time.perf_counter()
    try:
        warm_capacity(client, model, texts, 8, 1800)  # the prompt limit is 2,000 tokens (bench-serving's start)
        res["capacity_warm_mib"] = round(tree_rss(srv.proc.pid) / 2 ** 20, 1)
        quiet = {k: talk(client, model, convs[k], args.soak_tokens, 1000 + k) for k in range(seeded)}
        res["quiet_seconds"] = round(time.perf_counter() - t0)
        stop = threading.Event()
        tally = fuzz.Tally()

        def fuzzing() -> None:
            i = 0
            while not stop.is_set():
                try:
                    fuzz.fuzz_http(base, 20, args.seed + i, tally, stop=stop)
                    fuzz.fuzz_grpc(srv.address, 20, args.seed + i, tally, stop=stop)
                except Exception as e:  # noqa: BLE001 - the fuzzer's own failure is reported, not fatal
                    tally.add("fuzzer", type(e).__name__, f"the fuzzing client failed: {e}")
                i += 1

        fz = threading.Thread(target=fuzzing, daemon=True) if args.soak_fuzz else None
        # the seeded conversations spread through the soak (cache warm now, under load)
        order = list(range(seeded, n))
        for j, k in enumerate(range(seeded)):
            order.insert(min(len(order), (j + 1) * max(1, len(order) // (seeded + 1)) + j), k)
        lock, done, errors, again, rss, parts = threading.Lock(), [0], [], {}, [], []
        warm_at = max(1, n // 10)
        rss0: list = []

        def worker() -> None:
            while True:
                with lock:
                    if not order:
                        return
                    k = order.pop(0)
                try:
                    got = talk(client, model, convs[k], args.soak_tokens, 1000 + k if k < seeded else None)
                    if k < seeded:
                        again[k] = got
                except Exception as e:  # noqa: BLE001 - counted: an honest conversation must not fail
                    with lock:
                        errors.append(f"conversation {k}: {type(e).__name__}: {str(e)[:300]}")
                with lock:
                    done[0] += 1
                    c = done[0]
                if c == warm_at:
                    rss0.append(tree_rss(srv.proc.pid))
                if c % 25 == 0 or c == n:
                    by = tree_parts(srv.proc.pid)
                    r = sum(by.values())
                    rss.append((c, r))
                    parts.append((c, {k: round(v / 2 ** 20) for k, v in sorted(by.items())}))
                    print(f"  soak-serve {c}/{n}: rss {r / 2 ** 20:.0f} MiB, errors {len(errors)}, fuzz cases "
                          f"{sum(tally.cases.values())} failed {tally.failed}", file=sys.stderr, flush=True)

        t1 = time.perf_counter()
        if fz is not None:
            fz.start()
        workers = [threading.Thread(target=worker) for _ in range(args.soak_concurrency)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        stop.set()
        if fz is not None:
            fz.join(900)
        res["soak_seconds"] = round(time.perf_counter() - t1)
        res["errors"] = errors[:20]
        res["error_count"] = len(errors)
        res["seeded_changed"] = sorted(k for k in range(seeded) if again.get(k) != quiet[k])
        base_rss = rss0[0] if rss0 else (rss[0][1] if rss else 0)
        res["rss_mib"] = [(c, round(r / 2 ** 20, 1)) for c, r in rss]
        res["rss_warm_mib"] = round(base_rss / 2 ** 20, 1)
        res["rss_growth"] = (rss[-1][1] - base_rss) / base_rss if rss and base_rss else None
        res["rss_by_process_mib"] = parts
        res["fuzz"] = tally.to_dict()
        res["not_serving"] = fuzz.still_serving(base, srv.address)
    finally:
        client.close()
        srv.stop()
    return res


def verdict(so: dict) -> str:
    g = so.get("rss_growth")
    fz = so.get("fuzz", {})
    ok = (not so["error_count"] and not so["seeded_changed"] and g is not None and g <= FLAT
          and not fz.get("failed") and not so["not_serving"])
    return (f"soak through serve: {so['conversations']} conversations ({so['concurrency']} at a time), "
            f"{so['error_count']} errors; seeded {so['seeded']} changed {len(so['seeded_changed'])}; RSS "
            f"{so['rss_warm_mib']} MiB after the warm-up, {'%+.1f%%' % (100 * g) if g is not None else '?'} at the "
            f"end (target <= +{100 * FLAT:.0f}%); fuzzing beside it: {sum(fz.get('cases', {}).values())} cases, "
            f"{fz.get('failed')} failed; still serving: {not so['not_serving']}: {'MET' if ok else 'NOT MET'}")


__all__ = ["run_soak_served", "tree_rss", "verdict"]
