"""`python -m kvserve.bench ...`, the same as `kvserve bench ...`."""

import sys

from kvserve.bench.cli import main

sys.exit(main())
