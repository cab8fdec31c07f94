"""Multi-turn environments: the interface, tools, and the episode driver."""
