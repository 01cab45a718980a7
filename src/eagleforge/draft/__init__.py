"""The draft head: model, TTT attention, the unrolled training-time test and its loss."""
