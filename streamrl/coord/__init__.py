"""Redis control plane: key schema, versions, endpoints, heartbeats, capacity, stop."""
from streamrl.coord.coordinator import Coordinator
from streamrl.coord.keys import Keys

__all__ = ["Coordinator", "Keys"]
