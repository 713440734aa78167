"""The `qkv` command's entry point, outside the `qkv` package so that it runs before torch is
imported (importing `qkv` takes a second or two): Ctrl-C at any moment, the import included,
exits with code 130 and one line instead of a traceback."""

from __future__ import annotations

import sys

INTERRUPTED = 130


def main() -> int:
    try:
        from qkv.cli import main as run

        return run()
    except KeyboardInterrupt:
        chinese = "--lang=zh" in sys.argv or "--lang zh" in " ".join(sys.argv)
        print("\nqkv: 已中断" if chinese else "\nqkv: interrupted", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
