"""The control plane: observe, evaluate, decide (pure), act through runtimes, keep the ledger."""
