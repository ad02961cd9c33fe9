"""One source of guesses per file, run alone by a fixed strategy or weighed by `auto`."""
