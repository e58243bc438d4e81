"""`python -m sarathi_jax.bench.peer`: see compare.py."""

import sys

from sarathi_jax.bench.peer.compare import main

sys.exit(main())
