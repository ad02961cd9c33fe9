"""decodekit's evaluator: prompt suites, timing, metrics, the losslessness check, peers, reports and the CLI.

    import decoders
    from evals import CompareConfig, compare, report

    result = compare(decoders.load("zoo:smollm2-135m"), CompareConfig(strategies=("greedy", "prompt_lookup")))
    print(report.markdown(result))

The result's JSON schema is documented in evals/README.md.
"""

from evals.runner import CompareConfig, compare

__all__ = ["CompareConfig", "compare"]
