"""Measurement: timing, memory, FLOPs, and probes of this machine.

* :mod:`~labsupport.measure.timing`: one kernel timed, several functions side by side;
* :mod:`~labsupport.measure.memory`: parameters, model states, saved activations, peaks;
* :mod:`~labsupport.measure.flops`: FLOPs counted while a model runs;
* :mod:`~labsupport.measure.probe`: this machine's CPU, GPUs, bandwidth and FLOP/s.
"""
