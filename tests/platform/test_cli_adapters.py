"""`loraplex adapters upload/list/delete` as a subprocess against a real uvicorn server."""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

import httpx
import pytest
from random_adapters import write_random_adapter

REPO = Path(__file__).resolve().parents[2]
LORAPLEX = REPO / ".venv" / "bin" / "loraplex"

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def spec(smollm_path):  # type: ignore[no-untyped-def]
    from loraplex.adapters.base_model import BaseModelSpec

    return BaseModelSpec.from_model_dir(smollm_path)


def cli(server, *args: str, key: str | None = "adapters", env_key: bool = False, code: int = 0):  # type: ignore[no-untyped-def]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    argv = [str(LORAPLEX), "adapters", *args, "--base-url", server.base_url]
    if key is not None and env_key:
        env["LORAPLEX_API_KEY"] = server.keys[key]
    elif key is not None:
        argv += ["--api-key", server.keys[key]]
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    return result


def test_upload_list_delete_through_the_cli(api_server, spec, tmp_path):  # type: ignore[no-untyped-def]
    folder = write_random_adapter(tmp_path / "cli-folder", spec, r=4, targets=("q_proj", "v_proj"), seed=3)
    uploaded = cli(api_server, "upload", str(folder), "--name", "cli-folder", "--description", "from the CLI")
    out = uploaded.stdout
    assert "ready" in out and "cli-folder" in out, out
    assert "rank 4" in out and "targets q_proj,v_proj" in out
    weights_sha = out.split("sha256 ")[1].split()[0]
    assert len(weights_sha) == 64
    assert "uploading" in uploaded.stderr and "uploaded cli-folder" in uploaded.stderr  # the progress bar's line

    # The server agrees: the adapter is ready with what the CLI printed.
    headers = {"Authorization": f"Bearer {api_server.keys['adapters']}"}
    listing = httpx.get(f"{api_server.base_url}/v1/adapters", headers=headers).json()["data"]
    record = next(a for a in listing if a["name"] == "cli-folder")
    assert (record["status"], record["sha256"], record["description"]) == ("ready", weights_sha, "from the CLI")

    # An archive, key from the environment this time.
    archive = tmp_path / "adapter.tar.gz"
    other = write_random_adapter(tmp_path / "cli-archive", spec, r=2, targets=("o_proj",), seed=4)
    with tarfile.open(archive, "w:gz") as tf:
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            tf.add(other / name, arcname=f"adapter/{name}")
    assert "rank 2" in cli(api_server, "upload", str(archive), "--name", "cli-archive", env_key=True).stdout

    listed = cli(api_server, "list").stdout
    rows = {line.split("\t")[1]: line.split("\t") for line in listed.splitlines()[1:]}
    assert rows["cli-folder"][0] == record["id"] and rows["cli-folder"][2] == "ready"
    assert rows["cli-archive"][2] == "ready"

    assert f"deleted {record['id']}" in cli(api_server, "delete", record["id"]).stdout
    assert "cli-folder" not in cli(api_server, "list").stdout
    gone = cli(api_server, "delete", record["id"], code=1)
    assert "error 404" in gone.stderr and "not found" in gone.stderr
    cli(api_server, "delete", rows["cli-archive"][0])


def test_failed_validation_prints_reason_and_exits_1(api_server, spec, tmp_path):  # type: ignore[no-untyped-def]
    folder = write_random_adapter(tmp_path / "too-big", spec, r=128, targets=("q_proj",))
    result = cli(api_server, "upload", str(folder), "--name", "cli-too-big", code=1)
    assert "failed" in result.stdout and "r = 128 exceeds the maximum rank 64" in result.stdout


def test_refusals_exit_nonzero_with_the_message(api_server, spec, tmp_path):  # type: ignore[no-untyped-def]
    folder = write_random_adapter(tmp_path / "ok", spec, r=2, targets=("q_proj",))
    no_scope = cli(api_server, "upload", str(folder), "--name", "cli-no-scope", key="inference", code=1)
    assert "error 403" in no_scope.stderr
    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    (incomplete / "adapter_config.json").write_bytes((folder / "adapter_config.json").read_bytes())
    assert "lacks adapter_model.safetensors" in cli(api_server, "upload", str(incomplete), "--name", "x",
                                                    code=2).stderr
    assert "LORAPLEX_API_KEY" in cli(api_server, "list", key=None, code=2).stderr
