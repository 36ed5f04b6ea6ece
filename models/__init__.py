"""Model adapters, presets and small models."""
