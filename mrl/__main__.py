"""``python -m mrl ...`` is the same as the ``mrl`` console script."""
import sys

from mrl.cli import main

sys.exit(main())
