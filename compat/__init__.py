"""Drop-in APIs written against other projects' interfaces, on relaxsync's machinery (CAC's relaxed-sync DDP)."""
