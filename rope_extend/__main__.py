"""``python -m rope_extend ...`` (and ``accelerate launch -m rope_extend train ...``)."""

import sys

from .cli import main

sys.exit(main())
