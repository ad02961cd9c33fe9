from __future__ import annotations

from collections.abc import Generator

import torch

from decoders.base import Call, DecodeState
from decoders.drafting.draft_model import Chain, DraftModel
from decoders.models.cache import shared_length
from decoders.models.lm import LM

REENCODE = 3  # draft tokens re-encoded with the text that follows them: their merges may change
LOOKBEHIND = 3  # accepted target tokens encoded with a drafted text, to align it with the run


class Codec:
    """One tokenizer's text <-> ids, ids spelled as they read after an anchor token (so decoders that strip a leading
    space or drop a lone first byte spell every piece alike)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        plain = tokenizer("a", add_special_tokens=False)["input_ids"]
        full = tokenizer("a")["input_ids"]
        self.prefix = full[: len(full) - len(plain)] if plain and full[len(full) - len(plain) :] == plain else []
        self.anchor = plain[-1:]  # [] for a tokenizer that cannot spell "a"
        self.anchor_text = self.decode(self.anchor)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def text(self, ids) -> str:
        """The text `ids` spell inside a longer one."""
        spelled = self.decode(self.anchor + list(ids))
        return spelled[len(self.anchor_text) :] if spelled.startswith(self.anchor_text) else self.decode(ids)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def spellings(self, width: int) -> list[str]:
        """The text of every token id below `width`, as read inside a longer text."""
        spelled = self.tokenizer.batch_decode(
            [self.anchor + [i] for i in range(width)], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        return [s[len(self.anchor_text) :] if s.startswith(self.anchor_text) else s for s in spelled]


_SHARED: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}


def shared_tokens(lm: LM, draft: LM) -> tuple[torch.Tensor, torch.Tensor]:
    """(draft ids [s], target ids [s]): the tokens both vocabularies spell alike, paired; kept per vocabulary pair."""
    key = (lm.vocab_key, draft.vocab_key)
    if key not in _SHARED:
        targets: dict[str, int] = {}
        for i, text in enumerate(Codec(lm.tokenizer).spellings(min(len(lm.tokenizer), lm.vocab_size))):
            if text and "\ufffd" not in text:  # a lone byte of a longer character is no text of its own
                targets.setdefault(text, i)
        width = min(len(draft.tokenizer), draft.vocab_size, draft.model.get_input_embeddings().num_embeddings)
        pairs: dict[int, int] = {}  # target id -> draft id
        for i, text in enumerate(Codec(draft.tokenizer).spellings(width)):
            if text in targets:
                pairs.setdefault(targets[text], i)
        _SHARED[key] = (
            torch.tensor(list(pairs.values()), dtype=torch.long),
            torch.tensor(list(pairs.keys()), dtype=torch.long),
        )
    return _SHARED[key]


class TranslatedDraftModel(DraftModel):
    """A draft LM of another tokenizer, drafting in target ids (Timor et al. 2025, arXiv 2502.05202). Greedy: its text,
    encoded by the target's tokenizer after the last accepted tokens, is the draft. Sampling: it draws only tokens
    whose text is one target token, so its distribution is one over target ids."""

    translates = True

    def __init__(self, state: DecodeState) -> None:
        super().__init__(state)
        self.ours, self.theirs = Codec(state.lm.tokenizer), Codec(self.lm.tokenizer)  # the target's, the draft's
        lead = shared_length(self.ours.prefix, state.tokens[:-1])  # the target's own BOS says nothing to the draft
        self.lead, self.done, self.text = lead, lead, ""  # target tokens whose text is settled, and that text
        self.ids = list(self.theirs.prefix)  # [n] the draft's ids for `text`
        self.fed: list[int] = []  # [len(cache)] the draft ids its cache holds
        self.width = min(self.lm.vocab_size, len(self.lm.tokenizer), self.embeds)
        self.eos = self._eos_twin()
        self.shared = None  # sampling: (draft ids [s], target ids [s], draft id of each target id [vocab] or -1)
        if not state.sampling.greedy:
            theirs, ours = shared_tokens(state.lm, self.lm)
            back = torch.full((state.lm.vocab_size,), -1, dtype=torch.long)
            back[ours] = theirs
            self.shared = theirs.to(self.lm.device), ours.to(state.lm.device), back

    def _eos_twin(self) -> int | None:
        """The target's EOS a draft EOS stands for: the one spelled alike, else the target tokenizer's own."""
        vocab, eos = self.state.lm.tokenizer.get_vocab(), self.state.lm.eos_token_ids
        for token in sorted(self.lm.eos_token_ids):
            twin = vocab.get(self.lm.tokenizer.convert_ids_to_tokens(token))
            if twin in eos:
                return twin
        own = self.state.lm.tokenizer.eos_token_id
        return own if own in eos else None

    def sync(self) -> None:
        """Bring `text` and the draft's `ids` up to the run's accepted tokens."""
        tokens = self.state.tokens
        end = len(tokens)
        if end == self.done:
            return
        piece = self.ours.text(tokens[self.done : end])
        while piece.endswith("\ufffd") and end > max(self.done + 1, len(tokens) - 3):
            end -= 1  # the text ends inside a character: its last bytes wait for the rest
            piece = self.ours.text(tokens[self.done : end])
        old = self.text
        self.text, self.done = old + piece, end
        keep, start = self._restart(old)
        self.ids = self.ids[:keep] + self.theirs.encode(self.text[start:])

    def _restart(self, old: str) -> tuple[int, int]:
        """(i, c): ids[:i] spell text[:c] and stay; the rest is re-encoded (from the start if no cut is found)."""
        first = len(self.theirs.prefix)
        for i in range(len(self.ids) - REENCODE, max(first, len(self.ids) - REENCODE - 4), -1):
            tail = self.theirs.text(self.ids[i:])
            if not tail.startswith("\ufffd") and old.endswith(tail):
                return i, len(old) - len(tail)
        return first, 0

    def _cached(self) -> int:
        """How many of the ids the draft cache holds (never the last, which is fed to draft from)."""
        return shared_length(self.fed, self.ids[:-1])

    def _catch_up(self) -> list[int]:
        """Sync and cut the draft cache to what it shares with the ids; returns the ids to feed."""
        self.sync()
        common = self._cached()
        self.cache.crop(common)
        del self.fed[common:]
        return self.ids[common:]

    def uncached(self) -> list[int]:
        """The draft ids of the run's text not cached yet."""
        self.sync()
        return self.ids[self._cached() :]

    def _space(self) -> int | None:
        """`DraftModel._space`, after the run's text."""
        self.sync()
        context = self.lm.context_length
        return None if context is None else max(0, context - len(self.ids))

    def rewind(self) -> None:
        """Keep only cached positions that spell accepted text."""
        self._catch_up()

    def draft_chain(self, limit: int, keep_going=lambda prob: True) -> Chain:
        """`DraftModel.draft_chain` in target ids."""
        feed = self._catch_up()
        if limit <= 0 or not self.room(limit) or not feed or self.done < len(self.state.tokens):
            return [], [], []  # (the last: the target is inside a character, which it ends first)
        budget = 2 * limit + 2 if self.shared is None else limit  # draft tokens: a finer tokenizer needs more
        space = self._space()
        budget = budget if space is None else min(budget, space)
        if self.shared is not None:
            return (yield from self._sample_chain(feed, budget, keep_going))
        return (yield from self._greedy_chain(feed, limit, budget, keep_going))

    def _step(self, feed: list[int]) -> Generator[Call, torch.Tensor, torch.Tensor]:
        """One draft call; returns its last logits [width]."""
        self.fed.extend(feed)
        return (yield from self.forward(feed, keep=1))[-1, : self.width]

    def _greedy_chain(self, feed, limit, budget, keep_going) -> Chain:
        """String-level exact match: draft in the draft's ids, translate the text after each token."""
        drafted, tokens, seen = [], [], []  # seen[i]: the chain's probability when target token i first showed
        start = max(self.lead, self.done - LOOKBEHIND)  # the last accepted tokens, encoded with each drafted text
        before = self.ours.text(self.state.tokens[start : self.done])
        running, window = 1.0, (start, before) if self.text.endswith(before) else (self.done, "")
        for _ in range(budget):
            logits = yield from self._step(feed)
            token = int(logits.argmax())
            running *= float(torch.softmax(logits.float(), -1)[token])
            if token in self.lm.eos_token_ids:
                if self.eos is not None and len(tokens) < limit:
                    tokens, seen = tokens + [self.eos], seen[: len(tokens)] + [running]  # like DraftModel: not judged
                break
            drafted.append(token)
            tokens, stop = self.translate(drafted, window)[:limit], False
            for i in range(len(seen), len(tokens)):
                seen.append(running)
                if not keep_going(running):
                    del tokens[i + 1 :]
                    stop = True
                    break
            if stop or len(tokens) == limit:
                break
            feed = [token]
        return tokens, [None] * len(tokens), seen[: len(tokens)]

    def translate(self, drafted: list[int], window: tuple[int, str]) -> list[int]:
        """The target ids of the text `drafted` adds to the run, whose tokens from `window[0]` spell `window[1]`."""
        text = self.theirs.text(drafted).rstrip("\ufffd")  # a character the draft has not finished
        if not text:
            return []
        start, before = window
        accepted = self.state.tokens[start:]
        encoded = self.ours.encode(before + text)
        if encoded[: len(accepted)] == accepted:
            return encoded[len(accepted) :]
        return self.ours.encode(text)  # the target wrote those tokens otherwise than its tokenizer spells their text

    def _sample_chain(self, feed, budget, keep_going) -> Chain:
        """Token-level intersection: draws over shared tokens only, so each row is exactly what it was drawn from."""
        state, (theirs, ours, back) = self.state, self.shared
        grammar = state.grammar.fork() if state.grammar is not None else None
        tokens, rows, cumulative, running = [], [], [], 1.0
        for _ in range(budget):
            if grammar is not None and grammar.is_complete():
                break
            logits = yield from self._step(feed)
            shared = torch.full_like(logits, float("-inf"))  # [width]
            shared[theirs] = logits[theirs]
            if grammar is not None:
                allowed = grammar.allowed().to(ours.device)[ours].to(logits.device)  # [s]
                shared[theirs[~allowed]] = float("-inf")
            if not bool(torch.isfinite(shared).any()):
                break
            probs = torch.zeros(state.lm.vocab_size, device=state.lm.device)  # [vocab]
            probs[ours] = state.sampling.probs(shared)[theirs].to(probs.device)
            token = int(torch.multinomial(probs, 1, generator=state.generator))
            running *= float(probs[token])
            tokens.append(token)
            rows.append(probs)
            cumulative.append(running)
            if token in state.lm.eos_token_ids or not keep_going(running):
                break
            if grammar is not None:
                grammar.advance([token])
            feed = [int(back[token])]
        return tokens, rows, cumulative
