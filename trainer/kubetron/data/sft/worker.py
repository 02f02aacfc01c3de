"""A tokenizing worker of kubetron.data.sft.encode: ``python -m kubetron.data.sft.worker`` (started by encode_all).

Its answers go out on a copy of the stdout it was given; stdout itself then points at stderr, so nothing a library
prints can get into them."""

import os
import sys

from kubetron.data.sft.encode import serve

if __name__ == "__main__":
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    serve(sys.stdin.buffer, answers)
