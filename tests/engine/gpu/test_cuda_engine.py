"""The CUDA engine against the CPU engine on the same small random model (speculative verification steps too).

float32: greedy tokens equal (CUDA graphs on, mixed-step graphs too), also with mixed LoRA adapters and
grammar masks in one batch; bfloat16: prompt logprobs close to the float32 CPU engine's and most first tokens
equal; graphs on and off give the same tokens; the KV pool is sized from the memory fraction.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from enginecore_helpers import greedy, output_tokens, run_to_completion, tiny_random_config
from grammar_double import FixedSetGrammar
from loraplex.engine.config import AdapterLimits, EngineConfig
from loraplex.engine.cuda.graphs import capturing
from loraplex.engine.cuda.random_weights import RandomAdapterSource, SyntheticTokenizer
from loraplex.engine.cuda.runner import CudaModelRunner
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.model.loader import random_model
from loraplex.engine.protocol import EngineRequest, SamplingParams
from waiting import wait_until

pytestmark = pytest.mark.gpu

VOCAB = 1000  # not a multiple of 32: the bitmask's last word is partial
CONFIG = tiny_random_config(vocab_size=VOCAB)
MAX_LEN = 256
GPU_DEVICE = "cuda"


def make_engine(device: str, dtype: str = "float32", lora: bool = False, **overrides: Any) -> LLMEngine:
    settings = {"num_blocks": 96, "block_size": 16, "max_model_len": MAX_LEN, "max_num_batched_tokens": 64,
                "max_num_seqs": 8, "dtype": dtype, "device": device} | overrides
    config = EngineConfig(**settings)
    model = random_model(CONFIG, MAX_LEN, seed=0, dtype=config.torch_dtype, device=device)
    with torch.no_grad():  # peaked logits: greedy choices are never rounding-noise ties
        model.lm_head.weight.mul_(10.0)
    adapters = RandomAdapterSource(CONFIG, rank=8, dtype=config.torch_dtype, std=0.1) if lora else None
    return LLMEngine(model, CONFIG, config, SyntheticTokenizer(VOCAB), adapters=adapters,
                     adapter_limits=AdapterLimits(max_loras=4, max_cpu_loras=8, max_lora_rank=8))


def prompts(count: int, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = [3, 17, 40, 64, 90, 5, 33, 128][:count]
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def generate(engine: LLMEngine, requests: list[EngineRequest]) -> dict[str, list[int]]:
    return {rid: output_tokens(outs) for rid, outs in run_to_completion(engine, requests).items()}


def plain_requests(max_tokens: int = 12) -> list[EngineRequest]:
    return [EngineRequest(f"r{i}", p, greedy(max_tokens, ignore_eos=True)) for i, p in enumerate(prompts(8))]


def host_sampler_calls(engine: LLMEngine) -> list[int]:
    """The rows of each call of `engine`'s host sampler from now on."""
    calls: list[int] = []
    sample = engine.runner.sampler.sample
    engine.runner.sampler.sample = lambda logits, seqs, result: (calls.append(len(seqs)),  # type: ignore[method-assign]
                                                                 sample(logits, seqs, result))
    return calls


def test_cuda_runner_is_selected_by_device() -> None:
    engine = make_engine(GPU_DEVICE)
    assert isinstance(engine.runner, CudaModelRunner)
    assert engine.runner.kv_caches[0][0].is_cuda


def test_float32_greedy_equals_cpu_engine_with_graphs() -> None:
    expected = generate(make_engine("cpu"), plain_requests())
    engine = make_engine(GPU_DEVICE)
    assert generate(engine, plain_requests()) == expected
    # Prefill chunks (alone and beside decodes) replay mixed-step graphs: no step ran eagerly.
    assert engine.runner.num_graph_steps > 0 and engine.runner.num_mixed_graph_steps > 0
    assert engine.runner.num_eager_steps == 0


def test_logit_bias_rows_take_the_host_sampler_and_equal_the_cpu_engine() -> None:
    """Biased greedy rows beside unbiased ones (which stay on the GPU argmax and its graphs)."""
    def requests() -> list[EngineRequest]:
        out = []
        for i, prompt in enumerate(prompts(8)):
            bias = {5: 100.0} if i % 3 == 0 else ({int(t): -100.0 for t in range(0, VOCAB, 2)} if i % 3 == 1 else None)
            out.append(EngineRequest(f"r{i}", prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                                     logit_bias=bias)))
        return out

    expected = generate(make_engine("cpu"), requests())
    engine = make_engine(GPU_DEVICE)
    got = generate(engine, requests())
    assert got == expected
    assert all(t == [5] * 6 for rid, t in got.items() if int(rid[1:]) % 3 == 0)
    assert all(tok % 2 == 1 for rid, t in got.items() if int(rid[1:]) % 3 == 1 for tok in t)
    assert engine.runner.num_graph_steps > 0


