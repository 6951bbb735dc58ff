"""Pure-torch parallelism, one module per concern; nothing here imports Lightning."""
