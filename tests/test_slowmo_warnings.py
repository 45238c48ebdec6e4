"""SlowMo's warning for SGP-only settings under local SGD names the way to use them (SGP exists: the warning used
to say it was not implemented; issue 23, defect 6)."""

import pytest

from ddpkit.algorithms.gossip_checks import warn_sgp_only


def test_sgp_only_settings_warn_with_the_fix_not_a_stale_excuse():
    with pytest.warns(UserWarning) as caught:
        warn_sgp_only(graph="ring", mixing=None, overlap=True, synch_freq=0)
    message = str(caught[0].message)
    assert "graph, overlap" in message and "no effect with LOCALSGD" in message
    assert "SlowMoBaseAlgorithm.SGP" in message and "not implemented" not in message
