"""Multi-LoRA kernel benchmark: our fused Triton op against PyTorch baselines and the memory floor.

Per projection (h = 4096 -> 4096 and 2048 -> 2048), ranks 8/16/64: decode batches of
T = 1/16/64/256 tokens over n = 1/8/T distinct adapters (at most 128 resident slots) and
a prefill of 8 segments x 512 tokens. Baselines, timed in the same run the same way:
the base GEMM alone, gather-then-bmm in PyTorch, and the per-adapter loop (what PEFT
does). Every op is checked against the reference before it is timed, captured in a CUDA
graph, and timed per replay with L2 flushed before each. The floor of a case is the
bytes that must move (x read, y read and written, each used adapter's A and B read
once) over the copy bandwidth measured in the same run.

    python benchmarks/lora_kernels.py            # GPU: full run, writes benchmarks/results/lora_kernels.json
    python benchmarks/lora_kernels.py --sweep    # GPU: also time kernel configurations on a few cases
    python benchmarks/lora_kernels.py --quick    # CPU or GPU: small sizes, reference kernels on the CPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from loraplex.engine.kernels.lora_metadata import LoRAMetadata, build_lora_metadata
from loraplex.engine.kernels.lora_reference import add_lora_ref
from loraplex.engine.kernels.lora_weights import LoRAStack

RESULTS = Path(__file__).resolve().parent / "results" / "lora_kernels.json"
MAX_RESIDENT = 128
PREFILL_SEGMENTS = 8


@dataclass(slots=True)
class Case:
    hidden: int
    rank: int
    num_tokens: int
    num_adapters: int
    segment_len: int = 0  # prefill: PREFILL_SEGMENTS segments of this many tokens; 0 = decode

    @property
    def prefill(self) -> bool:
        return self.segment_len > 0

    @property
    def name(self) -> str:
        shape = f"prefill{PREFILL_SEGMENTS}x{self.segment_len}" if self.prefill else f"T{self.num_tokens}"
        return f"h{self.hidden}_r{self.rank}_{shape}_n{self.num_adapters}"


def prefill_case(hidden: int, rank: int, segment_len: int) -> Case:
    return Case(hidden, rank, PREFILL_SEGMENTS * segment_len, PREFILL_SEGMENTS, segment_len)


def all_cases(hiddens: list[int], ranks: list[int], token_counts: list[int], segment_len: int) -> list[Case]:
    cases = []
    for hidden in hiddens:
        for rank in ranks:
            for tokens in token_counts:
                for n in sorted({1, min(8, tokens), min(tokens, MAX_RESIDENT)}):
                    cases.append(Case(hidden, rank, tokens, n))
            cases.append(prefill_case(hidden, rank, segment_len))
    return cases


@dataclass(slots=True)
class Problem:
    x: torch.Tensor
    y: torch.Tensor
    weight: torch.Tensor
    stack: LoRAStack
    meta: LoRAMetadata
    token_slots: torch.Tensor  # int64, -1 none
    used_slots: list[int]
    rows_per_slot: list[torch.Tensor]
    scalings: list[float]  # host copies: a CUDA-graph capture must not read the device


def make_problem(case: Case, device: str, dtype: torch.dtype, gen: torch.Generator) -> Problem:
    h, r = case.hidden, case.rank
    num_slots = MAX_RESIDENT if device == "cuda" else max(case.num_adapters, 8)
    stack = LoRAStack(
        lora_a=(torch.randn(num_slots, 1, r, h, generator=gen) / h**0.5).to(device, dtype),
        lora_b=(torch.randn(num_slots, h, r, generator=gen) / r**0.5).to(device, dtype),
        ranks=torch.full((num_slots, 1), r, dtype=torch.int32, device=device),
        scalings=(torch.rand(num_slots, 1, generator=gen) + 0.5).to(device),
        out_sizes=(h,),
    )
    used = torch.randperm(num_slots, generator=gen)[: case.num_adapters].tolist()
    if case.prefill:
        slots = [used[i % len(used)] for i in range(PREFILL_SEGMENTS) for _ in range(case.segment_len)]
    else:
        order = torch.randperm(case.num_tokens, generator=gen).tolist()
        slots = [used[i % len(used)] for i in order]
    token_slots = torch.tensor(slots, dtype=torch.int64)
    return Problem(
        x=torch.randn(case.num_tokens, h, generator=gen).to(device, dtype),
        y=torch.randn(case.num_tokens, h, generator=gen).to(device, dtype),
        weight=(torch.randn(h, h, generator=gen) / h**0.5).to(device, dtype),
        stack=stack,
        meta=build_lora_metadata(slots, max_loras=num_slots, device=device),
        token_slots=token_slots.to(device),
        used_slots=used,
        rows_per_slot=[torch.nonzero(token_slots == s).flatten().to(device) for s in used],
        scalings=[float(stack.scalings[s, 0]) for s in used],
    )


def floor_bytes(case: Case, elem: int) -> int:
    h = case.hidden
    return elem * (case.num_tokens * h * 3 + case.num_adapters * case.rank * 2 * h)


# ---- baselines (each adds the delta into y, like ours, except the base GEMM) -------------------


def base_gemm(p: Problem) -> Callable[[], None]:
    out = torch.empty_like(p.y)
    return lambda: torch.matmul(p.x, p.weight.t(), out=out)


def gather_bmm(p: Problem) -> Callable[[], None]:
    """Gather each token's A and B ([T, r, h], [T, h, r]) and run two batched GEMMs."""
    slots = p.token_slots.clamp_min(0)
    # Rows without an adapter gather slot 0 and are scaled by zero.
    token_scale = (p.stack.scalings[slots, 0] * (p.token_slots >= 0)).to(p.y.dtype)[:, None, None]

    def run() -> None:
        a = p.stack.lora_a[slots, 0]
        b = p.stack.lora_b[slots]
        s = torch.bmm(p.x[:, None, :], a.transpose(1, 2)) * token_scale
        p.y.add_(torch.bmm(s, b.transpose(1, 2))[:, 0])

    return run


