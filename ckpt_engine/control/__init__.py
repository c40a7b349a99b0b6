"""The token-checked, deadline-bounded control plane: msgpack frames and the RPC server."""
