"""Developer tools for tuning decodekit (replays and micro-benchmarks), run from the repository root as
`python -m devtools.NAME`; not part of the installed package."""