def per_adapter_loop(p: Problem) -> Callable[[], None]:
    """PEFT's mixed-batch forward: per adapter, select its rows, two GEMMs, scatter back."""

    def run() -> None:
        for slot, rows, scaling in zip(p.used_slots, p.rows_per_slot, p.scalings, strict=True):
            xs = p.x.index_select(0, rows)
            delta = (xs @ p.stack.lora_a[slot, 0].t()) @ p.stack.lora_b[slot].t()
            p.y.index_add_(0, rows, delta, alpha=scaling)

    return run


def ours(p: Problem, config: object | None = None) -> Callable[[], None]:
    if p.x.is_cuda:
        from loraplex.engine.kernels.lora_triton import add_lora

        return lambda: add_lora(p.y, p.x, p.stack, p.meta, config=config)
    return lambda: add_lora_ref(p.y, p.x, p.stack, p.meta)


# ---- checking and timing -------------------------------------------------------------------------


def check(p: Problem, fn: Callable[[], None], expected_delta: torch.Tensor, tol: float) -> float:
    before = p.y.clone()
    fn()
    delta = p.y.double() - before.double()
    p.y.copy_(before)
    err = ((delta - expected_delta).norm() / expected_delta.norm()).item()
    if not err < tol:
        raise AssertionError(f"relative error {err:.2e} over {tol:.0e}")
    return err


class GpuTimer:
    def __init__(self, reps: int) -> None:
        self.reps = reps
        self.flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")

    def __call__(self, fn: Callable[[], None]) -> tuple[float, float]:
        """Median and inter-quartile spread (µs) of one CUDA-graph replay, L2 flushed before each."""
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for _ in range(5):
            graph.replay()
        for start, end in zip(starts, ends, strict=True):
            self.flush.zero_()
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        times = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends, strict=True))
        q = statistics.quantiles(times, n=4)
        self.last_p90 = statistics.quantiles(times, n=10)[-1]
        self.last_max = times[-1]
        return statistics.median(times), q[2] - q[0]


def cpu_timer(fn: Callable[[], None], reps: int = 5) -> tuple[float, float]:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times), max(times) - min(times)


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(2**30, dtype=torch.int8, device="cuda").random_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(times[2:])


def launch_us(timer: GpuTimer) -> float:
    """One empty Triton kernel, timed like every op here: the 'one launch' of the target."""
    from loraplex.engine.kernels.lora_triton_programs import noop_kernel

    buf = torch.empty(1, dtype=torch.int32, device="cuda")
    return timer(lambda: noop_kernel[(1,)](buf))[0]


# ---- main ----------------------------------------------------------------------------------------


