"""Names of the role servers: each is the server's process name (logs, metrics in Redis), its
Coordinator endpoint name and its entry point ``streamrl.workers.<name>_server``.

No imports: the monitor reads these without loading any role's dependencies.
"""

REWARD = "reward"
REFERENCE = "reference"
CRITIC = "critic"
ROLE_SERVERS = (REWARD, REFERENCE, CRITIC)
"""In the order the launcher starts them."""
