"""Integrations with other training libraries; each is imported only when used (``ddpkit.integrations.torchbearer``)."""
