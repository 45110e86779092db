"""Training data: reading records, tokenising them into samples, fitting them to the capacity."""
