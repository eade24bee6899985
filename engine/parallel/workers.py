"""Tensor-parallel worker processes, one per extra GPU, driven by the engine core (rank 0).

Rank 0 is the engine core's own process: it runs the scheduler and block manager, builds
each step's `InputBatch` once, sends it down a pipe to every worker, then runs its own shard
of the forward. Each worker holds its shard of the weights, its part of the KV pool (its KV
heads, the same block numbers), its own CUDA graphs and its own LoRA slot stacks, and
repeats the device work of every step (`ModelRunner.forward_batch`); the collectives inside
the model (all-reduce, all-gather) keep the ranks in lockstep. Only rank 0 samples, except in
an overlapped decode step (`launch`), where each rank takes the same greedy tokens from the same
gathered logits, so that the step after it reads its input ids on every rank's own GPU.

Messages are one way (no reply) except the KV pool plan, so a step costs one pickle of a
few integer arrays per worker. Block copies, host swaps, graph captures and adapter slot
writes travel the same pipe, in order, so every rank applies them at the same point.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from loraplex.engine.config import EngineConfig, ModelConfig
from loraplex.engine.interfaces import AdapterWeights
from loraplex.engine.lora.slot_pool import LoRASlotPool
from loraplex.engine.lora.step import LORA_BATCHES
from loraplex.engine.model.llama import LlamaForCausalLM
from loraplex.engine.parallel.group import TensorParallelGroup, one_shot_all_reduce, symmetric_memory_reusable
from loraplex.engine.parallel.sources import ModelSource
from loraplex.engine.process_lifetime import die_with_parent

logger = logging.getLogger(__name__)


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process is gone; the engine cannot step any more."""


class WorkerGroup:
    """Rank 0's handle on the worker processes: `send` an operation to all, `close` them."""

    def __init__(self, conns: list[Any], processes: list[Any]) -> None:
        self._conns = conns
        self._processes = processes
        self._runner: Any = None
        self._closed = False
        atexit.register(self.close)

    @classmethod
    def launch(cls, source: ModelSource, engine_config: EngineConfig) -> tuple[WorkerGroup, LlamaForCausalLM]:
        """Start ranks 1..N-1, join the process group as rank 0, build rank 0's shard."""
        world_size = engine_config.tensor_parallel_size
        device = torch.device(engine_config.device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda" and torch.cuda.device_count() < world_size:
            raise ValueError(f"tensor_parallel_size {world_size} needs {world_size} GPUs; "
                             f"{torch.cuda.device_count()} visible")
        address = f"tcp://127.0.0.1:{_free_port()}"
        one_shot = device.type == "cuda" and engine_config.tp_one_shot_all_reduce and symmetric_memory_reusable()
        context = mp.get_context("spawn")  # CUDA cannot be forked; the workers inherit the environment
        conns, processes = [], []
        for rank in range(1, world_size):
            parent, child = context.Pipe()
            process = context.Process(
                target=worker_main, name=f"loraplex-tp{rank}", daemon=True,
                args=(rank, world_size, backend, address, source, engine_config, one_shot, torch.get_num_threads(),
                      child),
            )
            process.start()
            child.close()
            conns.append(parent)
            processes.append(process)
        group = cls(conns, processes)
        try:
            tp = _join(0, world_size, backend, address, engine_config, one_shot)
            model_config = source.model_config()
            model = source.build(engine_config.resolve_max_model_len(model_config), engine_config.torch_dtype,
                                 _rank_device(device, 0), tp)
        except BaseException:
            group.close()
            raise
        return group, model

    # ---- rank 0 -> workers ------------------------------------------------------------------
    def send(self, op: str, *args: Any) -> None:
        """Raises `WorkerDiedError` instead of sending into a rank that is gone: rank 0 would then
        wait forever in the step's first collective."""
        for rank, (conn, process) in enumerate(zip(self._conns, self._processes, strict=True), start=1):
            if not process.is_alive():
                raise WorkerDiedError(f"tensor-parallel worker {rank} exited (code {process.exitcode})")
            conn.send((op, args))

    def plan_num_blocks(self, plan_own: Callable[[], int]) -> int:
        """Every rank sizes its KV pool (the profiling forward runs collectives, so all at once);
        the smallest wins, so every rank holds the same block numbers."""
        self.send("plan_num_blocks")
        own = plan_own()
        return min([own] + [conn.recv() for conn in self._conns])

    def start_runners(self, runner: Any, num_blocks: int, tokenizer_vocab_size: int, num_host_blocks: int) -> None:
        """Workers build their runners like rank 0's `runner` (whose graphs `close` releases)."""
        self._runner = runner
        self.send("start_runner", num_blocks, tokenizer_vocab_size, num_host_blocks)

    def mirror_slot_pool(self, pool: LoRASlotPool, limits: dict[str, Any]) -> LoRASlotPool:
        """Give every worker a slot pool like `pool` (its shard's shapes) and mirror writes into it."""
        self.send("lora_pool", limits)
        # It stands in for `pool` wherever a LoRASlotPool goes: writes and clears go to every rank, and every
        # other attribute is `pool`'s (`__getattr__`), which its type cannot say.
        return MirroredSlotPool(pool, self)  # type: ignore[return-value]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for conn, process in zip(self._conns, self._processes, strict=True):
            if process.is_alive():
                with contextlib.suppress(OSError, BrokenPipeError):
                    conn.send(("shutdown", ()))
        # NCCL finalizes a communicator only once no CUDA graph holds its captured kernels, and
        # its teardown waits for the peers: every rank drops its graphs, then all tear down at
        # once (joining the workers first would have each side wait for the other).
        if self._runner is not None:
            self._runner.release_graphs()
        _teardown_process_group()
        for process in self._processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()


class MirroredSlotPool:
    """Rank 0's slot pool: an adapter written into slot s here is written, sharded for each rank,
    into slot s of every worker's pool (they receive the whole weights and keep their part)."""

    def __init__(self, pool: LoRASlotPool, workers: WorkerGroup) -> None:
        self._pool = pool
        self._workers = workers

    def write(self, slot: int, weights: AdapterWeights) -> None:
        self._pool.write(slot, weights)  # checks first: a refused adapter reaches no worker
        self._workers.send("lora_write", slot, weights)

    def clear(self, slot: int) -> None:
        self._pool.clear(slot)
        self._workers.send("lora_clear", slot)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)


