"""A request, from what a caller gives to what it gets back, with no JAX: sampling settings and the one error of a
bad request (`sampling_params`), the outputs (`outputs`), a request's host-side state and the chunks a step
computes of it (`sequence`), text in and out (`tokenizer`, `chat_template`), and structured-output grammars
(`structured_outputs`, on llguidance)."""
