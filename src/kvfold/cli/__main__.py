"""``python -m kvfold.cli``: the ``kvfold`` command (Ctrl-C while it starts is one line too)."""

import sys

try:
    from kvfold.cli.main import main

    status = main()
except KeyboardInterrupt:
    print("kvfold: interrupted", file=sys.stderr)
    status = 130
sys.exit(status)
