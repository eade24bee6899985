"""The engine with LoRA against PEFT as the oracle, on SmolLM2 with real trained adapters (CPU, float32)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import GatedSource, drain, greedy, make_engine, run_all
from loraplex.adapters.source import FolderAdapterSource
from loraplex.engine.config import AdapterLimits, EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.protocol import EngineRequest
from peft import PeftModel
from random_adapters import write_random_adapter
from train_adapters import chat_prompt_ids
from transformers import AutoModelForCausalLM, AutoTokenizer

NUM_TOKENS = 10
PROMPTS = {
    "pirate": "What is the capital of France?",
    "upper": "What do cats eat?",
    "thinker": "Where is the sun?",
    None: "What is the capital of France?",  # same prompt as pirate: the prefix cache must not cross adapters
}


@pytest.fixture(scope="module")
def tokenizer(smollm_dir):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(smollm_dir)


@pytest.fixture  # one test's oracle: ~1 GB, not kept for the rest of the module
def peft_model(smollm_dir, trained_adapters):  # type: ignore[no-untyped-def]
    base = AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, trained_adapters["pirate"], adapter_name="pirate")
    model.load_adapter(trained_adapters["upper"], adapter_name="upper")
    model.load_adapter(trained_adapters["thinker"], adapter_name="thinker")
    return model.eval()


def _peft_generate(model, tokenizer, adapter, prompt):  # type: ignore[no-untyped-def]
    ids = torch.tensor([chat_prompt_ids(tokenizer, prompt)])
    kwargs = dict(max_new_tokens=NUM_TOKENS, do_sample=False, output_scores=True, return_dict_in_generate=True,
                  pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        if adapter is None:
            with model.disable_adapter():
                out = model.generate(input_ids=ids, **kwargs)
        else:
            model.set_adapter(adapter)
            out = model.generate(input_ids=ids, **kwargs)
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1) for s in out.scores]
    return tokens, logprobs


def test_mixed_batch_matches_peft_tokens_and_logprobs(ours, tokenizer, peft_model, trained_adapters, smollm_spec):
    model, config = ours
    engine, manager = make_engine(model, config, tokenizer, trained_adapters, smollm_spec, max_loras=4)
    requests = [
        EngineRequest(f"r-{adapter}", chat_prompt_ids(tokenizer, prompt), greedy(NUM_TOKENS, logprobs=5),
                      adapter_id=adapter)
        for adapter, prompt in PROMPTS.items()
    ]
    results = run_all(engine, requests)
    outputs = {}
    for adapter, prompt in PROMPTS.items():
        got = results[f"r-{adapter}"]
        assert got.error is None
        want_tokens, want_logprobs = _peft_generate(peft_model, tokenizer, adapter, prompt)
        assert got.token_ids == want_tokens[: len(got.token_ids)], (adapter, tokenizer.decode(got.token_ids),
                                                                    tokenizer.decode(want_tokens))
        assert len(got.token_ids) == len(want_tokens)
        for step, top in enumerate(got.top_logprobs):
            for token_id, value in top.items():
                assert value == pytest.approx(want_logprobs[step][token_id].item(), abs=2e-3), (adapter, step)
        outputs[adapter] = tokenizer.decode(got.token_ids)
    assert outputs["pirate"] != outputs[None]
    assert sorted(manager.resident_adapter_ids) == ["pirate", "thinker", "upper"]


def test_pirate_says_arr_through_engine(ours, tokenizer, trained_adapters, smollm_spec):
    model, config = ours
    engine, _ = make_engine(model, config, tokenizer, trained_adapters, smollm_spec, max_loras=2)
    prompts = ["Describe a dog.", "What is the weather like?"]
    requests = [EngineRequest(f"p{i}", chat_prompt_ids(tokenizer, p), greedy(12), adapter_id="pirate")
                for i, p in enumerate(prompts)]
    requests.append(EngineRequest("base", chat_prompt_ids(tokenizer, prompts[0]), greedy(12)))
    results = run_all(engine, requests)
    for i in range(len(prompts)):
        assert tokenizer.decode(results[f"p{i}"].token_ids).startswith("Arr")
    assert "Arr" not in tokenizer.decode(results["base"].token_ids)


@pytest.fixture(scope="module")
def random_smollm_adapters(tmp_path_factory, smollm_spec):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("random-smollm")
    shapes = [(4, ("q_proj", "v_proj")), (8, ("o_proj",)), (16, ("gate_proj", "down_proj")),
              (2, ("k_proj", "up_proj")), (32, ("q_proj", "k_proj", "v_proj"))]
    return {f"rnd{i}": write_random_adapter(root / f"rnd{i}", smollm_spec, r=r, targets=t, seed=i, b_scale=0.2)
            for i, (r, t) in enumerate(shapes)}


def test_slot_pressure_more_adapters_than_slots(ours, tokenizer, smollm_spec, random_smollm_adapters):
    model, config = ours
    prompt = chat_prompt_ids(tokenizer, "Name a colour.")
    names = [*random_smollm_adapters, None]

    def requests():  # type: ignore[no-untyped-def]
        return [EngineRequest(f"q-{n}", prompt, greedy(4), adapter_id=n) for n in names]

    # Reference: every adapter resident at once (no slot pressure); batching never changes a row's result.
    roomy, _ = make_engine(model, config, tokenizer, random_smollm_adapters, smollm_spec, max_loras=8)
    solo = run_all(roomy, requests())
    engine, manager = make_engine(model, config, tokenizer, random_smollm_adapters, smollm_spec, max_loras=2,
                                  max_cpu_loras=2)
    crowded = run_all(engine, requests())
    for name in names:
        assert crowded[f"q-{name}"].error is None
        assert crowded[f"q-{name}"].token_ids == solo[f"q-{name}"].token_ids, name
    assert len({tuple(r.token_ids) for r in solo.values()}) >= 4  # the adapters really change the output
    assert manager.num_slot_writes >= len(random_smollm_adapters)
    assert len(manager.resident_adapter_ids) <= 2


def test_loading_adapter_does_not_stall_others(ours, tokenizer, smollm_spec, random_smollm_adapters):
    model, config = ours
    source = GatedSource(FolderAdapterSource(random_smollm_adapters, smollm_spec, torch.float32), {"rnd1"})
    engine, _ = make_engine(model, config, tokenizer, random_smollm_adapters, smollm_spec, max_loras=2,
                            source=source)
    prompt = chat_prompt_ids(tokenizer, "Give me a fruit.")
    for request_id, adapter in (("slow", "rnd1"), ("fast", "rnd0"), ("base", None)):
        engine.add_request(EngineRequest(request_id, prompt, greedy(4), adapter_id=adapter))
    finished: set[str] = set()
    for _ in range(100):
        finished |= {out.request_id for out in engine.step() if out.finished}
        if finished >= {"fast", "base"}:
            break
    assert finished == {"fast", "base"}
    assert engine.requests["slow"].seqs[0].num_computed_tokens == 0  # still waiting for its weights
    source.gate.set()
    slow = drain(engine)["slow"]
    assert slow.error is None and len(slow.token_ids) == 4


def _fair_preemption_run(ours, tokenizer, trained_adapters, smollm_spec, *, max_num_seqs: int,  # type: ignore[no-untyped-def]
                         num_host_blocks: int) -> tuple[dict, LLMEngine]:
    """Three requests of one tenant (two adapters and the base model, one in a session), then another tenant's
    request once they run: with `max_num_seqs` 2 it takes the slot of the first tenant's newest."""
    model, config = ours
    engine = LLMEngine(model, config, EngineConfig(num_blocks=256, max_num_seqs=max_num_seqs, max_num_batched_tokens=512,
                                                    max_model_len=512, dtype="float32", device="cpu",
                                                    num_host_blocks=num_host_blocks),
                       tokenizer, adapters=FolderAdapterSource(trained_adapters, smollm_spec, torch.float32),
                       adapter_limits=AdapterLimits(max_loras=4, max_cpu_loras=8, max_lora_rank=64))
    # Every adapter in a slot first, so the quiet request is ready to run the moment it arrives.
    run_all(engine, [EngineRequest(f"warm-{name}", chat_prompt_ids(tokenizer, "Hi"), greedy(1), adapter_id=name)
                     for name in ("pirate", "upper", "thinker")])
    flood = [EngineRequest("pirate", chat_prompt_ids(tokenizer, PROMPTS["pirate"]), greedy(24), tenant_id="flood",
                           adapter_id="pirate"),
             EngineRequest("upper", chat_prompt_ids(tokenizer, PROMPTS["upper"]), greedy(24), tenant_id="flood",
                           adapter_id="upper"),
             EngineRequest("base", chat_prompt_ids(tokenizer, PROMPTS[None]), greedy(24), tenant_id="flood",
                           session_id="flood-session")]
    for request in flood:
        engine.add_request(request)
    early: dict = {}
    for _ in range(400):  # until the flood's first two have produced a few tokens (adapters load first)
        for out in engine.step():
            early.setdefault(out.request_id, []).extend(t for c in out.choices for t in c.token_ids)
        if sum(len(early.get(r, [])) for r in ("pirate", "upper")) >= 6:
            break
    quiet = EngineRequest("quiet", chat_prompt_ids(tokenizer, PROMPTS["thinker"]), greedy(16), tenant_id="quiet",
                          adapter_id="thinker")
    results = run_all(engine, [quiet])
    for request_id, tokens in early.items():
        results[request_id].token_ids[:0] = tokens
    return {rid: r.token_ids for rid, r in results.items() if not rid.startswith("warm-")}, engine


@pytest.mark.parametrize("num_host_blocks", [64, 0], ids=["swap", "recompute"])
def test_fair_preemption_keeps_every_token_with_adapters_and_sessions(ours, tokenizer, trained_adapters, smollm_spec,  # type: ignore[no-untyped-def]
                                                                      num_host_blocks):
    expected, _ = _fair_preemption_run(ours, tokenizer, trained_adapters, smollm_spec, max_num_seqs=8,
                                       num_host_blocks=num_host_blocks)
    got, engine = _fair_preemption_run(ours, tokenizer, trained_adapters, smollm_spec, max_num_seqs=2,
                                       num_host_blocks=num_host_blocks)
    assert engine.scheduler.num_fairness_preemptions >= 1
    assert (engine.scheduler.num_swapped_out >= 1) == bool(num_host_blocks)
    assert got == expected
    assert engine.session_state("flood-session") in ("pinned", "offloaded")
    assert engine.block_manager.num_free_blocks + engine.block_manager.num_pinned_blocks == engine.num_blocks
