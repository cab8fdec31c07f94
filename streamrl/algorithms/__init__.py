"""RL algorithms: advantages and policy losses as pure tensor functions."""
