"""Every hostile upload is refused at the edge with a clear 4xx, and leaves no blob, row or staging file."""

from __future__ import annotations

import gzip
import io
import json
import struct
import tarfile
import zipfile

import httpx
import pytest
from api_helpers import folder_files, upload
from loraplex.adapters.archive import UploadLimits
from loraplex.adapters.service import StorageQuota
from random_adapters import write_random_adapter

LIMITS = UploadLimits(max_upload_bytes=6 * 1024 * 1024, max_expanded_bytes=8 * 1024 * 1024, max_archive_members=8)


@pytest.fixture(scope="module")
def server(start_server):  # type: ignore[no-untyped-def]
    with start_server() as running:
        running.services.extensions.domain_state["adapters"].service.limits = LIMITS
        yield running


@pytest.fixture(scope="module")
def good(tmp_path_factory, smollm_spec) -> dict[str, bytes]:  # type: ignore[no-untyped-def]
    folder = write_random_adapter(tmp_path_factory.mktemp("good"), smollm_spec, r=2, targets=("q_proj",))
    return dict(folder_files(folder))


def _zip(members: list[tuple[str, bytes]], symlink: str | None = None) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in members:
            zf.writestr(name, data)
        if symlink:
            info = zipfile.ZipInfo(symlink)
            info.external_attr = (0o120777 << 16)
            zf.writestr(info, "/etc/passwd")
    return buf.getvalue()


def _tar(members: list[tuple[str, bytes]], link: tuple[str, str, bytes] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        if link:
            info = tarfile.TarInfo(link[0])
            info.type, info.linkname = link[2], link[1]
            tf.addfile(info)
    return buf.getvalue()


def _lying_safetensors(kind: str) -> bytes:
    if kind == "past_end":
        header = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
                  {"dtype": "F32", "shape": [2, 576], "data_offsets": [0, 4608]}}
        raw = json.dumps(header).encode()
        return struct.pack("<Q", len(raw)) + raw + b"\0" * 100
    if kind == "overlap":
        header = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                  "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}
        raw = json.dumps(header).encode()
        return struct.pack("<Q", len(raw)) + raw + b"\0" * 24
    return struct.pack("<Q", 10**12) + b"{}"


CASES = {
    "pickled_bin": (lambda g: [("adapter_config.json", g["adapter_config.json"]), ("adapter_model.bin", b"\x80\x04K\x01.")],
                    400, "pickled weights are refused"),
    "zip_traversal": (lambda g: [("a.zip", _zip([("../adapter_config.json", g["adapter_config.json"]),
                                                 ("adapter_model.safetensors", g["adapter_model.safetensors"])]))],
                      400, "path traversal"),
    "zip_absolute": (lambda g: [("a.zip", _zip([("/abs/adapter_config.json", g["adapter_config.json"])]))],
                     400, "absolute path"),
    "zip_symlink": (lambda g: [("a.zip", _zip([("adapter_config.json", g["adapter_config.json"])],
                                              symlink="adapter_model.safetensors"))],
                    400, "symbolic link"),
    "tar_symlink": (lambda g: [("a.tar.gz", _tar([("adapter_config.json", g["adapter_config.json"])],
                                                 link=("adapter_model.safetensors", "/etc/passwd", tarfile.SYMTYPE)))],
                    400, "is a link"),
    "tar_hardlink": (lambda g: [("a.tar.gz", _tar([("adapter_config.json", g["adapter_config.json"])],
                                                  link=("adapter_model.safetensors", "/etc/passwd", tarfile.LNKTYPE)))],
                     400, "is a link"),
    "tar_pickle": (lambda g: [("a.tar.gz", _tar([("adapter_config.json", g["adapter_config.json"]),
                                                ("x/pytorch_model.bin", b"\x80\x04.")]))],
                   400, "pickled weights are refused"),
    "zip_bomb": (lambda g: [("a.zip", _zip([("adapter_config.json", g["adapter_config.json"]),
                                           ("adapter_model.safetensors", b"\0" * (20 * 1024 * 1024))]))],
                 413, "decompression bomb"),
    "too_many_members": (lambda g: [("a.zip", _zip([(f"junk{i}.txt", b"x") for i in range(12)]))],
                         400, "more than 8 members"),
    "oversized_file": (lambda g: [("adapter_config.json", g["adapter_config.json"]),
                                  ("adapter_model.safetensors", b"\0" * (7 * 1024 * 1024))],
                       413, "larger than"),
    "malformed_json": (lambda g: [("adapter_config.json", b'{"r": 8, '),
                                  ("adapter_model.safetensors", g["adapter_model.safetensors"])],
                       400, "not valid JSON"),
    "header_past_end": (lambda g: [("adapter_config.json", g["adapter_config.json"]),
                                   ("adapter_model.safetensors", _lying_safetensors("past_end"))],
                        400, "but the data buffer has"),
    "header_overlap": (lambda g: [("adapter_config.json", g["adapter_config.json"]),
                                  ("adapter_model.safetensors", _lying_safetensors("overlap"))],
                       400, "overlap in the data buffer"),
    "header_length_lie": (lambda g: [("adapter_config.json", g["adapter_config.json"]),
                                     ("adapter_model.safetensors", _lying_safetensors("huge"))],
                          400, "-byte header but the file has"),
    "unexpected_file": (lambda g: [("weights.txt", b"hello")], 415, "unexpected file"),
    "dora": (lambda g: [("adapter_config.json", json.dumps({**json.loads(g["adapter_config.json"]), "use_dora": True}).encode()),
                        ("adapter_model.safetensors", g["adapter_model.safetensors"])],
             422, "DoRA"),
    "missing_weights": (lambda g: [("adapter_config.json", g["adapter_config.json"])], 400, "lacks adapter_model"),
    "zip_nested": (lambda g: [("a.zip", _zip([("adapter_config.json", g["adapter_config.json"]),
                                             ("weights/inner.zip", _zip([("x", b"x")]))]))],
                   400, "nested archives are refused"),
    "tar_long_name_bomb": (lambda g: [("a.tar.gz", _long_name_bomb())], 400, "extended header"),
    "catastrophic_regex": (lambda g: [("adapter_config.json", _config(g, target_modules="(a+)+$")),
                                      ("adapter_model.safetensors", g["adapter_model.safetensors"])],
                           422, "nests repeats"),
    "huge_integer": (lambda g: [("adapter_config.json", b'{"r": ' + b"9" * 5000 + b"}"),
                                ("adapter_model.safetensors", g["adapter_model.safetensors"])],
                     400, "not valid JSON"),
    "non_string_base_model": (lambda g: [("adapter_config.json", _config(g, base_model_name_or_path={"a": 1})),
                                         ("adapter_model.safetensors", g["adapter_model.safetensors"])],
                              422, "base_model_name_or_path"),
}