def plan_num_blocks(runner_class: Any, model: LlamaForCausalLM, model_config: ModelConfig,
                    engine_config: EngineConfig, workers: WorkerGroup | None) -> int:
    def own() -> int:
        return runner_class.plan_num_blocks(model, model_config, engine_config)

    return own() if workers is None else workers.plan_num_blocks(own)


# ---- the worker process -----------------------------------------------------------------------
class Worker:
    """One rank's loop: apply each operation rank 0 sends, in order, until `shutdown`."""

    def __init__(self, model: LlamaForCausalLM, engine_config: EngineConfig, conn: Any) -> None:
        from loraplex.engine.runner import runner_class_for

        self.model = model
        self.model_config = model.config
        self.engine_config = engine_config
        self.conn = conn
        self.runner_class = runner_class_for(engine_config.device)
        self.runner: Any = None
        self.lora_pool: LoRASlotPool | None = None
        self.launched_tokens: torch.Tensor | None = None  # the last launched step's sampled tokens (device)
        self.ops: dict[str, Callable[..., Any]] = {
            "plan_num_blocks": self.plan_num_blocks, "start_runner": self.start_runner, "step": self.step,
            "launch": self.launch,
            "copy_blocks": self.copy_blocks, "swap_kv": self.swap_kv,
            "capture_decode_graphs": self.capture_decode_graphs,
            "lora_pool": self.new_lora_pool, "lora_write": self.lora_write, "lora_clear": self.lora_clear,
        }

    def serve(self) -> None:
        while True:
            op, args = self.conn.recv()
            if op == "shutdown":
                if self.runner is not None:
                    self.runner.release_graphs()
                return
            self.ops[op](*args)

    def plan_num_blocks(self) -> None:
        self.conn.send(self.runner_class.plan_num_blocks(self.model, self.model_config, self.engine_config))

    def start_runner(self, num_blocks: int, tokenizer_vocab_size: int, num_host_blocks: int) -> None:
        self.runner = self.runner_class(self.model, self.model_config, self.engine_config, num_blocks,
                                        tokenizer_vocab_size, num_host_blocks=num_host_blocks)

    def _lora(self, batch: Any) -> Any:
        if batch.lora_slots is None or self.lora_pool is None:
            return None
        build = LORA_BATCHES[self.runner.device.type]
        return build(np.asarray(batch.lora_slots).tolist(), self.lora_pool, None)

    @torch.inference_mode()
    def step(self, batch: Any) -> None:
        out = self.runner.forward_batch(batch, self._lora(batch))
        if out.hidden is not None and batch.prompt_logprob_spans:
            for _ in self.runner.prompt_logits(out.hidden, batch):  # rank 0 scores them; the gathers must match
                pass
        if self.runner.device.type == "cuda":
            # The next step refills the pinned staging buffer that this step's copy reads from;
            # rank 0 waits the same way (it reads the sampled tokens back).
            torch.cuda.current_stream().synchronize()

    @torch.inference_mode()
    def launch(self, batch: Any, fed: bool) -> None:
        """An overlapped decode step (engine/step_overlap.py): replay it and sample greedily from the
        gathered logits, as rank 0 does, without waiting. Every rank holds the same full logits and
        its own copy of the sampled tokens, so a step launched ahead of the previous one's tokens
        (`fed`: its input ids are rows of those tokens) reads them on this rank's GPU too."""
        graph = self.runner.replay_launched(batch, self._lora(batch), self.launched_tokens if fed else None)
        graph.sample.replay()  # this rank's grammar rows stay empty: no mask, the same argmax as rank 0's
        self.launched_tokens = graph.tokens

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.runner._copy_blocks(copies)

    def swap_kv(self, swaps: list[tuple[str, int, int]]) -> None:
        self.runner.swap_kv(swaps)

    def capture_decode_graphs(self) -> None:
        self.runner.capture_decode_graphs()

    def new_lora_pool(self, limits: dict[str, Any]) -> None:
        # Sent when rank 0 builds its LoRA manager, which can be before this rank's runner starts.
        self.lora_pool = LoRASlotPool(self.model, device=next(self.model.parameters()).device, **limits)

    def lora_write(self, slot: int, weights: AdapterWeights) -> None:
        self._lora_pool().write(slot, weights)

    def lora_clear(self, slot: int) -> None:
        self._lora_pool().clear(slot)

    def _lora_pool(self) -> LoRASlotPool:
        if self.lora_pool is None:  # rank 0 sends "lora_pool" before any slot write (`mirror_slot_pool`)
            raise RuntimeError("a LoRA slot write reached a tensor-parallel worker before its slot pool")
        return self.lora_pool


