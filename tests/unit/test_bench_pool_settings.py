"""The greedy-agreement metric of `raylane bench pool-settings`: what "identical", "first divergence" and
"max |logprob diff|" mean when a quantized setting is compared with float32."""

import pytest

from raylane.bench.pool_settings import agreement, cut_at_eos, first_divergence

EOS = frozenset({2})


def test_first_divergence_finds_the_first_differing_token_or_the_shorter_end():
    assert first_divergence([5, 6, 7], [5, 6, 7]) is None
    assert first_divergence([5, 6, 7], [5, 9, 7]) == 1
    assert first_divergence([5, 6, 7], [5, 6]) == 2  # stopped early: differs where it ended
    assert first_divergence([5], [5, 6]) == 1


def test_cut_at_eos_keeps_the_answer_through_its_first_eos():
    assert cut_at_eos([5, 2, 7, 2], EOS) == [5, 2]
    assert cut_at_eos([5, 6], EOS) == [5, 6]


def test_agreement_counts_identical_answers_and_where_the_others_diverge():
    refs = [([5, 6, 7, 8], [-0.1, -0.2, -0.3, -0.4]), ([9, 9, 9], [-1.0, -1.0, -1.0])]
    others = [([5, 6, 7, 8], [-0.15, -0.2, -0.3, -0.4]), ([9, 4, 9], [-1.5, -3.0, -1.0])]
    result = agreement(refs, others, EOS)
    assert result["identical"] == 1 and result["prompts"] == 2
    assert result["mean_first_divergence"] == 1.0
    # Over the agreeing prefixes only: 0.05 in the first answer, 0.5 at token 0 of the second; the
    # diverged token's 2.0 does not count (it is another token's logprob).
    assert result["max_logprob_diff"] == pytest.approx(0.5)


def test_agreement_ignores_what_follows_the_reference_eos():
    # With EOS ignored in the run, both continue past the answer; only the answer is compared.
    refs = [([5, 2, 7, 7], [-0.1, -0.2, -0.3, -0.4])]
    others = [([5, 2, 8, 8], [-0.1, -0.2, -9.0, -9.0])]
    result = agreement(refs, others, EOS)
    assert result["identical"] == 1
    assert result["mean_first_divergence"] is None
    assert result["max_logprob_diff"] == pytest.approx(0.0)


def test_agreement_counts_an_answer_that_ends_early_as_diverging():
    refs = [([5, 6, 7, 2], [0.0] * 4)]
    others = [([5, 2], [0.0, 0.0])]
    result = agreement(refs, others, EOS)
    assert result["identical"] == 0
    assert result["mean_first_divergence"] == 1.0
