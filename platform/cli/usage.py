"""`loraplex usage report` / `usage requests`: a tenant's usage, or its per-request log, as a table or CSV."""

from __future__ import annotations

import sys

import typer
from loraplex.billing.reports import TOKEN_COLUMNS, ReportQuery, report_csv, report_totals, usage_report
from loraplex.billing.request_log import RequestLogQuery, list_requests, requests_csv
from loraplex.platform.cli.common import (
    bad_input_exits,
    db_session,
    err_console,
    load_settings,
    print_table,
    tenant_or_exit,
)

app = typer.Typer(help="Usage reports from the billing ledger.", no_args_is_help=True)


@app.command()
def report(
    tenant: str = typer.Option(..., "--tenant", help="Tenant id or name."),
    start: str = typer.Option(None, "--from", help="First day, YYYY-MM-DD (default: first of this month)."),
    end: str = typer.Option(None, "--to", help="Last day, inclusive (default: today, UTC)."),
    group_by: str = typer.Option("day", "--group-by", help="day, model, adapter, api_key, user (comma-separated)."),
    csv: bool = typer.Option(False, "--csv", help="Write CSV to stdout instead of a table."),
) -> None:
    """Tokens by class, requests and cost for one tenant over a date range."""
    with db_session(load_settings()) as db:
        found = tenant_or_exit(db, tenant)
        with bad_input_exits():
            query = ReportQuery.parse(start=start, end=end, group_by=group_by, tenant_id=found.id)
        rows = usage_report(db, query)
    if csv:
        sys.stdout.write(report_csv(query, rows))
        return
    metrics = [*TOKEN_COLUMNS, "requests", "cost_usd"]
    lines = [[_cell(row[k]) for k in (*query.group_by, *metrics)] for row in rows]
    totals = report_totals(rows)
    lines.append(["total", *[""] * (len(query.group_by) - 1), *[_cell(totals[k]) for k in metrics]])
    print_table([*query.group_by, *metrics], lines)


@app.command()
def requests(
    tenant: str = typer.Option(..., "--tenant", help="Tenant id or name."),
    start: str = typer.Option(None, "--from", help="First day, YYYY-MM-DD (default: first of this month)."),
    end: str = typer.Option(None, "--to", help="Last day, inclusive (default: today, UTC)."),
    session_id: str = typer.Option(None, "--session", help="Only this session's requests."),
    api_key_id: str = typer.Option(None, "--key", help="Only this API key's requests."),
    user: str = typer.Option(None, "--user", help="Only requests that sent this `user` (end-user id)."),
    limit: int = typer.Option(100, "--limit", help="Rows to show, 1-1000."),
    cursor: str = typer.Option(None, "--cursor", help="Continue after a previous page (its printed cursor)."),
    csv: bool = typer.Option(False, "--csv", help="Write CSV to stdout instead of a table."),
) -> None:
    """What each request was charged, newest first, with totals over every matching request."""
    with db_session(load_settings()) as db:
        found = tenant_or_exit(db, tenant)
        with bad_input_exits():
            query = RequestLogQuery.parse(tenant_id=found.id, start=start, end=end, session_id=session_id,
                                          api_key_id=api_key_id, user=user, limit=limit, cursor=cursor)
        page = list_requests(db, query)
    if page.next_cursor:
        err_console.print(f"more: --cursor {page.next_cursor}")
    if csv:
        sys.stdout.write(requests_csv(page.rows))
        return
    columns = ["created_at", "request_id", "api_key_id", "model", "adapter_id", "session_id", "status",
               *TOKEN_COLUMNS, "cost_usd"]
    lines = [[_cell(row[k]) for k in columns] for row in page.rows]
    totals = page.totals
    lines.append([f"total ({totals['requests']} requests)", *[""] * 6, *[_cell(totals[k]) for k in columns[7:]]])
    print_table(columns, lines)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6f}"
    return str(value)
