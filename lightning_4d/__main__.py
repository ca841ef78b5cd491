"""``python -m lightning_4d`` runs the same program as the ``lightning-4d`` console script."""

import sys

from lightning_4d.cli import main

sys.exit(main())
