"""Native kernels, each optional: the torch code they replace stays the fallback and the reference."""
