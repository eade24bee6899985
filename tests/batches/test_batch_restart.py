"""A server killed in the middle of a batch (SIGKILL: no shutdown hooks) comes back and completes it:
each custom_id answered once, lines finished before the kill not run again, each billed once with the
tokens of the answer the output file holds. PostgreSQL holds the batch, as in production."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from batch_helpers import chat_line, ledger_rows, result_lines, start_batch_server, upload, wait_batch
from waiting import wait_until


def test_restart_mid_batch_completes_each_line_once(tmp_path_factory: pytest.TempPathFactory, smollm_path: Path,
                                                     new_postgres_database: Any) -> None:
    with new_postgres_database("loraplex_batches") as database_url:
        server = start_batch_server(tmp_path_factory.mktemp("batch-restart"), smollm_path,
                                    database_url=database_url, batch_concurrency=2, batch_lease_s=3)
        try:
            client = server.client("acme")
            lines = [chat_line(f"r{i}", f"Say the number {i}.") for i in range(8)]
            batch = client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/chat/completions",
                                          completion_window="24h")
            wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 2, timeout_s=300,
                       interval_s=0.1, what="two finished lines")
            finished_before = client.batches.retrieve(batch.id).request_counts.completed
            killed_at = time.time()
            server.process.kill()
            server.process.start(timeout_s=600)
            client = server.client("acme")
            done = wait_batch(client, batch.id, timeout_s=300)
            assert done.status == "completed", done
            assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (8, 8, 0)
            outputs = result_lines(client, done.output_file_id)
            assert sorted(o["custom_id"] for o in outputs) == sorted(line["custom_id"] for line in lines)
            answered_before = [o for o in outputs if o["response"]["body"]["created"] < killed_at]
            assert len(answered_before) >= finished_before  # their answers are the first run's: not run again
            rows = wait_until(lambda: len(r := ledger_rows(server, "acme", batch.id)) >= 8 and r, timeout_s=120,
                              what="every line in the ledger")
            by_request = {row["request_id"]: row for row in rows}
            assert len(rows) == len(by_request) == 8
            for out in outputs:
                billed = by_request[out["response"]["request_id"]]
                usage = out["response"]["body"]["usage"]
                assert (billed["input_tokens"], billed["output_tokens"]) == (usage["prompt_tokens"],
                                                                            usage["completion_tokens"])
        except BaseException:
            server.process.print_log()
            raise
        finally:
            server.process.terminate()
