"""Transports: the Transport interface (`transport.py`), one file per transport, the registry."""
