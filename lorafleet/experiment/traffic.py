"""The generated request sequence: open-loop arrivals, prompts, output lengths and adapters.

Arrival times, prompts, input buckets and output lengths come from one random stream per
(seed, offered rate, repetition), independent of the profile: every profile of a repetition
sends the same prompts with the same lengths at the same times, only the adapters differ.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from lorafleet.experiment.manifest import Manifest, Skew
from lorafleet.experiment.results import ProfileName


@dataclass(frozen=True)
class Planned:
    seq: int
    arrival_s: float
    adapter: str
    prompt_id: int
    input_bucket: int
    max_tokens: int


@dataclass(frozen=True)
class Plan:
    requests: list[Planned]
    top1_share: float
    top10_share: float
    popular_before: str | None
    popular_after: str | None
    reversal_at_s: float | None


def _gaps(rng: random.Random, count: int, rate: float, policy: str, cv: float) -> list[float]:
    if policy == "fixed":
        return [1.0 / rate] * count
    if policy == "poisson":
        return [rng.expovariate(rate) for _ in range(count)]
    # Gamma with mean 1/rate and coefficient of variation cv (cv = 1 is Poisson).
    shape = 1.0 / (cv * cv)
    return [rng.gammavariate(shape, 1.0 / (rate * shape)) for _ in range(count)]


def _chooser(
    aliases: list[str], profile: ProfileName, skew: Skew
) -> Callable[[random.Random], str]:
    """Draws an alias; ``aliases[0]`` is the popular one for the skewed laws."""
    if profile == "single":
        return lambda rng: aliases[0]
    if profile == "uniform" or len(aliases) == 1:
        return lambda rng: rng.choice(aliases)
    if skew.law == "one_adapter":
        rest = aliases[1:]
        return lambda rng: aliases[0] if rng.random() < skew.p else rng.choice(rest)
    weights = [1.0 / (rank + 1) ** skew.s for rank in range(len(aliases))]
    return lambda rng: rng.choices(aliases, weights)[0]


def plan(
    manifest: Manifest,
    profile: ProfileName,
    rate: float,
    repetition: int,
    count: int | None = None,
) -> Plan:
    """The sequence for one trial. ``reversal`` uses the skewed law with the popularity
    ranking reversed from ``reversal_at`` of the run on (the arrival rate does not change)."""
    count = manifest.requests_per_cell if count is None else count
    aliases = [entry.alias for entry in manifest.adapter_registry]
    shared = random.Random(f"{manifest.random_seed}:{rate}:{repetition}")
    gaps = _gaps(shared, count, rate, manifest.arrival.policy, manifest.arrival.burstiness)
    arrivals, clock = [], 0.0
    for gap in gaps:
        arrivals.append(clock)
        clock += gap
    cap = manifest.output_cap
    shapes = [
        (
            shared.randrange(len(manifest.prompt_corpus.prompts)),
            shared.choice(manifest.input_token_buckets),
            shared.randint(max(1, cap // 2), cap),
        )
        for _ in range(count)
    ]
    picker = random.Random(f"{manifest.random_seed}:{rate}:{repetition}:{profile}")
    before = _chooser(aliases, profile, manifest.skew)
    after = _chooser(list(reversed(aliases)), profile, manifest.skew)
    switch = manifest.reversal_at * arrivals[-1] if profile == "reversal" and count else None
    requests = []
    for seq, (arrival, (prompt_id, bucket, max_tokens)) in enumerate(
        zip(arrivals, shapes, strict=True)
    ):
        choose = after if switch is not None and arrival >= switch else before
        requests.append(
            Planned(seq, round(arrival, 6), choose(picker), prompt_id, bucket, max_tokens)
        )
    counts = Counter(request.adapter for request in requests)
    total = max(1, len(requests))
    ranked = [share for _, share in counts.most_common()]
    popular = profile in ("skewed", "reversal")
    return Plan(
        requests=requests,
        top1_share=round(sum(ranked[:1]) / total, 4),
        top10_share=round(sum(ranked[:10]) / total, 4),
        popular_before=aliases[0] if popular else None,
        popular_after=aliases[-1] if profile == "reversal" else None,
        reversal_at_s=round(switch, 3) if switch is not None else None,
    )


def prompt_text(
    manifest: Manifest, prompt_id: int, bucket: int, count_tokens: Callable[[str], int]
) -> str:
    """Prompt ``prompt_id`` of the corpus, continued with the corpus' words (in order, from the
    next prompt on) until it holds at least ``bucket`` tokens, then cut back to the shortest
    such prefix."""
    corpus = manifest.prompt_corpus.prompts
    words = corpus[prompt_id].split()
    following = [
        word
        for index in range(1, len(corpus) + 1)
        for word in corpus[(prompt_id + index) % len(corpus)].split()
    ]
    cursor = 0
    while count_tokens(" ".join(words)) < bucket:
        words.append(following[cursor % len(following)])
        cursor += 1
    while len(words) > 1 and count_tokens(" ".join(words[:-1])) >= bucket:
        words.pop()
    return " ".join(words)


def word_count(text: str) -> int:
    return len(text.split())