def worker_main(rank: int, world_size: int, backend: str, address: str, source: ModelSource,
                engine_config: EngineConfig, one_shot: bool, num_threads: int, conn: Any) -> None:
    # Ctrl-C or a SIGTERM sent to the whole process group must not take a rank away while the engine drains its
    # requests: rank 0 ends this process (a "shutdown" message, or closing the pipe), and its death kills it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL)
    torch.set_num_threads(num_threads)
    device = torch.device(engine_config.device)
    try:
        tp = _join(rank, world_size, backend, address, engine_config, one_shot)
        model_config = source.model_config()
        model = source.build(engine_config.resolve_max_model_len(model_config), engine_config.torch_dtype,
                             _rank_device(device, rank), tp)
        Worker(model, engine_config, conn).serve()
    except (EOFError, KeyboardInterrupt):
        pass  # rank 0 went away
    except BaseException:
        logger.exception("tensor-parallel worker %d failed", rank)
        raise
    finally:
        _teardown_process_group()


def _teardown_process_group(timeout_s: float = 30.0) -> None:
    """Destroy the process group, but never hang a shutdown on it: a peer that died first
    leaves NCCL's teardown waiting forever, so it runs on a thread that is given up on."""
    if not dist.is_initialized():
        return
    teardown = threading.Thread(target=dist.destroy_process_group, name="tp-teardown", daemon=True)
    teardown.start()
    teardown.join(timeout_s)
    if teardown.is_alive():
        logger.warning("tensor-parallel process group teardown did not finish in %.0f s; left behind", timeout_s)


def _join(rank: int, world_size: int, backend: str, address: str, engine_config: EngineConfig,
          use_one_shot: bool) -> TensorParallelGroup:
    device = torch.device(engine_config.device)
    if device.type == "cuda":
        torch.cuda.set_device(rank)  # "cuda" now means this rank's GPU everywhere in the process
    # gloo (CPU): a collective that a rank never joins raises after this long instead of hanging
    timeout = timedelta(minutes=5) if backend == "gloo" else None
    dist.init_process_group(backend, init_method=address, rank=rank, world_size=world_size, timeout=timeout)
    group = dist.group.WORLD
    one_shot = None
    if use_one_shot:
        one_shot = one_shot_all_reduce(group, engine_config.torch_dtype, torch.device("cuda", rank))
    return TensorParallelGroup(rank, world_size, group, one_shot)


def _rank_device(device: torch.device, rank: int) -> str:
    return f"cuda:{rank}" if device.type == "cuda" else "cpu"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

