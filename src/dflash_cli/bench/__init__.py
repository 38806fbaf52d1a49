"""`dflash-cli bench`: plain decoding against DFlash on prompt sets here (local.py), or a server's own
acceptance and speed (remote.py, `bench --engine`)."""
