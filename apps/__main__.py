"""``python -m steerkit.apps``: the same as ``steerkit app``."""
import sys

from steerkit.cli.app import main

if __name__ == "__main__":
    sys.exit(main())
