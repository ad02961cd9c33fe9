"""The proposers, one file per source of guesses: each run alone by a fixed strategy, or weighed by `auto`."""
