"""The `qkv` command's entry point, outside the `qkv` package so that it runs before torch is
imported (importing `qkv` takes a second or two): Ctrl-C at any moment, the import included,
exits with code 130 and one line instead of a traceback; a reader that closes the pipe early
(`qkv explain | head -1`) ends it quietly with code 0."""

from __future__ import annotations

import os
import sys

INTERRUPTED = 130


def main() -> int:
    try:
        from qkv.cli import main as run

        code = run()
        sys.stdout.flush()  # here, where a closed pipe can still be caught
        return code
    except BrokenPipeError:  # `qkv explain | head -1`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 0
    except KeyboardInterrupt:
        chinese = "--lang=zh" in sys.argv or "--lang zh" in " ".join(sys.argv)
        print("\nqkv: 已中断" if chinese else "\nqkv: interrupted", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
