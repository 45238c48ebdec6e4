"""SlowMo's warning for SGP-only settings under local SGD names the way to use them (SGP exists: the warning used
to say it was not implemented)."""

import pytest
import torch

from ddpkit.algorithms.gossip_checks import warn_sgp_only


def test_sgp_only_settings_warn_with_the_fix_not_a_stale_excuse():
    with pytest.warns(UserWarning) as caught:
        warn_sgp_only(graph="ring", mixing=None, overlap=True, synch_freq=0)
    message = str(caught[0].message)
    assert "graph, overlap" in message and "no effect with LOCALSGD" in message
    assert "SlowMoBaseAlgorithm.SGP" in message and "not implemented" not in message


def test_a_module_that_is_not_an_nn_module_is_refused_naming_the_argument():
    from ddpkit.nn.slowmo_checks import check_settings

    with pytest.raises(TypeError, match=r"SlowMoDistributedDataParallel: module must be a torch\.nn\.Module, got"):
        check_settings(object(), 1, 1, 3, 48)
    check_settings(torch.nn.Linear(2, 2), 1, 1, 3, 48)
