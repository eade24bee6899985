"""The serving benchmark's load: deterministic request mixes, Poisson arrival schedules, and the two ways of
running one schedule (the engine alone, stepped in a plain loop; HTTP through the official `openai` client).

Every request is greedy with `ignore_eos`, so its output length is the one drawn for it (a JSON-schema
request may end earlier, when its grammar completes). Prompts are random token ids, sent as token ids, so
both sides prefill exactly the same prompt. Times are `time.monotonic()`, one clock for every process on
the machine: a request's TTFT runs from its scheduled arrival, not from when a busy client got to send it.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

# A JSON schema a share of the requests must follow (an extraction-style record, as tenants send).
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "active"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}


@dataclass(slots=True)
class Req:
    index: int
    prompt_ids: list[int]
    max_tokens: int
    adapter: str | None = None   # the adapter's served name (HTTP model name; engine adapter id)
    schema: bool = False


@dataclass(slots=True)
class Trace:
    """One request as its reader saw it: when it was due, when each text-bearing piece came, how it ended."""

    due: float
    times: list[float] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    text: list[str] | None = None  # kept only where a check compares it

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason is not None and bool(self.times)

    @property
    def ttft(self) -> float:
        return self.times[0] - self.due

    @property
    def tpot(self) -> float | None:
        if self.num_tokens < 2 or len(self.times) < 2:
            return None
        return (self.times[-1] - self.times[0]) / (self.num_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False)]


def fixed_mix(n: int, prompt_len: int, output_len: int) -> list[tuple[int, int]]:
    return [(prompt_len, output_len)] * n


def chat_mix(n: int, scale: float, seed: int) -> list[tuple[int, int]]:
    """A long-tailed chat-like mix: prompts lognormal (median ~300 tokens, 16..2,048); outputs lognormal
    (median ~150, 16..800) for 85% of requests and 1,000..4,000 tokens for 15% (long answers, code, reports).
    `scale` shrinks every length (the CPU's quick mode)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = min(max(int(rng.lognormvariate(5.7, 0.9)), 16), 2048)
        output = rng.randint(1000, 4000) if rng.random() < 0.15 else min(max(int(rng.lognormvariate(5.0, 0.8)), 16), 800)
        out.append((max(int(prompt * scale), 4), max(int(output * scale), 2)))
    return out


def make_requests(lengths: list[tuple[int, int]], vocab: int, seed: int, adapters: list[str],
                  adapter_share: float, schema_share: float) -> list[Req]:
    """Random prompts of the given lengths; exact shares of the requests on an adapter (round robin over
    them) and with the JSON schema, spread evenly: deterministic for a seed, so both sides and every rate run
    the same requests."""
    rng = random.Random(seed)
    reqs = []
    num_adapted = 0
    for i, (prompt_len, output_len) in enumerate(lengths):
        adapter = None
        if adapters and int((i + 1) * adapter_share) > int(i * adapter_share):
            adapter = adapters[num_adapted % len(adapters)]
            num_adapted += 1
        schema = adapter is None and int((i + 1) * schema_share + 0.5) > int(i * schema_share + 0.5)
        # Ids from a band of ordinary tokens (not special tokens, which some tokenizers drop or refuse).
        prompt = [rng.randrange(1000, min(vocab, 30000)) for _ in range(prompt_len)]
        reqs.append(Req(i, prompt, output_len, adapter, schema))
    return reqs


def poisson_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times (seconds after the start) of a Poisson process of `rate` per second; inf: all at once."""
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


# ---- the engine alone ------------------------------------------------------------------------------------

def engine_request(req: Req, request_id: str, grammar: Any | None) -> Any:
    from loraplex.engine.protocol import EngineRequest, SamplingParams

    sampling = SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)
    return EngineRequest(request_id=request_id, prompt_token_ids=req.prompt_ids, sampling=sampling,
                         adapter_id=req.adapter, grammar=grammar if req.schema else None)


def run_engine(engine: Any, reqs: list[Req], offsets: list[float], tag: str, make_grammar: Any,
               start_at: float | None = None) -> list[Trace]:
    """The engine by itself, open loop: each request is added at its arrival time (between steps, as the
    engine-core process admits what arrived while it stepped), and the engine steps while it has work.
    Nothing else runs in this thread: no event loop, no text made."""
    order = sorted(range(len(reqs)), key=lambda i: offsets[i])
    start = start_at if start_at is not None else time.monotonic()
    traces = [Trace(start + offsets[i]) for i in range(len(reqs))]
    running: dict[str, int] = {}
    k = 0
    while k < len(order) or running:
        now = time.monotonic()
        while k < len(order) and traces[order[k]].due <= now:
            i = order[k]
            request_id = f"{tag}-{i}"
            engine.add_request(engine_request(reqs[i], request_id, make_grammar() if reqs[i].schema else None))
            running[request_id] = i
            k += 1
        if not engine.has_unfinished_requests():
            if k < len(order):
                time.sleep(max(traces[order[k]].due - time.monotonic(), 0.0))  # idle until the next arrival
            continue
        outputs = engine.step()
        now = time.monotonic()
        for output in outputs:
            trace = traces[running[output.request_id]]
            for delta in output.choices:
                if delta.token_ids:
                    trace.times.append(now)
                trace.num_tokens = delta.num_output_tokens
                trace.finish_reason = delta.finish_reason or trace.finish_reason
            if output.error:
                trace.error = output.error
            if output.finished:
                del running[output.request_id]
    return traces


# ---- HTTP, in a client process ---------------------------------------------------------------------------

async def http_one(client: Any, model: str, req: Req, due: float, keep_text: bool = False) -> Trace:
    trace = Trace(due, text=[] if keep_text else None)
    await asyncio.sleep(max(due - time.monotonic(), 0.0))
    extra: dict[str, Any] = {"ignore_eos": True}
    if req.schema:
        extra["response_format"] = RESPONSE_FORMAT
    try:
        stream = await client.completions.create(
            model=req.adapter or model, prompt=req.prompt_ids, max_tokens=req.max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body=extra,
        )
        async for chunk in stream:
            now = time.monotonic()
            if chunk.usage is not None:
                trace.num_tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.text:
                    trace.times.append(now)
                    if trace.text is not None:
                        trace.text.append(choice.text)
                trace.finish_reason = choice.finish_reason or trace.finish_reason
    except Exception as exc:  # counted as an error of the phase, never dropped silently
        trace.error = f"{type(exc).__name__}: {exc}"[:300]
    return trace


def http_phase(base_url: str, key: str, model: str, reqs: list[Req], dues: list[float], keep_text: bool = False
               ) -> tuple[list[Trace], float]:
    """One client process's share of a phase: (traces in order, this process's CPU seconds over its wall
    seconds: near 1.0 would mean the client, not the server, set the pace)."""
    import openai

    async def go() -> list[Trace]:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=900)
        try:
            return list(await asyncio.gather(*(http_one(client, model, r, d, keep_text) for r, d in zip(reqs, dues, strict=True))))
        finally:
            await client.close()

    wall0, cpu0 = time.monotonic(), time.process_time()
    traces = asyncio.run(go())
    busy_from = min(dues, default=wall0)
    wall = max(time.monotonic() - max(busy_from, wall0), 1e-9)
    return traces, (time.process_time() - cpu0) / wall


def import_openai() -> None:
    import openai  # noqa: F401


# ---- figures ---------------------------------------------------------------------------------------------

def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(int(q / 100 * len(ordered)), len(ordered) - 1)]


def summarize(traces: list[Trace]) -> dict[str, Any]:
    """vLLM `benchmark_serving`'s figures: TTFT, TPOT (per request), ITL (every gap between pieces of
    text), all in ms; output tokens/s over the phase (first arrival to last finish); errors."""
    good = [t for t in traces if t.ok]
    ttft = [1000 * t.ttft for t in good]
    tpot = [1000 * v for t in good if (v := t.tpot) is not None]
    itl = [1000 * g for t in good for g in t.itls]
    span = (max(t.times[-1] for t in good) - min(t.due for t in traces)) if good else 0.0
    out: dict[str, Any] = {"num_requests": len(traces), "errors": len(traces) - len(good),
                           "output_tokens": sum(t.num_tokens for t in good), "duration_s": span}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        for q in (50, 90, 99):
            out[f"{name}_ms_p{q}"] = pct(values, q)
        out[f"{name}_ms_mean"] = statistics.fmean(values) if values else None
    out["output_tokens_per_s"] = out["output_tokens"] / span if span > 0 else 0.0
    out["requests_per_s"] = len(good) / span if span > 0 else 0.0
    errors = [t.error for t in traces if t.error]
    if errors:
        out["first_error"] = errors[0]
    return out


def position_itl_ms(traces: list[Trace], first: int, last: int) -> float | None:
    """Median gap between pieces of text in positions [first, last) of each stream: does the per-token
    cost grow with how long the output already is?"""
    gaps = [1000 * g for t in traces if t.ok for g in t.itls[first:last]]
    return statistics.median(gaps) if gaps else None
