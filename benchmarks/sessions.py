"""Sessions benchmark: time to first token of turn 10, pinned vs re-prefilled vs restored from host.

SmolLM2-135M-Instruct on this CPU. A 10-turn chat grows to about 3,000
tokens (long user messages, short greedy answers). Turn 10 is then sent:

- statelessly, with no prefix cache to help (a fresh cache salt each time:
  the engine cannot match a single block, exactly as with caching off);
- as a session turn whose KV stayed pinned since turn 9 (only the new
  tokens are prefilled);
- as a session turn whose pinned KV was offloaded to the host tier and whose
  device blocks were then reused (the benchmark forgets them in the prefix
  cache and zeroes their K/V, as other work would overwrite them), so the
  turn must copy every block back from host memory.

Each conversation runs under its own tenant (tenants never share cache), so
the three cases cannot help each other; the second session reaches turn 9's
state in one request (turn 9's prompt, pinned with its answer). Every turn-10 answer is checked equal
to the stateless answer before any time counts. TTFT is the time from
submitting the request to the step that produced its first token, with the
engine otherwise idle; the figure is the median over the repeats.

    python benchmarks/sessions.py           # full: writes benchmarks/results/sessions.json
    python benchmarks/sessions.py --quick   # 3 short turns, one repeat; writes nothing
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from loraplex.engine.host_info import cpu_benchmark_machine

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "sessions.json"
BLOCK_SIZE = 16
SUBJECTS = ["rivers", "mountains", "bridges", "libraries", "harbours", "forests", "markets", "railways",
            "gardens", "lighthouses"]


def user_message(turn: int, words: int) -> str:
    subject = SUBJECTS[turn % len(SUBJECTS)]
    filler = " ".join(f"{subject} note {turn}.{i} describes weather, people and history;" for i in range(words // 8))
    return f"Turn {turn}. Here are my notes on {subject}: {filler} Summarise them in one sentence."


def run_request(engine: Any, request: Any) -> tuple[list[int], float, int]:
    """(output token ids, time to first token in s, cached prompt tokens) with the engine otherwise idle."""
    start = time.perf_counter()
    engine.add_request(request)
    tokens: list[int] = []
    ttft = None
    cached = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            cached = out.num_cached_tokens
            new = [t for choice in out.choices for t in choice.token_ids]
            if new and ttft is None:
                ttft = time.perf_counter() - start
            tokens += new
    return tokens, ttft or 0.0, cached


def conversation_prompts(tokenizer: Any, engine: Any, *, turns: int, words: int, answer_tokens: int,
                         tenant: str, session: str) -> tuple[list[dict], list[int]]:
    """Run turns 1..turns-1 as session turns; return the messages so far and the token ids of turn `turns`."""
    from loraplex.engine.protocol import EngineRequest, SamplingParams

    messages: list[dict] = [{"role": "system", "content": "You are a concise assistant."}]
    for turn in range(1, turns):
        messages.append({"role": "user", "content": user_message(turn, words)})
        prompt = encode(tokenizer, messages)
        request = EngineRequest(f"{session}-t{turn}", prompt, greedy(answer_tokens, SamplingParams),
                                tenant_id=tenant, session_id=session)
        answer, _, _ = run_request(engine, request)
        messages.append({"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)})
    messages.append({"role": "user", "content": user_message(turns, words)})
    return messages, encode(tokenizer, messages)


def encode(tokenizer: Any, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def greedy(max_tokens: int, sampling_cls: Any) -> Any:
    return sampling_cls(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def overwrite_device_copies(engine: Any, key: str) -> int:
    """Stand in for other work reusing the device blocks an offloaded session left in the prefix cache:
    forget them and zero their K/V, so the next turn can only be right if the host copies come back."""
    bm = engine.block_manager
    rows = []
    for entry in engine.host_tier.sessions[key]:
        block_id = bm.cached_block(entry.hash, entry.token_ids, entry.salt, entry.parent_hash)
        if block_id is None or bm.blocks[block_id].ref_count:
            continue
        bm.cached_free.pop(block_id, None)
        del bm.hash_to_block_id[entry.hash]
        bm.blocks[block_id].hash = None
        bm.free_block_ids.append(block_id)
        rows.append(block_id)
    for k_cache, v_cache in engine.runner.kv_caches:
        for block_id in rows:
            k_cache[block_id * BLOCK_SIZE:(block_id + 1) * BLOCK_SIZE] = 0
            v_cache[block_id * BLOCK_SIZE:(block_id + 1) * BLOCK_SIZE] = 0
    return len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 short turns, one repeat; writes nothing")
    args = parser.parse_args()
    import torch
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine
    from loraplex.engine.model.default_model import ensure_default_model
    from loraplex.engine.protocol import EngineRequest, SamplingParams

    turns, words, repeats, answer_tokens = (3, 40, 1, 4) if args.quick else (10, 155, 2, 12)
    model_path = ensure_default_model(ROOT / "data" / "models")
    config = EngineConfig(num_blocks=640 if not args.quick else 200, num_host_blocks=400 if not args.quick else 120,
                          max_model_len=4096, max_num_batched_tokens=512, dtype="float32", device="cpu")
    engine = LLMEngine.from_model_path(model_path, config)
    tokenizer = engine.tokenizer

    stateless_ttft, pinned_ttft, restored_ttft = [], [], []
    prompt_len = cached_pinned = cached_restored = 0
    for repeat in range(repeats):
        pinned_key, offloaded_key = f"pinned-{repeat}", f"offloaded-{repeat}"
        messages, prompt = conversation_prompts(tokenizer, engine, turns=turns, words=words,
                                                answer_tokens=answer_tokens, tenant=pinned_key, session=pinned_key)
        # The second session reaches the same state in one request: turn 9's prompt, pinned with its answer.
        previous = encode(tokenizer, messages[:-2])
        answer_b, _, _ = run_request(engine, EngineRequest(
            f"{offloaded_key}-t{turns - 1}", previous, greedy(answer_tokens, SamplingParams),
            tenant_id=offloaded_key, session_id=offloaded_key))
        assert tokenizer.decode(answer_b, skip_special_tokens=True) == messages[-2]["content"]
        prompt_len = len(prompt)

        # Stateless: a cache salt nobody used, so no block can match.
        reference, ttft, cached = run_request(engine, EngineRequest(
            f"stateless-{repeat}", prompt, greedy(answer_tokens, SamplingParams),
            tenant_id=pinned_key, cache_salt=uuid.uuid4().hex))
        assert cached == 0
        stateless_ttft.append(ttft)

        answer, ttft, cached_pinned = run_request(engine, EngineRequest(
            f"pinned-t{turns}-{repeat}", prompt, greedy(answer_tokens, SamplingParams),
            tenant_id=pinned_key, session_id=pinned_key))
        assert answer == reference, "pinned turn differs from the stateless answer"
        pinned_ttft.append(ttft)

        # Offload the second session to host memory (what the scheduler does under pressure), then let
        # its device blocks be reused.
        tier = engine.host_tier
        while engine.session_state(offloaded_key) == "pinned":
            engine.block_manager.evict_oldest_pin()
        assert engine.session_state(offloaded_key) == "offloaded"
        engine.runner.swap_kv(tier.take_swaps())  # the copies a step would make before reusing the blocks
        overwritten = overwrite_device_copies(engine, offloaded_key)
        assert overwritten > 0
        copied_before = tier.num_blocks_copied_in
        answer, ttft, cached_restored = run_request(engine, EngineRequest(
            f"restored-t{turns}-{repeat}", prompt, greedy(answer_tokens, SamplingParams),
            tenant_id=offloaded_key, session_id=offloaded_key))
        assert answer == reference, "restored turn differs from the stateless answer"
        assert tier.num_blocks_copied_in > copied_before, "the restore must copy blocks back from host memory"
        restored_ttft.append(ttft)
        for key in (pinned_key, offloaded_key):
            engine.release_session(key)

    stateless, pinned, restored = (statistics.median(x) for x in (stateless_ttft, pinned_ttft, restored_ttft))
    metrics = {
        "pinned_ttft_speedup": stateless / pinned,
        "host_restore_ttft_speedup": stateless / restored,
        "turn10_prompt_tokens": prompt_len,
        "pinned_cached_tokens": cached_pinned,
        "restored_cached_tokens": cached_restored,
        "stateless_ttft_ms_median": stateless * 1000,
        "pinned_ttft_ms_median": pinned * 1000,
        "restored_ttft_ms_median": restored * 1000,
        "stateless_ttft_ms_all": [t * 1000 for t in stateless_ttft],
        "pinned_ttft_ms_all": [t * 1000 for t in pinned_ttft],
        "restored_ttft_ms_all": [t * 1000 for t in restored_ttft],
    }
    print(f"turn {turns}: {prompt_len} prompt tokens; cached pinned={cached_pinned} restored={cached_restored}")
    print(f"{'case':<22}{'TTFT ms (median)':>18}{'speed-up':>10}")
    print(f"{'stateless, no cache':<22}{stateless * 1000:>18.1f}{1.0:>10.2f}")
    print(f"{'pinned session':<22}{pinned * 1000:>18.1f}{stateless / pinned:>10.2f}")
    print(f"{'restored from host':<22}{restored * 1000:>18.1f}{stateless / restored:>10.2f}")
    if args.quick:
        return
    result = {
        "benchmark": "sessions",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": cpu_benchmark_machine(),
        "config": {"model": model_path.name, "dtype": "float32", "turns": turns, "answer_tokens": answer_tokens,
                   "repeats": repeats, "block_size": BLOCK_SIZE, "threads": torch.get_num_threads()},
        "metrics": metrics,
        "targets": {"pinned_ttft_speedup": {"op": ">=", "value": 8.0},
                    "host_restore_ttft_speedup": {"op": ">=", "value": 4.0}},
        "checked": True,
    }
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
