"""Sharded rollouts: with one random stream per response, generating a batch in pieces (as ranks do) and
merging the pieces gives the batch one engine call over all prompts gives — tokens, layout, log-probs and the
R3 routing trace."""

from __future__ import annotations

import torch

from gspo_study.models import load_pretrained
from gspo_study.rollout import HFEngine
from gspo_study.rollout.base import merge_batches


def test_generated_in_pieces_equals_generated_at_once(smoke_results):
    model, tok = load_pretrained(smoke_results / "smoke/checkpoints/coldstart")
    engine = HFEngine(model, tok)
    prompts = ["1+2=", "7+8+9=", "3+4=", "5+6+7+8=", "9+9=", "2+2+2="]  # ragged prompt lengths
    seeds = [101, 202, 303, 404, 505, 606]

    def gen(idx):
        return engine.generate(
            [prompts[i] for i in idx],
            12,
            1.0,
            capture_routing=True,
            row_seeds=[seeds[i] for i in idx],
        )

    whole = gen(range(6))
    pieces = merge_batches([gen([0, 1]), gen([2]), gen([3, 4, 5])], tok.pad_token_id)
    assert pieces.prompt_len == whole.prompt_len and pieces.response_texts == whole.response_texts
    for name in ("sequences", "attention_mask", "response_mask", "truncated"):
        assert torch.equal(getattr(pieces, name), getattr(whole, name)), name
    torch.testing.assert_close(pieces.rollout_logprobs, whole.rollout_logprobs, rtol=0, atol=1e-5)
    # Routing must agree wherever it can influence a response log-prob: every fed position but a row's last
    # token (its EOS, fed only while other rows of the same engine call are still generating).
    used = whole.attention_mask[:, :-1].bool()
    used[torch.arange(len(used)), used.long().cumsum(1).argmax(1)] = False
    for layer in whole.routing.layers:
        a, b = pieces.routing.layer(layer), whole.routing.layer(layer)
        assert a.shape == b.shape and torch.equal(a[used], b[used]), layer
    # a response depends on its own stream only: other seeds, same row -> same tokens for row 0
    other = engine.generate([prompts[0], prompts[3]], 12, 1.0, row_seeds=[seeds[0], 999])
    assert other.response_texts[0] == whole.response_texts[0]
