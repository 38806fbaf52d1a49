"""The DFlash engine: models, the speculative decoding loop and its statistics. No terminal code here."""
