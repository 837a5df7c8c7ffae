"""KV cache bookkeeping: which physical blocks hold which request's tokens. Plain Python, no torch."""
