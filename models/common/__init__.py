"""What several families share: a batch as collate then to the device (`batching.py`), and the
PIL processors' normalisation on the device (`pil_pixels.py`)."""
