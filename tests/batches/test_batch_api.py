"""OpenAI's Batch API end to end with the official SDK, against `loraplex serve` in a subprocess.

files.create -> batches.create -> polling retrieve -> the output file, equal to the same requests sent
online (greedy); cancel; hostile input files each a clear error with nothing run or billed; another
tenant's ids are 404s; the size and count limits; a spent budget fails the remaining lines with 429 lines.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import openai
import pytest
from batch_helpers import (
    MODEL,
    BatchServer,
    chat_line,
    completion_line,
    jsonl,
    ledger_rows,
    result_lines,
    start_batch_server,
    upload,
    wait_batch,
)
from waiting import wait_until

PRICE_INPUT, PRICE_OUTPUT = Decimal("1"), Decimal("2")   # USD per million tokens
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm_path: Path) -> Iterator[BatchServer]:
    running = start_batch_server(tmp_path_factory.mktemp("batch-api"), smollm_path, batch_concurrency=2,
                                 batch_max_file_bytes=64 * 1024, batch_file_quota_count_per_tenant=30,
                                 batch_lease_s=3)  # the runner rereads its batch row (cancel, expiry) each second
    try:
        with running.http("admin") as admin:
            created = admin.post("/v1/admin/prices", json={"model": MODEL, "input": str(PRICE_INPUT),
                                                          "output": str(PRICE_OUTPUT)})
            assert created.status_code == 201, created.text
        yield running
    except BaseException:
        running.process.print_log()
        raise
    finally:
        running.process.terminate()


def test_sdk_end_to_end_equals_online_and_bills_the_batch_price(server: BatchServer) -> None:
    client = server.client("acme")
    chat = [chat_line("capital", "What is the capital of France?"),
            chat_line("colour", "Name a colour."),
            chat_line("json", "Give a number as JSON.", max_tokens=12,
                      response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA,
                                                                              "strict": True}})]
    legacy = [completion_line("sky", "The sky is"), completion_line("grass", "Grass is")]
    chat_file, legacy_file = upload(client, chat, "chat.jsonl"), upload(client, legacy, "legacy.jsonl")
    assert (chat_file.object, chat_file.purpose, chat_file.filename) == ("file", "batch", "chat.jsonl")
    assert client.files.content(chat_file.id).content == b"".join(json.dumps(x).encode() + b"\n" for x in chat)
    created = client.batches.create(input_file_id=chat_file.id, endpoint="/v1/chat/completions",
                                    completion_window="24h", metadata={"job": "e2e"})
    assert (created.status, created.metadata, created.completion_window) == ("validating", {"job": "e2e"}, "24h")
    legacy_batch = client.batches.create(input_file_id=legacy_file.id, endpoint="/v1/completions",
                                         completion_window="24h")

    done = wait_batch(client, created.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (3, 3, 0)
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.error_file_id is None
    assert done.model == MODEL
    outputs = result_lines(client, done.output_file_id)
    assert [o["custom_id"] for o in outputs] == ["capital", "colour", "json"]
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"
    for line, out in zip(chat, outputs, strict=True):
        assert out["id"].startswith("batch_req_") and out["error"] is None
        assert out["response"]["status_code"] == 200
        body = out["response"]["body"]
        online = client.chat.completions.create(**line["body"])
        assert body["choices"][0]["message"]["content"] == online.choices[0].message.content
        assert body["usage"]["completion_tokens"] == online.usage.completion_tokens
    assert isinstance(json.loads(outputs[2]["response"]["body"]["choices"][0]["message"]["content"])["answer"], int)
    assert done.usage.input_tokens == sum(o["response"]["body"]["usage"]["prompt_tokens"] for o in outputs)
    assert done.usage.output_tokens == sum(o["response"]["body"]["usage"]["completion_tokens"] for o in outputs)

    legacy_done = wait_batch(client, legacy_batch.id)
    assert legacy_done.status == "completed", legacy_done
    for line, out in zip(legacy, result_lines(client, legacy_done.output_file_id), strict=True):
        online = client.completions.create(**line["body"])
        assert out["response"]["body"]["choices"][0]["text"] == online.choices[0].text

    rows = wait_until(lambda: len(r := ledger_rows(server, "acme", done.id)) == 3 and r,
                      what="the batch's three lines in the ledger")
    for row in rows:
        full = (row["input_tokens"] * PRICE_INPUT + row["output_tokens"] * PRICE_OUTPUT) / 1_000_000
        assert Decimal(row["cost_usd"]) == full / 2, row
    assert sorted(row["request_id"] for row in rows) == sorted(o["response"]["request_id"] for o in outputs)


def test_cancel_keeps_what_ran_and_fails_the_rest(server: BatchServer) -> None:
    client = server.client("acme")
    # Lines long enough that the batch is still running when the runner next rereads its row (each second):
    # 4-token lines on an engine core with one thread all ended before the cancel was seen.
    lines = [chat_line(f"c{i}", f"Say the number {i}.", max_tokens=32, ignore_eos=True) for i in range(7)]
    batch = client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 1, timeout_s=240,
               interval_s=0.1, what="a first finished line")
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = wait_batch(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at, done
    counts = done.request_counts
    assert counts.total == 7 and counts.completed + counts.failed == 7 and counts.failed >= 1
    errors = result_lines(client, done.error_file_id)
    assert len(errors) == counts.failed
    assert all(e["response"] is None and e["error"]["code"] == "batch_cancelled" for e in errors)
    outputs = result_lines(client, done.output_file_id)
    assert len(outputs) == counts.completed
    assert {o["custom_id"] for o in outputs} | {e["custom_id"] for e in errors} == {f"c{i}" for i in range(7)}
    wait_until(lambda: len(ledger_rows(server, "acme", batch.id)) == counts.completed,
               what="a ledger row for each line that ran, none for the cancelled ones")
    assert client.batches.cancel(batch.id).status == "cancelled"  # cancelling again changes nothing


def test_hostile_files_fail_validation_with_nothing_run(server: BatchServer) -> None:
    client = server.client("acme")
    cases = {
        "invalid_json_line": [chat_line("a", "x"), '{"custom_id": "b", "method": '],
        "duplicate_custom_id": [chat_line("same", "x"), chat_line("same", "y")],
        "invalid_url": [chat_line("a", "x"), {**chat_line("b", "y"), "url": "https://attacker.example/v1/chat/completions"}],
        "model_not_found": [chat_line("a", "x"), chat_line("b", "y", model="no-such-adapter")],
    }
    batches = {code: client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/chat/completions",
                                           completion_window="24h")
               for code, lines in cases.items()}
    for code, batch in batches.items():
        done = wait_batch(client, batch.id)
        assert done.status == "failed" and done.failed_at, done
        assert [(e.code, e.line) for e in done.errors.data] == [(code, 2)]
        assert done.errors.data[0].message
        assert done.request_counts.total == 0 and done.output_file_id is None and done.error_file_id is None
    assert all(not ledger_rows(server, "acme", batch.id) for batch in batches.values())
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batches["invalid_url"].id)


def test_requests_refused_at_the_door(server: BatchServer) -> None:
    client = server.client("acme")
    good = upload(client, [chat_line("a", "x")])
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=good.id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=good.id, endpoint="/v1/chat/completions", completion_window="1h")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError, match="empty") as empty:
        client.files.create(file=("empty.jsonl", b""), purpose="batch")
    assert empty.value.code == "empty_file"
    with pytest.raises(openai.APIStatusError) as too_large:
        client.files.create(file=("big.jsonl", b"x" * (65 * 1024)), purpose="batch")
    assert too_large.value.status_code == 413 and too_large.value.code == "file_too_large"
    client.files.delete(good.id)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(good.id)


def test_another_tenants_files_and_batches_are_404(server: BatchServer) -> None:
    acme, globex = server.client("acme"), server.client("globex")
    mine = upload(acme, [chat_line("a", "x")])
    batch = acme.batches.create(input_file_id=mine.id, endpoint="/v1/chat/completions", completion_window="24h")
    for attempt in (lambda: globex.batches.create(input_file_id=mine.id, endpoint="/v1/chat/completions",
                                                  completion_window="24h"),
                    lambda: globex.files.retrieve(mine.id), lambda: globex.files.content(mine.id),
                    lambda: globex.files.delete(mine.id), lambda: globex.batches.retrieve(batch.id),
                    lambda: globex.batches.cancel(batch.id)):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert mine.id not in {f.id for f in globex.files.list()}
    assert batch.id not in {b.id for b in globex.batches.list()}
    assert wait_batch(acme, batch.id).status == "completed"


def test_file_count_quota_and_pages(server: BatchServer) -> None:
    client = server.client("initech")
    ids = [upload(client, [chat_line(f"r{i}", "x")]).id for i in range(30)]
    with pytest.raises(openai.APIStatusError) as refused:
        upload(client, [chat_line("r30", "x")])
    assert refused.value.status_code == 413 and refused.value.code == "storage_quota_exceeded"
    page = client.files.list(limit=3)
    assert [f.id for f in page.data] == ids[::-1][:3] and page.has_more
    assert [f.id for f in client.files.list(limit=3)] == ids[::-1]  # the SDK follows `after` to the next page
    assert [f.id for f in client.files.list(order="asc", limit=2)] == ids


def test_a_spent_budget_fails_the_remaining_lines(server: BatchServer) -> None:
    with server.http("admin") as admin:
        assert admin.put("/v1/admin/tenants/globex/budgets", json={"monthly_token_limit": 45}).status_code == 200
    client = server.client("globex")
    lines = [chat_line(f"b{i}", f"Say {i}.") for i in range(4)]
    batch = client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    done = wait_batch(client, batch.id)
    assert done.status == "completed"
    assert done.request_counts.completed >= 1 and done.request_counts.failed >= 1
    assert done.request_counts.completed + done.request_counts.failed == 4
    errors = result_lines(client, done.error_file_id)
    assert errors and all(e["response"]["status_code"] == 429 for e in errors)
    assert all(e["response"]["body"]["error"]["code"] == "insufficient_quota" for e in errors)
    assert client.models.list().data  # the service itself still answers


def test_responses_lines_equal_online(server: BatchServer) -> None:
    client = server.client("acme")
    bodies = [{"model": MODEL, "input": question, "instructions": "Answer in a few words.", "max_output_tokens": 6,
               "temperature": 0, "store": False} for question in ("Name a fruit.", "Name a river.")]
    lines = [{"custom_id": f"resp-{i}", "method": "POST", "url": "/v1/responses", "body": body}
             for i, body in enumerate(bodies)]
    batch = client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/responses",
                                  completion_window="24h")
    done = wait_batch(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 2, done
    for body, out in zip(bodies, result_lines(client, done.output_file_id), strict=True):
        answer = out["response"]["body"]
        assert answer["object"] == "response" and answer["status"] in ("completed", "incomplete")
        online = client.responses.create(**body)
        texts = [part["text"] for item in answer["output"] if item["type"] == "message" for part in item["content"]]
        assert "".join(texts) == online.output_text


def test_cli_submits_lists_shows_and_downloads(server: BatchServer, tmp_path: Path) -> None:
    from loraplex.platform.cli.main import app
    from typer.testing import CliRunner

    runner = CliRunner()
    env = {"LORAPLEX_API_KEY": server.keys["acme"], "LORAPLEX_BASE_URL": server.url}
    source = tmp_path / "requests.jsonl"
    source.write_bytes(jsonl([chat_line("cli-1", "Say hi."), chat_line("cli-2", "Say bye.")]))
    created = runner.invoke(app, ["batches", "create", str(source), "--wait", "-m", "via=cli"], env=env)
    assert created.exit_code == 0, created.output
    batch_id = created.stdout.strip().splitlines()[-1]
    listed = runner.invoke(app, ["batches", "list"], env=env)
    assert listed.exit_code == 0 and batch_id in listed.stdout and "2/2 (100%)" in listed.stdout
    shown = runner.invoke(app, ["batches", "show", batch_id, "--json"], env=env)
    assert json.loads(shown.stdout)["metadata"] == {"via": "cli"}
    target = tmp_path / "out.jsonl"
    assert runner.invoke(app, ["batches", "download", batch_id, "-o", str(target)], env=env).exit_code == 0
    assert [json.loads(line)["custom_id"] for line in target.read_text().splitlines()] == ["cli-1", "cli-2"]
    no_errors = runner.invoke(app, ["batches", "download", batch_id, "--errors"], env=env)
    assert no_errors.exit_code == 1 and "no error file" in no_errors.stderr
    refused = runner.invoke(app, ["batches", "cancel", batch_id], env=env)
    assert refused.exit_code == 1 and "Cannot cancel" in refused.stderr
    # an error line quoting the tenant's own text, written as terminal markup, is printed as it is
    hostile = tmp_path / "hostile.jsonl"
    hostile.write_bytes(jsonl([chat_line("h-1", "x"), {**chat_line("h-2", "y"), "url": "[/x][link=http://e]"}]))
    failed = runner.invoke(app, ["batches", "create", str(hostile), "--wait"], env=env)
    assert failed.exit_code == 1, failed.output
    failed_id = failed.stdout.strip().splitlines()[-1]
    shown = runner.invoke(app, ["batches", "show", failed_id], env=env)
    assert shown.exit_code == 0, shown.output
    assert "invalid_url" in shown.stdout and "[/x][link=http://e]" in shown.stdout


def test_the_end_of_the_window_expires_the_lines_not_run(server: BatchServer) -> None:
    from loraplex.platform.batches.models import BatchRow
    from loraplex.platform.db.session import make_db_engine, make_session_factory
    from sqlalchemy import update

    client = server.client("acme")
    # One quick line, then long ones: the window ends while most lines are still to run, however fast the box.
    lines = [chat_line("e0", "Say the word 0.", max_tokens=1)]
    lines += [chat_line(f"e{i}", f"Count from 1 to 500, {i}.", max_tokens=100, ignore_eos=True) for i in range(1, 10)]
    batch = client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 1, timeout_s=300,
               interval_s=0.1, what="a first finished line")
    engine = make_db_engine(server.database_url)  # the 24 hours pass: the window ends now
    with make_session_factory(engine)() as db, db.begin():
        db.execute(update(BatchRow).where(BatchRow.id == batch.id).values(expires_at=int(time.time())))
    engine.dispose()
    done = wait_batch(client, batch.id)
    assert done.status == "expired" and done.expired_at, done
    counts = done.request_counts
    assert counts.completed >= 1 and counts.failed >= 1 and counts.completed + counts.failed == 10
    errors = result_lines(client, done.error_file_id)
    assert len(errors) == counts.failed
    assert all(e["response"] is None and e["error"]["code"] == "batch_expired" for e in errors)
    assert len(result_lines(client, done.output_file_id)) == counts.completed


def test_portal_lists_batches_with_progress_and_downloads(server: BatchServer, tmp_path: Path) -> None:
    chromium = Path("/usr/bin/chromium")
    if not chromium.exists():
        pytest.skip("needs Debian's chromium: apt-get install -y chromium")
    from playwright.sync_api import expect, sync_playwright

    client = server.client("acme")
    done = wait_batch(client, client.batches.create(
        input_file_id=upload(client, [chat_line("p1", "Hi."), chat_line("p2", "Bye.")]).id,
        endpoint="/v1/chat/completions", completion_window="24h").id)
    source = tmp_path / "from-the-page.jsonl"
    source.write_bytes(jsonl([chat_line("page-1", "Say yes.")]))
    problems: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(chromium), args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(accept_downloads=True)
            page.set_default_timeout(60_000)
            page.on("pageerror", lambda error: problems.append(str(error)))
            page.goto(f"{server.url}/portal/signin?next=/portal/batches")
            page.get_by_label("API key").fill(server.keys["acme"])
            page.get_by_role("button", name="Sign in").click()
            page.wait_for_url("**/portal/batches")
            row = page.locator(f'tr[data-batch="{done.id}"]')
            expect(row).to_have_attribute("data-status", "completed")
            expect(row.locator("progress")).to_have_attribute("value", "2")
            with page.expect_download() as downloading:
                row.locator('[data-action="output"]').click()
            saved = Path(downloading.value.path())
            assert [json.loads(line)["custom_id"] for line in saved.read_text().splitlines()] == ["p1", "p2"]
            page.set_input_files("#batch-file", str(source))
            page.click("#batch-submit")
            started = page.locator("tbody tr").first
            expect(started).not_to_have_attribute("data-batch", done.id)
            expect(started).to_have_attribute("data-status", "completed", timeout=300_000)
        finally:
            browser.close()
    assert problems == []


def test_a_resumed_batch_bills_and_writes_nothing_twice(server: BatchServer) -> None:
    """A worker that died after storing lines but before its meter had them (and before the batch ended):
    the next worker records their usage again (the ledger keeps one event per line) and ends the batch
    with the same files."""
    from loraplex.platform.batches.models import BatchLineRow, BatchRow
    from loraplex.platform.db.session import make_db_engine, make_session_factory
    from sqlalchemy import select, update

    client = server.client("acme")
    batch = client.batches.create(input_file_id=upload(client, [chat_line("m1", "Hi."), chat_line("m2", "Yo.")]).id,
                                  endpoint="/v1/chat/completions", completion_window="24h")
    first = wait_batch(client, batch.id)
    rows = wait_until(lambda: len(r := ledger_rows(server, "acme", batch.id)) == 2 and r, what="two ledger rows")
    engine = make_db_engine(server.database_url)
    with make_session_factory(engine)() as db, db.begin():
        db.execute(update(BatchLineRow).where(BatchLineRow.batch_id == batch.id).values(metered=False))
        db.execute(update(BatchRow).where(BatchRow.id == batch.id).values(status="in_progress", completed_at=None))
    again = wait_batch(client, batch.id)
    with make_session_factory(engine)() as db:
        assert all(db.scalars(select(BatchLineRow.metered).where(BatchLineRow.batch_id == batch.id)))
    engine.dispose()
    assert (again.status, again.output_file_id, again.request_counts) == ("completed", first.output_file_id,
                                                                            first.request_counts)
    assert result_lines(client, again.output_file_id) == result_lines(client, first.output_file_id)
    assert ledger_rows(server, "acme", batch.id) == rows
