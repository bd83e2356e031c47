import sys

from steerkit.cli import main

sys.exit(main())
