"""`python -m sandbox.native`: build the native stage now (scripts/setup.sh does, ahead of the first run)."""

import sys

from . import stage_path, unavailable

path = stage_path()
if path:
    print(path)
else:
    print(f"native stage unavailable: {unavailable()}", file=sys.stderr)
