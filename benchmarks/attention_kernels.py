"""GPU micro-benchmarks of the attention and bitmask kernels, each checked before it is timed.

- paged decode attention at batch 64, context 2k, 32 query / 8 KV heads, head_dim 128, bf16:
  achieved KV-read bandwidth over the card's measured copy bandwidth (target >= 0.70),
  over a sweep of split counts and tile shapes;
- paged prefill throughput against torch SDPA on contiguous tensors;
- token-bitmask apply for batch 1..512 over a 128k vocabulary against the PyTorch reference.

``python benchmarks/attention_kernels.py`` writes benchmarks/results/attention_kernels.json;
``--quick`` on a machine without a GPU checks the kernels through Triton's interpreter on tiny
shapes and exits (no timings). The GPU engine benchmark reuses ``copy_bandwidth_gbps``,
``time_graph_us`` and ``decode_attention_bandwidth``.
"""

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

import torch.nn.functional as F
import triton
from loraplex.engine.kernels.paged_attention_decode import paged_decode_attention
from loraplex.engine.kernels.paged_attention_kv_write import write_kv_cache
from loraplex.engine.kernels.paged_attention_prefill import paged_prefill_attention
from loraplex.engine.kernels.paged_attention_reference import (
    paged_decode_attention_reference,
    paged_prefill_attention_reference,
    write_kv_cache_reference,
)
from loraplex.engine.kernels.token_bitmask import apply_token_bitmask, apply_token_bitmask_reference

RESULTS = Path(__file__).parent / "results" / "attention_kernels.json"


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def copy_bandwidth_gbps(num_bytes: int = 2 << 30, repeats: int = 20) -> float:
    """The card's device-to-device copy rate (GB/s, bytes read plus bytes written)."""
    return max(copy_rates_gbps(num_bytes, repeats).values())


