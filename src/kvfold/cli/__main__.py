"""``python -m kvfold.cli``: the ``kvfold`` command."""

import sys

from kvfold.cli.main import main

sys.exit(main())
