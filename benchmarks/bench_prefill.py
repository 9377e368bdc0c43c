"""The shared prefill's speed (gspo_study/rollout/prefill.py): one rollout batch at the bench's shape (16 prompts × 8,
`bench_rl.MAX_NEW` new tokens, temperature 1) with the shared prefill as this machine's probe allows it, against the
whole batch prefilled (the probe forced off), alternating pair by pair; every pair's sequences and log-probs are
compared bit for bit.  python -m benchmarks.bench_prefill --checkpoint DIR [--threads 2] [--repeats 5]"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.bench_rl import MAX_NEW, _prompts
from gspo_study.models import load_pretrained
from gspo_study.rollout import prefill
from gspo_study.rollout.hf import HFEngine


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="a policy (results/cpu/checkpoints/coldstart-L4)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_pretrained(args.checkpoint)
    prompts = [x.prompt for x in _prompts()]
    engine, probed = HFEngine(model, tok), prefill.exact
    print(f"probe: shared prefill {'taken' if probed(model) else 'declined'} here; threads {args.threads}", flush=True)

    def rollout(shared: bool, rep: int):
        prefill.exact = probed if shared else (lambda m: False)
        t = time.perf_counter()
        b = engine.generate(prompts, MAX_NEW, 1.0, torch.Generator().manual_seed(rep))
        return time.perf_counter() - t, b

    try:
        rollout(True, 0), rollout(False, 0)  # warm-up
        times, ratios = {True: [], False: []}, []
        for rep in range(1, args.repeats + 1):
            got = {}
            for shared in (True, False) if rep % 2 else (False, True):
                dt, got[shared] = rollout(shared, rep)
                times[shared].append(dt)
            a, b = got[True], got[False]
            same = torch.equal(a.sequences, b.sequences) and torch.equal(a.rollout_logprobs, b.rollout_logprobs)
            ratios.append(times[False][-1] / times[True][-1])
            print(f"rep {rep}: shared {times[True][-1]:.3f} s, whole {times[False][-1]:.3f} s, bit-identical {same}")
    finally:
        prefill.exact = probed
    shared, whole, r = statistics.median(times[True]), statistics.median(times[False]), statistics.median(ratios)
    print(f"median shared {shared:.3f} s, whole {whole:.3f} s; paired speed-up {r:.3f}x", end=" ")
    print(f"[{min(ratios):.3f}, {max(ratios):.3f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