def run_cases(cases: list[Case], device: str, timer: Callable, bandwidth: float | None) -> list[dict]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    gen = torch.Generator().manual_seed(0)
    rows = []
    for case in cases:
        p = make_problem(case, device, dtype, gen)
        expected = p.y.double().clone()
        add_lora_ref(expected, p.x.double(), _double_stack(p.stack), p.meta)
        expected -= p.y.double()
        impls = {"ours": ours(p), "gather": gather_bmm(p), "loop": per_adapter_loop(p)}
        errors = {name: check(p, fn, expected, tol) for name, fn in impls.items()}
        row = {"case": case.name, "n": case.num_adapters, "prefill": case.prefill}
        for name, fn in [*impls.items(), ("base", base_gemm(p))]:
            row[f"{name}_us"], row[f"{name}_spread_us"] = timer(fn)
            if name == "ours" and isinstance(timer, GpuTimer):
                row["ours_p90_us"] = timer.last_p90
        row["max_rel_error"] = max(errors.values())
        if bandwidth:
            row["floor_us"] = floor_bytes(case, p.x.element_size()) / bandwidth * 1e6
        rows.append(row)
        print(_format_row(row), flush=True)
    return rows


def _double_stack(stack: LoRAStack) -> LoRAStack:
    return LoRAStack(stack.lora_a.double(), stack.lora_b.double(), stack.ranks, stack.scalings, stack.out_sizes)


def _format_row(row: dict) -> str:
    floor = row.get("floor_us")
    extra = f" floor {floor:8.2f}  ours/floor {row['ours_us'] / floor:5.2f}" if floor else ""
    return (
        f"{row['case']:32s} ours {row['ours_us']:9.2f}  gather {row['gather_us']:9.2f}  "
        f"loop {row['loop_us']:9.2f}  base {row['base_us']:9.2f}{extra}"
    )


def summarize(rows: list[dict], launch: float) -> dict:
    decode_n8 = [r for r in rows if r["n"] >= 8 and not r["prefill"]]
    prefill = [r for r in rows if r["prefill"]]
    beats = [r["ours_us"] < min(r["gather_us"], r["loop_us"], r["base_us"]) for r in rows]
    return {
        # The target is ours <= 2 x floor + one launch, i.e. (ours - launch) / floor <= 2.
        "worst_ratio_to_floor_n_ge_8": max((r["ours_us"] - launch) / r["floor_us"] for r in decode_n8),
        "worst_raw_ratio_to_floor_n_ge_8": max(r["ours_us"] / r["floor_us"] for r in decode_n8),
        "prefill_ratio_to_floor": max(r["ours_us"] / r["floor_us"] for r in prefill),
        "cases_beating_all_baselines_fraction": sum(beats) / len(beats),
        "cases_beating_gather_and_loop_fraction": sum(
            r["ours_us"] < min(r["gather_us"], r["loop_us"]) for r in rows) / len(rows),
        # Cases where even the floor is slower than the base GEMM: no kernel can beat that baseline.
        "cases_with_floor_above_base_gemm": sum(r["floor_us"] > r["base_us"] for r in rows),
        "launch_us": launch,
    }


def sweep(device: str, timer: GpuTimer) -> list[dict]:
    from loraplex.engine.kernels.lora_triton import LoRAKernelConfig, choose_config

    prefill_configs = [
        LoRAKernelConfig(block_n, split_k, 128, 4, fused=False, rank_masked_loads=masked)
        for block_n, split_k, masked in [(256, 2048, True), (256, 1024, False), (128, 4096, False)]
    ]
    picks = [
        (prefill_case(hidden, rank, 512), [16, 32], prefill_configs)
        for hidden, rank in [(4096, 16), (4096, 64), (2048, 16), (2048, 64)]
    ]
    gen = torch.Generator().manual_seed(1)
    out = []
    for case, block_ms, configs in picks:
        p = make_problem(case, device, torch.bfloat16, gen)
        expected = p.y.double().clone()
        add_lora_ref(expected, p.x.double(), _double_stack(p.stack), p.meta)
        expected -= p.y.double()
        y_start = p.y.clone()  # timing replays add into y; each check starts from the same y
        for block_m in block_ms:
            p.meta = build_lora_metadata(p.token_slots.tolist(), max_loras=MAX_RESIDENT, device=device,
                                         block_m=block_m)
            for cfg in [choose_config(p.stack, p.meta), *configs]:
                row = {"case": case.name, "block_m": block_m, "fused": cfg.fused, "block_n": cfg.block_n,
                       "split_k": cfg.split_k, "num_warps": cfg.num_warps,
                       "num_stages": cfg.num_stages, "rank_masked_loads": cfg.rank_masked_loads}
                p.y.copy_(y_start)
                try:
                    row["rel_error"] = check(p, ours(p, cfg), expected, 2e-2)
                except AssertionError as err:
                    print(f"sweep FAILED CHECK {row}: {err}", flush=True)
                    continue
                row["us"], row["spread_us"] = timer(ours(p, cfg))
                out.append(row)
        best = min((r for r in out if r["case"] == case.name), key=lambda r: r["us"])
        print(f"sweep {case.name:32s} best {best}", flush=True)
    return out


