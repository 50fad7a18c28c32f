"""The inference engines behind one interface (engine.py), their config, processes and verbs (serving.py)."""
