"""The synchronous engine: add_request / step / abort.

`step()` is the whole loop body: schedule -> execute -> update outputs.
The engine core (`engine/core/engine_core.py`) drives it, in a thread or in its own process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loraplex.engine.config import AdapterLimits, EngineConfig, ModelConfig
from loraplex.engine.context import LoRAStepBuilder
from loraplex.engine.errors import DuplicateRequestError, InvalidRequestError, PromptTooLongError
from loraplex.engine.interfaces import AdapterSource, BudgetedGrammarMatcher
from loraplex.engine.kv.block_manager import BlockManager
from loraplex.engine.kv.host_tier import HostTier
from loraplex.engine.lora.manager import LoRAManager
from loraplex.engine.model.llama import LlamaForCausalLM
from loraplex.engine.model.loader import load_model, random_model
from loraplex.engine.output.processor import RequestState
from loraplex.engine.output.text import RequestText
from loraplex.engine.parallel.group import SINGLE_RANK
from loraplex.engine.parallel.sources import ModelSource, PathModelSource, RandomModelSource
from loraplex.engine.parallel.workers import WorkerGroup, plan_num_blocks
from loraplex.engine.protocol import EngineRequest, FinishReason, RequestOutput, TokenLogprob
from loraplex.engine.runner import StepResult, runner_class_for
from loraplex.engine.sampler import new_generator, next_uniform
from loraplex.engine.scheduler import Scheduler, SchedulerOutput
from loraplex.engine.sequence import Sequence
from loraplex.engine.spec.policy import Speculation
from loraplex.engine.spec.verify import verify_drafts
from loraplex.engine.step_isolation import execute_isolating
from loraplex.engine.step_overlap import StepOverlap

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        model: LlamaForCausalLM,
        model_config: ModelConfig,
        engine_config: EngineConfig,
        tokenizer: Any,
        lora: LoRAStepBuilder | None = None,
        adapter_ready: Callable[[str], bool] | None = None,
        workers: WorkerGroup | None = None,
        detokenize: bool = True,
        adapters: AdapterSource | None = None,
        adapter_limits: AdapterLimits | None = None,
    ) -> None:
        """`model` is rank 0's shard under tensor parallelism, with `workers` running the other
        ranks (`from_source` starts them). `detokenize`: step() outputs carry text and stop strings end
        requests here; off under an engine core, whose clients do that on their own side.
        `adapters` (with `adapter_limits`): serve tenants' LoRA adapters from this source; the engine builds
        its `LoRAManager` and hands it to its scheduler and runner. `lora` / `adapter_ready` instead take a
        step builder and admission gate of the caller's own (tests of the runner's LoRA path)."""
        if engine_config.tensor_parallel_size > 1 and workers is None:
            raise ValueError("tensor_parallel_size > 1 needs its worker processes: build the engine with "
                             "LLMEngine.from_source / from_random / from_model_path")
        if adapters is not None and (lora is not None or adapter_ready is not None):
            raise ValueError("pass either `adapters` or a step builder of your own (`lora`/`adapter_ready`)")
        self.model_config = model_config
        self.config = engine_config
        self.tokenizer = tokenizer
        self.max_model_len = engine_config.resolve_max_model_len(model_config)
        runner_class = runner_class_for(engine_config.device)
        self.num_blocks = plan_num_blocks(runner_class, model, model_config, engine_config, workers)
        num_host_blocks = engine_config.resolve_num_host_blocks(model_config)
        self.host_tier = HostTier(num_host_blocks) if num_host_blocks else None
        self.block_manager = BlockManager(
            self.num_blocks, engine_config.block_size, engine_config.enable_prefix_caching,
            max_pinned_blocks=engine_config.max_pinned_blocks,
            max_pinned_blocks_per_tenant=engine_config.max_pinned_blocks_per_tenant, host_tier=self.host_tier,
        )
        self._own_adapter_ready = adapter_ready
        self.lora: LoRAManager | None = None  # built from `adapters`; serve_adapters replaces it
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # rank 0's shard
        self.scheduler = Scheduler(
            self.block_manager, engine_config.max_num_batched_tokens, engine_config.running_slots(),
            self._adapter_ready, decode_yield_min_tokens=engine_config.resolve_decode_yield_min_tokens(),
            fair_sharing=engine_config.fair_sharing,
            newcomer_reserved_slots=engine_config.resolve_newcomer_reserved_slots(),
            flood_sit_out_prompt_tokens=(engine_config.flood_sit_out_prompt_tokens
                                         if engine_config.mixed_steps_replay_graphs() else None),
            batch_rows_beside_interactive=engine_config.batch_rows_beside_interactive,
            batch_admission_wave=engine_config.resolve_batch_admission_wave(weight_bytes),
            batch_prefill_tokens_beside_interactive=engine_config.resolve_batch_prefill_tokens_beside_interactive(
                weight_bytes),
        )
        if engine_config.device.startswith("cuda"):
            logger.info("batch work beside interactive work: waves of %.2f of its room, %s prompt tokens a step "
                        "(%.1f GiB of weights a GPU)", self.scheduler.batch.wave,
                        self.scheduler.batch.prefill_tokens or "uncapped", weight_bytes / (1 << 30))
        if adapters is not None:
            self.lora = self._new_lora_manager(model, workers, adapters, adapter_limits or AdapterLimits())
            lora = self.lora
        self.runner = runner_class(model, model_config, engine_config, self.num_blocks, len(tokenizer), lora,
                                  num_host_blocks=num_host_blocks, workers=workers)
        self.workers = workers  # the runner only sends them steps; the engine owns their lifecycle
        if workers is not None:
            workers.start_runners(self.runner, self.num_blocks, len(tokenizer), num_host_blocks)
        self.eos_token_ids = set(model_config.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        self.requests: dict[str, RequestState] = {}
        self._detokenize = detokenize
        self.texts: dict[str, RequestText] = {}  # with `detokenize`: each request's text side
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self.num_discarded_tokens_total = 0  # generated past a stop string the caller matched: never delivered
        self.num_jump_forward_tokens_total = 0  # appended without a sampling step
        self.num_reasoning_tokens_total = 0  # of those, inside a reasoning segment (billed as thinking)
        self.last_step_was_idle = False  # work is waiting but nothing could run (e.g. adapters loading)
        self.speculation = Speculation.from_config(engine_config.speculation(self.max_model_len))
        self.scheduler.speculation = self.speculation
        # Launch decode steps ahead (engine/step_overlap.py); never a step with drafts, which the host verifies
        # after the step: with speculation on, steps run ahead only while no sequence would draft
        self.overlap = StepOverlap.for_engine(self)
        if self.speculation is not None:  # whether steps do run ahead (not every engine the setting asks it of can)
            self.speculation.config.overlapped = self.overlap is not None

    # ---- constructors ---------------------------------------------------------------------
    @classmethod
    def from_source(cls, source: ModelSource, engine_config: EngineConfig, tokenizer: Any, **kwargs: Any
                    ) -> LLMEngine:
        """Build the model from `source`; with tensor_parallel_size > 1 start one worker process per
        further GPU, each building its own shard (`engine/parallel`)."""
        model_config = source.model_config()
        if engine_config.tensor_parallel_size > 1:
            workers, model = WorkerGroup.launch(source, engine_config)
            try:
                return cls(model, model_config, engine_config, tokenizer, workers=workers, **kwargs)
            except BaseException:
                workers.close()
                raise
        max_len = engine_config.resolve_max_model_len(model_config)
        model = source.build(max_len, engine_config.torch_dtype, engine_config.device, SINGLE_RANK)
        return cls(model, model_config, engine_config, tokenizer, **kwargs)

    def close(self) -> None:
        """Stop loading adapters and stop the tensor-parallel workers."""
        if self.lora is not None:
            self.lora.shutdown()
        if self.workers is not None:
            self.workers.close()

    # ---- adapters -------------------------------------------------------------------------
    def _new_lora_manager(self, model: LlamaForCausalLM, workers: WorkerGroup | None, source: AdapterSource,
                          limits: AdapterLimits) -> LoRAManager:
        return LoRAManager(
            model, source, max_loras=limits.max_loras, max_cpu_loras=limits.max_cpu_loras,
            max_lora_rank=limits.max_lora_rank, dtype=self.config.torch_dtype, device=self.config.device,
            load_retry_base_s=limits.load_retry_base_s, load_retry_max_s=limits.load_retry_max_s,
            mirror=None if workers is None else workers.mirror_slot_pool,  # every rank holds its shard's slots
            running_adapters=self.scheduler.running_adapter_ids, queued_adapters=self.scheduler.queued_adapter_ids,
        )

    def _adapter_ready(self, adapter_id: str) -> bool:
        """The scheduler's admission gate for an adapter request: its adapter is in a device slot."""
        if self.lora is not None:
            return self.lora.adapter_ready(adapter_id)
        return self._own_adapter_ready is None or self._own_adapter_ready(adapter_id)

    def serve_adapters(self, source: AdapterSource, limits: AdapterLimits) -> LoRAManager:
        """Serve adapters from `source` from now on, replacing the manager built at construction or by an
        earlier call (whose background loading stops). Call it while no adapter request runs: tests share
        one engine between apps with different adapter folders."""
        previous = self.lora
        self.lora = self._new_lora_manager(self.runner.model, self.workers, source, limits)
        self.runner.lora = self.lora
        if previous is not None:
            previous.shutdown()
        return self.lora

    def stop_serving_adapters(self, manager: LoRAManager) -> None:
        """Stop `manager`'s loading; if it is still the engine's, adapter requests wait from now on."""
        manager.shutdown()
        if self.lora is manager:
            self.lora = None
            self.runner.lora = None

    @classmethod
    def from_model_path(cls, path: str | Path, engine_config: EngineConfig, **kwargs: Any) -> LLMEngine:
        from transformers import AutoTokenizer

        if engine_config.tensor_parallel_size > 1:
            return cls.from_source(PathModelSource(str(path)), engine_config, AutoTokenizer.from_pretrained(path),
                                   **kwargs)
        model_config = ModelConfig.from_pretrained(path)
        max_len = engine_config.resolve_max_model_len(model_config)
        model = load_model(path, max_len, engine_config.torch_dtype, engine_config.device)
        return cls(model, model_config, engine_config, AutoTokenizer.from_pretrained(path), **kwargs)

    @classmethod
    def from_random(
        cls, model_config: ModelConfig, engine_config: EngineConfig, tokenizer: Any, seed: int = 0, **kwargs: Any
    ) -> LLMEngine:
        if engine_config.tensor_parallel_size > 1:
            return cls.from_source(RandomModelSource(model_config, seed), engine_config, tokenizer, **kwargs)
        max_len = engine_config.resolve_max_model_len(model_config)
        model = random_model(model_config, max_len, seed, engine_config.torch_dtype, engine_config.device)
        return cls(model, model_config, engine_config, tokenizer, **kwargs)

    # ---- requests -------------------------------------------------------------------------
    def validate(self, request: EngineRequest) -> None:
        """Raise a typed error for input that can never run; nothing is queued."""
        if not isinstance(request.request_id, str) or not request.request_id:
            raise InvalidRequestError("request_id must be a non-empty string", param="request_id")
        prompt = request.prompt_token_ids
        if not prompt:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in prompt):
            raise InvalidRequestError(f"prompt holds token ids outside [0, {vocab})", param="prompt")
        sampling = request.sampling
        sampling.validate(vocab)
        if sampling.logit_bias and max(sampling.logit_bias) >= vocab:
            raise InvalidRequestError(f"logit_bias holds token ids outside [0, {vocab})", param="logit_bias")
        if sampling.n > self.config.max_num_seqs:  # its choices could never all run
            raise InvalidRequestError(
                f"n ({sampling.n}) is more than the {self.config.max_num_seqs} sequences this server runs at once",
                param="n")
        total = len(prompt) + sampling.max_tokens
        if total > self.max_model_len:
            raise PromptTooLongError(
                f"prompt ({len(prompt)} tokens) plus max_tokens ({sampling.max_tokens}) exceeds the "
                f"context length {self.max_model_len}", param="max_tokens",
            )
        bm = self.block_manager
        needed = bm.blocks_needed(total) + (sampling.n - 1) * (bm.blocks_needed(sampling.max_tokens) + 1)
        if needed > self.num_blocks:
            raise PromptTooLongError(
                f"the request needs {needed} KV blocks; the pool holds {self.num_blocks}", param="max_tokens"
            )

    def add_request(self, request: EngineRequest) -> None:
        if request.request_id in self.requests:
            raise DuplicateRequestError(f"request id {request.request_id!r} is already running", param="request_id")
        self.validate(request)
        sampling = request.sampling
        salt = (request.tenant_id, request.adapter_id, request.cache_salt)
        seqs = []
        prompt_ids = request.prompt_token_ids
        for index in range(sampling.n):
            seq = Sequence(request.request_id, index, request.prompt_token_ids, sampling, request.tenant_id,
                           request.adapter_id, salt, request.arrival_time)
            if sampling.temperature > 0:
                seq.generator = new_generator(sampling.seed, index)
            if request.grammar is not None:
                seq.matcher = request.grammar.new_matcher()
                if isinstance(seq.matcher, BudgetedGrammarMatcher):
                    seq.matcher.set_token_budget(min(sampling.max_tokens, self.max_model_len - len(prompt_ids)),
                                               phase=index)
            if request.reasoning is not None:
                seq.reasoning_inside = request.reasoning.starts_inside
            seq.priority, seq.background = request.priority, request.background
            seqs.append(seq)
        seqs[0].wants_prompt_logprobs = sampling.prompt_logprobs is not None
        self.requests[request.request_id] = RequestState(request, seqs, self.eos_token_ids, self.max_model_len)
        if self.detokenize:
            self.texts[request.request_id] = RequestText(request, self.tokenizer)
        if request.session_id:
            # Offloaded KV back before it is matched (a pinned one becomes the most recently used).
            self.block_manager.restore_pin(request.session_id, request.tenant_id)
        self.scheduler.add(seqs[0], seqs[1:], weight=request.tenant_weight)
        self.num_prompt_tokens_total += len(request.prompt_token_ids)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Free every block of the request now; returns its final output (None if unknown)."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        state.finish_all(FinishReason.ABORT)
        output = self._retire(state)
        if self.detokenize:
            processed = self._with_text([output])
            return processed[0] if processed else output
        return output

    def stop(self, request_id: str, kept_tokens: list[int] | None = None) -> RequestOutput | None:
        """A stop string ended the request on the caller's side: finish it as stopped, not aborted (a session
        keeps its KV pinned); returns its final output (None if unknown). `kept_tokens`: output tokens each
        choice delivered; what was generated past them is counted as discarded (generated, never billed)."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        for seq, kept in zip(state.seqs, kept_tokens or [], strict=False):
            self.num_discarded_tokens_total += max(0, seq.num_output_tokens - kept)
        state.finish_all(FinishReason.STOP)
        for seq in state.seqs:
            if not seq.is_finished:
                self._finish_seq(state, seq)
        self.texts.pop(request_id, None)
        return self._retire(state)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def release_session(self, key: str) -> bool:
        on_host = self.host_tier is not None and self.host_tier.discard(key)
        return self.block_manager.unpin(key) or on_host

    def session_state(self, key: str) -> str:
        """Where a session's KV is: pinned (device), offloaded (host) or dropped."""
        if key in self.block_manager.pins:
            return "pinned"
        if self.host_tier is not None and key in self.host_tier.sessions:
            return "offloaded"
        return "dropped"

    @property
    def detokenize(self) -> bool:
        """Fixed at construction: a client that makes its own text builds the engine without it."""
        return self._detokenize

    # ---- the loop body --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = self._step()
        return self._with_text(outputs) if self.detokenize else outputs

    def _with_text(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Text and stop strings, for callers that read step() directly (tests, benchmarks, tools)."""
        done = []
        for output in outputs:
            text = self.texts.get(output.request_id)
            if text is None:  # no text side (stopped here already)
                done.append(output)
                continue
            processed = text.process(output)
            if text.finished:
                del self.texts[output.request_id]
            if text.stopped_early:
                self.stop(output.request_id, text.kept_token_counts())
            if processed is not None:
                done.append(processed)
        return done

    def _step(self) -> list[RequestOutput]:
        if self.overlap is not None:
            outputs = self.overlap.step()
            self.last_step_was_idle = self.overlap.last_step_was_idle
            return outputs
        scheduled = self.scheduler.schedule()
        outputs = self.fail_unready()
        self.last_step_was_idle = scheduled.is_empty and not outputs
        if scheduled.is_empty:
            return outputs
        return outputs + self.run_scheduled(scheduled)

    # ---- what a step is made of (StepOverlap runs them in its own order) ------------------
    def run_scheduled(self, scheduled: SchedulerOutput) -> list[RequestOutput]:
        """Run a scheduled step start to finish: KV moves, the forward pass (a failing row fails alone), update."""
        try:
            if self.host_tier is not None:
                self.runner.swap_kv(self.host_tier.take_swaps())  # before any K/V of this step is written
        except Exception as exc:
            logger.exception("moving KV between host and device failed; failing the requests of this batch")
            return self._fail_batch(scheduled, exc)
        result = execute_isolating(self.runner.execute, scheduled)
        return self.apply_step_result(scheduled, result)

    def fail_unready(self) -> list[RequestOutput]:
        """End the requests that can never run: their adapter is unavailable or its weights cannot load."""
        failed = [(seq, f"adapter {seq.adapter_id!r} unavailable: {exc}") for seq, exc in self.scheduler.take_failed()]
        failed += self._adapter_load_failures()
        outputs = []
        for seq, reason in failed:
            state = self.requests.get(seq.request_id)
            if state is not None:
                state.finish_all(FinishReason.ERROR, reason)
                outputs.append(self._retire(state))
        return outputs

    def _adapter_load_failures(self) -> list[tuple[Sequence, str]]:
        """Waiting sequences whose adapter's weights could not be loaded: they would wait forever."""
        if self.lora is None or not self.scheduler.num_waiting:
            return []
        waiting = self.scheduler.waiting_seqs()
        failed = []
        for seq in waiting:
            reason = self.lora.load_error(seq.adapter_id) if seq.adapter_id is not None else None
            if reason:
                failed.append((seq, reason))
        return failed

    def apply_step_result(self, scheduled: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        """The sampled tokens of a step that ran: append them, finish what is done, and the outputs."""
        self.scheduler.update_from_output(scheduled)
        touched: dict[str, RequestState] = {}
        for seq in scheduled.seqs:
            state = self.requests[seq.request_id]
            if seq.is_finished:
                continue
            touched[seq.request_id] = state
            try:
                self._update_seq(state, seq, result)
            except Exception as exc:
                logger.exception("request %s failed", seq.request_id)
                state.finish_all(FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
        outputs = []
        for state in touched.values():
            if state.finished:
                outputs.append(self._retire(state))
            else:
                out = state.take_output(state.seqs[0].num_cached_tokens)
                if out is not None:
                    outputs.append(out)
        return outputs

    def _update_seq(self, state: RequestState, seq: Sequence, result: StepResult) -> None:
        self.block_manager.cache_blocks(seq)
        if seq.seq_id in result.errors:
            raise result.errors[seq.seq_id]
        chunk_logprobs = result.prompt_logprobs.get(seq.seq_id)
        if chunk_logprobs is not None and state.prompt_logprobs is not None:
            state.prompt_logprobs.extend(chunk_logprobs)
        if seq.spec_token_ids:
            self._update_verified(state, seq, result)
            return
        token = result.sampled.get(seq.seq_id)
        if token is None:
            return
        seq.wants_prompt_logprobs = False
        self.num_generation_tokens_total += 1
        num_reasoning_before = seq.num_reasoning_tokens
        finished = state.add_token(seq, token, result.logprobs.get(seq.seq_id))
        if not finished:
            finished = self._jump_forward(state, seq)
        self.num_reasoning_tokens_total += seq.num_reasoning_tokens - num_reasoning_before
        if finished:
            self._finish_seq(state, seq)

    def _update_verified(self, state: RequestState, seq: Sequence, result: StepResult) -> None:
        """A decode that ran with drafts: the tokens its verification keeps (engine/spec/verify.py)."""
        first = len(seq.token_ids)
        num_reasoning_before = seq.num_reasoning_tokens

        def add_token(token: int, logprob: TokenLogprob | None) -> bool:
            self.num_generation_tokens_total += 1
            return state.add_token(seq, token, logprob)

        try:
            finished = verify_drafts(seq, result.spec_logits.get(seq.seq_id), self.runner.sampler, add_token,
                                     lambda: self._jump_forward(state, seq), result.spec_argmax.get(seq.seq_id))
        finally:
            self.scheduler.settle_drafts(seq, first)
            self.block_manager.cache_blocks(seq)
        self.num_reasoning_tokens_total += seq.num_reasoning_tokens - num_reasoning_before
        if finished:
            self._finish_seq(state, seq)

    def _jump_forward(self, state: RequestState, seq: Sequence) -> bool:
        """Append the tokens the grammar forces now, as sampling them one step at a time would; they are
        prefilled together in the next step. True if the choice finished."""
        matcher = seq.matcher
        if (matcher is None or not self.config.grammar_jump_forward  # None first: a Protocol isinstance costs ~10 us
                or not isinstance(matcher, BudgetedGrammarMatcher)
                or seq.sampling.logprobs is not None or seq.forced_token_ids):
            return False
        draws = seq.generator is not None and seq.sampling.temperature > 0 and seq.sampling.top_k != 1
        for token in matcher.forced_token_ids():
            if draws:
                next_uniform(seq.generator)  # the draw the skipped step would have made
            self.num_generation_tokens_total += 1
            self.num_jump_forward_tokens_total += 1
            if state.add_token(seq, token, None):
                return True
        return False

    def _finish_seq(self, state: RequestState, seq: Sequence) -> None:
        request = state.request
        choice = state.choices[seq.index]
        if (request.session_id and seq.index == 0
                and choice.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)):
            self.block_manager.pin(request.session_id, seq)
        self.scheduler.finish(seq)

    def _retire(self, state: RequestState) -> RequestOutput:
        for seq in state.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
        del self.requests[state.request.request_id]
        out = state.take_output(max(state.seqs[0].num_cached_tokens, 0))
        if out is None:  # nothing new since the last output: still tell the caller it is done
            out = RequestOutput(state.request.request_id, [], True, len(state.request.prompt_token_ids),
                                max(state.seqs[0].num_cached_tokens, 0), error=state.error)
        return out

    def _fail_batch(self, scheduled: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        outputs = []
        for request_id in {seq.request_id for seq in scheduled.seqs}:
            state = self.requests.get(request_id)
            if state is not None:
                state.finish_all(FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
                outputs.append(self._retire(state))
        return outputs

    # ---- metrics --------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        bm = self.block_manager
        return {
            "num_blocks_total": bm.num_blocks,
            "num_blocks_free": bm.num_free_blocks,
            "num_blocks_used": bm.num_blocks - bm.num_free_blocks,
            "num_blocks_cached": bm.num_cached_blocks,
            "num_blocks_pinned": bm.num_pinned_blocks,
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "prefix_cache_queries": bm.num_prefix_queries,
            "prefix_cache_hits": bm.num_prefix_hits,
            "prompt_tokens_total": self.num_prompt_tokens_total,
            "generation_tokens_total": self.num_generation_tokens_total,
            "discarded_tokens_total": self.num_discarded_tokens_total,
            "reasoning_tokens_total": self.num_reasoning_tokens_total,
            "num_preemptions": self.scheduler.num_preemptions,
            "engine_steps": self.runner.step_counts(),
            "engine_step_gpu": self.runner.step_gpu_times(),
            "overlap_steps": dict(self.overlap.outcomes) if self.overlap is not None else {},
            **(self.speculation.stats() if self.speculation is not None else Speculation.empty_stats()),
            "num_pins_evicted": bm.num_pins_evicted,
            "num_pins_over_budget": bm.num_pins_over_budget,
            "pinned_blocks_by_tenant": bm.pinned_blocks_by_tenant(),
            **self._host_stats(),
        }

    def _host_stats(self) -> dict[str, int]:
        tier = self.host_tier
        if tier is None:
            return {"num_blocks_pinned_host": 0, "num_session_offloads": 0, "num_session_restores": 0,
                    "num_session_drops": self.block_manager.num_pins_evicted}
        return {"num_blocks_pinned_host": tier.num_used_slots, "num_session_offloads": tier.num_offloads,
                "num_session_restores": tier.num_restores, "num_session_drops": tier.num_drops}