def stability(device: str, reps: int = 400) -> list[dict]:
    """Tail latency of the one-launch (waiting) and two-launch forms where a wait could stall."""
    import dataclasses

    from loraplex.engine.kernels.lora_triton import choose_config

    timer = GpuTimer(reps=reps)
    gen = torch.Generator().manual_seed(2)
    out = []
    for case in (Case(2048, 64, 16, 16), Case(2048, 64, 256, 1), Case(4096, 16, 256, 1), Case(4096, 16, 64, 8)):
        p = make_problem(case, device, torch.bfloat16, gen)
        for fused in (True, False):
            cfg = dataclasses.replace(choose_config(p.stack, p.meta), fused=fused)
            median, _ = timer(ours(p, cfg))
            row = {"case": case.name, "fused": fused, "p50_us": median, "p90_us": timer.last_p90,
                   "max_us": timer.last_max}
            print(f"stability {row}", flush=True)
            out.append(row)
    return out


def machine(device: str) -> dict:
    import triton

    gpu = torch.cuda.get_device_name() if device == "cuda" else None
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "gpu": gpu,
            "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small sizes; the CPU runs the reference kernels")
    parser.add_argument("--sweep", action="store_true", help="also time kernel configurations")
    parser.add_argument("--sweep-only", action="store_true", help="time kernel configurations, nothing else")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"

    if args.quick and device == "cpu":
        print("no GPU: quick run of the reference kernels and baselines on the CPU (nothing written)")
        rows = run_cases(all_cases([256], [8], [1, 16], segment_len=16), device, cpu_timer, bandwidth=None)
        print(f"{len(rows)} cases checked")
        return 0

    if device != "cuda":
        print("no GPU: the full benchmark runs on a CUDA device (see --quick)")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    timer = GpuTimer(reps=60 if args.quick else 120)
    bandwidth = copy_bandwidth()
    launch = launch_us(timer)
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s, empty launch {launch:.2f} us",
          flush=True)
    sweep_rows = sweep(device, timer) if args.sweep or args.sweep_only else []
    if args.sweep_only:
        args.out.with_suffix(".sweep.json").write_text(json.dumps(sweep_rows, indent=1) + "\n")
        return 0
    if args.quick:
        cases = all_cases([2048], [16], [64], segment_len=512)
    else:
        cases = all_cases([4096, 2048], [8, 16, 64], [1, 16, 64, 256], segment_len=512)
    stability_rows = stability(device, reps=100 if args.quick else 400)
    rows = run_cases(cases, device, timer, bandwidth)
    metrics = summarize(rows, launch)
    metrics["copy_bandwidth_tb_s"] = bandwidth / 1e12
    print(json.dumps(metrics, indent=1))
    if args.quick:
        return 0
    result = {
        "benchmark": "lora_kernels",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine(device),
        "config": {"dtype": "bfloat16", "max_resident_slots": MAX_RESIDENT, "timing":
                   "CUDA graph replay, L2 flushed (256 MiB write) before each, median of 120",
                   "floor": "(x read + y read/write + used adapters' A and B) / measured copy bandwidth"},
        "metrics": {**metrics, "cases": [{k: r[k] for k in ("case", "ours_us", "gather_us", "loop_us",
                                                               "base_us", "floor_us")} for r in rows]},
        "targets": {
            "worst_ratio_to_floor_n_ge_8": {"op": "<=", "value": 2.0},
            "prefill_ratio_to_floor": {"op": "<=", "value": 1.3},
            "cases_beating_all_baselines_fraction": {"op": ">=", "value": 1.0},
        },
        "checked": True,
        "detail": {"rows": rows, "sweep": sweep_rows, "stability": stability_rows},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
