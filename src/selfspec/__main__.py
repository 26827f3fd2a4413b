"""``python -m selfspec``: the same as the ``selfspec`` command."""

import sys

from .cli import main

sys.exit(main())
