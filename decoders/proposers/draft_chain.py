"""A draft model's chains (`speculative`, `auto`'s `draft` plans)."""

from __future__ import annotations

from decoders.base import DecodeState
from decoders.drafting.chooser import Acceptance, Chooser, Offer, Plan, given_above
from decoders.drafting.cost import CostModel
from decoders.drafting.draft import Draft, Drafting
from decoders.drafting.draft_model import SELF_ACCEPTANCE, DraftModel, SharedCacheDraft, stack_probs
from decoders.drafting.draft_models import draft_model
from decoders.proposers.base import Clock, Setup, Step


class ChainProposer:
    """A draft model's chains of the plan's length; with a `chooser`, on past it while the next token pays."""

    name = "draft"
    corrected = True
    needs_draft = True

    def __init__(
        self,
        model: DraftModel,
        cost: CostModel | None = None,
        chooser: Chooser | None = None,
        clock: Clock | None = None,
        max_draft: int = 16,
    ) -> None:
        self.model, self.cost, self.chooser, self.clock = model, cost, chooser, clock or Clock()
        self.max_draft = max_draft
        self.shares_cache = isinstance(model, SharedCacheDraft)  # the target's own int8 copy, on the target's cache
        self.acceptance = Acceptance(
            chooser.options if chooser else None, SELF_ACCEPTANCE if self.shares_cache else None
        )
        self.offered: Offer | None = None
        self.confidences: list[float] = []  # [levels] the draft's probability of each token of its last chain
        self.room = 0

    @classmethod
    def build(cls, setup: Setup, needed: dict) -> ChainProposer:
        """`auto`'s: up to its `max_draft` tokens."""
        return cls(draft_model(setup.state), setup.cost, setup.chooser, setup.clock, setup.options.max_draft)

    def offer(self, state: DecodeState, limit: int) -> Offer | None:
        self.offered = None
        if self.shares_cache and not len(state.cache):
            return None  # before the target's cache holds the prompt, a draft would compute it only to drop it
        self.room = self.model.room(min(limit, self.max_draft))
        if not self.room:
            return None
        drafting, catch_up = (), 0.0
        if self.cost is not None:
            context = len(state.cache)
            call = self.cost.draft_seconds(1, context)
            catch_up = self.cost.draft_seconds(1, context, len(self.model.uncached())) - call
            drafting = tuple(catch_up + call * k for k in range(1, self.room + 1))
        self.offered = Offer(self.name, self.acceptance.chain(self.room), drafting, catch_up=catch_up)
        return self.offered

    def draft(self, state: DecodeState, plan: Plan) -> Drafting:
        """`plan.k` tokens (a plan the chooser took for its rate: at least 1), then on while the next one pays."""
        context, clock, stamps, probs = len(state.cache), self.clock, [], []
        planned = plan.k if plan.probe or self.chooser is None else 1
        fed, calls = len(self.model.uncached()), state.stats.draft_calls
        call = self.cost.draft_seconds(1, context) if self.cost is not None else 0.0
        catch_up = self.offered.catch_up if self.offered is not None else 0.0

        def keep_going(cumulative: float) -> bool:
            stamps.append(clock.now())  # a call has ended (its token's probability is on the host)
            probs.append(cumulative)
            if len(probs) < planned or self.chooser is None:
                return len(probs) < planned
            confidences = given_above(probs)
            return self.chooser.should_continue(
                self.acceptance.chain(len(probs), confidences),
                self.acceptance.level(len(probs) + 1, confidences[-1]),
                context,
                call,
                catch_up,
            )

        start = clock.now()
        tokens, rows, cumulative = yield from self.model.draft_chain(self.room if self.chooser else plan.k, keep_going)
        state.lm.synchronize()
        end, calls = clock.now(), state.stats.draft_calls - calls
        if self.cost is not None and clock.timed and tokens:  # the first call feeds what the draft had not seen
            self.cost.observe("draft", fed, context, (stamps[0] if stamps else end) - start)
            if calls > 1:
                self.cost.observe("draft", 1, context, max(0.0, end - stamps[0]) / (calls - 1))
        self.confidences = list(given_above(cumulative))
        return Draft(tokens, stack_probs(rows))

    def learn(self, state: DecodeState, step: Step) -> None:
        if step.plan.proposer != self.name:
            return
        drafted = len(step.draft.tokens)  # fewer than drafted where an EOS or the grammar cut it
        if drafted:
            self.acceptance.learn(drafted, step.accepted, self.confidences[:drafted])
        self.model.rewind()
