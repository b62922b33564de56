"""Metrics: phase timers, per-iteration reduction, data statistics and tps, and sinks.

Key names and formulas follow the seed (docs/metrics.md lists every key).
"""

from posttrain.metrics.reduce import MetricAccumulator, reduce_values, sort_metrics
from posttrain.metrics.sinks import MetricsLogger, format_line
from posttrain.metrics.stats import (compute_tps, data_metrics, length_metrics, prompt_length_metrics,
                                     response_length_metrics, score_metrics, stat_metrics,
                                     verifier_reward_metrics)
from posttrain.metrics.timers import Timers, non_overlap_timings


def plot_metrics(jsonl_path, png_path, keys, title=None):
    """See :func:`posttrain.metrics.plot.plot_metrics` (matplotlib is imported on call)."""
    from posttrain.metrics.plot import plot_metrics as _plot  # lazy: keeps data/ off posttrain plan's imports

    return _plot(jsonl_path, png_path, keys, title)


__all__ = ["MetricAccumulator", "MetricsLogger", "Timers", "compute_tps", "data_metrics", "format_line",
           "length_metrics", "non_overlap_timings", "plot_metrics", "prompt_length_metrics",
           "reduce_values", "response_length_metrics", "score_metrics", "sort_metrics",
           "stat_metrics", "verifier_reward_metrics"]
