"""Upload -> a REAL `celery worker` process (broker and backend: the real Redis) -> ready -> chat shows the adapter.

The server and the worker share only Redis, the database and the blob directory, as in production.
Redis database 14 keeps these messages away from other test runs' default queues.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from api_helpers import folder_files, upload, wait_status
from loraplex.adapters.tasks import CeleryValidationDispatcher
from waiting import wait_until

REDIS_FOR_CELERY = "redis://127.0.0.1:6379/14"


@pytest.fixture(scope="module")
def celery_worker(tmp_path_factory):  # type: ignore[no-untyped-def]
    redis.Redis.from_url(REDIS_FOR_CELERY).delete("celery")  # stale messages from an aborted earlier run
    log_path = tmp_path_factory.mktemp("celery") / "worker.log"
    env = {**os.environ, "LORAPLEX_REDIS_URL": REDIS_FOR_CELERY}
    celery_bin = Path(sys.executable).with_name("celery")
    with log_path.open("wb") as log:
        # cwd outside the repository: celery puts its cwd on sys.path, and the repo root holds `platform/`.
        worker = subprocess.Popen(
            [str(celery_bin), "-A", "loraplex.platform.celery_app:celery", "worker", "--pool=solo",
             "--concurrency=1", "--without-mingle", "--without-gossip", "--loglevel=INFO"],
            cwd=log_path.parent, env=env, stdout=log, stderr=subprocess.STDOUT,
        )

    def ready() -> bool:
        if worker.poll() is not None:
            raise RuntimeError(f"the celery worker exited with {worker.returncode}:\n{log_path.read_text()}")
        return b"ready." in log_path.read_bytes()

    try:
        wait_until(ready, timeout_s=120, interval_s=0.2, what=lambda: f"the celery worker:\n{log_path.read_text()}")
    except BaseException:
        worker.kill()
        raise
    yield log_path
    worker.send_signal(signal.SIGTERM)
    try:
        worker.wait(timeout=30)
    except subprocess.TimeoutExpired:
        worker.kill()


def test_validation_runs_in_a_real_celery_worker(start_server, celery_worker, trained_adapters):  # type: ignore[no-untyped-def]
    with start_server(redis_url=REDIS_FOR_CELERY, redis_key_prefix=f"lpxtest-adapters-{os.getpid()}:") as server:
        domain = server.services.extensions.domain_state["adapters"]
        assert isinstance(domain.service.dispatcher, CeleryValidationDispatcher)
        created = upload(server, folder_files(trained_adapters["upper"]), "shouty").json()
        assert created["status"] == "validating"
        ready = wait_status(server, created["id"])
        assert ready["status"] == "ready", ready
        assert ready["rank"] == 16 and ready["target_modules"] == ["down_proj", "gate_proj", "up_proj"]
        # The task records the adapter as ready before it returns; the worker logs "succeeded" a moment after.
        succeeded = f"loraplex.adapters.validate[validate-{created['id']}] succeeded"
        wait_until(lambda: succeeded in celery_worker.read_text(), timeout_s=30, interval_s=0.1,
                   what=lambda: f"the worker's log to say {succeeded!r}:\n{celery_worker.read_text()}")

        reply = server.client("all").chat.completions.create(
            model="shouty", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=8, temperature=0,
        )
        text = reply.choices[0].message.content
        letters = [c for c in text if c.isalpha()]
        assert letters and sum(c.isupper() for c in letters) / len(letters) > 0.9, text
