"""`python -m benchmarks.peer`: see compare.py."""

import sys

from benchmarks.peer.compare import main

sys.exit(main())
