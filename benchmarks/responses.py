"""Responses benchmark: turn-10 time to first token of an agent conversation, chained vs stateless.

SmolLM2-135M-Instruct on this CPU, through real HTTP servers and the openai
client. A 10-turn agent conversation grows to about 3,000 tokens (long user
messages with notes, short greedy answers; turns 3 and 7 force a call of the
`lookup` function tool, whose output opens the next turn). It runs three ways,
each under its own tenant (tenants never share cache):

- chained: POST /v1/responses with previous_response_id (prefix caching on);
  each turn sends only its new items and continues on the response's pinned KV;
- stateless, prefix caching on: the whole conversation through
  /v1/chat/completions on the same server;
- stateless, prefix caching off: the same on a second server whose engine
  has prefix caching disabled.

Between turns (untimed), a third tenant's traffic passes through the caching
server: unrelated long prompts, as an agent's tool runs and its user types
while other tenants keep the server busy. The KV pool (`--kv-blocks`) holds a
pinned conversation plus one running request, so that traffic evicts the
stateless conversation's prefix-cache blocks (least recently used first)
while the chained conversation's pinned blocks stay. With no other traffic at
all, prefix caching alone keeps nearly as much as the pin (the quiet case is
reported too, as `turn10_ttft_speedup_vs_prefix_cached_quiet`).

The stateless runs replay the chained run's transcript (same tool-call ids),
so every turn's answer (text and tool-call arguments) of all three must be
identical; that is checked before any time counts. TTFT is measured by the
client: request sent -> first streamed output delta. The figures are medians
over the repeats (each repeat is a new conversation, so no run can find its
own turn 10 already cached).

    python benchmarks/responses.py           # full: writes benchmarks/results/responses.json
    python benchmarks/responses.py --quick   # 3 short turns, one repeat; writes nothing
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "responses.json"
INSTRUCTIONS = "You are a concise research assistant. Use the lookup tool when asked to look something up."
LOOKUP_TOOL = {"type": "function", "name": "lookup", "description": "Look a topic up in the archive.", "strict": True,
               "parameters": {"type": "object", "properties": {"topic": {"type": "string"}}, "required": ["topic"],
                              "additionalProperties": False}}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in LOOKUP_TOOL.items() if k != "type"}}
SUBJECTS = ["rivers", "mountains", "bridges", "libraries", "harbours", "forests", "markets", "railways",
            "gardens", "lighthouses"]


def user_message(repeat: int, turn: int, words: int, tool_turns: tuple[int, ...]) -> str:
    subject = SUBJECTS[(turn + repeat) % len(SUBJECTS)]
    filler = " ".join(f"{subject} note {repeat}.{turn}.{i} describes weather, people and history;"
                      for i in range(words // 8))
    ask = f"Look up {subject} in the archive." if turn in tool_turns else "Summarise them in one sentence."
    return f"Turn {turn}. Here are my notes on {subject}: {filler} {ask}"


# ---- servers --------------------------------------------------------------------------------------

@contextlib.contextmanager
def serve(model_path: Path, *, prefix_caching: bool, max_model_len: int, num_kv_blocks: int) -> Iterator[tuple[str, dict[str, str]]]:
    """A real server (uvicorn in a thread, its own engine) with tenants a, b; yields (base URL, keys)."""
    import socket

    import uvicorn
    from loraplex.platform.app import create_app
    from loraplex.platform.auth import store
    from loraplex.platform.auth.scopes import Scope
    from loraplex.platform.db import migrate
    from loraplex.platform.db.session import make_db_engine, make_session_factory
    from loraplex.platform.settings import Settings

    with tempfile.TemporaryDirectory() as data_dir:
        settings = Settings(data_dir=Path(data_dir), model_path=model_path, migrate_on_start=True,
                            enable_prefix_caching=prefix_caching, max_model_len=max_model_len,
                            num_kv_blocks=num_kv_blocks, kv_host_memory_mb=0, dtype="float32", device="cpu")
        migrate.upgrade(settings.resolved_database_url)
        db_engine = make_db_engine(settings.resolved_database_url)
        keys = {}
        with make_session_factory(db_engine)() as db:
            for name in ("chained", "stateless", "others"):
                tenant = store.create_tenant(db, name=name)
                keys[name] = store.create_api_key(db, tenant=tenant, scopes=list(Scope), name=name).key
        db_engine.dispose()
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        try:
            yield f"http://127.0.0.1:{port}/v1", keys
        finally:
            server.should_exit = True
            thread.join(timeout=60)


# ---- one turn, timed ------------------------------------------------------------------------------

def timed_response(client: Any, **kwargs: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    ttft = None
    final = None
    for event in client.responses.create(stream=True, **kwargs):
        if ttft is None and event.type in ("response.output_text.delta", "response.function_call_arguments.delta"):
            ttft = time.perf_counter() - start
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    if final is None:
        raise RuntimeError("the stream ended without a final response")
    return final, ttft or 0.0


def timed_chat(client: Any, **kwargs: Any) -> tuple[dict[str, Any], float]:
    """(the assistant message as text + tool calls, TTFT)."""
    start = time.perf_counter()
    ttft = None
    content, calls = [], {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            if ttft is None and (delta.content or delta.tool_calls):
                ttft = time.perf_counter() - start
            content.append(delta.content or "")
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
    return {"text": "".join(content), "calls": [(c["name"], c["arguments"]) for c in calls.values()]}, ttft or 0.0


def answer_of(response: Any) -> dict[str, Any]:
    calls = [(item.name, item.arguments) for item in response.output if item.type == "function_call"]
    return {"text": response.output_text, "calls": calls}


def other_traffic(client: Any, model: str, *, repeat: int, turn: int, num_tokens: int) -> None:
    """Unrelated prompts of another tenant, about `num_tokens` in all (never cached before: fresh text)."""
    for part in range(max(num_tokens // 1000, 1)):
        words = " ".join(f"ledger {repeat}.{turn}.{part}.{i} balances;" for i in range(min(num_tokens, 1000) // 6))
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": words}], max_tokens=1,
                                       temperature=0)


def conversation(repeat: int, *, turns: int, words: int, answer_tokens: int, tool_turns: tuple[int, ...],
                 chained: Any, cached: Any, uncached: Any, others: Any | None, other_tokens: int,
                 model: str) -> dict[str, list[Any]]:
    """One conversation three ways; returns per-turn TTFTs and cached-token counts, outputs checked equal."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": INSTRUCTIONS}]
    previous = None
    pending_outputs: list[dict[str, Any]] = []
    out: dict[str, list[Any]] = {"chained": [], "prefix_cached": [], "stateless": [], "cached_tokens": [],
                                 "prompt_tokens": []}
    for turn in range(1, turns + 1):
        if others is not None and turn > 1:
            other_traffic(others, model, repeat=repeat, turn=turn, num_tokens=other_tokens)
        user = {"role": "user", "content": user_message(repeat, turn, words, tool_turns)}
        forced = turn in tool_turns
        limit = 40 if forced else answer_tokens
        items = [*pending_outputs, {"role": "user", "content": user["content"]}]
        response, ttft = timed_response(
            chained, model=model, instructions=INSTRUCTIONS, input=items, previous_response_id=previous,
            tools=[LOOKUP_TOOL], tool_choice="required" if forced else "auto", parallel_tool_calls=False,
            max_output_tokens=limit, temperature=0)
        # The same turn, stateless: the transcript so far (the chained run's tool-call ids) plus this input.
        for item in pending_outputs:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        messages.append(user)
        chat_kwargs = {"model": model, "messages": messages, "tools": [CHAT_TOOL], "parallel_tool_calls": False,
                       "tool_choice": "required" if forced else "auto", "max_tokens": limit, "temperature": 0}
        with_cache, ttft_cached = timed_chat(cached, **chat_kwargs)
        without_cache, ttft_uncached = timed_chat(uncached, **chat_kwargs)
        ours = answer_of(response)
        if not ours == with_cache == without_cache:
            raise AssertionError(f"turn {turn} differs: {ours} / {with_cache} / {without_cache}")
        out["chained"].append(ttft)
        out["prefix_cached"].append(ttft_cached)
        out["stateless"].append(ttft_uncached)
        out["cached_tokens"].append(response.usage.input_tokens_details.cached_tokens)
        out["prompt_tokens"].append(response.usage.input_tokens)
        calls = [item for item in response.output if item.type == "function_call"]
        message: dict[str, Any] = {"role": "assistant", "content": response.output_text or None}
        if calls:
            message["tool_calls"] = [{"id": c.call_id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        messages.append(message)
        pending_outputs = [{"type": "function_call_output", "call_id": c.call_id,
                            "output": json.dumps({"topic": json.loads(c.arguments).get("topic"), "found": 3})}
                           for c in calls]
        previous = response.id
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 short turns, one repeat; writes nothing")
    parser.add_argument("--kv-blocks", type=int, default=420, help="KV pool of each server (16-token blocks)")
    parser.add_argument("--other-tokens", type=int, default=3000, help="another tenant's tokens between turns")
    args = parser.parse_args()
    import openai
    import torch
    from loraplex.engine.host_info import cpu_benchmark_machine
    from loraplex.engine.model.default_model import DEFAULT_MODEL_NAME, ensure_default_model

    turns, words, repeats, answer_tokens = (3, 40, 1, 4) if args.quick else (10, 150, 3, 12)
    tool_turns = (2,) if args.quick else (3, 7)
    other_tokens = 200 if args.quick else args.other_tokens
    model_path = ensure_default_model(ROOT / "data" / "models")
    runs, quiet = [], []
    with serve(model_path, prefix_caching=True, max_model_len=4096, num_kv_blocks=args.kv_blocks) as (url, keys), \
            serve(model_path, prefix_caching=False, max_model_len=4096, num_kv_blocks=args.kv_blocks) as (url_off,
                                                                                                        keys_off):
        def client(base: str, key: str) -> Any:
            return openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=600)

        def run(repeat: int, others: Any | None) -> dict[str, list[Any]]:
            return conversation(
                repeat, turns=turns, words=words, answer_tokens=answer_tokens, tool_turns=tool_turns,
                model=DEFAULT_MODEL_NAME, chained=client(url, keys["chained"]), cached=client(url, keys["stateless"]),
                uncached=client(url_off, keys_off["stateless"]), others=others, other_tokens=other_tokens)

        for repeat in range(repeats):
            runs.append(run(repeat, client(url, keys["others"])))
            print(f"repeat {repeat}: turn-{turns} TTFT s chained/prefix-cached/stateless "
                  f"{runs[-1]['chained'][-1]:.2f}/{runs[-1]['prefix_cached'][-1]:.2f}/{runs[-1]['stateless'][-1]:.2f}",
                  flush=True)
        if not args.quick:
            quiet.append(run(repeats, None))
    last = {name: [run[name][-1] for run in runs] for name in ("chained", "prefix_cached", "stateless")}
    chained, cached, stateless = (statistics.median(last[name]) for name in ("chained", "prefix_cached", "stateless"))
    metrics = {
        "turn10_ttft_speedup_vs_stateless": stateless / chained,
        "turn10_ttft_speedup_vs_prefix_cached": cached / chained,
        "turn10_prompt_tokens": runs[-1]["prompt_tokens"][-1],
        "turn10_cached_tokens": runs[-1]["cached_tokens"][-1],
        "turn10_ttft_ms_chained_median": chained * 1000,
        "turn10_ttft_ms_prefix_cached_median": cached * 1000,
        "turn10_ttft_ms_stateless_median": stateless * 1000,
        **{f"turn10_ttft_ms_{name}_all": [t * 1000 for t in values] for name, values in last.items()},
        "turn10_ttft_speedup_vs_prefix_cached_quiet": (
            quiet[0]["prefix_cached"][-1] / quiet[0]["chained"][-1] if quiet else None),
        "ttft_ms_chained_by_turn_last_repeat": [t * 1000 for t in runs[-1]["chained"]],
        "cached_tokens_by_turn_last_repeat": runs[-1]["cached_tokens"],
    }
    print(f"turn {turns}: {metrics['turn10_prompt_tokens']} prompt tokens, {metrics['turn10_cached_tokens']} from "
          "pinned KV; every turn's output identical in all three runs")
    print(f"{'case':<34}{'TTFT ms (median)':>18}{'speed-up':>10}")
    print(f"{'stateless, prefix caching off':<34}{stateless * 1000:>18.1f}{1.0:>10.2f}")
    print(f"{'stateless, prefix caching on':<34}{cached * 1000:>18.1f}{stateless / cached:>10.2f}")
    print(f"{'chained (previous_response_id)':<34}{chained * 1000:>18.1f}{stateless / chained:>10.2f}")
    for name in ("prompt_tokens", "cached_tokens", "chained", "prefix_cached", "stateless"):
        print(f"  by turn, {name}: " + " ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in runs[-1][name]))
    if args.quick:
        return
    result = {
        "benchmark": "responses",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": cpu_benchmark_machine(),
        "config": {"model": DEFAULT_MODEL_NAME, "dtype": "float32", "turns": turns, "answer_tokens": answer_tokens,
                   "tool_turns": list(tool_turns), "repeats": repeats, "kv_blocks": args.kv_blocks,
                   "block_size": 16, "other_tenant_tokens_between_turns": other_tokens, "threads": torch.get_num_threads(),
                   "transport": "HTTP, openai client, streamed; TTFT = request sent -> first output delta"},
        "metrics": metrics,
        "targets": {"turn10_ttft_speedup_vs_stateless": {"op": ">=", "value": 5.0},
                    "turn10_ttft_speedup_vs_prefix_cached": {"op": ">=", "value": 1.5}},
        "checked": True,
    }
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
