"""The graph engine: the encoder manager, the capture core it shares with the decoder, statistics."""
