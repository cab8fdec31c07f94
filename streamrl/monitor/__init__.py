"""Live monitoring (``streamrl-monitor``) and after-the-fact reports (``streamrl-report``)."""
