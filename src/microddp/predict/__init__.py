"""Predicting a DDP step before running it: the cost model of a step (step.py, built on
collectives.cost) and its calibration against this machine (calibrate.py); a pipeline step
(pipeline.py) from the costs of its actions and messages measured here (pipeline_costs.py)."""

from .step import (
    ALGORITHMS,
    HARDWARE,
    MODELS,
    Hardware,
    Model,
    across_hosts,
    allreduce_time,
    fullmlp,
    predict,
    save_calibration,
    scaling,
    table,
    verdict,
)

__all__ = ["ALGORITHMS", "HARDWARE", "MODELS", "Hardware", "Model", "across_hosts", "allreduce_time", "fullmlp",
           "predict", "save_calibration", "scaling", "table", "verdict"]
