"""`python -m benchmarks.gpu_report --out DIR`: everything a lent GPU should tell us, in one command
(run.py holds the command line, the parts' table and their child processes; its docstring describes the
report). The parts: parts.py (each part's process), profiles.py (the two profile parts), result.py (what a
part writes, and the floors), md.py (report.md)."""
