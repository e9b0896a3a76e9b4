"""``python -m ringmaster.launch ...`` is ``ringrun ...``."""

import sys

from .cli import main

sys.exit(main())
