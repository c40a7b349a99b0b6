"""Transport backends, one file each; `pipelined.py` holds the broadcast core they share."""
