"""`python -m benchmarks.gpu_report`: see run.py."""

import sys

from benchmarks.gpu_report.run import main

sys.exit(main())
