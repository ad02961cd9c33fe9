"""decodekit's evaluator: prompt suites, timing, metrics, the losslessness check, peers, reports and the CLI.

    import decoders
    from evals import CompareConfig, compare, report

    result = compare(decoders.load("zoo:smollm2-135m"), CompareConfig(strategies=("greedy", "prompt_lookup")))
    print(report.markdown(result))

The result's JSON schema is documented in evals/README.md. `compare` and `CompareConfig` are imported on first use,
so the parts that need no model (`decodekit leaderboard`, the reports) never import torch.
"""

__all__ = ["CompareConfig", "compare"]


def __getattr__(name: str):
    if name in __all__:
        from evals import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'evals' has no attribute {name!r}")
