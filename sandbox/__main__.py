import sys

try:
    from .cli import entry
except KeyboardInterrupt:  # Ctrl-C while starting up: no sandbox exists yet, and no traceback
    sys.stderr.write("sandboxrun: interrupted\n")
    sys.exit(130)

entry()
