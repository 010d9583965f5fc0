"""How long and how strictly one A/B run samples: the budget every comparison, tournament and measurement
takes, checked once when it is made."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from . import clocks, stats

# Seconds of sampling (per comparison) that fit a default A/B budget: thousands of pairs for kernels under 1 ms.
DEFAULT_MAX_TIME_S = 2.0


# How long each look's chunk of rounds may run before the budget is checked again.
CHUNK_SECONDS = 0.05


@dataclass(frozen=True)
class Budget:
    """How long and how strictly one comparison samples; every field is a keyword of ``compare``.

    >>> Budget().replace(max_time=0.5, alpha=0.01).max_time
    0.5
    >>> Budget().replace(max_tme=1)
    Traceback (most recent call last):
    ...
    TypeError: unknown budget keyword 'max_tme'; expected one of: alpha, calls_per_sample, check_escape, check_output, flush_l2, hold_gpu, margin, max_pairs, max_time, min_pairs, seed, throttle, use_cuda_graph, warmup
    """

    max_time: float = DEFAULT_MAX_TIME_S  # seconds of sampling, after warm-up; min_pairs overrides it
    min_pairs: int = 20  # first look; never stop before it (20 pairs can reach p ~ 2e-6)
    max_pairs: int = 10_240  # last look (10 looks in all with min_pairs 20)
    alpha: float = 0.05  # false win/loss rate over all looks
    margin: float = 0.02  # equivalence margin: a speedup inside [1/1.02, 1.02] can be a tie
    flush_l2: bool = False  # CUDA only: overwrite twice the device's L2 before each sample
    hold_gpu: bool = False  # CUDA only: hold the GPU while a round is queued, so events time device work alone
    calls_per_sample: int | str = "auto"  # "auto": batch calls shorter than 50 us
    use_cuda_graph: bool | str = False  # True: always replay a graph; "auto": when calls are batched
    warmup: float = 0.025  # seconds of warm-up rounds (at least 3) before sampling
    check_output: bool = True  # outputs after timing must equal the first call's
    seed: int | None = None  # seeds the random order inside rounds
    throttle: str = "flag"  # rounds taken with the SM clock >10% below the session's highest: flag, discard, fail
    check_escape: bool = True  # CUDA only: fail when the events miss most of the work (see escape.py)

    def replace(self, **changes: Any) -> "Budget":
        known = {f.name for f in dataclasses.fields(self)}
        for key in changes:
            if key not in known:
                raise TypeError(f"unknown budget keyword {key!r}; expected one of: {', '.join(sorted(known))}")
        budget = dataclasses.replace(self, **changes)
        budget.validate()
        return budget

    def validate(self) -> None:
        def positive_number(name: str, value: Any, allow_zero: bool = False) -> None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"budget {name} must be a finite number of seconds, got {value!r}")
            if value < 0 or (value == 0 and not allow_zero):
                raise ValueError(f"budget {name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")

        def positive_int(name: str, value: Any) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"budget {name} must be a positive integer, got {value!r}")

        positive_number("max_time", self.max_time)
        positive_number("warmup", self.warmup, allow_zero=True)
        positive_int("min_pairs", self.min_pairs)
        positive_int("max_pairs", self.max_pairs)
        if self.max_pairs < self.min_pairs:
            raise ValueError(f"budget max_pairs ({self.max_pairs}) must be >= min_pairs ({self.min_pairs})")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0 < self.alpha < 1:
            raise ValueError(f"budget alpha must be between 0 and 1 (exclusive), got {self.alpha!r}")
        if isinstance(self.margin, bool) or not isinstance(self.margin, (int, float)) or not 0 <= self.margin < 1:
            raise ValueError(f"budget margin must be in [0, 1) (0.02 means 2%), got {self.margin!r}")
        if self.calls_per_sample != "auto":
            positive_int("calls_per_sample", self.calls_per_sample)
        if self.use_cuda_graph not in (True, False, "auto"):
            raise ValueError(f"budget use_cuda_graph must be True, False or 'auto', got {self.use_cuda_graph!r}")
        clocks.check_policy(self.throttle)
        for name in ("flush_l2", "hold_gpu", "check_output", "check_escape"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"budget {name} must be True or False, got {getattr(self, name)!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"budget seed must be an integer or None, got {self.seed!r}")

    @property
    def planned_looks(self) -> int:
        return len(stats.look_schedule(self.min_pairs, self.max_pairs))