def _config(good: dict[str, bytes], **changes: object) -> bytes:
    return json.dumps({**json.loads(good["adapter_config.json"]), **changes}).encode()


def _long_name_bomb() -> bytes:
    """A GNU long-name header declaring 4 MB of name (the standard library would read it whole)."""
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb") as gz:
        info = tarfile.TarInfo("././@LongLink")
        info.size, info.type = 4 * 1024 * 1024, tarfile.GNUTYPE_LONGNAME
        gz.write(info.tobuf(format=tarfile.GNU_FORMAT) + b"a" * info.size + b"\0" * 1024)
    return buf.getvalue()


def _leftovers(server) -> tuple[int, int, list[str]]:  # type: ignore[no-untyped-def]
    service = server.services.extensions.domain_state["adapters"].service
    rows = service.registry.list(tenant_id=server.tenants["acme"])
    staged = [p.name for p in service.staging_root.iterdir()] if service.staging_root.exists() else []
    return service.store.count(), len(rows), staged


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_upload_refused_and_nothing_left(server, good, case):  # type: ignore[no-untyped-def]
    build, status, message = CASES[case]
    before = _leftovers(server)
    response = upload(server, build(good), f"hostile-{case.replace('_', '-')}")
    assert response.status_code == status, response.text
    assert message in response.json()["error"]["message"]
    assert _leftovers(server) == before == (before[0], before[1], [])


def test_storage_quota_refuses_with_413_naming_it_and_leaves_nothing(server, good):  # type: ignore[no-untyped-def]
    service = server.services.extensions.domain_state["adapters"].service
    before = _leftovers(server)
    saved, service.quota = service.quota, StorageQuota(max_bytes=len(good["adapter_model.safetensors"]) - 1)
    try:
        response = upload(server, list(good.items()), "over-quota")
    finally:
        service.quota = saved
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["code"] == "storage_quota_exceeded" and "storage quota is" in error["message"]
    assert _leftovers(server) == before


def test_wrong_content_type_refused(server):  # type: ignore[no-untyped-def]
    response = httpx.post(f"{server.base_url}/v1/adapters", json={"name": "x"},
                          headers={"Authorization": f"Bearer {server.keys['adapters']}"})
    assert response.status_code == 415
    assert "multipart/form-data" in response.json()["error"]["message"]


def test_archive_upload_accepted(server, good):  # type: ignore[no-untyped-def]
    tgz = _tar([("adapter/adapter_config.json", good["adapter_config.json"]),
                ("adapter/adapter_model.safetensors", good["adapter_model.safetensors"]),
                ("adapter/README.md", b"# notes")])
    response = upload(server, [("adapter.tar.gz", tgz)], "from-archive")
    assert response.status_code == 202, response.text
    zipped = _zip([("adapter_config.json", good["adapter_config.json"]),
                   ("adapter_model.safetensors", good["adapter_model.safetensors"])])
    assert upload(server, [("adapter.zip", zipped)], "from-zip").status_code == 202


def test_a_body_of_many_form_fields_is_refused_before_it_piles_up(server, good):  # type: ignore[no-untyped-def]
    """Each field is small, but without a count thousands of them would sit in memory until the upload ended."""
    before = _leftovers(server)
    fields = {f"note{i}": "x" * 4000 for i in range(2000)}
    response = httpx.post(f"{server.base_url}/v1/adapters", data={"name": "many-fields", **fields},
                          files=[("file", (n, data, "application/octet-stream")) for n, data in good.items()],
                          headers={"Authorization": f"Bearer {server.keys['adapters']}"}, timeout=120)
    assert response.status_code == 400, response.text
    assert "more than 16 form fields" in response.json()["error"]["message"]
    assert _leftovers(server) == before
