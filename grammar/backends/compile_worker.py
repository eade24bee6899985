"""A compile worker's main loop (see compile_pool): read the setup, then answer one job per message."""

from __future__ import annotations

import sys

from loraplex.grammar.backends.compile_pool import read_message, write_message


def main() -> None:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints must not corrupt the message stream
    setup, setup_args = read_message(stdin)
    job = setup(*setup_args)
    write_message(stdout, ("ready", None))
    while True:
        try:
            request = read_message(stdin)
        except EOFError:
            return
        try:
            write_message(stdout, ("ok", job(request)))
        except Exception as exc:  # the job's error goes back to the caller as text
            write_message(stdout, ("error", str(exc)))


if __name__ == "__main__":
    main()
