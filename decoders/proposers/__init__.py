"""The proposers: one file per source of guesses, each run as it is by a fixed strategy in `decoders.strategies` and
weighed against the others by `auto`, so no strategy module imports another."""
