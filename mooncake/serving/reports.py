"""What a worker reports to the Conductor: the rules the workers and the Conductor's twin both call.

    prefill worker                                       the Conductor (conductor.core, .learning)
      as it starts: calibration_lengths() prompts,  ---> prefill samples: its predictors learn
        one PrefillSample each
      after each prefill: prefill_sample()          ---> a prefill sample
      each heartbeat: InFlight per prompt it holds  ---> queued_seconds(prompts, its predictor): the queue it
        (cached_tokens, computed_tokens)                   places by, priced by its own fit; queued_tokens()
      beats: beat_interval(); at once as one ends
    decode worker
      each heartbeat: mean_step() of its engine     ---> one sample of its step model
        steps since the last one
      each heartbeat: requests waiting for a place  ---> early_predictive counts it full while more
        in its batch, the longest one's wait               than half a batch wait, past the TBT SLO

Workers measure and report; only the Conductor fits predictors (conductor.predictors), so a
worker's report never carries a fit of its own. The twin (conductor.planner.twin) plays the
workers with these same functions, so what it tells the Conductor is what a worker would.

Pure: numbers in, numbers out; no torch, no I/O (the Conductor and the twin import it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

# A prefill worker beats this often while it holds prompts, and at once when one ends (mooncake.runtime's ConductorLink
# ``busy_interval_s``, the twin's instances too): between two the Conductor only guesses how its queue drains
# (conductor.types.Instance.drain)
PREFILL_BUSY_BEAT_S = 0.5
# a prefill worker's calibration prompts as it starts, in shares of its step budget (64, 256 and 512 tokens on the CPU)
CALIBRATION_SHARES = (0.125, 0.5, 1.0)


def beat_interval(interval_s: float, busy_interval_s: float, holding: bool) -> float:
    """Seconds from one heartbeat to the next: the Conductor's interval, or ``busy_interval_s`` (0: none) while the
    worker holds prompts, whichever is shorter. Called at every beat."""
    return min(interval_s, busy_interval_s) if holding and busy_interval_s > 0 else interval_s


def calibration_lengths(step_budget: int, limit: int | None = None) -> list[int]:
    """The calibration prompts' lengths: ``CALIBRATION_SHARES`` of the step budget, 2 tokens at least and ``limit``
    (the model's context less one) at most."""
    lengths = [max(2, round(share * step_budget)) for share in CALIBRATION_SHARES]
    return [min(limit, n) for n in lengths] if limit is not None else lengths


# -- prefill ---------------------------------------------------------------------------------------------------------


def cached_tokens(blocks: int, block_size: int, prompt_tokens: int) -> int:
    """Tokens of a prompt whose KV is loaded, not computed, with ``blocks`` leading blocks at hand: the last prompt
    token is always computed (its logits give the first token)."""
    return max(0, min(blocks * block_size, prompt_tokens - 1))


@dataclass(frozen=True, slots=True)
class PrefillSample:
    """One measured prefill, for the Conductor's prefill predictor."""

    prompt_tokens: int
    cached_tokens: int
    seconds: float  # its own compute: not its reads of the prefix, not the time other prompts' tokens took


def prefill_sample(prompt_tokens: int, cached: int, span_s: float, own_s: float = 0.0) -> PrefillSample:
    """A prefill as a sample: ``span_s`` from its first step to its first token, or, with prompts batched into the
    same steps, its own share of their time (``own_s``, where measured: the whole span would count the others' tokens
    too). Called once per prefill, and for each calibration prompt."""
    return PrefillSample(prompt_tokens, cached, max(own_s if own_s > 0 else span_s, 1e-6))


@dataclass(frozen=True, slots=True)
class InFlight:
    """A prompt a prefill worker holds (queued or running), as each heartbeat reports it."""

    prompt_tokens: int
    computed_tokens: int  # loaded or computed so far: the Conductor prices the rest

    @property
    def remaining_tokens(self) -> int:
        return self.prompt_tokens - self.computed_tokens


def computed_tokens(prompt_tokens: int, cached: int, issued_blocks: int, block_size: int) -> int:
    """What a prompt in flight has behind it: its cached prefix, or the blocks whose KV it has started to push
    (``issued_blocks``: the engine has computed them), whichever is more; never its last token, which ends it."""
    return max(cached, min(prompt_tokens - 1, issued_blocks * block_size))


def queued_tokens(prompts: Iterable[InFlight]) -> int:
    """Prompt tokens the prompts in flight still have to compute."""
    return sum(p.remaining_tokens for p in prompts)


def queued_seconds(prompts: Iterable[InFlight], predict: Callable[[int, int], float]) -> float:
    """Predicted seconds of prefill still to compute for the prompts in flight, each from what it has computed so far
    (not from its start), with ``predict(prompt tokens, computed tokens)``: the Conductor's predictor, on every
    prefill worker's heartbeat."""
    return sum(predict(p.prompt_tokens, p.computed_tokens) for p in prompts)


# -- decode ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepMean:
    """The mean decode step between two heartbeats (one sample of the Conductor's step model: the last step alone swung
    with whatever else the cores were doing at that moment)."""

    batch: float
    context_tokens: float
    seconds: float


def mean_step(batch, context_tokens, seconds, new_tokens) -> StepMean | None:
    """The mean of the decode steps among engine steps given as equal-length sequences (one entry a step): those that
    ran requests, took time and computed at most one token a request (a step a prompt's chunk rode on is not a decode
    step). None: no decode step. Called with every decode heartbeat (by the twin: once a run of steps)."""
    batch, seconds = np.asarray(batch, dtype=np.float64), np.asarray(seconds, dtype=np.float64)
    decode = (batch > 0) & (seconds > 0) & (np.asarray(new_tokens, dtype=np.float64) <= batch)
    n = int(decode.sum())
    if not n:
        return None
    context = np.asarray(context_tokens, dtype=np.float64)
    return StepMean(float(batch[decode].sum() / n), float(context[decode].sum() / n), float(seconds[decode].sum() / n))
