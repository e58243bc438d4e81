import sys

from benchmarks.gpu_capacity.experiment import main

sys.exit(main())
