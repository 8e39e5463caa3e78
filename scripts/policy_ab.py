#!/usr/bin/env python3
"""A drafter under this code's budget policy against another commit's, in one process.

Loads ``specmesh/loop.py`` as it was at ``--rev`` (``at_rev.module_at``: its relative
imports resolve to this checkout's modules) beside this checkout's, and on each prompt of the
chosen bench workloads runs, alternating the order prompt by prompt: plain decoding,
the drafter under this policy, the drafter under the one at ``--rev`` (each loop with its
own ``AdaptiveBudget.for_drafter`` and one ``VerifyCosts`` per policy shared by all its
requests, as a ``Runtime`` shares one). ``--drafter``: a self drafter of the verifier
(``block_tree``, ``block``, ...) or a drafter ``Runtime.drafter`` builds (``prompt_lookup``,
``suffix``, ``draft_lm``: one instance per policy, so a suffix tree learns only from its
own arm's outputs). Prints tokens/s and each policy's ratio to plain decoding per
workload, and checks that all three outputs are identical (greedy).

    .venv/bin/python scripts/policy_ab.py --rev d077749 --dtype int4 --workloads open_writing,code_write
    .venv/bin/python scripts/policy_ab.py --rev 531f17a --drafter prompt_lookup --workloads open_writing
"""

from __future__ import annotations

import argparse
import time

import specmesh  # noqa: E402 - before torch: this script has the machine to itself

specmesh.spin_threads()

from specmesh import loop  # noqa: E402
from specmesh.workloads import load  # noqa: E402
from specmesh.runtime import Runtime  # noqa: E402

from at_rev import module_at  # noqa: E402 - scripts/at_rev.py


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rev", required=True, help="the commit whose loop.py is the baseline")
    ap.add_argument("--dtype", default="int4")
    ap.add_argument("--drafter", default="block_tree")
    ap.add_argument("--workloads", default="open_writing,chat_multiturn,code_write,reasoning")
    ap.add_argument("--prompts", type=int, default=4, help="per workload")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    a = ap.parse_args()
    rt = Runtime("smollm2-135m-instruct", dtype=a.dtype, n_slots=2, max_seq_len=2048, quiet=True)
    v = rt.verifier
    mods = {"this": loop, a.rev: module_at(a.rev, "specmesh/loop.py")}
    costs = {k: m.VerifyCosts() for k, m in mods.items()}
    own = a.drafter in v.self_drafters
    drafters = {k: None if own else rt.drafter(a.drafter) for k in mods}
    for wl, ps in load(a.workloads.split(","), a.prompts).items():
        ids = [rt.encode(p.prompt, p.messages) for p in ps]
        loop.generate_tokens(None, v, ids[0], max_new_tokens=16, stop_ids=rt.stop_ids)  # warm-up
        arms = ["plain", *mods]
        secs, toks = dict.fromkeys(arms, 0.0), dict.fromkeys(arms, 0)
        for n, prompt in enumerate(ids):
            outs = {}
            for arm in arms if n % 2 == 0 else arms[::-1]:
                t0 = time.perf_counter()
                if arm == "plain":
                    out, _ = loop.generate_tokens(None, v, prompt, max_new_tokens=a.max_new_tokens, stop_ids=rt.stop_ids)
                else:
                    m = mods[arm]
                    pol = m.AdaptiveBudget.for_drafter(a.drafter, 8, costs=costs[arm])
                    out, _ = m.generate_tokens(drafters[arm], v, prompt, max_new_tokens=a.max_new_tokens,
                                               stop_ids=rt.stop_ids, budget=pol, self_draft=a.drafter if own else None)
                secs[arm] += time.perf_counter() - t0
                toks[arm] += len(out)
                outs[arm] = out
            if len({tuple(o) for o in outs.values()}) != 1:
                raise SystemExit(f"{wl}: outputs differ between the arms on prompt {n}")
        rates = {k: toks[k] / secs[k] for k in arms}
        print(f"{wl}: plain {rates['plain']:.1f} tok/s; "
              + ", ".join(f"{k} {rates[k]:.1f} tok/s = {rates[k] / rates['plain']:.2f}x plain" for k in mods),
              flush=True)


if __name__ == "__main__":
    main()
