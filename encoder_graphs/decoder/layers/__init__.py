"""What the language models of every family share for the decoder's graphs: the decode-step
layers (`decode.py`) and the prefill's fused norms and MLPs (`stack.py`)."""