def test_min_tokens_rows_take_the_host_sampler_and_equal_the_cpu_engine() -> None:
    """Rows whose stop token would come first, held to min_tokens, beside plain rows on the GPU argmax."""
    baseline = generate(make_engine("cpu"), plain_requests(8))

    def requests() -> list[EngineRequest]:
        out = []
        for i, prompt in enumerate(prompts(8)):
            held = i % 2 == 0
            sampling = greedy(8, ignore_eos=True, stop_token_ids=[baseline[f"r{i}"][1]], min_tokens=5 if held else 0)
            out.append(EngineRequest(f"r{i}", prompt, sampling))
        return out

    expected = generate(make_engine("cpu"), requests())
    engine = make_engine(GPU_DEVICE)
    got = generate(engine, requests())
    assert got == expected
    for rid, tokens in got.items():
        stop = baseline[rid][1]
        if int(rid[1:]) % 2 == 0:
            assert stop not in tokens[:5] and len(tokens) >= 5
        else:
            assert tokens == baseline[rid][: len(tokens)] and tokens[-1] == stop
    assert engine.runner.num_graph_steps > 0


def test_seeded_random_rows_draw_on_the_gpu_and_equal_the_cpu_engine() -> None:
    """Temperature, top-k, top-p and min-p rows (seeded) beside greedy ones: drawn on the GPU from the same
    per-sequence uniforms as the host sampler, so float32 gives the CPU engine's tokens, and no row takes the
    host sampler (whose copy of a batch's logits cost more than the step)."""
    def requests() -> list[EngineRequest]:
        filters = [{}, {"top_k": 20}, {"top_p": 0.9}, {"min_p": 0.05}]
        return [EngineRequest(f"r{i}", prompt, SamplingParams(max_tokens=10, temperature=0.0 if i == 0 else 0.7,
                                                              seed=100 + i, ignore_eos=True, **filters[i % 4]))
                for i, prompt in enumerate(prompts(8))]

    expected = generate(make_engine("cpu"), requests())
    engine = make_engine(GPU_DEVICE)
    host_calls = host_sampler_calls(engine)
    assert generate(engine, requests()) == expected
    assert host_calls == []


def test_host_sampler_rows_go_to_the_host_alone_and_every_row_equals_the_cpu_engine() -> None:
    """Rows with penalties or a bias beside logprobs, grammar, random and greedy rows: only the former's logits
    go to the host (logprobs are made on the GPU, a grammar row's from its unmasked logits, as on the host);
    every row's tokens and logprobs are the CPU engine's, as each would be in any batch."""
    grammar = FixedSetGrammar([list(range(0, VOCAB, 3))] * 8)

    def requests() -> list[EngineRequest]:
        host = [{"repetition_penalty": 1.3}, {"frequency_penalty": 0.5, "presence_penalty": 0.2},
                {"logprobs": 2}, {"logit_bias": {7: 3.0}}]
        out = []
        for i, prompt in enumerate(prompts(8)):
            if i < 4:
                out.append(EngineRequest(f"r{i}", prompt, SamplingParams(max_tokens=8, temperature=0.0,
                                                                         ignore_eos=True, **host[i])))
            elif i == 4:
                out.append(EngineRequest(f"r{i}", prompt, greedy(8, ignore_eos=True, logprobs=1), grammar=grammar))
            else:  # seeded random rows: a temperature alone (the graph's draw) and a top-p one (the GPU's draw)
                out.append(EngineRequest(f"r{i}", prompt, SamplingParams(max_tokens=8, temperature=0.8, seed=40 + i,
                                                                         ignore_eos=True, top_p=0.9 if i == 7 else 1.0)))
        return out

    cpu = run_to_completion(make_engine("cpu"), requests())
    engine = make_engine(GPU_DEVICE)
    host_rows = host_sampler_calls(engine)
    gpu = run_to_completion(engine, requests())
    assert {rid: output_tokens(outs) for rid, outs in gpu.items()} == {rid: output_tokens(outs)
                                                                       for rid, outs in cpu.items()}
    assert all(token % 3 == 0 for token in output_tokens(gpu["r4"]))

    def entries(outs: list[Any]) -> list[Any]:
        return [entry for out in outs for choice in out.choices for entry in (choice.logprobs or [])]

    for rid, k in (("r2", 2), ("r4", 1)):
        want, got = entries(cpu[rid]), entries(gpu[rid])
        assert len(got) == len(want) == 8
        assert [e.logprob for e in got] == pytest.approx([e.logprob for e in want], abs=1e-4)
        assert [[t for t, _ in e.top] for e in got] == [[t for t, _ in e.top] for e in want]
        assert all(len(e.top) == k for e in got)
    assert host_rows and max(host_rows) <= 3  # never the whole step: the three host rows at most
    assert engine.runner.num_graph_steps > 0


def temperature_requests(max_tokens: int = 10) -> list[EngineRequest]:
    """Seeded rows at a temperature alone (no top-k, top-p or min-p) beside greedy ones."""
    temperatures = [0.0, 0.7, 2.0, 5.0]
    return [EngineRequest(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=temperatures[i % 4],
                                                          seed=200 + i, ignore_eos=True))
            for i, prompt in enumerate(prompts(8))]


def test_temperature_rows_draw_inside_the_graphs_and_equal_the_cpu_engine() -> None:
    """The graphs' own draw (one upload, one replay) takes the CPU engine's tokens from the same uniforms."""
    expected = generate(make_engine("cpu"), temperature_requests())
    engine = make_engine(GPU_DEVICE)
    assert generate(engine, temperature_requests()) == expected
    assert engine.runner.num_graph_draws > 0
    assert len({tuple(tokens) for tokens in expected.values()}) == len(expected)


