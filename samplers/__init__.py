"""Logits processing, seeded sampling and (with draft-then-verify strategies) the verifiers."""

from samplers.logits import SamplingConfig, make_generator, sample

__all__ = ["SamplingConfig", "make_generator", "sample"]
