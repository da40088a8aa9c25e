"""`python -m edgetune.engine.cli`: the `edgetune` command (torchrun starts ranks this way)."""

import sys

from edgetune.engine.cli import main

sys.exit(main())
