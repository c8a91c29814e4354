"""The fleet study: replicas, routers and a shared store in the simulator (``study``)."""
