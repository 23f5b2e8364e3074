"""The peers a user would pick instead of relaxsync, run on our job: bench/peers/__main__.py says how."""
