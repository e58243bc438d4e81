"""Instruments for developers, run from a clone and never installed: probes, the vLLM comparison, the GPU report,
the paper's capacity experiments, kernel benchmarks and the server soak (benchmarks/README.md lists them). They
import the library; the library never imports them."""
