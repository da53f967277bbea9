"""Print known lines; argv[1] == "binary": then raw bytes with no final newline."""

import os
import sys

rank = os.environ["RANK"]
print(f"out {rank}")
print(f"err {rank}", file=sys.stderr)
if len(sys.argv) > 1 and sys.argv[1] == "binary":
    sys.stdout.flush()
    sys.stdout.buffer.write(b"\xff\xfe\x00bin\r\n" + b"x" * 10 + b" no newline")
    sys.stdout.buffer.flush()