def copy_rates_gbps(num_bytes: int = 2 << 30, repeats: int = 20) -> dict[str, float]:
    """Device-to-device copy rate, counting bytes read plus bytes written (GB/s).

    The best of three ways: a captured ``copy_`` becomes a graph memcpy node that the copy
    engines may serve (seen ~20% under the SMs' rate), so eager ``copy_`` and an elementwise
    kernel are timed too; float32 elements, since a uint8 copy does not vectorise.
    """
    source = torch.randn(num_bytes // 4, device="cuda")
    target = torch.empty_like(source)
    moved = 2 * num_bytes / 1e3
    return {
        "graph_copy": moved / time_graph_us(lambda: target.copy_(source), repeats=repeats, calls_per_graph=1),
        "eager_copy": moved / time_eager_us(lambda: target.copy_(source), repeats=repeats),
        "graph_elementwise": moved / time_graph_us(
            lambda: torch.mul(source, 1.0, out=target), repeats=repeats, calls_per_graph=1
        ),
    }


def time_eager_us(fn, repeats: int = 20) -> float:
    """Median of event-timed eager calls (µs), for work long enough that launch cost is noise."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def read_bandwidth_gbps(num_bytes: int = 4 << 30, repeats: int = 20) -> float:
    """Device read rate through a full reduction (GB/s): the ceiling of a read-only kernel."""
    source = torch.randn(num_bytes // 4, device="cuda")
    total = torch.empty((), device="cuda")
    microseconds = time_graph_us(lambda: torch.sum(source, dim=0, out=total), repeats=repeats, calls_per_graph=1)
    return num_bytes / microseconds / 1e3


def kv_write_us(num_tokens: int, num_kv_heads: int = 8, head_dim: int = 128, block_size: int = 16) -> dict:
    """write_kv_cache for one step's new tokens into shuffled slots, checked against the reference."""
    num_blocks = max(4 * num_tokens // block_size, 64)
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    value_cache = torch.randn_like(key_cache)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:num_tokens].to(torch.int32)
    expected = [key_cache.clone(), value_cache.clone()]
    write_kv_cache_reference(key, value, *expected, slots)
    write_kv_cache(key, value, key_cache, value_cache, slots)
    if not (torch.equal(key_cache, expected[0]) and torch.equal(value_cache, expected[1])):
        raise AssertionError("write_kv_cache wrong")
    microseconds = time_graph_us(lambda: write_kv_cache(key, value, key_cache, value_cache, slots))
    return {"num_tokens": num_tokens, "us": microseconds, "bytes": 4 * key.numel() * 2}


def time_graph_us(fn, repeats: int = 30, calls_per_graph: int = 10) -> float:
    """Median time of one call (µs), from CUDA-graph replays of ``calls_per_graph`` calls."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm allocator and caches on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls_per_graph)
    return statistics.median(times)


def paged_decode_inputs(batch: int, context: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                        block_size: int, dtype: torch.dtype, device: str) -> dict:
    """Random caches; each sequence owns shuffled blocks; every row has ``context`` tokens."""
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return {
        "query": torch.randn(batch, num_q_heads, head_dim, device=device, dtype=dtype),
        "key_cache": torch.randn(shape, device=device, dtype=dtype),
        "value_cache": torch.randn(shape, device=device, dtype=dtype),
        "block_tables": torch.randperm(num_blocks, device=device, dtype=torch.int32).reshape(batch, blocks_per_seq),
        "seq_lens": torch.full((batch,), context, dtype=torch.int32, device=device),
    }


def decode_attention_bandwidth(copy_gbps: float, batch: int = 64, context: int = 2048, num_q_heads: int = 32,
                               num_kv_heads: int = 8, head_dim: int = 128, block_size: int = 16,
                               variants: list[dict] | None = None) -> dict:
    """Check, then time paged decode attention; report each variant's KV-read bandwidth."""
    inputs = paged_decode_inputs(batch, context, num_q_heads, num_kv_heads, head_dim, block_size, torch.bfloat16, "cuda")
    scale = head_dim**-0.5
    args = (inputs["query"], inputs["key_cache"], inputs["value_cache"], inputs["block_tables"], inputs["seq_lens"], scale)
    expected = paged_decode_attention_reference(*args)
    kv_bytes = 2 * batch * context * num_kv_heads * head_dim * 2
    moved_bytes = kv_bytes + 2 * inputs["query"].numel() * 2 + inputs["block_tables"].numel() * 4
    out = torch.empty_like(inputs["query"])
    rows = []
    for variant in variants or [{}]:
        out.fill_(float("nan"))
        paged_decode_attention(*args, out=out, **variant)
        error = relative_error(out, expected)
        if not error < 1e-2:
            raise AssertionError(f"decode variant {variant} is wrong: relative error {error:.2e}")
        microseconds = time_graph_us(lambda v=variant: paged_decode_attention(*args, out=out, **v))
        gbps = moved_bytes / microseconds / 1e3
        rows.append({**variant, "us": microseconds, "gbps": gbps, "bw_fraction": gbps / copy_gbps, "rel_error": error})
    return {"kv_bytes": kv_bytes, "floor_us": moved_bytes / copy_gbps / 1e3, "variants": rows}


DECODE_VARIANTS = [{}] + [  # {} = the function's defaults, what the runner gets
    {"num_splits": splits, "block_n": block_n, "num_warps": warps, "num_stages": stages}
    for splits in (1, 2, 4)
    for block_n in (64, 128)
    for warps in (4, 8)
    for stages in (2, 3, 4)
]
PREFILL_VARIANTS = [
    {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2},
    {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3},
    {"block_m": 128, "block_n": 32, "num_warps": 4, "num_stages": 3},
    {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3},
    {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2},
    {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3},
    {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 2},
]


def prefill_throughput(batch: int = 8, seq_len: int = 2048, cached: int = 0, num_q_heads: int = 32,
                       num_kv_heads: int = 8, head_dim: int = 128, block_size: int = 16) -> dict:
    """Our paged prefill vs SDPA (contiguous, K/V heads expanded outside the timing) in TFLOP/s."""
    total = cached + seq_len
    inputs = paged_decode_inputs(batch, total, num_q_heads, num_kv_heads, head_dim, block_size, torch.bfloat16, "cuda")
    query = torch.randn(batch * seq_len, num_q_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    cu_seqlens_q = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * seq_len
    scale = head_dim**-0.5
    args = (query, inputs["key_cache"], inputs["value_cache"], inputs["block_tables"], cu_seqlens_q, inputs["seq_lens"], scale)
    expected = paged_prefill_attention_reference(*args)
    # Causal: each query sees its cached prefix plus half the chunk on average.
    flops = 4 * batch * num_q_heads * head_dim * seq_len * (cached + seq_len / 2)
    rows = []
    out = torch.empty_like(query)
    for variant in PREFILL_VARIANTS:
        out.fill_(float("nan"))
        paged_prefill_attention(*args, out=out, **variant)
        error = relative_error(out, expected)
        if not error < 1e-2:
            raise AssertionError(f"prefill variant {variant} is wrong: relative error {error:.2e}")
        microseconds = time_graph_us(lambda v=variant: paged_prefill_attention(*args, out=out, **v), calls_per_graph=3)
        rows.append({**variant, "us": microseconds, "tflops": flops / microseconds / 1e6, "rel_error": error})

    def gather(cache):
        tables = inputs["block_tables"].long()
        dense = cache[tables].reshape(batch, -1, num_kv_heads, head_dim)[:, :total]
        return dense.repeat_interleave(num_q_heads // num_kv_heads, dim=2).transpose(1, 2).contiguous()

    key, value = gather(inputs["key_cache"]), gather(inputs["value_cache"])
    sdpa_query = query.reshape(batch, seq_len, num_q_heads, head_dim).transpose(1, 2).contiguous()
    mask = None
    if cached:
        positions = cached + torch.arange(seq_len, device="cuda")
        mask = torch.arange(total, device="cuda")[None, :] <= positions[:, None]

    def sdpa():
        return F.scaled_dot_product_attention(sdpa_query, key, value, attn_mask=mask, is_causal=mask is None, scale=scale)

    sdpa_error = relative_error(sdpa().transpose(1, 2).reshape_as(query), expected)
    sdpa_us = time_graph_us(sdpa, calls_per_graph=3)
    best = min(rows, key=lambda row: row["us"])
    return {
        "batch": batch, "seq_len": seq_len, "cached": cached, "variants": rows,
        "sdpa_us": sdpa_us, "sdpa_tflops": flops / sdpa_us / 1e6, "sdpa_rel_error": sdpa_error,
        "best_over_sdpa_speed": sdpa_us / best["us"],
    }


def load_xgrammar_triton_kernel():
    """xgrammar's own Triton kernel as a same-run baseline, when its source file travelled along
    (XGRAMMAR_TRITON_KERNEL=path; xgrammar itself is not installed on the GPU machine)."""
    path = os.environ.get("XGRAMMAR_TRITON_KERNEL")
    if not path or not Path(path).exists():
        return None
    spec = importlib.util.spec_from_file_location("xgrammar_triton_bitmask", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.apply_token_bitmask_inplace_triton


def packed_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    batch, width = allowed.shape
    weights = 1 << torch.arange(32, device=allowed.device, dtype=torch.int64)
    packed = (allowed.view(batch, width // 32, 32).long() * weights).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def bitmask_apply(copy_gbps: float, vocab_size: int = 128_256, batches=(1, 4, 16, 64, 128, 256, 512),
                  allowed_fractions=(0.01, 0.5)) -> list[dict]:
    """In-place mask of a 128k vocab, fp32 logits, random masks; ours (both variants) vs the
    PyTorch reference and xgrammar's Triton kernel where available."""
    num_words = triton.cdiv(vocab_size, 32)
    xgrammar_kernel = load_xgrammar_triton_kernel()
    rows = []
    for fraction in allowed_fractions:
        for batch in batches:
            # Rotate over enough buffers to exceed L2, so every batch is timed from memory.
            num_buffers = max(1, min(8, (256 << 20) // (batch * vocab_size * 4)))
            logits = [torch.randn(batch, vocab_size, device="cuda") for _ in range(num_buffers)]
            allowed = torch.rand(batch, num_words * 32, device="cuda") < fraction
            bitmask = packed_bitmask(allowed)
            expected = logits[0].clone()
            apply_token_bitmask_reference(expected, bitmask)
            row = {"batch": batch, "allowed_fraction": fraction}
            for name, fn in [("ours", lambda x, m: apply_token_bitmask(x, m)),
                             ("ours_masked_store", lambda x, m: apply_token_bitmask(x, m, whole_words=False)),
                             ("xgrammar_triton", xgrammar_kernel)]:
                if fn is None:
                    continue
                checked = logits[0].clone()
                fn(checked, bitmask)
                if not torch.equal(checked, expected):
                    raise AssertionError(f"bitmask {name} wrong at batch {batch}")
                row[f"{name}_us"] = _rotating_graph_us(fn, logits, bitmask)
            row["reference_us"] = time_graph_us(lambda x=logits[0], m=bitmask: apply_token_bitmask_reference(x, m),
                                                calls_per_graph=1)
            disallowed = int((~allowed[:, :vocab_size]).sum())
            row["floor_us"] = (bitmask.numel() * 4 + disallowed * 4) / copy_gbps / 1e3
            row["speedup_vs_reference"] = row["reference_us"] / row["ours_us"]
            rows.append(row)
    return rows


def _rotating_graph_us(fn, logits: list[torch.Tensor], bitmask: torch.Tensor) -> float:
    """One graph applies the mask to each buffer in turn (16 calls at least); time per call."""
    buffers = logits * max(1, 16 // len(logits))

    def calls():
        for buffer in buffers:
            fn(buffer, bitmask)

    return time_graph_us(calls, calls_per_graph=1) / len(buffers)


def quick_cpu_check() -> None:
    """No GPU: run each kernel once through the interpreter against its reference, no timings."""
    inputs = paged_decode_inputs(2, 40, 4, 2, 16, 8, torch.float32, "cpu")
    args = (inputs["query"], inputs["key_cache"], inputs["value_cache"], inputs["block_tables"], inputs["seq_lens"], 0.25)
    error = relative_error(paged_decode_attention(*args, num_splits=2, block_n=16), paged_decode_attention_reference(*args))
    logits = torch.randn(3, 100)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32)
    ours, expected = logits.clone(), logits.clone()
    apply_token_bitmask(ours, bitmask)
    apply_token_bitmask_reference(expected, bitmask)
    if not (error < 1e-5 and torch.equal(ours, expected)):
        raise SystemExit(f"kernel check failed (decode relative error {error:.2e})")
    print("no GPU: kernels checked through the Triton interpreter; timings need a CUDA device")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="reduced sizes (CPU: interpreter check only)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    options = parser.parse_args()
    if not torch.cuda.is_available():
        quick_cpu_check()
        return
    copy_rates = copy_rates_gbps()
    copy_gbps = max(copy_rates.values())
    read_gbps = read_bandwidth_gbps()
    kv_writes = [kv_write_us(64), kv_write_us(16384)]
    variants = DECODE_VARIANTS[:2] if options.quick else DECODE_VARIANTS
    decode = decode_attention_bandwidth(copy_gbps, variants=variants)
    best = min(decode["variants"], key=lambda row: row["us"])
    default = decode["variants"][0]
    page32 = decode_attention_bandwidth(copy_gbps, block_size=32)["variants"][0]
    # Small batch, long context: where splitting the KV length should pay.
    small_batch = decode_attention_bandwidth(copy_gbps, batch=2, context=8192, variants=[{}, {"num_splits": 1}])
    prefill = [prefill_throughput()] + ([] if options.quick else [prefill_throughput(batch=4, seq_len=512, cached=3584)])
    bitmask = bitmask_apply(copy_gbps, batches=(1, 512) if options.quick else (1, 4, 16, 64, 128, 256, 512))
    properties = torch.cuda.get_device_properties(0)
    result = {
        "benchmark": "attention_kernels",
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "gpu": properties.name, "sms": properties.multi_processor_count,
                    "torch": torch.__version__, "triton": triton.__version__, "python": sys.version.split()[0]},
        "config": {"decode": "batch 64, context 2048, 32 q / 8 kv heads, head_dim 128, bf16, block 16",
                   "prefill": "32 q / 8 kv heads, head_dim 128, bf16, block 16, causal",
                   "bitmask": "vocab 128256, fp32 logits, random masks with 1% and 50% allowed"},
        "metrics": {
            "copy_bandwidth_gbps": copy_gbps,
            "copy_rates_gbps": copy_rates,
            "read_bandwidth_gbps": read_gbps,
            "attention_fraction_of_read_bw": best["gbps"] / read_gbps,
            "kv_write": kv_writes,
            "attention_bw_fraction": best["bw_fraction"],
            "attention_bw_fraction_default_config": default["bw_fraction"],
            "decode_us": best["us"], "decode_floor_us": decode["floor_us"],
            "attention_bw_fraction_page32": page32["bw_fraction"],
            "decode_b2_ctx8k_bw_fraction_auto_splits": small_batch["variants"][0]["bw_fraction"],
            "decode_b2_ctx8k_bw_fraction_one_split": small_batch["variants"][1]["bw_fraction"],
            "prefill_over_sdpa_speed": prefill[0]["best_over_sdpa_speed"],
            "bitmask_us_batch1": bitmask[0]["ours_us"],
            "bitmask_us_batch512": max(row["ours_us"] for row in bitmask if row["batch"] == 512),
            "decode_variants": decode["variants"], "prefill": prefill, "bitmask": bitmask,
        },
        "targets": {"attention_bw_fraction": {"op": ">=", "value": 0.70}},
        "checked": True,
    }
    options.output.parent.mkdir(parents=True, exist_ok=True)
    options.output.write_text(json.dumps(result, indent=2))
    print(f"card {properties.name}: copy {copy_gbps:.0f} GB/s {copy_rates}, read {read_gbps:.0f} GB/s")
    for row in kv_writes:
        print(f"write_kv_cache {row['num_tokens']} tokens: {row['us']:.1f} us ({row['bytes'] / row['us'] / 1e3:.0f} GB/s)")
    print(f"decode b64 ctx2k: best {best['us']:.1f} us = {best['bw_fraction']:.2%} of copy bw  {best}")
    print(f"decode default config: {default['us']:.1f} us = {default['bw_fraction']:.2%}; "
          f"page 32: {page32['us']:.1f} us = {page32['bw_fraction']:.2%}")
    for row in small_batch["variants"]:
        print(f"decode b2 ctx8k {row}")
    for row in prefill:
        top = min(row["variants"], key=lambda r: r["us"])
        print(f"prefill b{row['batch']} q{row['seq_len']} cached{row['cached']}: ours {top['us']:.0f} us "
              f"{top['tflops']:.0f} TFLOP/s vs sdpa {row['sdpa_us']:.0f} us {row['sdpa_tflops']:.0f} TFLOP/s {top}")
    for row in bitmask:
        others = " ".join(f"{k[:-3]} {v:.1f}" for k, v in row.items() if k.endswith("_us") and k != "ours_us")
        print(f"bitmask b{row['batch']} allowed {row['allowed_fraction']}: ours {row['ours_us']:.1f} us | {others}")


if __name__ == "__main__":
    main()
