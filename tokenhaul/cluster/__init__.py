"""Ray cluster: engine replicas as actors behind one endpoint, cache-aware routing (optional extra)."""
