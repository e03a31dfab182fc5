"""Token accounting's names: a record written under the former names reads under the current
ones, and the two per-run fractions follow from the token counts."""

import pytest

from espo_jax.zve import accounting


def test_former_names_read_as_current_ones():
    # An older summary and metrics row (the values are kept, only the keys change).
    old = {"wasted_token_fraction": 0.546, "zve/wasted_token_frac": 0.0, "steps": 3,
           "zve/trained_no_grad_tokens": 10.0, "wasted_tokens": 7}
    assert accounting.current_names(old) == {
        "no_signal_token_frac_with_offline": 0.546, "zve/no_signal_token_frac": 0.0,
        "steps": 3, "zve/trained_zero_adv_tokens": 10.0, "no_signal_tokens": 7}
    # A record with both keeps the current one's value.
    both = {"zve/wasted_tokens": 1.0, "zve/no_signal_tokens": 2.0}
    assert accounting.current_names(both) == {"zve/no_signal_tokens": 2.0}


def test_run_fractions_with_and_without_the_offline_pass():
    # RL steps generated 900 tokens, 300 of them without signal; the offline pass 100 more.
    f = accounting.run_fractions(900, 300, 100)
    assert f["no_signal_token_frac"] == pytest.approx(300 / 900)
    assert f["no_signal_token_frac_with_offline"] == pytest.approx((300 + 100) / 1000)
    # No step ran: the offline pass alone, all of it without signal.
    assert accounting.run_fractions(0, 0, 52) == {"no_signal_token_frac": 0.0,
                                                   "no_signal_token_frac_with_offline": 1.0}
