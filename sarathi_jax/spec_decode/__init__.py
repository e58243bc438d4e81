"""Speculative decoding, the plain-data side (no JAX): its configuration, which requests speculate, how verified
rows become emitted tokens, the counters (`speculative`), and the model-free n-gram proposer (`ngram_proposer`).
The scheduler grants drafts (`scheduler.speculation`); the device side lives in `runner` (`draft_runner`,
`sample.rejection`)."""
