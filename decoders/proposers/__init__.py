"""The proposers: one file per source of guesses, shared by the fixed strategies and `auto`. Each holds a drafter (the
`Drafter` protocol of `decoders.drafting.draft`) and its options; a fixed strategy in `decoders.strategies` registers
one of them under its name, and `auto` weighs them all each step, so no strategy module imports another.
"""
