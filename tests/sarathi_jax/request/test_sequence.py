from sarathi_jax.request.sampling_params import SamplingParams
from sarathi_jax.request.sequence import Sequence, SequenceStatus


def test_sequence_state():
    seq = Sequence("a", [5, 6, 7], SamplingParams(max_tokens=4), arrival_time=1.5)
    assert seq.status is SequenceStatus.WAITING and seq.finish_reason is None and seq.error is None
    assert (seq.num_tokens, seq.num_prompt_tokens, seq.num_output_tokens) == (3, 3, 0)
    assert seq.num_uncomputed_tokens == 3 and not seq.is_decode
    assert seq.metrics.arrival_time == 1.5 and seq.max_total_tokens == 7
    seq.num_computed_tokens = 3
    seq.append_token(9)
    assert seq.token_ids == [5, 6, 7, 9] and seq.output_token_ids == [9] and seq.prompt_token_ids == [5, 6, 7]
    assert seq.is_decode and seq.num_uncomputed_tokens == 1
    seq.num_computed_tokens = 4
    assert not seq.is_decode


def test_token_ids_is_cheap_and_live():
    seq = Sequence("a", [1, 2], SamplingParams(), 0.0)
    ids = seq.token_ids
    assert seq.token_ids is ids  # no copy per call
    seq.append_token(3)
    assert ids == [1, 2, 3]


def test_prompt_is_copied():
    prompt = [1, 2]
    seq = Sequence("a", prompt, SamplingParams(), 0.0)
    prompt.append(3)
    assert seq.num_prompt_tokens == 2


def test_reset_for_recompute_keeps_outputs():
    seq = Sequence("a", [1, 2, 3], SamplingParams(), 0.0)
    seq.num_computed_tokens = 3
    seq.status = SequenceStatus.RUNNING
    seq.append_token(4)
    seq.num_computed_tokens = 4
    seq.append_token(5)
    seq.reset_for_recompute()
    assert seq.num_computed_tokens == 0 and seq.status is SequenceStatus.WAITING
    assert seq.output_token_ids == [4, 5] and seq.num_uncomputed_tokens == 5 and not seq.is_decode
    assert seq.metrics.num_preemptions == 1


def test_pending_tokens_are_placeholders_until_resolved():
    from sarathi_jax.request.sequence import PENDING_TOKEN

    seq = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=5), 0.0)
    seq.num_computed_tokens = 3
    seq.append_pending_token()  # a dispatched step samples the next token
    assert seq.token_ids == [1, 2, 3, PENDING_TOKEN] and seq.output_token_ids == []
    assert (seq.num_tokens, seq.num_pending_tokens, seq.num_generated_tokens) == (4, 1, 1) and seq.is_decode
    seq.num_computed_tokens = 4
    seq.append_pending_token()  # the next step was dispatched before the first token came back
    seq.resolve_pending_token(7)
    assert seq.token_ids == [1, 2, 3, 7, PENDING_TOKEN] and seq.output_token_ids == [7]
    assert seq.num_generated_tokens == 2
    seq.discard_pending_tokens()  # finished: the in-flight extra token is dropped
    assert seq.token_ids == [1, 2, 3, 7] and seq.num_pending_tokens == 0 and seq.num_computed_tokens == 4
