"""Archives small on the wire but huge in metadata are refused fast, with bounded memory, writing nothing.

Each refusal is measured in a fresh process (tracemalloc peak): before these checks, a 200 KB tar.gz
with one long-name header cost over 200 MB, and a zip of 100,000 empty entries some 100 MB.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import archive_bombs
import pytest

HERE = Path(__file__).resolve().parent
MAX_PEAK_BYTES = 24 * 1024 * 1024
MAX_SECONDS = 5.0

BOMBS = {
    "tar_long_name": (lambda p: archive_bombs.tar_extension_bomb(p, tarfile.GNUTYPE_LONGNAME), "extended header"),
    "tar_pax_header": (lambda p: archive_bombs.tar_extension_bomb(p, tarfile.XHDTYPE), "extended header"),
    "tar_header_chain": (archive_bombs.tar_header_chain, "more than 64 members"),
    "tar_skipped_member": (archive_bombs.tar_skipped_bomb, "decompression bomb"),
    "zip_many_entries": (archive_bombs.zip_many_entries, "more than 64 members"),
    "zip_lying_directory": (archive_bombs.zip_lying_directory, "central directory"),
    "zip_nested": (archive_bombs.zip_nested, "nested archives are refused"),
    "tar_nested": (archive_bombs.tar_nested, "nested archives are refused"),
    "corrupt_gzip": (archive_bombs.corrupt_gzip, "corrupt"),
    "corrupt_zip": (archive_bombs.corrupt_zip, "corrupt"),
}


@pytest.fixture(scope="module")
def bombs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bombs")


@pytest.mark.parametrize("case", sorted(BOMBS))
def test_bomb_refused_fast_with_bounded_memory_and_nothing_written(case, bombs_dir):
    build, message = BOMBS[case]
    suffix = ".zip" if "zip" in case else ".tar.gz"
    archive = build(bombs_dir / f"{case}{suffix}")
    assert archive.stat().st_size < 16 * 1024 * 1024  # small on the wire
    dest = bombs_dir / f"{case}-out"
    dest.mkdir()
    result = subprocess.run([sys.executable, str(HERE / "archive_bombs.py"), str(archive), str(dest)],
                            capture_output=True, text=True, timeout=120, check=True)
    report = json.loads(result.stdout)
    assert report["error"] is not None and report["error"].startswith(("UnsafeUploadError", "UploadTooLargeError",
                                                                       "UnsupportedMediaError")), report
    assert message in report["error"], report
    assert report["peak_bytes"] < MAX_PEAK_BYTES, report
    assert report["seconds"] < MAX_SECONDS, report
    assert list(dest.iterdir()) == []