def test_temperature_draws_with_graphs_on_and_off_give_the_same_tokens_bf16() -> None:
    """Row by row the graph's draw is `Sampler.draw`'s arithmetic: graphs on and off agree token for token."""
    on = make_engine(GPU_DEVICE, "bfloat16")
    off = make_engine(GPU_DEVICE, "bfloat16", enable_cuda_graphs=False, cuda_graph_mixed_steps=False)
    tokens_on = generate(on, temperature_requests(20))
    assert tokens_on == generate(off, temperature_requests(20))
    assert on.runner.num_graph_draws > 0 and off.runner.num_graph_draws == 0


def test_graphs_on_and_off_give_the_same_tokens_bf16() -> None:
    on = make_engine(GPU_DEVICE, "bfloat16")
    assert on.runner.capture_decode_graphs() == len(on.runner.ladder)  # start-up capture of every size
    off = make_engine(GPU_DEVICE, "bfloat16", enable_cuda_graphs=False)
    assert off.runner.capture_decode_graphs() == 0
    tokens_on = generate(on, plain_requests(20))
    assert tokens_on == generate(off, plain_requests(20))
    assert on.runner.num_graph_steps > 0 and off.runner.num_graph_steps == 0
    assert all(len(t) == 20 for t in tokens_on.values())


def test_bfloat16_stays_close_to_float32_cpu() -> None:
    def requests() -> list[EngineRequest]:
        sampling = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
        return [EngineRequest(f"r{i}", p, sampling) for i, p in enumerate(prompts(8))]

    def run(engine: LLMEngine) -> dict[str, tuple[list[float], list[int]]]:
        out = {}
        for rid, outs in run_to_completion(engine, requests()).items():
            logprobs = [lp.logprob for o in outs if o.prompt_logprobs for lp in o.prompt_logprobs if lp is not None]
            out[rid] = (logprobs, output_tokens(outs))
        return out

    reference, ours = run(make_engine("cpu")), run(make_engine(GPU_DEVICE, "bfloat16"))
    diffs = [abs(a - b) for rid in reference for a, b in zip(reference[rid][0], ours[rid][0], strict=True)]
    assert len(diffs) == sum(len(p) - 1 for p in prompts(8))
    assert max(diffs) < 0.2, max(diffs)
    same_first = sum(reference[rid][1] == ours[rid][1] for rid in reference)
    assert same_first >= 6, same_first


def mixed_requests() -> list[EngineRequest]:
    """Adapters a/b/c and the base model, half of them under a grammar, in one batch."""
    allowed = [[7, 100, 999], [31, 32, 33, 500], [1, 2, 3, 4, 5, 6], [998, 997], [64, 128, 256, 512]]
    requests = []
    for i, prompt in enumerate(prompts(8)):
        adapter = [None, "a", "b", "c"][i % 4]
        grammar = FixedSetGrammar(allowed) if i % 2 else None
        max_tokens = len(allowed) if grammar else 10
        requests.append(EngineRequest(f"r{i}", prompt, greedy(max_tokens, ignore_eos=True), adapter_id=adapter,
                                      grammar=grammar))
    return requests


def test_mixed_lora_and_grammar_batch_equals_cpu_engine() -> None:
    expected = generate(make_engine("cpu", lora=True), mixed_requests())
    engine = make_engine(GPU_DEVICE, lora=True)
    got = generate(engine, mixed_requests())
    assert got == expected
    assert engine.runner.num_graph_steps > 0
    assert any(key[1] is not None for key in engine.runner.graphs)  # a LoRA graph was replayed
    allowed = mixed_requests()[1].grammar.allowed
    for i in (1, 3, 5, 7):
        tokens = got[f"r{i}"]
        assert len(tokens) == len(allowed) and all(t in allowed[k] for k, t in enumerate(tokens))
    # Adapters change the output: the same prompt without its adapter differs.
    base = generate(make_engine(GPU_DEVICE), [EngineRequest("x", prompts(8)[2], greedy(10, ignore_eos=True))])
    assert base["x"] != got["r2"]


def many_lora_requests(count: int = 20, max_tokens: int = 10) -> list[EngineRequest]:
    """More sequences than the fused LoRA linear's 16-row minimum: adapters a/b/c and base rows mixed."""
    generator = torch.Generator().manual_seed(5)
    return [EngineRequest(f"m{i}", torch.randint(0, VOCAB, (3 + 7 * i % 50,), generator=generator).tolist(),
                          greedy(max_tokens, ignore_eos=True), adapter_id=[None, "a", "b", "c"][i % 4])
            for i in range(count)]


def counting_fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    from loraplex.engine.kernels import lora_gemm

    calls: list[int] = []
    real = lora_gemm.linear_with_lora

    def counted(x, *args, **kwargs):
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(lora_gemm, "linear_with_lora", counted)
    monkeypatch.setattr(lora_gemm, "TUNED_ONLY", False)  # the tiny model's shapes are not in the tuned table
    return calls


