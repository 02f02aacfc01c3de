"""`python -m kubetron` is the `kubetron` tool (so `torchrun -m kubetron train ...` works)."""

from kubetron.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
