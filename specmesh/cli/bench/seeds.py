"""Seeded requests repeated through the OpenAI front under load: are they reproducible?

``repeat_seeded`` sends each of some seeded, sampled chat requests ``repeats`` times with
``n`` 1 and with ``n`` = ``choices``, under the router's default strategy (``auto``: it picks
by features and by what it measured, and sizes drafts by measured timings), while
``background`` other streams decode beside them; every other repeat under a fresh
``cache_salt`` (a tenant of its own: the prefix cache cold) and the others under one
shared salt (warm). The seed contract: every repeat's answer is the same, and choice 0 of
``n`` choices is the ``n`` = 1 answer (docs/serving.md, "Seeds").

Used by ``scripts/seed_repeats.py`` (issue 68's 20 repeats of 5 requests beside 8 streams)
and ``tests/services/test_served_fields.py`` (a smaller run). Speaks the HTTP API only.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter, defaultdict
from typing import Optional

PROMPTS = [  # what auto sees: fresh text, a code edit, a quote, a conversation, a list
    [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message in a bottle."}],
    [{"role": "user", "content": "Rename the variable x to total in this code:\n```python\ndef f(items):\n    x = 0\n"
                                 "    for i in items:\n        x += i\n    return x\n```"}],
    [{"role": "user", "content": "Quote this sentence back to me, then explain it: \"The early bird catches the "
                                 "worm, but the second mouse gets the cheese.\""}],
    [{"role": "system", "content": "You are a friendly tutor."}, {"role": "user", "content": "What is a prime number?"},
     {"role": "assistant", "content": "A prime number has exactly two divisors: 1 and itself."},
     {"role": "user", "content": "Give me three examples and say why."}],
    [{"role": "user", "content": "List five fruits and one fact about each."}],
]
BACKGROUND = ["Tell me about the history of tea.", "Explain recursion to a child.", "Describe a rainy city street.",
              "What makes a good password?", "Summarise how vaccines work.", "Invent a board game.",
              "Why is the sky blue?", "Write a haiku about autumn."]


def _ask(client, model: str, messages: list, seed: int, n: int, max_tokens: int, salt: str,
         temperature: float) -> tuple[list[str], list[str]]:
    r = client.chat.completions.create(model=model, messages=messages, temperature=temperature, seed=seed, n=n,
                                       max_tokens=max_tokens, extra_body={"cache_salt": salt})
    sm = r.model_extra.get("specmesh", {})
    picks = [f"{c.get('strategy')}:{c.get('drafter')}" for c in sm.get("choices", [sm])]
    return [c.message.content for c in sorted(r.choices, key=lambda c: c.index)], picks


def repeat_seeded(client, model: str, repeats: int = 20, prompts: Optional[list] = None, choices: int = 4,
                  background: int = 8, max_tokens: int = 48, temperature: float = 0.8, seed: int = 777,
                  background_client=None, log=None) -> dict:
    """The run described in the module docstring; returns per prompt the distinct answers
    with n = 1, whether every n-choices answer's choice 0 equals them, the choice-wise
    distinct answers, the strategies auto picked, and the background streams' count and errors."""
    prompts = prompts if prompts is not None else PROMPTS
    stop = threading.Event()
    bg = {"requests": 0, "errors": []}
    bclient = background_client or client

    def stream(k: int) -> None:  # another user decoding beside the seeded requests (no seed: differs)
        while not stop.is_set():
            try:
                s = bclient.chat.completions.create(model=model, stream=True, max_tokens=max_tokens,
                                                    temperature=0.7 if k % 2 else 0.0,
                                                    messages=[{"role": "user", "content": BACKGROUND[k % 8]}])
                for _ in s:
                    pass
                bg["requests"] += 1
            except Exception as e:  # noqa: BLE001 - counted
                bg["errors"].append(f"{type(e).__name__}: {e}"[:300])

    threads = [threading.Thread(target=stream, args=(k,), daemon=True) for k in range(background)]
    for t in threads:
        t.start()
    single: dict[int, list] = defaultdict(list)
    multi: dict[int, list] = defaultdict(list)
    picks: dict[int, Counter] = defaultdict(Counter)
    warm = f"warm-{uuid.uuid4().hex[:8]}"
    try:
        for r in range(repeats):
            salt = f"cold-{uuid.uuid4().hex}" if r % 2 == 0 else warm
            for i, msgs in enumerate(prompts):
                one, p1 = _ask(client, model, msgs, seed + i, 1, max_tokens, salt, temperature)
                many, pn = _ask(client, model, msgs, seed + i, choices, max_tokens, salt, temperature)
                single[i].append(one[0])
                multi[i].append(tuple(many))
                picks[i].update(p1 + pn)
            if log is not None:
                log(f"repeat {r + 1}/{repeats}: distinct n=1 answers so far "
                    f"{[len(set(v)) for _, v in sorted(single.items())]}")
    finally:
        stop.set()
        for t in threads:
            t.join(600)
    out = {}
    for i in range(len(prompts)):
        firsts = [m[0] for m in multi[i]]
        out[i] = {"distinct_n1": len(set(single[i])), "distinct_n_choices": len(set(multi[i])),
                  "choice0_equals_n1": all(f == s for f, s in zip(firsts, single[i])),
                  "distinct_choices_within": len(set(multi[i][0])) if multi[i] else 0,
                  "picked": dict(picks[i]), "answer": single[i][0][:200] if single[i] else ""}
    return {"prompts": out, "repeats": repeats, "choices": choices, "background": background,
            "background_requests": bg["requests"], "background_errors": bg["errors"][:10],
            "all_identical": all(v["distinct_n1"] == 1 and v["distinct_n_choices"] == 1 and v["choice0_equals_n1"]
                                 for v in out.values())}


__all__ = ["PROMPTS", "repeat_seeded"]
