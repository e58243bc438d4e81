"""`python -m sarathi_jax.bench.gpu_report`: see run.py."""

import sys

from sarathi_jax.bench.gpu_report.run import main

sys.exit(main())
