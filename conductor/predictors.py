"""What the Conductor predicts: prefill time, decode step time (TBT), transfer time.

Each predictor starts from a configured default (so the first requests are placed
sanely) and refits from the measurements workers report: prefill workers send
(prompt tokens, cached tokens, seconds) after each prefill, decode workers their step
time with the batch size and context tokens, pool transfers their bytes and seconds.
All are pure: numbers in, numbers out.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel, Field


class PredictorConfig(BaseModel):
    """Defaults used until enough samples arrive (a LLaMA3-70B-like model on 8 GPUs is about 0.5 s per 4k tokens)."""

    prefill_tokens_per_s: float = Field(8000.0, gt=0, description="default prefill rate for uncached tokens")
    prefill_attention_s_per_token2: float = Field(
        0.0, ge=0, description="default quadratic term: seconds per (new x context) token pair"
    )
    prefill_overhead_s: float = Field(0.01, ge=0)
    decode_base_s: float = Field(0.02, ge=0, description="default decode step time of a batch of one")
    decode_s_per_request: float = Field(0.0005, ge=0)
    decode_s_per_context_token: float = Field(2e-8, ge=0)
    transfer_bytes_per_s: float = Field(10e9, gt=0, description="default pool bandwidth (bytes/s)")
    transfer_latency_s: float = Field(0.001, ge=0)
    min_samples: int = Field(
        3,
        ge=2,
        description="samples before a fitted model replaces the default (a prefill worker "
        "sends 3 as it starts: prefill.worker's calibrate)",
    )
    window: int = Field(2000, ge=10, description="most recent samples kept for fitting")


def _features_prefill(prompt: np.ndarray, cached: np.ndarray) -> np.ndarray:
    new = prompt - cached
    # constant, linear in new tokens, and new x average context (attention is quadratic)
    return np.stack([np.ones_like(new), new, new * (prompt + cached) / 2.0], axis=-1)


def fit_toward(x: np.ndarray, y: np.ndarray, prior: np.ndarray, rcond: float = 1e-6) -> np.ndarray:
    """Least squares for ``x @ c = y``, taking ``prior`` along the directions the samples leave open; c >= 0.

    Plain least squares is arbitrary where the samples do not vary: a decode instance
    that only ever ran one request at a time gives a batch column equal to the constant
    one, and the minimum-norm split of the step time between the two made a second
    request look as costly as the first. Here the fit is the prior plus the smallest
    correction that explains the samples, a correction measured per term relative to
    that term's typical size, so the larger term absorbs most of what one direction of
    data cannot tell apart; directions the samples do determine are fitted as plain
    least squares would fit them.
    """
    scale = np.sqrt((x * x).mean(axis=0))
    scale[scale == 0] = 1.0
    typical = np.abs(prior) * scale  # each term's contribution at a typical sample, in seconds
    size = np.maximum(typical, 0.05 * max(typical.sum(), 1e-12))
    # Non-negative: a term the unconstrained fit drives below zero is pinned at zero and the others refitted
    # (clamping it alone would keep the rest of that fit: samples of nearly one prompt length fitted noise
    # with a large negative constant and a large rate, and predicted 9 s for a prefill of 1 s)
    free = np.ones(len(prior), dtype=bool)
    while True:
        fixed = np.where(free, prior, 0.0)
        u = np.zeros(len(prior))
        u[free], *_ = np.linalg.lstsq((x / scale * size)[:, free], y - x @ fixed, rcond=rcond)
        coef = fixed + u * size / scale
        negative = free & (coef < 0)
        if not negative.any():
            return coef
        free &= ~negative


class PrefillPredictor:
    """T_prefill = c0 + c1 * new + c2 * new * (prompt + cached) / 2, least squares on recent samples.

    ``new`` = prompt - cached tokens. Coefficients are kept non-negative (a negative
    rate would predict negative times for some prompts).
    """

    def __init__(self, config: PredictorConfig) -> None:
        self.config = config
        self._samples: deque[tuple[int, int, float]] = deque(maxlen=config.window)
        self._since_fit = 0
        self._prior = np.array(
            [config.prefill_overhead_s, 1.0 / config.prefill_tokens_per_s, config.prefill_attention_s_per_token2]
        )
        self.coef = self._prior
        self.fitted = False

    def _features(self, prompt: np.ndarray, cached: np.ndarray) -> np.ndarray:
        return _features_prefill(prompt, cached)

    def observe(self, prompt_tokens: int, cached_tokens: int, seconds: float) -> None:
        """Record one measured prefill (refits every few samples)."""
        if prompt_tokens <= 0 or cached_tokens < 0 or cached_tokens > prompt_tokens or seconds <= 0:
            raise ValueError(f"bad prefill sample: {prompt_tokens} prompt, {cached_tokens} cached tokens, {seconds} s")
        self._samples.append((prompt_tokens, cached_tokens, seconds))
        self._since_fit += 1
        if len(self._samples) >= self.config.min_samples and (
            not self.fitted or self._since_fit >= max(1, len(self._samples) // 20)
        ):
            self._fit()

    def _fit(self) -> None:
        data = np.array(self._samples, dtype=np.float64)
        x = self._features(data[:, 0], data[:, 1])
        self.coef = fit_toward(x, data[:, 2], self._prior)
        self.fitted = True
        self._since_fit = 0

    @property
    def coef(self) -> np.ndarray:
        return np.array(self._coef)

    @coef.setter
    def coef(self, value) -> None:
        self._coef = tuple(float(v) for v in value)

    def predict(self, prompt_tokens: int, cached_tokens: int) -> float:
        """Seconds to prefill ``prompt_tokens`` of which ``cached_tokens`` are already computed."""
        cached = min(max(cached_tokens, 0), prompt_tokens)
        new = prompt_tokens - cached
        c0, c1, c2 = self._coef  # plain floats: called for every instance on every Schedule
        return c0 + c1 * new + c2 * new * (prompt_tokens + cached) / 2.0

    @property
    def num_samples(self) -> int:
        return len(self._samples)


MAX_PIPELINE_ROWS = 1 << 16  # a pipeline predictor's remembered rows (a prompt's is a sum over its chunks)


class PipelinePrefillPredictor(PrefillPredictor):
    """A chunked-pipeline group's prefill: ``stages`` nodes, each 1/stages of the layers, a prompt's new tokens in
    chunks of ``chunk``. Chunk j (n_j tokens after a_j) costs a stage w_j = r1 * n_j + r2 * n_j * (a_j + n_j / 2); stage
    0 runs the chunks back to back and the last stage ends (stages - 1) chunks later, so with chunk costs that grow
    (attention does) T = c0 + sum_j w_j + (stages - 1) * max_j w_j: linear in (c0, r1, r2), fitted on the group's own
    samples (the costliest chunk, which the drain waits for, is taken to be the last whole one). Its prior is a single
    node's rates split over the stages, and its fixed cost once per stage (each stage has its own launches, and a
    chunk's hidden states cross each boundary): until its samples say otherwise, a prompt that fits in one chunk is
    predicted slower through the group than on a single node."""

    def __init__(self, config: PredictorConfig, stages: int, chunk: int) -> None:
        if stages < 2 or chunk < 1:
            raise ValueError(
                f"a pipeline needs at least 2 stages and a chunk of at least 1 token, got {stages}, {chunk}"
            )
        super().__init__(config)
        self.stages, self.chunk = stages, chunk
        self._prior = np.array([self._prior[0] * stages, self._prior[1] / stages, self._prior[2] / stages])
        self.coef = self._prior
        # (prompt, cached) -> its row: each heartbeat of a group prices every prompt it holds again (price_queue)
        self._rows: dict[tuple[int, int], tuple[float, float, float]] = {}

    def _features(self, prompt: np.ndarray, cached: np.ndarray) -> np.ndarray:
        return np.array([self._row(int(p), int(c)) for p, c in zip(prompt, cached)], dtype=np.float64).reshape(-1, 3)

    def _row(self, prompt: int, cached: int) -> tuple[float, float, float]:
        row = self._rows.get((prompt, cached))
        if row is None:
            if len(self._rows) >= MAX_PIPELINE_ROWS:
                self._rows.clear()
            row = self._rows[(prompt, cached)] = self._chunks(prompt, cached)
        return row

    def _chunks(self, prompt: int, cached: int) -> tuple[float, float, float]:
        new = max(prompt - cached, 0)
        if new == 0:
            return (1.0, 0.0, 0.0)
        full, rest = divmod(new, self.chunk)
        sizes = [self.chunk] * full + ([rest] if rest else [])
        starts = [cached + i * self.chunk for i in range(len(sizes))]
        # the drain: the costliest chunk, taken to be the last whole one (the last, when there is no whole one)
        d = full - 1 if full else 0
        linear = float(new) + (self.stages - 1) * sizes[d]
        pairs = sum(n * (a + n / 2.0) for a, n in zip(starts, sizes))
        pairs += (self.stages - 1) * sizes[d] * (starts[d] + sizes[d] / 2.0)
        return (1.0, linear, pairs)

    def predict(self, prompt_tokens: int, cached_tokens: int) -> float:
        cached = min(max(cached_tokens, 0), prompt_tokens)
        c0, r1, r2 = self._coef
        _, linear, pairs = self._row(prompt_tokens, cached)
        return c0 + r1 * linear + r2 * pairs


class DecodePredictor:
    """TBT = c0 + c1 * batch + c2 * context tokens, least squares on reported steps."""

    def __init__(self, config: PredictorConfig) -> None:
        self.config = config
        self._samples: deque[tuple[int, int, float]] = deque(maxlen=config.window)
        self._since_fit = 0
        self._prior = np.array([config.decode_base_s, config.decode_s_per_request, config.decode_s_per_context_token])
        self.coef = self._prior.copy()
        self.fitted = False

    def observe(self, batch: int, context_tokens: int, step_s: float) -> None:
        if batch <= 0 or context_tokens < 0 or step_s <= 0:
            raise ValueError(f"bad decode sample: batch {batch}, {context_tokens} context tokens, {step_s} s")
        self._samples.append((batch, context_tokens, step_s))
        self._since_fit += 1
        if len(self._samples) >= self.config.min_samples and (
            not self.fitted or self._since_fit >= max(1, len(self._samples) // 20)
        ):
            data = np.array(self._samples, dtype=np.float64)
            x = np.stack([np.ones(len(data)), data[:, 0], data[:, 1]], axis=-1)
            self.coef = fit_toward(x, data[:, 2], self._prior)
            self.fitted = True
            self._since_fit = 0

    def predict(self, batch: int, context_tokens: int) -> float:
        """Seconds per decode step with ``batch`` running requests holding ``context_tokens`` in all."""
        if batch <= 0:
            return 0.0
        return float(self.coef[0] + self.coef[1] * batch + self.coef[2] * context_tokens)


class TransferPredictor:
    """Seconds to move bytes across the pool's network: latency + bytes / bandwidth. The configured bandwidth is a
    guess until the first sample, which replaces it (moved toward by an EMA, a 10 GB/s guess would take a dozen
    samples of a 25 MB/s link to fall below 1 GB/s); later samples move it as an EMA."""

    def __init__(self, config: PredictorConfig, alpha: float = 0.2) -> None:
        self.bytes_per_s = config.transfer_bytes_per_s
        self.latency_s = config.transfer_latency_s
        self.alpha = alpha
        self.samples = 0

    def observe(self, num_bytes: int, seconds: float) -> None:
        if num_bytes <= 0 or seconds <= 0:
            raise ValueError(f"bad transfer sample: {num_bytes} bytes in {seconds} s")
        rate = num_bytes / max(seconds - self.latency_s, seconds / 2)
        self.bytes_per_s = (1 - self.alpha) * self.bytes_per_s + self.alpha * rate if self.samples else rate
        self.samples += 1

    def predict(self, num_bytes: int) -> float:
        return 0.0 if num_bytes <= 0 else self.latency_s + num_bytes / self.bytes_per_s


@dataclass(slots=True)
class Predictors:
    """The three predictors a policy consults, and the bytes of one block (for transfers)."""

    prefill: PrefillPredictor
    decode: DecodePredictor
    transfer: TransferPredictor
    block_bytes: int
    pipelines: dict[tuple[int, int], PipelinePrefillPredictor] = field(default_factory=dict)  # (stages, chunk) ->

    @classmethod
    def from_config(cls, config: PredictorConfig, block_bytes: int) -> "Predictors":
        return cls(PrefillPredictor(config), DecodePredictor(config), TransferPredictor(config), block_bytes)

    def prefill_for(self, stages: int, chunk: int) -> PrefillPredictor:
        """The prefill predictor of instances of this shape: single nodes share one, each pipeline shape has its own."""
        if stages <= 1:
            return self.prefill
        shape = (stages, chunk)
        if shape not in self.pipelines:
            self.pipelines[shape] = PipelinePrefillPredictor(self.prefill.config, stages, chunk)
        return self.pipelines[shape]
