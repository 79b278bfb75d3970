"""``python -m dlperf.cli VERB ...``: the same as the ``dlperf`` command."""

import sys

from . import main

sys.exit(main())
