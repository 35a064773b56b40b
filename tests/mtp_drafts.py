"""What the ``mtp`` proposer drafts, recorded for tests that compare two ways of running it."""

from __future__ import annotations

from specdec.plugins.mtp import MtpProposer


def record_mtp_drafts(monkeypatch) -> dict:
    """``{(prompt length, tokens so far): greedy drafts}`` of every MTP proposal from now on."""
    drafts_at: dict = {}
    real = MtpProposer.propose

    def propose(self, batch):
        drafts = real(self, batch)
        for request, draft in zip(batch.requests, drafts.to_lists()):
            if draft:
                drafts_at[(request.num_prompt_tokens, len(request.token_ids))] = draft
        return drafts

    monkeypatch.setattr(MtpProposer, "propose", propose)
    return drafts_at


def count_mtp_catch_ups(monkeypatch) -> list:
    """The batch size of every ``MtpProposer.catch_up`` (the catch-up at the end of a step) from
    now on, in order."""
    sizes: list = []
    real = MtpProposer.catch_up

    def catch_up(self, batch):
        sizes.append(len(batch))
        return real(self, batch)

    monkeypatch.setattr(MtpProposer, "catch_up", catch_up)
    return sizes
