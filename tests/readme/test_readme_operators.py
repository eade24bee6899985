"""The docs' command-line and admin examples, run as written against `make serve`: adapters from the
CLI, tenants and keys, prices and budgets, and the same over the admin API."""

from __future__ import annotations

import csv
import io
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from make_serve import MakeServe
from readme_examples import BashSession, Example, PythonRun, doc_examples, readme_example, run_python

KEY_ID = re.compile(r"created key (key_\w+)")


@dataclass
class ShellRun:
    outputs: dict[str, subprocess.CompletedProcess[str]] = field(default_factory=dict)

    def of(self, fragment: str) -> subprocess.CompletedProcess[str]:
        found = [result for command, result in self.outputs.items() if fragment in command]
        assert len(found) == 1, f"{len(found)} commands contain {fragment!r}: {list(self.outputs)}"
        return found[0]


def block(name: str) -> Example:
    return doc_examples()[name]


@pytest.fixture(scope="package")
def tenants_run(make_serve: MakeServe, placeholders: dict[str, str], shell_env: dict[str, str]) -> ShellRun:
    """The tenants-and-keys block; `key_...` becomes acme's key (created, listed, then revoked by the block)."""
    shell, run = BashSession(make_serve.workdir, shell_env, placeholders), ShellRun()
    for command, result in shell.run_all(block("tenants-keys")):
        run.outputs[command] = result
        if "keys create --tenant acme" in command:
            placeholders["key_..."] = KEY_ID.search(result.stderr).group(1)
            placeholders["acme key"] = result.stdout.strip()
        if "keys create --tenant ops" in command:
            placeholders["lpx_<admin key>"] = result.stdout.strip()
    return run


