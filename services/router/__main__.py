"""`python -m services.router -c FILE [--replica N]`: same as `tandem router`."""

import sys

from services.cli import main

sys.exit(main(["router", *sys.argv[1:]]))
