"""`loraplex serve` failing to start: a clear message, exit status 1, and no process left behind.

The supervisor binds the port first (a port in use fails before any model loads), then starts the engine core
and the API servers together; if the core cannot start, the API servers already started must go with it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
from server_process import REPO_ROOT, SERVE_COMMAND, server_env


def _serve(env: dict[str, str], port: int, timeout_s: float, interrupt_on: str | None = None) -> tuple[int, str, float]:
    """Run `serve` to its exit; (exit status, output, seconds). With `interrupt_on`, Ctrl-C (SIGINT to the whole
    process group, as a terminal sends it) as soon as that text is printed."""
    started = time.monotonic()
    process = subprocess.Popen([*SERVE_COMMAND, "--port", str(port)], cwd=REPO_ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        head = b""
        if interrupt_on is not None:
            assert process.stdout is not None
            while interrupt_on.encode() not in head:
                line = process.stdout.readline()
                assert line, head.decode(errors="replace")
                head += line
            os.killpg(process.pid, signal.SIGINT)
        output, _ = process.communicate(timeout=timeout_s)
        output = head + output
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    # A zombie has exited already (only its entry waits for a parent that is not ours to reap it). A child the
    # supervisor stopped may still be exiting when the supervisor's own exit returns (its memory already gone,
    # so an empty command line): it is left behind only if it is still there a few seconds later.
    deadline = time.monotonic() + 10
    while True:
        group = [p for p in psutil.process_iter(["pid", "status", "cmdline"])
                 if _pgid(p.pid) == process.pid and p.info["status"] != psutil.STATUS_ZOMBIE]
        if not group or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not group, f"processes left behind: {[(p.pid, p.info['status'], p.info['cmdline']) for p in group]}"
    return process.returncode, output.decode(errors="replace"), time.monotonic() - started


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def test_port_in_use_fails_at_once_without_loading_the_model(tmp_path: Path, smollm_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = server_env(database_url=f"sqlite:///{tmp_path / 'db.sqlite'}", data_dir=tmp_path,
                         model_path=smollm_path)
        code, output, _ = _serve(env, port, timeout_s=120)
    assert code == 1, output
    assert f"cannot listen on 127.0.0.1:{port}" in output and "in use" in output, output
    assert "engine core starting" not in output, output


def test_engine_core_that_cannot_load_the_model_stops_the_api_servers_too(tmp_path: Path, smollm_path: Path) -> None:
    broken = tmp_path / "broken-model"
    broken.mkdir()
    for source in smollm_path.iterdir():
        if source.name != "model.safetensors":
            (broken / source.name).write_bytes(source.read_bytes())
    (broken / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")  # a corrupt download
    env = server_env(database_url=f"sqlite:///{tmp_path / 'db.sqlite'}", data_dir=tmp_path, model_path=broken,
                     api_servers=2)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code, output, _ = _serve(env, port, timeout_s=300)
    assert code == 1, output
    assert "the engine core exited while starting" in output, output


def test_ctrl_c_while_starting_stops_everything_quietly(tmp_path: Path, smollm_path: Path) -> None:
    env = server_env(database_url=f"sqlite:///{tmp_path / 'db.sqlite'}", data_dir=tmp_path, model_path=smollm_path,
                     api_servers=2)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code, output, elapsed = _serve(env, port, timeout_s=120, interrupt_on="engine core starting")
    assert code == 0, output
    assert "stopped before the engine core was ready" in output, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    assert elapsed < 30, output


CHILD_MASK_SCRIPT = '''
import multiprocessing
import signal


def report(conn):
    conn.send(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))


if __name__ == "__main__":
    from loraplex.platform.supervisor import ctrl_c_held

    context = multiprocessing.get_context("spawn")
    seen = []
    with ctrl_c_held():
        for _ in range(2):  # the first starts multiprocessing's resource tracker, which unblocks SIGINT after it
            parent, child = context.Pipe()
            process = context.Process(target=report, args=(child,))
            process.start()
            seen.append(parent)
    print([conn.recv() for conn in seen], signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))
'''


def test_children_start_with_ctrl_c_blocked_and_the_supervisor_gets_it_back(tmp_path: Path) -> None:
    """Deterministic half of the test above: every child started under `ctrl_c_held` starts with SIGINT blocked,
    the first (which starts multiprocessing's resource tracker) too, and the block ends with the block."""
    script = tmp_path / "child_mask.py"
    script.write_text(CHILD_MASK_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[True,", "True]", "False"], done.stdout + done.stderr