@readme_example("adapters-cli")
def test_adapters_and_usage_from_the_command_line(
    example: Example, make_serve: MakeServe, placeholders: dict[str, str], shell_env: dict[str, str],
    adapters_run: PythonRun, sessions_run: PythonRun,
) -> None:
    # the python example uploaded `pirate` for the same tenant; the CLI shows the other way to do it
    headers = {"Authorization": f"Bearer {make_serve.key}"}
    httpx.delete(f"{make_serve.url}/v1/adapters/{placeholders['adp_...']}", headers=headers).raise_for_status()
    shell = BashSession(make_serve.workdir, {**shell_env, "LORAPLEX_BASE_URL": make_serve.url}, placeholders)
    run = ShellRun(dict(shell.run_all(example)))

    uploaded = re.search(r"ready pirate \((adp_\w+)\): rank 8", run.of("adapters upload").stdout)
    assert uploaded, run.of("adapters upload").stdout
    placeholders["adp_..."] = uploaded.group(1)   # the later examples price this adapter
    listed = run.of("adapters list").stdout.splitlines()
    assert listed[0].split("\t")[:3] == ["id", "name", "status"]
    assert [row.split("\t")[1:3] for row in listed[1:]] == [["pirate", "ready"]]
    pirate = httpx.post(f"{make_serve.url}/v1/chat/completions", headers=headers, timeout=120, json={
        "model": "pirate", "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 12, "temperature": 0}).json()
    assert pirate["choices"][0]["message"]["content"].startswith("Arr"), pirate

    report = list(csv.DictReader(io.StringIO(run.of("usage report").stdout)))
    assert report and int(report[-1]["requests"]) > 0 and int(report[-1]["input_tokens"]) > 0
    requests = run.of("usage requests").stdout.splitlines()
    assert "request_id" in requests[0] and requests[-1].startswith("total (2 requests)"), requests  # two turns
    assert placeholders["sess_..."] in requests[1]


@readme_example("tenants-keys")
def test_tenants_and_keys(example: Example, make_serve: MakeServe, tenants_run: ShellRun,
                          placeholders: dict[str, str]) -> None:
    assert "created tenant acme" in tenants_run.of("tenants create acme").stdout
    acme_key = placeholders["acme key"]
    assert acme_key.startswith("lpx_") and "inference" in tenants_run.of("keys create --tenant acme").stderr
    listed = tenants_run.of("keys list").stdout
    assert placeholders["key_..."] in listed and acme_key not in listed   # the key itself is never shown again
    assert f"revoked {placeholders['key_...']}" in tenants_run.of("keys revoke").stdout
    refused = httpx.get(f"{make_serve.url}/v1/models", headers={"Authorization": f"Bearer {acme_key}"})
    assert refused.status_code == 401 and refused.json()["error"]["message"]
    admin = httpx.get(f"{make_serve.url}/v1/admin/tenants",
                      headers={"Authorization": f"Bearer {placeholders['lpx_<admin key>']}"})
    assert admin.status_code == 200 and {"acme", "ops", "demo"} <= {t["name"] for t in admin.json()["data"]}
    assert tenants_run.of("db upgrade").returncode == 0
    helped = tenants_run.of("--help").stdout
    for command in ("serve", "db", "tenants", "keys", "adapters", "usage", "prices", "budgets"):
        assert re.search(rf"\b{command}\b", helped), command


@readme_example("prices-budgets-cli")
def test_prices_and_budgets_from_the_command_line(
    example: Example, make_serve: MakeServe, tenants_run: ShellRun, adapters_run: PythonRun,
    placeholders: dict[str, str], shell_env: dict[str, str],
) -> None:
    shell = BashSession(make_serve.workdir, shell_env, placeholders)
    run = ShellRun(dict(shell.run_all(example)))
    prices = run.of("prices list").stdout.splitlines()
    header = prices[0].split("\t")
    rows = [dict(zip(header, line.split("\t"), strict=True)) for line in prices[1:]]
    in_force = [r for r in rows if r["in force"] == "yes"]
    assert len(in_force) == 1 and in_force[0]["model"] == "SmolLM2-135M-Instruct"
    assert in_force[0]["input"] == "0.15" and in_force[0]["cached input"] == "0.075"
    assert "budget cleared for acme key " + placeholders["key_..."] in run.of("budgets clear").stdout
    budgets = run.of("budgets list").stdout
    assert "50000000" in budgets and placeholders["key_..."] in budgets   # listed before the clear
    assert "tenant" in shell.run(".venv/bin/loraplex budgets list --tenant acme").stdout


@readme_example("admin-api-python")
def test_prices_and_budgets_over_the_admin_api(
    example: Example, make_serve: MakeServe, tenants_run: ShellRun, placeholders: dict[str, str],
    shell_env: dict[str, str],
) -> None:
    shell = BashSession(make_serve.workdir, shell_env, placeholders)
    shell.run(".venv/bin/loraplex budgets set --tenant acme --key key_... --tokens 1000")  # so the DELETE has one
    run = run_python(example, placeholders, cwd=make_serve.workdir)

    created = run.value_of("admin/prices\", headers=admin, json=")
    assert created.status_code == 201, created.text
    assert created.json()["input"] == "0.15" and created.json()["cached_input"] == "0.15"
    listed = run.value_of("params={\"model\"")
    assert listed.status_code == 200 and any(p["in_force"] for p in listed.json()["data"])
    put = run.value_of("httpx.put(")
    assert put.status_code == 200, put.text
    budgets = run.value_of("admin/tenants/acme/budgets\", headers=admin)").json()["data"]
    tenant_budget = next(b for b in budgets if b["scope"] == "tenant")
    assert tenant_budget["monthly_token_limit"] == 50_000_000 and tenant_budget["monthly_cost_limit_usd"] == "250"
    deleted = run.value_of("httpx.delete(")
    assert deleted.status_code in (200, 204), deleted.text
    after = httpx.get(f"{make_serve.url}/v1/admin/tenants/acme/budgets",
                      headers={"Authorization": f"Bearer {placeholders['lpx_<admin key>']}"}).json()["data"]
    assert [b["scope"] for b in after] == ["tenant"]
    own = run.value_of("/usage/budgets").json()["data"]      # the demo tenant has no budget
    assert own == []


def test_placeholders_are_only_the_documented_ones() -> None:
    """Every `xxx_...` placeholder in the runnable blocks is one the tests substitute."""
    known = {"lpx_...", "key_...", "adp_...", "sess_...", "lpx_<admin key>"}
    for example in doc_examples().values():
        if example.lang in ("bash", "python"):
            found = set(re.findall(r"\b[a-z]+_\.\.\.|lpx_<[^>]+>", example.text))
            assert found <= known, f"{example.name}: unknown placeholders {found - known}"


def test_pirate_folder_is_what_peft_saved(make_serve: MakeServe) -> None:
    names = {p.name for p in Path(make_serve.workdir, "pirate").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names
