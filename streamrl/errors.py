"""The error a bad run configuration raises, shared by :mod:`streamrl.config` and the modules
that validate one part of it (:mod:`streamrl.placement`, :mod:`streamrl.models`) so that those
need not import the config module that calls them."""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range; the message names it."""