def test_fused_lora_linear_at_decode_equals_cpu_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32: decode batches of 16+ rows run GEMM + LoRA delta in one launch (`lora_gemm`), graphs on."""
    expected = generate(make_engine("cpu", lora=True, max_num_seqs=24), many_lora_requests())
    calls = counting_fused_calls(monkeypatch)
    engine = make_engine(GPU_DEVICE, lora=True, max_num_seqs=24)
    assert generate(engine, many_lora_requests()) == expected
    assert calls and min(calls) >= 16 and engine.runner.num_graph_steps > 0


def test_fused_lora_linear_bf16_graphs_on_off_and_separate_path_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    from loraplex.engine.lora import step as lora_step

    calls = counting_fused_calls(monkeypatch)
    on = generate(make_engine(GPU_DEVICE, "bfloat16", lora=True, max_num_seqs=24), many_lora_requests())
    assert calls
    off = generate(make_engine(GPU_DEVICE, "bfloat16", lora=True, max_num_seqs=24, enable_cuda_graphs=False),
                   many_lora_requests())
    assert on == off
    monkeypatch.setattr(lora_step, "FUSED_LINEAR_ROWS", range(0))
    count = len(calls)
    separate = generate(make_engine(GPU_DEVICE, "bfloat16", lora=True, max_num_seqs=24), many_lora_requests())
    assert len(calls) == count  # the separate GEMM + LoRA kernel path ran
    assert separate == on


def test_kv_pool_is_sized_from_the_memory_fraction() -> None:
    engine = make_engine(GPU_DEVICE, num_blocks=None, gpu_memory_utilization=0.05)
    total = torch.cuda.get_device_properties(0).total_memory
    pool = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in engine.runner.kv_caches)
    assert engine.num_blocks > 1000
    assert pool <= 0.05 * total
    assert generate(engine, plain_requests(4))["r0"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_overlapped_steps_give_the_same_tokens_as_steps_one_at_a_time(dtype: str) -> None:
    """Decode steps launched ahead of the previous step's tokens (the ids gathered on the GPU):
    the workload of tests/engine/test_step_overlap.py (requests finishing at different steps, one
    admitted and one aborted mid-run, seeded rows drawing at a temperature in the graphs, one at the context
    limit)."""
    from test_step_overlap import make_engine as overlap_engine
    from test_step_overlap import workload

    expected = workload(overlap_engine(False, device=GPU_DEVICE, dtype=dtype))
    engine = overlap_engine(True, device=GPU_DEVICE, dtype=dtype)
    got = workload(engine)
    doomed, doomed_expected = got.pop("doomed"), expected.pop("doomed")
    assert doomed == doomed_expected[: len(doomed)]
    assert got == expected
    assert engine.overlap.num_steps_ahead > 10 and engine.overlap.num_rows_dropped > 0
    assert engine.runner.num_graph_steps > 10 and engine.runner.num_graph_draws > 10


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_requests_arriving_mid_flight_join_steps_launched_ahead_with_the_same_tokens(dtype: str) -> None:
    """Prompt chunks, cached prompts' one-token first rows and seeded temperature rows launched ahead of the
    step in flight, through mixed-step graphs whose in-flight decodes take their ids on the GPU: the same
    tokens as steps one at a time."""
    from test_step_overlap import make_engine as overlap_engine
    from test_step_overlap import mid_flight_arrivals

    expected = mid_flight_arrivals(overlap_engine(False, device=GPU_DEVICE, dtype=dtype, max_model_len=256))
    engine = overlap_engine(True, device=GPU_DEVICE, dtype=dtype, max_model_len=256)
    assert mid_flight_arrivals(engine) == expected
    assert engine.overlap.num_prompt_steps_ahead > 0 and engine.runner.num_mixed_graph_steps > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_scoring_requests_arriving_mid_flight_keep_their_prompt_logprobs_with_overlap() -> None:
    """A step with prompt logprobs replays a mixed graph but is never launched ahead (a launched step returns
    its tokens alone): scoring requests arriving while decodes run ahead get every prompt logprob."""
    from test_step_overlap import make_engine as overlap_engine
    from test_step_overlap import prompt

    def run(engine: LLMEngine) -> dict[str, tuple[list[int], list[float]]]:
        arrivals = {0: [EngineRequest("first", prompt(41, 10), greedy(40, ignore_eos=True))]}
        for i in range(3):
            arrivals[3 + 5 * i] = [EngineRequest(f"score{i}", prompt(90 + i, 30 + 20 * i), SamplingParams(
                max_tokens=2, temperature=0.0, prompt_logprobs=0, ignore_eos=True))]
        outs: dict[str, list[Any]] = {}
        for step in range(500):
            for request in arrivals.pop(step, []):
                engine.add_request(request)
            for out in engine.step():
                outs.setdefault(out.request_id, []).append(out)
            if not arrivals and not engine.has_unfinished_requests():
                break
        return {rid: (output_tokens(o), [lp.logprob for x in o if x.prompt_logprobs for lp in x.prompt_logprobs
                                         if lp is not None]) for rid, o in outs.items()}

    expected = run(overlap_engine(False, device=GPU_DEVICE, max_model_len=256))
    engine = overlap_engine(True, device=GPU_DEVICE, max_model_len=256)
    got = run(engine)
    assert engine.overlap.num_steps_ahead > 0 and engine.runner.num_mixed_graph_steps > 0
    for rid, (tokens, logprobs) in expected.items():
        assert got[rid][0] == tokens
        assert got[rid][1] == pytest.approx(logprobs, abs=1e-4)
        if rid.startswith("score"):
            assert len(logprobs) == 30 + 20 * int(rid[-1]) - 1


def test_lora_graphs_captured_at_start_up_equal_cpu_engine_and_follow_a_new_manager() -> None:
    """`serve` captures every decode graph at start-up, LoRA ones included; a new LoRA manager (new slot
    stacks) gets new LoRA graphs instead of replaying ones that read the old stacks."""
    cpu = make_engine("cpu", lora=True, max_num_seqs=24)
    engine = make_engine(GPU_DEVICE, lora=True, max_num_seqs=24)
    ladder = engine.runner.ladder
    assert engine.runner.capture_decode_graphs() == 2 * len(ladder)
    assert all((size, "lora") in engine.runner.graphs for size in ladder)
    assert generate(engine, many_lora_requests()) == generate(cpu, many_lora_requests())
    limits = AdapterLimits(max_loras=4, max_cpu_loras=8, max_lora_rank=8)
    for e in (cpu, engine):
        e.serve_adapters(RandomAdapterSource(CONFIG, rank=8, dtype=e.config.torch_dtype, std=0.2), limits)
    assert generate(engine, many_lora_requests()) == generate(cpu, many_lora_requests())


def test_a_capture_holds_off_the_collector_that_would_free_old_graphs_inside_it() -> None:
    """Earlier graphs (each with memory of its pool) left in reference cycles, which the capture's own
    allocations make garbage, with churn that would run the collector many times: a collection inside the capture
    destroys them, and the capture then fails ("operation failed due to a previous error during capture", a test
    order's random failure). `capturing` collects nothing until the capture ends; the graph replays its ops,
    and the collector runs again after."""
    device = torch.device(GPU_DEVICE)
    x = torch.ones(4096, device=device)
    (x * 2 + 1).sum()  # the kernels compiled off the capture
    old_graphs = []
    for _ in range(4):
        old = torch.cuda.CUDAGraph()
        with capturing(old):
            scratch = torch.full((1 << 20,), 2.0, device=device)
            old_graphs.append((old, x * scratch[:4096], scratch))
    torch.cuda.synchronize()
    collections: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    thresholds = gc.get_threshold()
    graph = torch.cuda.CUDAGraph()
    gc.callbacks.append(count)
    try:
        with capturing(graph):
            collections.clear()
            doubled = x * 2
            for held in old_graphs:  # each old graph now held only by a cycle
                cycle: list[Any] = [held]
                cycle.append(cycle)
            del cycle, held
            old_graphs.clear()
            gc.set_threshold(1, 1, 1)
            churn = [[[]] for _ in range(5000)]
            out = doubled + 1
            during = len(collections)
        gc.set_threshold(*thresholds)
        del churn
        x.fill_(3.0)
        graph.replay()
        torch.cuda.synchronize()
        assert out.eq(7.0).all()
        assert during == 0 and gc.isenabled()
        assert gc.collect() > 0  # the cycles were there to collect
    finally:
        gc.set_threshold(*thresholds)
        gc.callbacks.remove(count)


def load_adapters(engine: LLMEngine, requests: list[EngineRequest]) -> None:
    """The requests' adapters into host memory before they run (see `staggered`)."""
    adapter_ids = {r.adapter_id for r in requests if r.adapter_id is not None}
    if engine.lora is not None and adapter_ids:
        for adapter_id in adapter_ids:
            engine.lora.host.request(adapter_id)
        wait_until(lambda: all(engine.lora.host.get(a) is not None for a in adapter_ids), timeout_s=60,
                   what="the requests' adapters in host memory")


def staggered(requests: list[EngineRequest], engine: LLMEngine) -> dict[str, list[int]]:
    """Requests added one every other step, so prompts' chunks run beside others' decodes.

    Their adapters are loaded first: adapter requests wait until theirs has loaded (in the background), so
    otherwise the steps would group rows by how fast the loads ran (a cold machine's first engine loaded slower),
    and float32 tokens from other batch shapes can differ by a rounding."""
    load_adapters(engine, requests)
    pending, outputs = list(requests), {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 2 == 0:
            engine.add_request(pending.pop(0))
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        step += 1
    return {rid: output_tokens(outs) for rid, outs in outputs.items()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mixed_step_graphs_give_the_eager_steps_tokens_with_lora_and_grammar(dtype: str) -> None:
    """Prefill chunks beside decodes, adapters, grammar rows and chunked prompts (budget 64 tokens): the mixed
    graphs (padded sequences and tokens) give the tokens of the same steps run eagerly."""
    off = make_engine(GPU_DEVICE, dtype, lora=True, cuda_graph_mixed_steps=False)
    on = make_engine(GPU_DEVICE, dtype, lora=True)
    expected = staggered(mixed_requests(), off)
    assert staggered(mixed_requests(), on) == expected
    assert off.runner.num_mixed_graph_steps == 0 and off.runner.num_eager_steps > 0
    assert on.runner.num_mixed_graph_steps > 0 and on.runner.num_eager_steps == 0
    assert any(key[2] == "lora" for key in on.runner.mixed_graphs)
    assert on.stats()["engine_steps"]["mixed_graph"] == on.runner.num_mixed_graph_steps
    # Every forward pass was timed on the GPU, by kind and padded rows: the step counts agree, each time is real.
    for engine, kinds in ((on, {"decode_graph", "mixed_graph"}), (off, {"decode_graph", "eager"})):
        timed = engine.stats()["engine_step_gpu"]
        assert {key.split(":")[0] for key in timed} == kinds
        counts = engine.stats()["engine_steps"]
        for kind in kinds:
            assert sum(n for key, (n, _) in timed.items() if key.startswith(kind + ":")) == counts[kind]
        assert all(seconds > 0 for _, seconds in timed.values())  # a first use spans its kernels' compile too


class AttentionOnlyAdapters(RandomAdapterSource):
    """PEFT's default targets for Llama: q_proj and v_proj alone."""

    def shapes(self) -> dict[str, tuple[int, int]]:
        return {name: shape for name, shape in super().shapes().items() if name in ("q_proj", "v_proj")}


def attention_only_engine(device: str) -> LLMEngine:
    engine = make_engine(device)
    engine.serve_adapters(AttentionOnlyAdapters(CONFIG, rank=8, dtype=engine.config.torch_dtype, std=0.2),
                          AdapterLimits(max_loras=4, max_cpu_loras=8, max_lora_rank=8))
    return engine


def test_graphs_of_adapters_on_some_linears_launch_lora_kernels_there_alone_with_the_same_tokens() -> None:
    """q_proj/v_proj adapters: decode and mixed graphs keyed by the adapted linears (LoRA kernels at the merged
    q/k/v projection only) give the tokens of graphs with LoRA kernels at every linear, and of the CPU engine."""
    from loraplex.engine.lora import slot_pool

    subset = attention_only_engine(GPU_DEVICE)
    tokens = staggered(many_lora_requests(), subset)
    assert subset.lora is not None and subset.lora.pool.adapted_signature == "q_proj+k_proj+v_proj"
    kinds = {key[1] for key in subset.runner.graphs} | {key[2] for key in subset.runner.mixed_graphs}
    assert "lora:q_proj+k_proj+v_proj" in kinds
    assert subset.runner.num_graph_steps > 0 and subset.runner.num_eager_steps == 0
    every = attention_only_engine(GPU_DEVICE)
    assert every.lora is not None
    every.lora.pool.adapted_stacks = every.lora.pool.stacks  # the kernels launched at every linear, as before
    every.lora.pool._refresh_adapted = lambda: None  # type: ignore[method-assign]
    every.lora.pool.adapted_signature = slot_pool.EVERY_LINEAR
    assert staggered(many_lora_requests(), every) == tokens
    assert staggered(many_lora_requests(), attention_only_engine("cpu")) == tokens


def test_the_first_step_of_adapters_on_some_linears_captures_all_their_graphs_at_once() -> None:
    """Start-up cannot know which linears adapters will adapt: the first step on q_proj/v_proj adapters captures
    every decode and mixed graph of that signature in one go, and later steps of any shape capture nothing."""
    engine = attention_only_engine(GPU_DEVICE)
    runner = engine.runner
    runner.capture_decode_graphs()
    runner.capture_mixed_graphs()
    run_to_completion(engine, [EngineRequest("first", prompts(1)[0], greedy(3, ignore_eos=True), adapter_id="a")])
    kind = "lora:q_proj+k_proj+v_proj"
    assert {size for size, k in runner.graphs if k == kind} == set(runner.ladder)
    assert {(s, t) for s, t, k in runner.mixed_graphs if k == kind} == set(runner.mixed_shapes())
    captured = len(runner.graphs) + len(runner.mixed_graphs)
    staggered(many_lora_requests(), engine)  # decodes and prompts of many sizes beside them
    assert runner.num_graph_steps > 0 and runner.num_mixed_graph_steps > 0 and runner.num_eager_steps == 0
    assert len(runner.graphs) + len(runner.mixed_graphs) == captured


def test_start_up_captures_the_graphs_of_adapters_on_peft_default_targets() -> None:
    """q_proj/v_proj adapters are the common case: a server captures their graphs at start-up, so their first
    step captures none, and gives the tokens of an engine that captured them on that step."""
    engine = attention_only_engine(GPU_DEVICE)
    runner = engine.runner
    runner.capture_decode_graphs()
    runner.capture_mixed_graphs()
    ahead = runner.capture_default_target_graphs()
    assert ahead == len(runner.ladder) + len(runner.mixed_shapes())
    assert runner.capture_default_target_graphs() == 0
    captured = len(runner.graphs) + len(runner.mixed_graphs)
    tokens = staggered(many_lora_requests(), engine)
    assert len(runner.graphs) + len(runner.mixed_graphs) == captured
    assert staggered(many_lora_requests(), attention_only_engine(GPU_DEVICE)) == tokens


def test_mixed_graphs_captured_at_start_up_cover_every_shape_and_give_prompt_logprobs() -> None:
    """Scoring requests (prompt logprobs) beside decodes on adapters: their steps replay mixed graphs too, with
    the logprobs and tokens of eager steps."""
    engine = make_engine(GPU_DEVICE, lora=True)
    runner = engine.runner
    captured = runner.capture_mixed_graphs()
    assert captured == len(runner.mixed_graphs) > 0
    assert {key[2] for key in runner.mixed_graphs} == {None, "lora"}
    assert runner.capture_mixed_graphs() == 0  # nothing left to capture

    def requests() -> list[EngineRequest]:
        scoring = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1, ignore_eos=True)
        return [EngineRequest(f"r{i}", prompt, scoring if i % 2 else greedy(6, ignore_eos=True),
                              adapter_id=[None, "a", "b"][i % 3]) for i, prompt in enumerate(prompts(6))]

    def scored(outs: list[Any]) -> list[tuple[int, float, list[int]]]:
        return [(lp.token_id, lp.logprob, [t for t, _ in lp.top])
                for o in outs if o.prompt_logprobs for lp in o.prompt_logprobs if lp is not None]

    eager_engine = make_engine(GPU_DEVICE, lora=True, cuda_graph_mixed_steps=False)
    eager, graphed = run_to_completion(eager_engine, requests()), run_to_completion(engine, requests())
    assert eager_engine.runner.num_eager_steps > 0
    assert runner.num_eager_steps == 0 and runner.num_mixed_graph_steps > 0
    for rid, outs in eager.items():
        assert output_tokens(graphed[rid]) == output_tokens(outs)
        want, got = scored(outs), scored(graphed[rid])
        assert [(t, top) for t, _, top in got] == [(t, top) for t, _, top in want]
        assert [lp for _, lp, _ in got] == pytest.approx([lp for _, lp, _ in want], abs=1e-4)
        assert len(want) == (len(prompts(6)[int(rid[1:])]) - 1 if int(rid[1:]) % 2 else 0)
    assert make_engine(GPU_DEVICE, cuda_graph_mixed_steps=False).runner.capture_mixed_graphs() == 0


def test_forks_of_n_choices_replay_mixed_graphs_with_the_cpu_engines_tokens() -> None:
    """Requests with n > 1 (greedy and seeded at a temperature) arriving beside decodes and prompts on adapters:
    the step where each forks its choices replays a mixed graph (one tenant's `n` used to make that step eager
    for every row in it), and every choice's tokens are the CPU engine's."""
    lengths = [65, 3, 17, 40, 64, 90, 33, 128]  # 65: a last chunk of one token (max_num_batched_tokens 64)

    def requests() -> list[EngineRequest]:
        out = []
        for i, length in enumerate(lengths):
            prompt = torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(20 + i)).tolist()
            sampling = SamplingParams(max_tokens=6, temperature=0.0 if i % 2 else 0.8, seed=300 + i,
                                      n=1 + i % 4, ignore_eos=True)
            out.append(EngineRequest(f"r{i}", prompt, sampling, adapter_id=[None, "a", "b"][i % 3]))
        return out

    def run(engine: LLMEngine) -> dict[tuple[str, int], list[int]]:
        pending, outs = requests(), {}
        load_adapters(engine, pending)
        step = 0
        while pending or engine.has_unfinished_requests():
            if pending and step % 2 == 0:
                engine.add_request(pending.pop(0))
            for out in engine.step():
                for choice in out.choices:
                    outs.setdefault((out.request_id, choice.index), []).extend(choice.token_ids)
            step += 1
        return outs

    cpu = run(make_engine("cpu", lora=True))
    engine = make_engine(GPU_DEVICE, lora=True)
    gpu = run(engine)
    assert gpu == cpu
    assert len(gpu) == sum(1 + i % 4 for i in range(len(lengths))) and all(len(t) == 6 for t in gpu.values())
    assert engine.runner.num_eager_steps == 0 and engine.runner.num_mixed_graph_steps > 0


def looping_requests() -> list[EngineRequest]:
    """Prompts of one short phrase repeated (n-gram lookup finds drafts; this random model often repeats it),
    on adapters a/b/c and the base model."""
    return [EngineRequest(f"s{i}", (p[:6] * 7)[:40], greedy(24, ignore_eos=True), adapter_id=[None, "a", "b", "c"][i % 4])
            for i, p in enumerate(prompts(8))]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verification_steps_replay_graphs_and_give_the_tokens_of_no_drafts(dtype: str) -> None:
    """n-gram drafts verified beside plain decodes, prefill chunks, adapters and grammar rows: every step replays a
    graph (verification steps their own, gathering every draft row's logits), and the tokens are those of the
    same engine without drafts (float32: also the CPU engine's)."""
    def run(engine: LLMEngine) -> dict[str, list[int]]:
        return staggered(looping_requests() + mixed_requests(), engine)

    expected = run(make_engine(GPU_DEVICE, dtype, lora=True))
    if dtype == "float32":
        assert run(make_engine("cpu", lora=True)) == expected
    eager = make_engine(GPU_DEVICE, dtype, lora=True, speculative_decoding="ngram", cuda_graph_mixed_steps=False)
    engine = make_engine(GPU_DEVICE, dtype, lora=True, speculative_decoding="ngram")
    assert run(eager) == expected
    assert run(engine) == expected
    stats = engine.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens_total"] < stats["spec_decode_num_draft_tokens_total"]
    runner = engine.runner
    assert "lora+verify" in {key[2] for key in runner.mixed_graphs}  # adapter rows ride in every step here
    assert runner.num_eager_steps == 0 and eager.runner.num_eager_steps > 0
    # Verification steps without adapter rows replay graphs of their own: the base model's looping requests alone.
    base_only = [EngineRequest(r.request_id, r.prompt_token_ids, r.sampling) for r in looping_requests()]
    plain = make_engine(GPU_DEVICE, dtype, speculative_decoding="ngram")
    assert staggered(base_only, plain) == staggered(base_only, make_engine(GPU_DEVICE, dtype))
    assert "verify" in {key[2] for key in plain.runner.mixed_graphs}
    assert plain.stats()["spec_decode_num_accepted_tokens_total"] > 0
    for e in (eager, engine, plain):
        assert e.block_manager.num_free_blocks == e.block_manager.num_blocks


def test_verification_graphs_are_captured_at_start_up_where_steps_may_draft() -> None:
    drafting = make_engine(GPU_DEVICE, lora=True, speculative_decoding="ngram").runner
    assert drafting.capture_mixed_graphs() == len(drafting.mixed_graphs)
    kinds = {key[2] for key in drafting.mixed_graphs}
    assert kinds == {None, "lora", "verify", "lora+verify"}
    verifying = {(s, t) for s, t, kind in drafting.mixed_graphs if kind == "verify"}
    assert verifying == set(drafting.mixed_shapes())
    # They gather the draft rows of every sequence: 8 sequences x 4 drafts past one token each.
    assert drafting.verify_extra_tokens >= 8 * 4
    assert drafting.mixed_graphs[(8, 72, "verify")].logits.shape[0] == 8 + drafting.verify_extra_tokens
    assert make_engine(GPU_DEVICE, speculative_decoding="off").runner.verify_extra_tokens == 0


def test_overlapped_steps_run_ahead_between_verification_steps_with_the_same_tokens() -> None:
    """Overlapped scheduling with drafts: steps run ahead while no sequence would draft (never with drafts of
    their own), the engine finishes the step in flight once one would, and the tokens are those without either."""
    def requests() -> list[EngineRequest]:
        unique = [EngineRequest(f"u{i}", p, greedy(24, ignore_eos=True)) for i, p in enumerate(prompts(4, seed=3))]
        return looping_requests()[:4] + unique

    expected = generate(make_engine(GPU_DEVICE, lora=True), requests())
    engine = make_engine(GPU_DEVICE, lora=True, speculative_decoding="ngram", overlap_scheduling=True)
    assert generate(engine, requests()) == expected
    stats = engine.stats()
    assert stats["spec_decode_num_accepted_tokens_total"] > 0
    assert engine.overlap is not None and engine.overlap.num_steps_ahead > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_linears_through_the_skinny_gemm_give_graphs_and_eager_steps_the_same_tokens_near_float32(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every linear of 2 to 128 rows through the skinny GEMM (the tiny model's shapes are not in its tuned table,
    so the table lookup is replaced): decode graphs and eager steps agree token for token, and prompt logprobs
    (prefill chunks of up to 64 tokens, K split over programs) stay near the float32 CPU engine's."""
    from loraplex.engine.cuda import skinny_gemm

    config = skinny_gemm.SkinnyConfig(block_n=32, block_k=64, num_warps=4, num_stages=2, splits=2)
    monkeypatch.setattr(skinny_gemm, "config_for", lambda rows, n, k: config)
    calls = []
    original = skinny_gemm.skinny_gemm
    monkeypatch.setattr(skinny_gemm, "skinny_gemm", lambda *args, **kwargs: (calls.append(args[0].shape[0]),
                                                                             original(*args, **kwargs))[1])
    on = make_engine(GPU_DEVICE, "bfloat16")
    off = make_engine(GPU_DEVICE, "bfloat16", enable_cuda_graphs=False, cuda_graph_mixed_steps=False)
    tokens_on = generate(on, plain_requests(20))
    assert tokens_on == generate(off, plain_requests(20))
    assert on.runner.num_graph_steps > 0 and any(1 < rows <= 8 for rows in calls) and max(calls) > 8

    sampling = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
    requests = [EngineRequest(f"p{i}", p, sampling) for i, p in enumerate(prompts(8))]
    reference = run_to_completion(make_engine("cpu"), requests)
    ours = run_to_completion(make_engine(GPU_DEVICE, "bfloat16"),
                             [EngineRequest(f"p{i}", p, sampling) for i, p in enumerate(prompts(8))])
    diffs = [abs(a.logprob - b.logprob) for rid in reference
             for a, b in zip([lp for o in reference[rid] if o.prompt_logprobs for lp in o.prompt_logprobs if lp],
                             [lp for o in ours[rid] if o.prompt_logprobs for lp in o.prompt_logprobs if lp], strict=True)]
    assert len(diffs) == sum(len(p) - 1 for p in prompts(8))
    assert max(diffs) < 0.2, max(diffs)
