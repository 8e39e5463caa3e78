"""A two-step agent loop with tools against a running ``specmesh serve``: call, tool result, answer.

The way an agent framework drives the OpenAI API: the request carries tools, the model
answers with ``tool_calls``, this script runs the called tool here (real Python functions:
``multiply`` and ``word_count``), sends the result back as a ``role: tool`` message and
reads the model's final answer. Four clients do the same loop:

- ``openai``: the official ``openai`` client, not streamed;
- ``openai-stream``: the same, streamed (tool-call deltas put together by index);
- ``langchain``: LangChain's ``ChatOpenAI(...).bind_tools([...])`` with ``invoke``;
- ``langchain-stream``: the same with ``stream`` (chunks added up).

For each it prints whether the model called a tool, whether the arguments hold the tool's
JSON schema (``jsonschema``), the tool's result, whether the final answer contains it, and
the specmesh stats of each step; ``--out`` gets them as JSON. Start the server first, e.g.

    specmesh serve --model qwen2.5-coder-1.5b-instruct --dtype int4     # make setup-qwen once
    python scripts/agent_loop.py --model qwen2.5-coder-1.5b-instruct

LangChain is the optional ``agents`` extra: ``pip install -e '.[agents]'``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

TOOLS = [
    {"type": "function", "function": {
        "name": "multiply", "description": "Multiply two integers exactly and return the product.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "first factor"},
                                                        "b": {"type": "integer", "description": "second factor"}},
                       "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "word_count", "description": "Count the words of a text.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string", "description": "the text"}},
                       "required": ["text"], "additionalProperties": False}}},
]
QUESTION = "What is 1234 multiplied by 5678? Use the multiply tool, then tell me the result."


def multiply(a: int, b: int) -> int:
    return a * b


def word_count(text: str) -> int:
    return len(text.split())


FUNCTIONS = {"multiply": multiply, "word_count": word_count}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def run_tool(name: str, arguments: str) -> tuple[str, dict]:
    """Run one call here: (the result as text, a record of the call)."""
    import jsonschema

    rec = {"name": name, "arguments": arguments, "valid_args": False}
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else dict(arguments)
        jsonschema.validate(args, SCHEMAS[name])
        rec["valid_args"] = True
        result = str(FUNCTIONS[name](**args))
    except Exception as e:  # noqa: BLE001 - the model's call is reported as it came
        result = f"error: {e}"
    rec["result"] = result
    return result, rec


def _stats(extra) -> dict:
    st = (extra or {}).get("specmesh") or {}
    return {k: st.get(k) for k in ("strategy", "drafter", "tau", "forced_tokens", "tokens_per_s") if k in st}


# ---------------------------------------------------------------- the official openai client

def openai_loop(base_url: str, model: str, stream: bool, max_tokens: int, temperature: float) -> dict:
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=600, max_retries=0)
    messages = [{"role": "user", "content": QUESTION}]
    out = {"client": "openai" + ("-stream" if stream else ""), "steps": []}
    for step in range(2):
        kw = dict(model=model, messages=messages, tools=TOOLS, max_tokens=max_tokens, temperature=temperature)
        t0 = time.perf_counter()
        if not stream:
            r = client.chat.completions.create(**kw)
            msg, finish = r.choices[0].message, r.choices[0].finish_reason
            content = msg.content or ""
            calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                     for c in msg.tool_calls or []]
            stats = _stats(r.model_extra)
        else:
            content, calls, finish, stats = "", {}, None, {}
            for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
                if chunk.model_extra and chunk.model_extra.get("specmesh"):
                    stats = _stats(chunk.model_extra)
                if not chunk.choices:
                    continue
                d = chunk.choices[0].delta
                content += d.content or ""
                for tc in d.tool_calls or []:
                    c = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                    c["id"] = tc.id or c["id"]
                    if tc.function:
                        c["name"] += tc.function.name or ""
                        c["arguments"] += tc.function.arguments or ""
                finish = chunk.choices[0].finish_reason or finish
            calls = [calls[i] for i in sorted(calls)]
        rec = {"finish_reason": finish, "content": content, "tool_calls": calls, "stats": stats,
               "seconds": round(time.perf_counter() - t0, 1)}
        out["steps"].append(rec)
        if not calls:
            break
        messages.append({"role": "assistant", "content": content or None, "tool_calls": [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls]})
        rec["tools_run"] = []
        for c in calls:
            result, ran = run_tool(c["name"], c["arguments"])
            rec["tools_run"].append(ran)
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": result})
    return out


# ---------------------------------------------------------------- LangChain

def langchain_loop(base_url: str, model: str, stream: bool, max_tokens: int, temperature: float) -> dict:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def multiply_tool(a: int, b: int) -> int:
        """Multiply two integers exactly and return the product."""
        return multiply(a, b)

    @tool
    def word_count_tool(text: str) -> int:
        """Count the words of a text."""
        return word_count(text)

    multiply_tool.name, word_count_tool.name = "multiply", "word_count"
    lc_tools = {"multiply": multiply_tool, "word_count": word_count_tool}
    llm = ChatOpenAI(model=model, base_url=base_url, api_key="unused", temperature=temperature,
                     max_tokens=max_tokens, max_retries=0, timeout=600)
    bound = llm.bind_tools(list(lc_tools.values()))
    messages = [HumanMessage(QUESTION)]
    out = {"client": "langchain" + ("-stream" if stream else ""), "steps": []}
    for step in range(2):
        t0 = time.perf_counter()
        if stream:
            ai = None
            for chunk in bound.stream(messages):
                ai = chunk if ai is None else ai + chunk
        else:
            ai = bound.invoke(messages)
        meta = getattr(ai, "response_metadata", {}) or {}
        calls = [{"id": c["id"], "name": c["name"], "arguments": json.dumps(c["args"])} for c in ai.tool_calls]
        rec = {"finish_reason": meta.get("finish_reason"), "content": ai.content if isinstance(ai.content, str) else
               str(ai.content), "tool_calls": calls, "invalid_tool_calls": [dict(c) for c in ai.invalid_tool_calls],
               "seconds": round(time.perf_counter() - t0, 1)}
        out["steps"].append(rec)
        if not ai.tool_calls:
            break
        messages.append(ai)
        rec["tools_run"] = []
        for c in ai.tool_calls:
            _, ran = run_tool(c["name"], json.dumps(c["args"]))
            rec["tools_run"].append(ran)
            messages.append(lc_tools[c["name"]].invoke(c) if ran["valid_args"] else
                            ToolMessage(ran["result"], tool_call_id=c["id"]))
    return out


def verdict(run: dict) -> dict:
    """Did the model call a tool with valid arguments, and does the final answer carry the result?"""
    s = run["steps"]
    ran = s[0].get("tools_run") or []
    results = [r["result"] for r in ran]
    final = s[-1]["content"] if len(s) > 1 else ""
    answer_has = any(x in final.replace(",", "") for x in results) if results else False
    return {"called_tool": bool(ran), "valid_args": bool(ran) and all(r["valid_args"] for r in ran),
            "calls": [f"{r['name']}({r['arguments']}) -> {r['result']}" for r in ran], "final_answer": final,
            "answer_has_result": answer_has, "completed": bool(ran) and len(s) == 2 and bool(final.strip())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--clients", nargs="*", default=["openai", "openai-stream", "langchain", "langchain-stream"],
                    choices=["openai", "openai-stream", "langchain", "langchain-stream"])
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--out", default="bench-out/agent_loop.json")
    args = ap.parse_args(argv)
    runs = []
    for name in args.clients:
        f = langchain_loop if name.startswith("langchain") else openai_loop
        print(f"--- {name}", flush=True)
        try:
            run = f(args.base_url, args.model, name.endswith("-stream"), args.max_tokens, args.temperature)
            run["verdict"] = verdict(run)
        except Exception as e:  # noqa: BLE001 - a client that fails is a result
            run = {"client": name, "error": f"{type(e).__name__}: {e}", "verdict": {"completed": False}}
        runs.append(run)
        v = run["verdict"]
        if "error" in run:
            print(f"  error: {run['error']}")
            continue
        for i, st in enumerate(run["steps"]):
            print(f"  step {i + 1}: finish {st['finish_reason']}, {st['seconds']} s, tool calls "
                  f"{[c['name'] + c['arguments'] for c in st['tool_calls']]}, content {st['content'][:200]!r}"
                  + (f", {st['stats']}" if st.get("stats") else ""))
        print(f"  called a tool: {v['called_tool']}, arguments valid: {v['valid_args']}, {v['calls']}; "
              f"final answer has the result: {v['answer_has_result']}; loop completed: {v['completed']}")
    if args.out:
        from pathlib import Path

        p = Path(args.out)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps({"model": args.model, "question": QUESTION, "runs": runs}, indent=1))
        print(f"wrote {p}")
    return 0 if all(r["verdict"]["completed"] and r["verdict"]["valid_args"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
