"""The one object that reads the environment (prefix `LORAPLEX_`).

Every other module receives a `Settings` instance; none calls `os.environ`.
Other domains add their knobs here (a field each, with a default that works
on one machine).
"""

from __future__ import annotations

import json
import os
import socket
from functools import cached_property
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LORAPLEX_", env_file=None, extra="ignore")

    # Storage
    data_dir: Path = Path("./data")
    database_url: str | None = None     # None: sqlite:///<data_dir>/loraplex.db
    redis_url: str | None = None        # None: in-process rate limits, sessions and tasks
    redis_key_prefix: str = "lpx:"      # lets several deployments (or test runs) share one Redis
    migrate_on_start: bool = True       # only ever applied to SQLite; PostgreSQL is migrated explicitly

    # Model and engine limits
    model_path: Path | None = None      # None: the bundled SmolLM2, converted into <data_dir>/models
    served_model_name: str | None = None  # None: the model folder's name
    device: str = "auto"                # auto (cuda when available) | cpu | cuda
    dtype: str = "auto"                 # auto (bfloat16 on cuda, float32 on cpu) | float32 | bfloat16 | float16
    # torch's CPU threads in the engine-core process; 0: every core on the CPU device, 1 on CUDA, where the
    # core's CPU tensor work is small bookkeeping and idle OpenMP threads spinning between steps took cores
    # from the API servers and the tokenizer
    engine_cpu_threads: int = Field(default=0, ge=0)
    kv_cache_memory_mb: int = 256
    kv_host_memory_mb: int = 256        # host memory for pinned session KV offloaded under pressure; 0: drop instead
    num_kv_blocks: int | None = None    # overrides the memory budget (tests use tiny pools)
    # Device KV blocks sessions (and stored responses) may pin in all / per tenant; None: the pool is the limit /
    # pinned_kv_share_per_tenant of the pool, so one tenant's sessions cannot push every other tenant's out
    max_pinned_blocks: int | None = Field(default=None, ge=0)
    max_pinned_blocks_per_tenant: int | None = Field(default=None, ge=0)
    pinned_kv_share_per_tenant: float = Field(default=0.25, gt=0, le=1)  # 1: no per-tenant limit
    kv_block_size: int = 16
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64
    # A decode this many tokens long (and twice as long as another tenant's running one) sits out two steps
    # of three for it; None: 16 on the CPU (where a step's cost grows with its batch), off on CUDA; 0: off
    decode_yield_min_tokens: int | None = Field(default=None, ge=0)
    # Tenants share the engine by weighted fair shares of running slots, KV blocks and prefill tokens, and one
    # under its share that waits preempts the tenant furthest over its own; False: first come, first served
    fair_sharing: bool = True
    # With fair sharing, the engine runs this many slots beyond max_num_seqs, kept for a tenant under its share:
    # one tenant's flood fills max_num_seqs, never the engine, and another's request starts without preempting;
    # None: 1/32 of max_num_seqs (2 of 64; none below 32)
    newcomer_reserved_slots: int | None = Field(default=None, ge=0)
    # GPU with mixed-step graphs: a flooding tenant's rows sit out the step that admits another tenant's request of
    # at most this many prompt tokens, so that request's first token comes from a step of its own rows rather than
    # one beside the flood's ~60; the flood sits out at most one step in four this way. It trades the flood's
    # throughput for others' first tokens: on an H200 (SmolLM2 shapes, 128) a quiet tenant's p95 TTFT beside 256
    # flood streams went from 16.6-17.7 to 11.5-16.1 ms, and the flood lost 5-17% of its tokens/s (one step for each
    # of the quiet tenant's ~25 requests a second). 0 (the default): the flood never sits out
    flood_sit_out_prompt_tokens: int = Field(default=0, ge=0)
    # GPU: while interactive work runs or waits, batch work (the Batch API's lines) runs at most this many rows a
    # step, so interactive requests decode in steps of few rows, at the batch's expense; 0 (the default): no limit
    # (the CPU runs no batch row beside interactive work whatever this says)
    batch_rows_beside_interactive: int = Field(default=0, ge=0)
    # GPU: while interactive work runs or waits, batch lines are admitted in waves, once this share of the batch's
    # room is free, so that few steps carry batch prompts beside interactive decodes; 0: whenever a slot is free;
    # unset: 0.25 for a model of at least 4 GiB of weights a GPU, 0.5 below (where a step is bound by host work)
    batch_admission_wave: float | None = Field(default=None, ge=0, le=1)
    # GPU: while interactive work runs or waits, a step runs at most this many batch prompt tokens (a wave of
    # admissions then spreads over steps), so interactive requests never decode in a step heavy with batch prompts;
    # 0: the step's budget (max_num_batched_tokens); unset: 32 for a model of at least 4 GiB of weights a GPU, 0
    # below (where each step that carries prompts costs host work whatever its tokens)
    batch_prefill_tokens_beside_interactive: int | None = Field(default=None, ge=0)
    # Speculative decoding: off | ngram (decodes draft up to speculative_num_tokens tokens by prompt lookup, with
    # n-grams of speculative_ngram_min..max tokens, verified in one forward pass) | auto (the same, switched off
    # per sequence where drafts are mostly rejected and per step where the batch is compute-bound)
    speculative_decoding: Literal["off", "ngram", "auto"] = "off"
    speculative_num_tokens: int = Field(default=4, ge=1, le=16)
    speculative_ngram_min: int = Field(default=2, ge=1, le=16)
    speculative_ngram_max: int = Field(default=4, ge=1, le=16)
    max_num_batched_tokens: int = 512
    # CUDA: launch each plain decode step (greedy, or drawing at a temperature alone) before the previous step's
    # tokens reach the host, so the host's scheduling and bookkeeping overlap the GPU's work (same outputs).
    # None (the default): on on CUDA, off on the CPU (docs/hooks/settings.yml)
    overlap_scheduling: bool | None = None
    # CUDA: steps that mix prompt chunks with decodes replay captured graphs too (padded to a captured shape),
    # instead of launching every kernel from the host; False: such steps run eagerly
    cuda_graph_mixed_steps: bool = True
    max_model_len: int = 2048
    tensor_parallel_size: int = Field(default=1, ge=1)  # GPUs one model is split over (one worker process each)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)  # CUDA: the share of the GPU the engine may take
    # Requests each API server process admits at once (N API servers: up to N times this), shared fairly: once
    # full, a tenant past its share (these places over the tenants with requests in flight) gets a 429; 503 only
    # past twice this many
    max_pending_requests: int = Field(default=256, ge=1)
    # The engine loop thread and the HTTP event loop share one GIL; Python's default 5 ms switch interval
    # makes the HTTP side wait up to that long whenever the engine thread holds it (a whole token's time).
    gil_switch_interval_ms: float | None = 0.5  # None: leave Python's default

    # Process layout of `loraplex serve`: one engine-core process, `api_servers` uvicorn processes on one port.
    # None: one without Redis (sessions and limits would be per process), else `api_servers_for_this_machine()`
    api_servers: int | None = Field(default=None, ge=1, le=64)
    engine_core_address: str | None = None  # set by `serve` for its API servers; None: the engine runs in-process
    engine_core_start_timeout_s: float = Field(default=600.0, gt=0)  # loading (and converting) the model
    # `serve`'s processes move their start-up objects out of the garbage collector's full passes once ready
    # (platform/startup_heap.py): a full pass over them paused the whole process for 100-300 ms.
    freeze_startup_heap: bool = True
    drain_timeout_s: float = Field(default=30.0, ge=0)  # SIGTERM: in-flight requests get this long to finish
    # Requests one tenant may have in flight at once (each prompt of a list counts); 0: no cap. 429 beyond.
    max_inflight_per_tenant: int = Field(default=0, ge=0)
    # A response whose client has not taken a chunk of its body for this long is ended (its slot returns), and
    # its connection is closed by the kernel once data has waited unread that long (TCP_USER_TIMEOUT); 0: never
    stream_send_timeout_s: float = Field(default=30.0, ge=0)
    # Benchmarks: random weights of the model folder's architecture (config.json + tokenizer suffice)
    random_weights: bool = False
    metrics_multiprocess_dir: str | None = None  # set by `serve` for N API servers: their metrics, aggregated
    # GET /metrics needs `Authorization: Bearer <this>` when set (401 otherwise): its vllm:lora_requests_info
    # names tenants' adapters. None: open, for scrapers that send no credentials (llm-d's endpoint picker)
    metrics_bearer_token: str | None = None
    # KV-cache events in vLLM's format (ZeroMQ PUB, msgpack) for prefix-aware routers such as llm-d's
    # precise prefix-cache scorer; None: off. `tcp://host:5557` connects to the subscriber (llm-d's picker
    # binds), `tcp://*:5557` binds here. Topic `kv@<kv_events_pod>@<served model name>`.
    kv_events_endpoint: str | None = None
    kv_events_pod: str | None = None    # None: this host's name; on Kubernetes the pod's IP (what llm-d expects)

    # HTTP
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    # Longer than clients' idle pools hold connections, so a reused connection is never one the server
    # is closing at that very moment (uvicorn's default of 5 s makes idle SDK clients fail now and then).
    keep_alive_timeout_s: int = 75
    # Request bodies, refused with 413 before they are read or parsed (platform/body_limit.py, checked by platform/edge.py)
    max_request_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    max_upload_request_bytes: int = Field(default=1026 * 1024 * 1024, ge=1024)  # POST /v1/adapters

    # Rate limits per API key (a key may override them); 0 = unlimited
    default_rpm: int = 600
    default_tpm: int = 1_000_000
    key_last_used_resolution_s: float = 60.0  # last_used_at is written at most this often per key
    key_cache_fresh_s: float = 5.0      # a key revoked by another process stops working within this; 0 = no cache
    key_cache_stale_s: float = 900.0    # while the database is unreachable, keys seen this recently still work

    # Placeholders the other domains fill in
    max_loras: int = 8                  # adapters resident on the device at once (slots)
    max_cpu_loras: int = 32             # adapters kept in host memory
    max_lora_rank: int = 64
    adapter_storage_dir: Path | None = None  # None: <data_dir>/adapters
    # Adapter storage per tenant (failed adapters hold none); past either: 413 storage_quota_exceeded. 0: no limit
    adapter_quota_bytes_per_tenant: int = Field(default=20 * 1024**3, ge=0)
    adapter_quota_count_per_tenant: int = Field(default=100, ge=0)
    # One adapter upload: the file (or archive) as sent, an archive's members decompressed and counted, and its
    # adapter_config.json; past any, 413 / 400 naming it (adapters/archive.py)
    adapter_max_upload_bytes: int = Field(default=512 * 1024 * 1024, ge=1)
    adapter_max_expanded_bytes: int = Field(default=1024 * 1024 * 1024, ge=1)
    adapter_max_archive_members: int = Field(default=64, ge=1)
    adapter_max_config_bytes: int = Field(default=1024 * 1024, ge=1)
    # Adapter uploads one tenant may have in progress at once, per API server (their bytes count against the
    # storage quota as they arrive); past it: 429 too_many_uploads. 0: no cap
    max_concurrent_uploads_per_tenant: int = Field(default=2, ge=0)
    adapter_sweep_interval_s: float = Field(default=600.0, gt=0)  # orphaned blobs / abandoned staging removed
    adapter_sweep_min_age_s: float = Field(default=3600.0, ge=0)  # ...once at least this old
    max_reasoning_tokens: int | None = None  # default thinking budget; None: unbounded
    reasoning_format: str = "think"     # think markers of the served family: think | auto | none | a family name
    reasoning_budget_low: int = Field(default=64, ge=0)     # reasoning_effort -> thinking budget (tokens)
    reasoning_budget_medium: int = Field(default=256, ge=0)
    reasoning_budget_high: int = Field(default=1024, ge=0)
    grammar_compile_timeout_s: float = 30.0  # a compilation running longer than this: 400
    grammar_max_spec_bytes: int = 256 * 1024  # response_format / tools larger than this: 400
    grammar_max_compiled_bytes: int = Field(default=256 * 1024 * 1024, ge=1)  # a compiled grammar larger: 400
    # Structured output: backend choice (auto = the one enforcing each schema exactly), JSON-schema
    # shape limits checked before any work (deeper or larger: 400), and the most `tools` per request.
    grammar_backend: str = "auto"       # auto | llguidance | xgrammar
    grammar_max_schema_depth: int = Field(default=64, ge=1)
    grammar_max_schema_nodes: int = Field(default=20000, ge=1)
    grammar_max_tools: int = Field(default=128, ge=1)
    # A grammar forcing more tokens than this without a choice, or allowing no output (no finite value): 400
    grammar_max_completion_tokens: int = Field(default=8192, ge=1)
    grammar_cache_dir: str | None = None  # compiled grammars shared by this host's processes; None: per process
    # Grammar compilations one tenant may have running at once (per API server, and in the engine core, where
    # tenants also take turns; 0: no cap); a request past it waits this long for one of them to finish, then
    # 429 tenant_compile_limit. Cached schemas skip it.
    grammar_compiles_per_tenant: int = Field(default=1, ge=0)
    grammar_compile_wait_s: float = Field(default=30.0, ge=0)
    session_ttl_s: int = 3600
    session_max_ttl_s: int = 7 * 86400
    # Sessions per tenant alive at once (0: no cap; past it 429 session_limit_exceeded), and the largest
    # `system` prompt a session may keep (400 naming `system`); its tools obey the grammar_* limits.
    max_sessions_per_tenant: int = Field(default=1000, ge=0)
    max_session_system_chars: int = Field(default=32 * 1024, ge=1)
    session_lease_s: float = 600.0      # a turn's hold on its session; a crashed turn frees it after this
    session_busy_wait_s: float = 1.0    # a turn waits this long for the previous one to finish before 409
    session_sweep_interval_s: float = 5.0  # how often expired sessions' pinned KV is released
    # names this engine replica in session and response records (a turn elsewhere is counted as moved);
    # the default, the host name, is the pod's name on Kubernetes. Two replicas on one host need their own
    replica_id: str = Field(default_factory=socket.gethostname)
    # Responses API: how long a stored response (and so a chain through it) can be retrieved and continued
    response_retention_s: int = Field(default=30 * 86400, ge=1)
    # What one tenant may keep stored (0: no cap). Stored responses (store=true; each keeps its chain's whole
    # conversation) and live sessions, counted in bytes as stored (their JSON); past a tenant's count or bytes:
    # 429 stored_state_limit_exceeded naming the setting; one record past its own cap: 400 stored_state_too_large.
    max_stored_responses_per_tenant: int = Field(default=10_000, ge=0)
    max_stored_response_bytes_per_tenant: int = Field(default=256 * 1024**2, ge=0)
    max_stored_response_bytes: int = Field(default=8 * 1024**2, ge=0)
    max_session_bytes_per_tenant: int = Field(default=256 * 1024**2, ge=0)
    max_session_bytes: int = Field(default=8 * 1024**2, ge=0)
    # Caller-chosen strings a stored response keeps although no prompt holds them: input item ids and call ids,
    # and descriptions (text.format, tools); longer: 400 naming the field
    max_item_id_chars: int = Field(default=128, ge=8)
    max_description_chars: int = Field(default=4096, ge=1)
    metering_enabled: bool = True       # off only to measure metering overhead
    billing_batch_size: int = 256       # usage events per ledger write
    billing_journal_lease_s: float = 10.0  # a killed server's Redis journal is taken over this long after it died
    billing_rollup_interval_s: float = 3600.0  # Celery beat period of rollups and quota reconciliation
    # A running request's maximum cost is held on its budgets until its usage is recorded; a crashed
    # request's hold lapses after this (longer than the longest generation)
    budget_reservation_ttl_s: float = Field(default=900.0, gt=0)
    celery_always_eager: bool = Field(default=False, description="run tasks in-process (no worker)")
    # Batch API (/v1/files, /v1/batches). A tenant's files: count and bytes (past either: 413
    # storage_quota_exceeded; 0: no limit); one file's bytes (413) and requests (OpenAI's 200 MB and 50,000);
    # a custom_id's length; batches not yet finished per tenant (429 batch_limit_exceeded; 0: no limit)
    batch_file_quota_count_per_tenant: int = Field(default=500, ge=0)
    batch_file_quota_bytes_per_tenant: int = Field(default=10 * 1024**3, ge=0)
    batch_max_file_bytes: int = Field(default=200 * 1024**2, ge=1024)
    batch_max_requests: int = Field(default=50_000, ge=1)
    batch_max_custom_id_chars: int = Field(default=512, ge=1)
    batch_max_active_per_tenant: int = Field(default=100, ge=0)
    batch_file_expires_after_s: int = Field(default=30 * 86400, ge=3600)  # files without expires_after
    # Execution: lines of one batch in flight at once on one API server, batches one API server runs at
    # once, the price (percent off the price book), a worker's hold on a batch (another replica takes it
    # over this long after its worker died), how often idle workers look for work, and how long the one
    # completion window OpenAI allows ("24h") lasts
    batch_concurrency: int = Field(default=64, ge=1)
    batch_max_running_per_server: int = Field(default=4, ge=1)
    batch_price_discount_percent: int = Field(default=50, ge=0, le=100)
    batch_lease_s: float = Field(default=30.0, gt=0)
    batch_poll_interval_s: float = Field(default=2.0, gt=0)
    batch_completion_window_s: int = Field(default=86400, ge=1)
    batch_workers_enabled: bool = True  # off: this process serves the routes but runs no batch work
    # `serve` runs batch work in a process of its own beside the API servers (the same app on a private socket),
    # so a batch's lines never share an event loop with interactive requests: in one API server, a running
    # 2,000-line batch made a 32-token chat request 10x slower on an H200. False: every API server runs
    # batch work beside its routes.
    batch_worker_process: bool = True

    # OpenAI/vLLM conformance: request limits (each a 400 naming the parameter), streaming, browsers
    reasoning_budget_minimal: int = Field(default=16, ge=0)  # reasoning_effort "minimal" (tokens); "none" is 0
    max_stop_sequences: int = Field(default=4, ge=1)        # OpenAI allows 4
    max_stop_sequence_chars: int = Field(default=256, ge=1)
    max_stop_token_ids: int = Field(default=64, ge=0)
    max_logit_bias_entries: int = Field(default=300, ge=0)  # OpenAI allows 300
    max_n: int = Field(default=16, ge=1)                    # choices per request
    max_messages: int = Field(default=2048, ge=1)           # chat messages (and /v1/responses input items) per request
    max_prompts: int = Field(default=256, ge=1)             # prompts in one /v1/completions list
    usage_report_max_rows: int = Field(default=10_000, ge=1)  # rows of one GET /v1/usage report; past it 400
    chat_template_kwargs_max_bytes: int = Field(default=16 * 1024, ge=1)  # the request's chat_template_kwargs as JSON
    sse_keepalive_s: float = Field(default=10.0, ge=0)      # ": keep-alive" while a stream waits for its first token; 0: off
    # Browser origins allowed to call the API (CORS), comma-separated or a JSON list; empty: none
    cors_allowed_origins: Annotated[list[str], NoDecode] = Field(default_factory=list)

    @field_validator("cors_allowed_origins", mode="before")
    @classmethod
    def _split_origins(cls, value: object) -> object:
        if isinstance(value, str):
            text = value.strip()
            return json.loads(text) if text.startswith("[") else [o.strip() for o in text.split(",") if o.strip()]
        return value

    @model_validator(mode="after")
    def _default_api_servers(self) -> Settings:
        """One API server turns every chunk of a step's streams (up to `max_num_seqs` and the kept slots) into
        SSE on one core: past a few dozen streams it, not the engine, sets the pace. With Redis (shared sessions
        and limits) several share the load, leaving half the cores to the engine core, tokenizing threads and
        the OS."""
        if self.api_servers is None:
            self.api_servers = default_api_servers(self.redis_url)
        return self

    @property
    def num_api_servers(self) -> int:
        """`api_servers`, which the validator above always fills in, as a plain int."""
        return self.api_servers if self.api_servers is not None else default_api_servers(self.redis_url)

    @model_validator(mode="after")
    def _absolute_paths(self) -> Settings:
        """Paths are made absolute once, here. The default `./data` is relative, and a relative path kept in a
        symlink, handed to a Celery worker or opened after a chdir points somewhere else (uploads failed so)."""
        self.data_dir = self.data_dir.expanduser().absolute()
        if self.model_path is not None:
            self.model_path = self.model_path.expanduser().absolute()
        if self.adapter_storage_dir is not None:
            self.adapter_storage_dir = self.adapter_storage_dir.expanduser().absolute()
        return self

    @cached_property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{self.data_dir / 'loraplex.db'}"

    @cached_property
    def models_dir(self) -> Path:
        return self.data_dir / "models"

    @cached_property
    def resolved_adapter_storage_dir(self) -> Path:
        return self.adapter_storage_dir or self.data_dir / "adapters"

    @property
    def is_sqlite(self) -> bool:
        return self.resolved_database_url.startswith("sqlite")

    def resolve_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolve_engine_cpu_threads(self) -> int | None:
        """torch threads for the engine core; None: leave torch's default (all cores)."""
        if self.engine_cpu_threads:
            return self.engine_cpu_threads
        return 1 if self.resolve_device() == "cuda" else None

    def resolve_max_pinned_blocks_per_tenant(self) -> int | float | None:
        """Blocks, or a share of the pool the engine turns into blocks once it knows the pool; None: no limit."""
        if self.max_pinned_blocks_per_tenant is not None:
            return self.max_pinned_blocks_per_tenant
        return self.pinned_kv_share_per_tenant if self.pinned_kv_share_per_tenant < 1 else None

    def resolve_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.resolve_device() == "cuda" else "float32"

    def resolve_model_path(self) -> Path:
        """The model folder to serve; converts the bundled GGUF on first use (slow once)."""
        if self.model_path is not None:
            return self.model_path
        from loraplex.engine.model.default_model import ensure_default_model

        return ensure_default_model(self.models_dir)


# The most API servers `serve` starts by itself. Each holds ~0.5 GB (tokenizer, app). With a GPU, 4 of them on a
# 16-core H200 host could not keep up with one tenant's 64-256 streams: their SSE work set another tenant's time to
# first token (p95 1.8-2.1x its quiet time over two runs); 8 gave 1.4-1.6x and no less throughput.
MAX_DEFAULT_API_SERVERS = 8


def api_servers_for_this_machine() -> int:
    """API servers for this machine when they can share state (Redis): half its cores, leaving the rest to the
    engine core, tokenizing threads and the OS; at least 1, at most MAX_DEFAULT_API_SERVERS."""
    return max(1, min(MAX_DEFAULT_API_SERVERS, len(os.sched_getaffinity(0)) // 2))


def default_api_servers(redis_url: str | None) -> int:
    return api_servers_for_this_machine() if redis_url else 1
